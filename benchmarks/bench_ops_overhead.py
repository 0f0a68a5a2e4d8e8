"""What a call through the PyTorch operators costs over the direct NumPy call, in us.

Sides, timed interleaved in one run (harness.interleaved_times), each on the same
inputs and the same output buffer where the entry takes one:
  numpy        deepseek_csa.<kernel> on ndarrays (the floor: parse, validate, run)
  tensors      deepseek_csa.<kernel> on CPU tensors (the glue's tensor view)
  call         deepseek_csa.torch.ops.call: the direct eager path (no dispatcher)
  op           torch.ops.deepseek_csa.<name> under no_grad: the dispatcher, the
               autograd kernel and the CPU kernel -- C++ for the operators in
               ops.NATIVE (rms_norm: deepseek_csa.torch._native), else Python
  op_inference the same under torch.inference_mode (the autograd kernel skipped)
and the registrations the operator could have had instead (the same CPU kernel, fake
kernel and autograd formula, in the namespace deepseek_csa_bench), under no_grad:
  op_register_autograd   Library.impl(CPU) + torch.library.register_autograd: the
               autograd kernel redispatches to the CPU kernel (two trips from Python
               into the dispatcher); ops.py's registration before its no-grad shortcut
  op_custom_op torch.library.custom_op + register_autograd
  op_python    for an operator in ops.NATIVE, the registration it has without the C++
               module (DEEPSEEK_CSA_TORCH_NATIVE=0): ops.py's Python CPU kernel and
               Python autograd kernel with its no-grad shortcut
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
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

import deepseek_csa as dc  # noqa: E402
from deepseek_csa.torch import ops  # noqa: E402


_BENCH_LIB = torch.library.Library("deepseek_csa_bench", "DEF")


def _alternatives(name, schema, impl, fake, backward, setup, args):
    """Sides calling the same kernel registered the other ways (see the module doc)."""
    lib = _BENCH_LIB
    lib.define(f"{name}_ra{schema}")
    lib.impl(f"{name}_ra", impl, "CPU")
    torch.library.register_fake(f"deepseek_csa_bench::{name}_ra", fake, lib=lib)
    torch.library.register_autograd(f"deepseek_csa_bench::{name}_ra", backward,
                                    setup_context=setup, lib=lib)
    ra = getattr(torch.ops.deepseek_csa_bench, f"{name}_ra").default
    co = torch.library.custom_op(f"deepseek_csa_bench::{name}_co", impl, mutates_args=(),
                                 schema=schema)
    co.register_fake(fake)
    co.register_autograd(backward, setup_context=setup)
    return {"op_register_autograd": lambda: ra(*args), "op_custom_op": lambda: co(*args)}


def _python_kernels(name, schema, impl, fake, backward, setup):
    """The operator as ops.py registers it without deepseek_csa.torch._native: Python
    CPU kernel, Python autograd kernel (with its no-grad shortcut), in deepseek_csa_bench."""
    lib = _BENCH_LIB
    lib.define(f"{name}_py{schema}")
    lib.impl(f"{name}_py", impl, "CPU")
    torch.library.register_fake(f"deepseek_csa_bench::{name}_py", fake, lib=lib)
    op = getattr(torch.ops.deepseek_csa_bench, f"{name}_py").default
    ops._register_autograd(op, f"{name}_py", impl, backward, setup, lib=lib)
    return op


def _rms_sides():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    y = np.empty_like(x)
    tx, tw, ty = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(y)
    op = torch.ops.deepseek_csa.rms_norm
    python = _python_kernels("rms_norm", "(Tensor x, Tensor? weight, float eps) -> Tensor",
                             ops._rms_norm_impl, ops._rms_norm_fake, ops._rms_norm_backward,
                             ops._rms_norm_setup)
    assert torch.equal(python(tx, tw, 1e-6), op(tx, tw, 1e-6))
    return {
        "op_python": lambda: python(tx, tw, 1e-6),
        "numpy": lambda: dc.rms_norm(x, w, 1e-6, out=y),
        "tensors": lambda: dc.rms_norm(tx, tw, 1e-6, out=ty),
        "call": lambda: ops.call("rms_norm", tx, tw, 1e-6),
        "op": lambda: op(tx, tw, 1e-6),
        **_alternatives("rms_norm", "(Tensor x, Tensor? weight, float eps) -> Tensor",
                        ops._rms_norm_impl, ops._rms_norm_fake, ops._rms_norm_backward,
                        ops._rms_norm_setup, (tx, tw, 1e-6)),
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
        **_alternatives("sparse_attn", "(Tensor q, Tensor kv, Tensor attn_sink, Tensor topk_idxs, "
                        "float softmax_scale) -> (Tensor, Tensor)", ops._attn_impl, ops._attn_fake,
                        ops._attn_backward, ops._attn_setup, tuple(t[:4]) + (D ** -0.5,)),
    }, op, (t[0], t[1], t[2], t[3], D ** -0.5)


def cpu_us(sides, rounds=7, calls=500):
    """CPU time per call (us) of each side: the best of `rounds` interleaved batches of
    `calls` calls, timed by time.process_time -- what a side costs this process, which
    other tenants of a loaded host inflate far less than the wall clock (these calls run
    on one thread)."""
    best = {k: float("inf") for k in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            fn = sides[name]
            c0 = time.process_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.process_time() - c0) / calls * 1e6)
    return best


def measure(budget):
    rows = []
    for kernel, (sides, op, args) in (("rms_norm [1, 4096]", _rms_sides()),
                                      ("sparse_attn decode H=64 D=512 K=640", _attn_sides())):
        def inference(op=op, args=args):
            with torch.inference_mode():
                op(*args)
        sides["op_inference"] = inference
        load = os.getloadavg()
        with torch.no_grad():
            times = harness.interleaved_times(sides, budget=budget)
            cpu = cpu_us(sides, calls=500 if "rms" in kernel else 20)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        rows.append({"kernel": kernel, "median_us": med, "bar_us": 5.0,
                     "overhead_us": {k: med[k] - med["numpy"] for k in med if k != "numpy"},
                     "cpu_us": cpu,
                     "cpu_overhead_us": {k: cpu[k] - cpu["numpy"] for k in cpu if k != "numpy"},
                     "rounds": len(times["numpy"]),
                     "load_average": [load, os.getloadavg()]})
    return rows


def plot(rows, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = ["tensors", "call", "op", "op_inference", "op_python", "op_register_autograd",
             "op_custom_op"]
    labels = ["tensors", "ops.call\n(direct)", "torch.ops\nno_grad", "torch.ops\ninference",
              "Python kernels\n(no C++ module)", "register_\nautograd", "custom_op"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.38
    for ax, key, base, what in ((axes[0], "overhead_us", "median_us", "wall, median"),
                                (axes[1], "cpu_overhead_us", "cpu_us", "CPU time, best batch")):
        for i, r in enumerate(rows):
            vals = [r[key].get(s, np.nan) for s in sides]
            xs = np.arange(len(sides)) + (i - 0.5) * width
            ax.bar(xs, vals, width, label=f"{r['kernel']} (numpy call {r[base]['numpy']:.1f} us)")
        ax.axhline(5, color="k", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(sides)), labels, fontsize=7)
        ax.set_ylabel("us over the NumPy call")
        ax.set_title(f"{what}; load {rows[0]['load_average'][0][0]:.1f}", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(f"Per-call overhead, {env['cpu']}, ISA {env['isa']}, {env['threads']} threads",
                 fontsize=9)
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
        print("  cpu", " ".join(f"{k} {v:.2f}" for k, v in r["cpu_us"].items()), "us",
              "load", r["load_average"])
    with open(a.out, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    plot(rows, env, a.out[:-5] + ".png")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
