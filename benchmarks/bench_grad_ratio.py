"""Backward / forward of our own kernels: sparse_attn_backward against sparse_attn
(return_lse), gated_pool_backward against gated_pool, each pair timed interleaved in one
process (harness.interleaved_times; the ratio is the median over rounds of backward /
forward in the same round, so a machine whose speed drifts slows both alike), at every
ISA level this CPU runs (avx2, avx512, amx), float32 and bfloat16 inputs.  The bar: each
backward within 2.5x of its forward.

Work counted (only what the kernel must do):
- attention: 4 H D flops per valid (query, slot) pair forward (q.k and p.v), 10 backward
  (q.k and dO.k recomputed, dS^T k, P^T dO and dS^T q); -1 slots count nothing.
- pooling is memory-bound: GB/s of the bytes it must move (forward: kv + score read,
  the entries written; backward: kv + score + grad_out read, d(kv) + d(score) written).
Peak memory: harness.peak_extra_rss (the RSS high-water mark above the start) of one call,
with its results preallocated; the bf16 rows show what reading bf16 as it is saves against
widening the inputs to float32 copies first (what the torch Function did before).

bf16 rows are what bf16 training runs: bf16 inputs and bf16 gradients (grad_dtype='bfloat16',
rounded by the kernels as they store them).  Inputs and results start on 64-byte lines, as
torch's tensors do (NumPy's large arrays start 16 bytes past one, or anywhere on 16 bytes
once they come from the heap, which depends on what the process allocated before: the
gated_pool rows swung by up to 1.5x between runs with it; pool_pair).

Method: a round whose forward or backward call was descheduled (an involuntary context
switch of any of the process's threads during the call, getrusage) is left out of the
medians: on the shared 2-vCPU host the backward, 2-3x longer, was descheduled in 88% of
its calls where the forward was in 45% (load 5, 1 thread), and the median over all rounds
read 4.3x where the clean rounds and the CPU times read 2.2x.  A row with fewer than
MIN_CLEAN clean rounds (after up to 4x the budget) falls back to all rounds and says so
(`method`); `bwd_over_fwd_all_rounds` keeps the old statistic.

Every row carries the CPU, the ISA level, the thread count and the 1-minute load average:
on a shared host the absolute times move, the interleaved ratios much less.  Each row also
has the ratio of CPU times (process CPU time of each call, the same rounds), which other
tenants disturb least at 1 thread (``--threads 1``).  A run restricted by -k / --levels
replaces only its own rows (same case, level and thread count) in the JSON.

    python benchmarks/bench_grad_ratio.py [--quick] [--threads 2] [--levels avx2,avx512,amx]
writes benchmarks/results/grad_ratio[_quick].json and .png.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402

import deepseek_csa as dc  # noqa: E402
import harness  # noqa: E402


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _empty64(shape, dtype):
    """An empty array starting on a 64-byte line, as torch allocates (the training path's
    gradients are torch tensors); NumPy's large arrays start 16 bytes past one."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 64, np.uint8)
    o = (-raw.ctypes.data) % 64
    return raw[o:o + n].view(dtype).reshape(shape)


def _copy64(a):
    """a copy of `a` starting on a 64-byte line (_empty64)."""
    b = _empty64(a.shape, a.dtype)
    b[...] = a
    return b


