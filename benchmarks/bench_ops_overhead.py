"""What a call through the PyTorch operators costs over the direct NumPy call, in us.

Sides, timed interleaved in one run (harness.interleaved_times), each on the same
inputs and the same output buffer where the entry takes one:
  numpy        deepseek_csa.<kernel> on ndarrays (the floor: parse, validate, run)
  tensors      deepseek_csa.<kernel> on CPU tensors (the glue's tensor view)
  call         deepseek_csa.torch.ops.call: the direct eager path (no dispatcher)
  op           torch.ops.deepseek_csa.<name> under no_grad (dispatcher + the
               operator's Python autograd kernel + the CPU kernel)
  op_inference the same under torch.inference_mode (the autograd kernel skipped)
Shapes: rms_norm [1, 4096] (a decode step's norm) and sparse_attn decode (one token,
H = 64, D = 512, K = 640 of N = 4096 rows: V4-Flash's CSA shape).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_ops_overhead.py
writes benchmarks/results/ops_overhead.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

import deepseek_csa as dc  # noqa: E402
from deepseek_csa.torch import ops  # noqa: E402


def _rms_sides():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    y = np.empty_like(x)
    tx, tw, ty = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(y)
    op = torch.ops.deepseek_csa.rms_norm
    return {
        "numpy": lambda: dc.rms_norm(x, w, 1e-6, out=y),
        "tensors": lambda: dc.rms_norm(tx, tw, 1e-6, out=ty),
        "call": lambda: ops.call("rms_norm", tx, tw, 1e-6),
        "op": lambda: op(tx, tw, 1e-6),
    }, op, (tx, tw, 1e-6)


def _attn_sides():
    rng = np.random.default_rng(1)
    H, D, N, K = 64, 512, 4096, 640
    q = rng.standard_normal((1, 1, H, D), dtype=np.float32)
    kv = rng.standard_normal((1, N, D), dtype=np.float32)
    sink = rng.standard_normal(H, dtype=np.float32)
    idx = np.sort(rng.choice(N, K, replace=False)).astype(np.int32)[None, None]
    out = np.empty_like(q)
    t = [torch.from_numpy(a) for a in (q, kv, sink, idx, out)]
    op = torch.ops.deepseek_csa.sparse_attn
    return {
        "numpy": lambda: dc.sparse_attn(q, kv, sink, idx, D ** -0.5, out=out),
        "tensors": lambda: dc.sparse_attn(t[0], t[1], t[2], t[3], D ** -0.5, out=t[4]),
        "call": lambda: ops.call("sparse_attn", t[0], t[1], t[2], t[3], D ** -0.5),
        "op": lambda: op(t[0], t[1], t[2], t[3], D ** -0.5),
    }, op, (t[0], t[1], t[2], t[3], D ** -0.5)


def measure(budget):
    rows = []
    for kernel, (sides, op, args) in (("rms_norm [1, 4096]", _rms_sides()),
                                      ("sparse_attn decode H=64 D=512 K=640", _attn_sides())):
        def inference(op=op, args=args):
            with torch.inference_mode():
                op(*args)
        sides["op_inference"] = inference
        with torch.no_grad():
            times = harness.interleaved_times(sides, budget=budget)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        rows.append({"kernel": kernel, "median_us": med,
                     "overhead_us": {k: med[k] - med["numpy"] for k in med if k != "numpy"},
                     "rounds": len(times["numpy"])})
    return rows


def plot(rows, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = ["tensors", "call", "op", "op_inference"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.38
    for i, r in enumerate(rows):
        vals = [r["overhead_us"][s] for s in sides]
        xs = np.arange(len(sides)) + (i - 0.5) * width
        ax.bar(xs, vals, width, label=f"{r['kernel']} (numpy call {r['median_us']['numpy']:.1f} us)")
    ax.axhline(5, color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(sides)), ["tensors", "ops.call\n(direct)", "torch.ops\nno_grad",
                                          "torch.ops\ninference_mode"])
    ax.set_ylabel("us over the NumPy call")
    ax.set_title(f"Per-call overhead, {env['cpu']}, ISA {env['isa']}, {env['threads']} threads",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per side")
    ap.add_argument("--out", default=str(harness.RESULTS / "ops_overhead.json"))
    a = ap.parse_args()
    threads = torch.get_num_threads()
    env = harness.environment(threads)
    rows = measure(a.budget)
    for r in rows:
        print(r["kernel"], " ".join(f"{k} {v:.2f}" for k, v in r["median_us"].items()), "us")
    with open(a.out, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    plot(rows, env, a.out[:-5] + ".png")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
