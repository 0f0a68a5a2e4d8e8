"""Long context: one V4-Flash CSA layer's indexer decode step (index_topk, S=1, Hi=64,
Di=128, top-512, ratio 4: Tc = context / 4) with float32, bfloat16 and FP4-row keys
against torch eager, time and key-cache bytes against the context length; the prefill
check (S=4096, Tc=1024) and, with --long, the indexer cache of all 20 CSA layers of
V4-Flash at a 1M-token context measured as resident memory.

    .venv/bin/python benchmarks/bench_long_context.py            # 4K .. 64K, short
    .venv/bin/python benchmarks/bench_long_context.py --long     # 4K .. 1M, + 20 layers

Every side is timed interleaved (harness.interleaved_times), so only ratios inside one
run mean anything on a shared machine.  Writes benchmarks/results/long_context.json and
long_context.png.  run.py finds no cases here (cases() is empty): this is its own run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import deepseek_csa as dc  # noqa: E402

HI, DI, TOPK, RATIO = 64, 128, 512, 4
N_CSA_LAYERS = 20   # V4-Flash: the ratio-4 (CSA) layers that run an indexer


def cases(quick):
    return []


def _inputs(Tc, rng):
    q = dc.fp4_round(rng.standard_normal((1, 1, HI, DI)).astype(np.float32), 32)
    k = dc.fp4_round(rng.standard_normal((1, Tc, DI)).astype(np.float32), 32)
    w = rng.standard_normal((1, 1, HI)).astype(np.float32)
    return q, k, w


def _eager(q, k, w, K, start_pos):
    import torch
    qt, kt, wt = torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(w)
    n = (start_pos + q.shape[1]) // RATIO

    def run():
        s = torch.einsum("bshd,btd->bsht", qt, kt[:, :n]).relu_()
        s = (s * wt.unsqueeze(-1)).sum(2)
        return s.topk(min(K, n), dim=-1).indices
    return run


def decode_rows(contexts, reps, with_torch=True):
    from ml_dtypes import bfloat16
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        Tc = ctx // RATIO
        q, k, w = _inputs(Tc, rng)
        kb, qb = k.astype(bfloat16), q.astype(bfloat16)
        kp = dc.fp4_pack(k)
        sp = ctx - 1
        sides = {
            "float32": lambda: dc.index_topk(q, k, w, TOPK, ratio=RATIO, start_pos=sp),
            "bfloat16": lambda: dc.index_topk(qb, kb, w, TOPK, ratio=RATIO, start_pos=sp),
            "fp4": lambda: dc.index_topk(q, kp, w, TOPK, ratio=RATIO, start_pos=sp),
        }
        if with_torch:
            sides["torch_eager"] = _eager(q, k, w, TOPK, sp)
        t = harness.interleaved_times(sides, reps=reps)
        med = {n: statistics.median(v) for n, v in t.items()}
        row = {"context": ctx, "Tc": Tc, "ms": {n: 1e3 * v for n, v in med.items()},
               "cache_bytes": {"float32": k.nbytes, "bfloat16": kb.nbytes, "fp4": kp.nbytes},
               "bytes_per_key": {"float32": k.nbytes // Tc, "bfloat16": kb.nbytes // Tc,
                                 "fp4": kp.nbytes // Tc},
               "fp4_speedup_vs_float32": med["float32"] / med["fp4"],
               "fp4_speedup_vs_bfloat16": med["bfloat16"] / med["fp4"]}
        rows.append(row)
        print(f"ctx {ctx:>8} Tc {Tc:>7}: " + "  ".join(f"{n} {v:8.2f} ms" for n, v in row["ms"].items())
              + f"  fp4 x{row['fp4_speedup_vs_float32']:.2f} vs f32, x{row['fp4_speedup_vs_bfloat16']:.2f}"
              f" vs bf16; {row['bytes_per_key']['fp4']} B/key", flush=True)
    return rows


def prefill_row(reps):
    rng = np.random.default_rng(1)
    S, Tc = 4096, 1024
    q = dc.fp4_round(rng.standard_normal((1, S, HI, DI)).astype(np.float32), 32)
    k = dc.fp4_round(rng.standard_normal((1, Tc, DI)).astype(np.float32), 32)
    w = rng.standard_normal((1, S, HI)).astype(np.float32)
    kp = dc.fp4_pack(k)
    t = harness.interleaved_times({
        "float32": lambda: dc.index_topk(q, k, w, TOPK, ratio=RATIO, start_pos=0, offset=S),
        "fp4": lambda: dc.index_topk(q, kp, w, TOPK, ratio=RATIO, start_pos=0, offset=S),
    }, reps=reps)
    med = {n: statistics.median(v) for n, v in t.items()}
    row = {"S": S, "Tc": Tc, "ms": {n: 1e3 * v for n, v in med.items()},
           "fp4_speedup_vs_float32": med["float32"] / med["fp4"]}
    print(f"prefill S={S} Tc={Tc}: float32 {row['ms']['float32']:.1f} ms, fp4 {row['ms']['fp4']:.1f}"
          f" ms (x{row['fp4_speedup_vs_float32']:.2f})", flush=True)
    return row


def twenty_layers(ctx=1 << 20):
    """Resident memory of the FP4 index-key caches of all CSA layers at ctx, filled."""
    Tc = ctx // RATIO
    W = DI // 2 + DI // 32
    caches = []

    def fill():
        for _ in range(N_CSA_LAYERS):
            c = np.empty((1, Tc, W), np.uint8)
            c[...] = 1                      # touch every page
            caches.append(c)
    rss = harness.peak_extra_rss(fill)
    nbytes = sum(c.nbytes for c in caches)
    row = {"context": ctx, "Tc": Tc, "layers": N_CSA_LAYERS, "bytes": nbytes,
           "measured_rss_bytes": rss, "GiB": rss / 2 ** 30}
    print(f"{N_CSA_LAYERS} layers at ctx {ctx}: {nbytes / 2**30:.3f} GiB of FP4 index keys, "
          f"measured +{rss / 2**30:.3f} GiB resident", flush=True)
    return row


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ctx = [r["context"] for r in rows]
    for n in rows[0]["ms"]:
        a.plot(ctx, [r["ms"][n] for r in rows], marker="o", label=n)
    for n in rows[0]["cache_bytes"]:
        b.plot(ctx, [r["cache_bytes"][n] / 2 ** 20 for r in rows], marker="o", label=n)
    for ax, yl in ((a, "index_topk decode step, ms"), (b, "index-key cache per layer, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens; Tc = context / 4)")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"V4-Flash CSA indexer, {harness.cpu_model()}, level {dc.get_isa()}, "
                 f"{dc.max_threads()} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", action="store_true", help="contexts up to 1M and the 20-layer check")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--contexts", type=str, default=None, help="comma-separated, e.g. 262144")
    a = ap.parse_args(argv)
    if a.contexts:
        contexts = [int(c) for c in a.contexts.split(",")]
    else:
        contexts = [4096, 16384, 65536] + ([262144, 1 << 20] if a.long else [])
    env = {"cpu": harness.cpu_model(), "isa": dc.get_isa(), "threads": dc.max_threads(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    print(f"CPU {env['cpu']}, ISA level {env['isa']}, {env['threads']} threads", flush=True)
    out = {"environment": env, "decode": decode_rows(contexts, a.reps, not a.no_torch)}
    if not a.no_prefill:
        out["prefill"] = prefill_row(max(3, a.reps // 2))
    if a.long:
        out["twenty_layers_1M"] = twenty_layers()
    res = harness.RESULTS
    res.mkdir(parents=True, exist_ok=True)
    (res / "long_context.json").write_text(json.dumps(out, indent=1))
    try:
        plot(out["decode"], res / "long_context.png")
    except ImportError as e:
        print(f"no plot: {e}")
    print(f"wrote {res / 'long_context.json'}")


if __name__ == "__main__":
    main()