def attn_pair(S, dtype, rng, H=64, D=512, K=640):
    """(forward, backward, backward-with-copies, work) at the V4-Flash CSA shape; N = S + 512
    distinct rows a query (every slot valid)."""
    N = S + 512
    q = rng.standard_normal((1, S, H, D), dtype=np.float32) * 0.5
    kv = rng.standard_normal((1, N, D), dtype=np.float32)
    sink = rng.standard_normal(H, dtype=np.float32)
    idx = np.stack([rng.choice(N, K, replace=False) for _ in range(S)])[None].astype(np.int32)
    dout = rng.standard_normal((1, S, H, D), dtype=np.float32)
    if dtype == "bf16":
        bf = _bf16()
        q, kv, dout = q.astype(bf), kv.astype(bf), dout.astype(bf)
    # every array on 64-byte lines, as torch allocates them (pool_pair says why)
    q, kv, dout = _copy64(q), _copy64(kv), _copy64(dout)
    scale = D ** -0.5
    out, lse = dc.sparse_attn(q, kv, sink, idx, scale, return_lse=True)
    out, lse = _copy64(out), _copy64(lse)
    o_buf = _empty64(out.shape, out.dtype)
    gdt = _bf16() if dtype == "bf16" else np.float32
    gq, gkv = _empty64(q.shape, gdt), _empty64(kv.shape, gdt)
    gs = np.empty_like(sink)

    def fwd():
        return dc.sparse_attn(q, kv, sink, idx, scale, out=o_buf, return_lse=True)

    def bwd():
        return dc.sparse_attn_backward(dout, q, kv, sink, idx, scale, out, lse,
                                       grad_q=gq, grad_kv=gkv, grad_sink=gs, grad_dtype=gdt)

    def bwd_copies():  # widen every bf16 input to float32 first (the old contract)
        f = np.float32
        return dc.sparse_attn_backward(dout.astype(f), q.astype(f), kv.astype(f), sink, idx,
                                       scale, out.astype(f), lse, grad_sink=gs)

    pairs = float((idx >= 0).sum())
    work = dict(fwd_flops=4.0 * H * D * pairs, bwd_flops=10.0 * H * D * pairs)
    return fwd, bwd, (bwd_copies if dtype == "bf16" else None), work, \
        f"sparse_attn S={S} H={H} D={D} K={K} {dtype}"


