"""The FP4 lightning indexer at the integer-dot-product limit: index_topk decode (S=1,
Hi=64, Di=128, top-512, ratio 4) on packed FP4 key rows against the float32 path on
the same FP4-rounded values, at Tc = 16K, 64K and 256K compressed entries (64K .. 1M
tokens), at the native ISA level (amx: the scoring on AMX-INT8 tiles, TDPBSUD), at
avx512 (VPDPBUSD on the same CPU) and at avx2 (what DEEPSEEK_CSA_ISA=avx2 selects), and
as a fraction of the integer dot-product peak of the vector units (_peak_idot:
VPDPBUSD where the CPU has AVX512_VNNI, VPMADDUBSW pairs below; 2 ops a byte product;
the tiles of the amx level go past it).

    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/bench_fp4_index.py [--quick]

Both sides of a row are timed interleaved in one process (harness.interleaved_times),
by the wall clock and by CPU time (cpu_times): only their ratios mean anything on a
shared machine.  The peak is measured right
before and right after each level's rows, the larger kept.  Peak memory: the high-water
mark of resident memory above the start while one call runs (harness.peak_extra_rss).
Writes benchmarks/results/fp4_index.json and fp4_index.png (--out to rename).
run.py finds no cases here (cases() is empty): this is its own run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import deepseek_csa as dc  # noqa: E402
from deepseek_csa import _core  # noqa: E402

HI, DI, TOPK, RATIO = 64, 128, 512, 4
RESULTS = Path(__file__).resolve().parent / "results"


def cases(quick):
    return []


def idot_peak(threads, seconds=0.3):
    """(integer ops per wall second, per CPU second) of _peak_idot at the current
    level: the second, a thread's own rate, does not shrink when other tenants take
    the cores."""
    n = 20000
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        ops = _core._peak_idot(n, threads)
        dt, dc_ = time.perf_counter() - t0, time.process_time() - c0
        if dt > seconds or n > 1 << 40:
            return ops / dt, ops / max(dc_, 1e-9)
        n *= 4


def cpu_times(sides, reps):
    """Median CPU time of a call (all threads: process time), interleaved like the wall
    clock.  On a host shared with other tenants the wall clock of a 2-thread call
    counts the time slices its threads wait for (4 ms steps at 250 Hz); CPU time does
    not, so for a compute-bound kernel its ratio is the steadier one.  Meaningful with
    OMP_WAIT_POLICY=passive only (else a waiting thread spins and counts)."""
    out = {n: [] for n in sides}
    for r in range(max(reps, 5)):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            t0 = time.process_time()
            sides[name]()
            out[name].append(time.process_time() - t0)
    return {n: statistics.median(v) for n, v in out.items()}


def rows_at_level(level, tcs, reps, threads, rng):
    dc.set_isa(level)
    shape = _core._peak_idot_shape()
    scoring = ("TDPBSUD (AMX-INT8 tiles)" if level == "amx" and
               "amx_int8" in _core._build_info()["cpu_features"].split() else shape["instruction"])
    peak, peak_cpu = idot_peak(threads)
    out = []
    for Tc in tcs:
        q = dc.fp4_round(rng.standard_normal((1, 1, HI, DI)).astype(np.float32), 32)
        k = dc.fp4_round(rng.standard_normal((1, Tc, DI)).astype(np.float32), 32)
        w = rng.standard_normal((1, 1, HI)).astype(np.float32)
        kp = dc.fp4_pack(k)
        sp = Tc * RATIO - 1
        sides = {
            "float32": lambda: dc.index_topk(q, k, w, TOPK, ratio=RATIO, start_pos=sp),
            "fp4": lambda: dc.index_topk(q, kp, w, TOPK, ratio=RATIO, start_pos=sp),
        }
        a, b = sides["float32"](), sides["fp4"]()
        # the two sides score the same values; they may part only at (near-)ties
        same = float(np.mean([len(set(a[0, 0]) & set(b[0, 0])) / TOPK]))
        t = harness.interleaved_times(sides, reps=reps)
        med = {n: statistics.median(v) for n, v in t.items()}
        cpu = cpu_times(sides, len(t["fp4"]))
        ops = 2.0 * Tc * HI * DI
        out.append({
            "level": level, "isa": dc.get_isa(), "cpu": harness.cpu_model(),
            "cpu_features": _core._build_info()["cpu_features"], "threads": threads,
            "fp4_scoring": scoring, "loadavg": os.getloadavg(),
            "Tc": Tc, "context_tokens": Tc * RATIO, "Hi": HI, "Di": DI, "topk": TOPK,
            "ms": {n: 1e3 * v for n, v in med.items()},
            "speedup_fp4_vs_float32": med["float32"] / med["fp4"],
            "cpu_ms": {n: 1e3 * v for n, v in cpu.items()},
            "cpu_speedup_fp4_vs_float32": cpu["float32"] / cpu["fp4"],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "idot_peak_gops": peak / 1e9, "idot_instruction": shape["instruction"],
            "fp4_gops": ops / med["fp4"] / 1e9,
            "fp4_frac_idot_peak": ops / med["fp4"] / peak,
            "idot_peak_gops_per_cpu_s": peak_cpu / 1e9,
            "fp4_gops_per_cpu_s": ops / cpu["fp4"] / 1e9,
            "fp4_frac_idot_peak_cpu": ops / cpu["fp4"] / peak_cpu,
            "topk_overlap_float32_fp4": same,
            "key_bytes": {"float32": k.nbytes, "fp4": kp.nbytes},
            "peak_extra_rss_bytes": {n: harness.peak_extra_rss(f) for n, f in sides.items()},
            "reps": len(t["fp4"]),
            "note": "host shared with other tenants: only the ratio within a row is meaningful",
        })
        r = out[-1]
        print(f"{level:7s} Tc={Tc:7d}  float32 {r['ms']['float32']:7.2f} ms  fp4 "
              f"{r['ms']['fp4']:6.2f} ms  {r['speedup_fp4_vs_float32']:.2f}x  cpu "
              f"{r['cpu_ms']['float32']:6.2f} / {r['cpu_ms']['fp4']:5.2f} ms "
              f"{r['cpu_speedup_fp4_vs_float32']:.2f}x  "
              f"{r['fp4_frac_idot_peak_cpu'] * 100:4.1f}% of the {shape['instruction']} peak "
              f"(scoring: {scoring}; load {r['loadavg'][0]:.1f}) "
              f"(CPU time; {peak_cpu / 1e9:.0f} Gop/s a CPU second)", flush=True)
    peak2, peak2_cpu = idot_peak(threads)
    for r in out:
        r["idot_peak_gops"] = max(peak, peak2) / 1e9
        r["fp4_frac_idot_peak"] = r["fp4_gops"] / r["idot_peak_gops"]
        r["idot_peak_gops_per_cpu_s"] = max(peak_cpu, peak2_cpu) / 1e9
        r["fp4_frac_idot_peak_cpu"] = r["fp4_gops_per_cpu_s"] / r["idot_peak_gops_per_cpu_s"]
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = list(dict.fromkeys(r["level"] for r in rows))
    tcs = sorted({r["Tc"] for r in rows})
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    wdt = 0.8 / len(levels)
    for i, lv in enumerate(levels):
        rr = {r["Tc"]: r for r in rows if r["level"] == lv}
        xs = [j + i * wdt for j in range(len(tcs))]
        ax[0].bar(xs, [rr[t]["speedup_fp4_vs_float32"] for t in tcs], wdt, label=f"{lv} wall",
                  alpha=0.5)
        ax[0].plot(xs, [rr[t]["cpu_speedup_fp4_vs_float32"] for t in tcs], "o", label=f"{lv} cpu time")
        ax[1].bar(xs, [100 * rr[t]["fp4_frac_idot_peak_cpu"] for t in tcs], wdt, label=lv)
    for a in ax:
        a.set_xticks([j + 0.4 - wdt / 2 for j in range(len(tcs))])
        a.set_xticklabels([f"Tc={t // 1024}K\n({t * RATIO // 1024}K tok)" for t in tcs])
        a.legend()
    ax[0].axhline(4, color="k", ls=":", lw=1)
    ax[0].axhline(2, color="gray", ls=":", lw=1)
    ax[0].set_ylabel("FP4 speedup vs float32 path (same values)")
    ax[1].set_ylabel("% of the level's int8 dot-product peak (CPU time)")
    fig.suptitle(f"index_topk decode, H=64 D=128 top-512, {rows[0]['cpu']}, "
                 f"{rows[0]['threads']} threads (shared host)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Tc = 16K and 64K, 5 rounds")
    ap.add_argument("--levels", nargs="+", default=["native", "avx512", "avx2"])
    ap.add_argument("--tc", nargs="+", type=int, default=None)
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--out", default="fp4_index")
    a = ap.parse_args()
    tcs = a.tc or ([16384, 65536] if a.quick else [16384, 65536, 262144])
    reps = a.reps or (5 if a.quick else 0)
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    rng = np.random.default_rng(0)
    before = dc.get_isa()
    rows = []
    for lv in a.levels:
        lv = dc.best_isa() if lv == "native" else lv
        if dc.ISA_LEVELS.index(lv) <= dc.ISA_LEVELS.index(dc.best_isa()) and lv not in [r["level"] for r in rows]:
            rows += rows_at_level(lv, tcs, reps, threads, rng)
    dc.set_isa(before)
    RESULTS.mkdir(exist_ok=True)
    out = {"rows": rows, "environment": harness.environment(threads)}
    (RESULTS / f"{a.out}.json").write_text(json.dumps(out, indent=1))
    plot(rows, RESULTS / f"{a.out}.png")
    print(f"wrote {RESULTS / (a.out + '.json')} and .png")


if __name__ == "__main__":
    main()