def pool_pair(T, d, ratio, overlap, dtype, rng):
    cd = d * (2 if overlap else 1)
    kv = rng.standard_normal((1, T, cd), dtype=np.float32)
    sc = rng.standard_normal((1, T, cd), dtype=np.float32)
    ape = rng.standard_normal((ratio, cd), dtype=np.float32)
    dy = rng.standard_normal((1, T // ratio, d), dtype=np.float32)
    if dtype == "bf16":
        bf = _bf16()
        kv, sc, dy = kv.astype(bf), sc.astype(bf), dy.astype(bf)
    # inputs on 64-byte lines too, as torch's are: NumPy's start 16 bytes past one (or
    # anywhere on 16 bytes, once its allocations come from the heap), and a d(kv) row
    # that starts 48 bytes past its kv row splits every kv load or store across lines
    # (the kernel streams d(kv)'s whole lines): 4_bf16 1.65x -> 2.7-3.3x, 128_bf16 2.1x
    # -> 3.0-3.4x at avx512, 1 thread, which is how the bf16 rows swung between runs
    kv, sc, dy, ape = _copy64(kv), _copy64(sc), _copy64(dy), _copy64(ape)
    out = _empty64((1, T // ratio, d), kv.dtype)
    gdt = _bf16() if dtype == "bf16" else np.float32
    gk, gs = _empty64(kv.shape, gdt), _empty64(sc.shape, gdt)
    ga = _empty64(ape.shape, ape.dtype)

    def fwd():
        return dc.gated_pool(kv, sc, ratio, ape=ape, overlap=overlap, out=out)

    def bwd():
        return dc.gated_pool_backward(dy, kv, sc, ratio, ape=ape, overlap=overlap,
                                      grad_kv=gk, grad_score=gs, grad_ape=ga, grad_dtype=gdt)

    def bwd_copies():
        f = np.float32
        return dc.gated_pool_backward(dy.astype(f), kv.astype(f), sc.astype(f), ratio, ape=ape,
                                      overlap=overlap, grad_ape=ga)

    work = dict(fwd_bytes=float(kv.nbytes + sc.nbytes + ape.nbytes + out.nbytes),
                bwd_bytes=float(kv.nbytes + sc.nbytes + dy.nbytes + gk.nbytes + gs.nbytes))
    name = f"gated_pool T={T} D={d} ratio {ratio}{' overlap' if overlap else ''} + ape {dtype}"
    return fwd, bwd, (bwd_copies if dtype == "bf16" else None), work, name


MIN_CLEAN = 30   # clean rounds a row's ratio needs (else all rounds, flagged)


def measure(kernel, make, level, threads, reps, budget, cpu):
    fwd, bwd, bwd_copies, work, name = make()
    cpu_t = {"fwd": [], "bwd": []}

    def cpu_timed(k, fn):
        def call():
            c0 = time.process_time()
            fn()
            cpu_t[k].append(time.process_time() - c0)
        return call
    sw = {}
    t = harness.interleaved_times({"fwd": cpu_timed("fwd", fwd), "bwd": cpu_timed("bwd", bwd)},
                                  reps=reps, budget=budget, switches=sw, min_clean=MIN_CLEAN,
                                  max_seconds=4 * budget)
    n = len(t["fwd"])   # the timed rounds are the last n calls (warm-up and probe first)
    # the rounds in which neither call was descheduled (module docstring: Method)
    clean = [i for i in range(n) if sw["fwd"][i] == 0 and sw["bwd"][i] == 0]
    use = clean if len(clean) >= MIN_CLEAN else list(range(n))
    ratio = statistics.median(t["bwd"][i] / t["fwd"][i] for i in use)
    ratio_all = statistics.median(b / a for a, b in zip(t["fwd"], t["bwd"]))
    cf, cb = cpu_t["fwd"][-n:], cpu_t["bwd"][-n:]
    cpu_ratio = statistics.median(cb[i] / cf[i] for i in use)
    tf, tb = statistics.median(t["fwd"][i] for i in use), statistics.median(t["bwd"][i] for i in use)
    row = dict(kernel=kernel, case=name, isa=level, cpu=cpu, threads=threads,
               load_avg_1min=os.getloadavg()[0], rounds=n, clean_rounds=len(clean),
               method="median over clean rounds" if use is clean else
                      "median over all rounds (too few clean: host busy)",
               descheduled_fwd=sum(x > 0 for x in sw["fwd"]) / n,
               descheduled_bwd=sum(x > 0 for x in sw["bwd"]) / n,
               fwd_ms=tf * 1e3, bwd_ms=tb * 1e3, bwd_over_fwd=ratio,
               bwd_over_fwd_all_rounds=ratio_all,
               bwd_over_fwd_cpu_time=cpu_ratio, bar=2.5, met=ratio <= 2.5,
               met_cpu_time=cpu_ratio <= 2.5,
               grad_dtype="bfloat16" if "bf16" in name else "float32")
    if "fwd_flops" in work:
        row.update(fwd_gflops=work["fwd_flops"] / tf / 1e9, bwd_gflops=work["bwd_flops"] / tb / 1e9)
    else:
        row.update(fwd_gbs=work["fwd_bytes"] / tf / 1e9, bwd_gbs=work["bwd_bytes"] / tb / 1e9)
    row["fwd_peak_mib"] = harness.peak_extra_rss(fwd) / 2 ** 20
    row["bwd_peak_mib"] = harness.peak_extra_rss(bwd) / 2 ** 20
    if bwd_copies is not None:
        row["bwd_with_f32_copies_peak_mib"] = harness.peak_extra_rss(bwd_copies) / 2 ** 20
    return row


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(rows) + 1.6))
    # 1-thread rows: the CPU-time ratio (the steadiest on a shared host); others: wall
    cpu = [r["threads"] == 1 and "bwd_over_fwd_cpu_time" in r for r in rows]
    labels = [f"{r['case']} [{r['isa']}, {r['threads']}t{', cpu' if c else ''}]"
              for r, c in zip(rows, cpu)]
    vals = [r["bwd_over_fwd_cpu_time"] if c else r["bwd_over_fwd"] for r, c in zip(rows, cpu)]
    ax.barh(range(len(rows)), vals, color=["tab:green" if v <= 2.5 else "tab:red" for v in vals])
    ax.axvline(2.5, color="k", ls="--", lw=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
    r0 = rows[0]
    ax.set_xlabel("backward time / forward time (median of interleaved rounds; bar 2.5)")
    ax.set_title(f"{r0['cpu']}, load avg {min(r['load_avg_1min'] for r in rows):.1f}-"
                 f"{max(r['load_avg_1min'] for r in rows):.1f} (shared host)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S=256 / T=2048 (shapes otherwise as stated)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--levels", default="avx2,avx512,amx")
    ap.add_argument("--reps", type=int, default=0, help="interleaved rounds (0: ~budget)")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("-k", action="append", default=[], help="keep cases whose name matches")
    a = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits
    cpu = harness.cpu_model()
    levels = [lv for lv in a.levels.split(",")
              if lv in dc.ISA_LEVELS and dc.ISA_LEVELS.index(lv) <= dc.ISA_LEVELS.index(dc.best_isa())]
    S, T = (256, 2048) if a.quick else (2048, 8192)
    makers = []
    for dt in ("f32", "bf16"):
        makers.append(("sparse_attn_backward", lambda dt=dt: attn_pair(S, dt, np.random.default_rng(0))))
    for dt in ("f32", "bf16"):
        makers.append(("gated_pool_backward",
                       lambda dt=dt: pool_pair(T, 512, 4, True, dt, np.random.default_rng(0))))
        makers.append(("gated_pool_backward",
                       lambda dt=dt: pool_pair(T, 512, 128, False, dt, np.random.default_rng(0))))
    rows = []
    before = dc.get_isa()
    t0 = time.time()
    try:
        with threadpool_limits(a.threads, user_api="openmp"):
            for level in levels:
                dc.set_isa(level)
                for kernel, make in makers:
                    if a.k and not any(w in kernel for w in a.k):
                        continue
                    r = measure(kernel, make, level, a.threads, a.reps, a.budget, cpu)
                    extra = (f"{r['fwd_gflops']:.0f} / {r['bwd_gflops']:.0f} GFLOP/s" if "fwd_gflops" in r
                             else f"{r['fwd_gbs']:.1f} / {r['bwd_gbs']:.1f} GB/s")
                    cp = (f", bwd with f32 copies {r['bwd_with_f32_copies_peak_mib']:.0f} MiB"
                          if "bwd_with_f32_copies_peak_mib" in r else "")
                    print(f"{r['case']:<52} {level:<6} fwd {r['fwd_ms']:8.2f} ms  bwd {r['bwd_ms']:8.2f} ms"
                          f"  bwd/fwd {r['bwd_over_fwd']:.2f} (cpu {r['bwd_over_fwd_cpu_time']:.2f})  {extra}  peak fwd {r['fwd_peak_mib']:.0f}"
                          f" / bwd {r['bwd_peak_mib']:.0f} MiB{cp}  (load {r['load_avg_1min']:.1f}; clean rounds"
                          f" {r['clean_rounds']}/{r['rounds']}, all rounds {r['bwd_over_fwd_all_rounds']:.2f}"
                          f"{'' if r['clean_rounds'] >= MIN_CLEAN else ', HOST BUSY: ratio over all rounds'})",
                          flush=True)
                    rows.append(r)
    finally:
        dc.set_isa(before)
    name = "grad_ratio" + ("_quick" if a.quick else "")
    out = harness.RESULTS
    out.mkdir(parents=True, exist_ok=True)
    if (out / f"{name}.json").exists():   # keep the rows this run did not measure
        key = (lambda r: (r["kernel"], r["case"], r["isa"], r["threads"]))
        mine = {key(r) for r in rows}
        old = json.loads((out / f"{name}.json").read_text()).get("rows", [])
        rows = [r for r in old if key(r) not in mine] + rows
    snap = dict(note="benchmarks/bench_grad_ratio.py" + (" --quick" if a.quick else "") +
                ": backward / forward of our kernels, interleaved rounds, medians; the host "
                "may be shared (load average per row)",
                env=harness.environment(a.threads), host=platform.node(),
                seconds=time.time() - t0, rows=rows,
                summary=f"{sum(r['met'] for r in rows)}/{len(rows)} rows backward <= 2.5x forward "
                        f"(wall), {sum(r.get('met_cpu_time', False) for r in rows)} by CPU time")
    (out / f"{name}.json").write_text(json.dumps(snap, indent=1, default=float))
    if rows:
        plot(rows, out / f"{name}.png")
    print(f"wrote {out / (name + '.json')} and {name}.png; {snap['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
