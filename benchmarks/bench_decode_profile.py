"""Where a decode step's time goes: compute kernels vs Python and dispatch, for the
transformers model swapped onto deepseek_csa, eager ("hf + swap fp8") and compiled
("hf + swap compile": torch.compile(model.forward, dynamic=True)).

Sides (--sides, comma-separated, each in a fresh process): "eager"; "compiled"
(Inductor, Python wrapper); "compiled_cpp" (Inductor's C++ wrapper).  Modifiers on a
compiled side: "+static" (inline_inbuilt_nn_modules off, meant to make parameters
graph constants: torch 2.13 ignores the flag, deprecated, so "+static" measures as
without it; kept so the committed rows' names still run), "+auto" (dynamic=None: sizes static until they change), "+skipguards" (the
unsafe steady-state stance that checks only the guards telling graphs apart).

The model is bench_llamacpp_model.py's V4-Flash-width 3-layer checkpoint (window,
CSA and HCA layers; written once under build/peers/model27/, see that file), loaded as
its "hf + swap fp8" side loads it (bfloat16, swapped, projections on the FP8 / FP4
codes).  After a prefill of --context tokens, --steps greedy decode steps are timed
(wall clock), then --steps more run under cProfile with the calling thread's CPU
time as its clock (time.thread_time): the Python and the dispatcher run on that thread
only, and CPU time is what other tenants of a loaded host do not inflate.

Definitions, per decode step:
  wall          the step's wall time without the profiler.
  profiled      the profiled step's CPU time on the calling thread.
  compute       the calling thread's CPU time inside the C functions that do the
                arithmetic, as cProfile's tottime of each call from Python: every deepseek_csa._core kernel
                (our C kernels, glue included), every torch builtin that runs an aten
                operator (torch.* functions, Tensor methods, torch._C._nn.*), and
                Inductor's compiled kernels (with its C++ wrapper, the compiled graph's
                whole C++ entry, inductor_entry_cpp: kernels and C++ calls only), and
                the C++ kernels of the operators in deepseek_csa.torch.ops.NATIVE, timed
                by the calling thread's CPU clock inside them (_native.time_kernels:
                cProfile does not see inside a torch.ops call, and misses some of them
                altogether); but not the torch.ops.deepseek_csa.* calls themselves,
                whose own time is the dispatcher.
  python_dispatch  profiled minus compute: the interpreter running
                transformers' and our Python (modules, hooks, cache bookkeeping, Dynamo's
                guards and the compiled graph's wrapper), the torch.ops dispatcher, and
                argument parsing of every builtin that is not itself timed.
The aten builtins' own argument parsing and C++ dispatch (about a microsecond a call)
count as compute here: python_dispatch is a lower bound.  The profiler's own
per-call cost inflates the profiled step; both sides pay it per Python call, so the
ratio of python_dispatch between the sides is what this measures.

    DEEPSEEK_CSA_ISA=avx2 OMP_NUM_THREADS=2 flock /tmp/timing.lock \\
        .venv/bin/python benchmarks/bench_decode_profile.py --context 1024

Writes benchmarks/results/decode_profile[_<isa>].json (+ .png).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import bench_llamacpp_model as blm  # noqa: E402
from harness import RESULTS, environment  # noqa: E402


def is_compute(func):
    """True for a cProfile entry name of a C function doing tensor arithmetic (see the
    module doc)."""
    if not func.startswith("<"):
        return False
    if "deepseek_csa._core" in func:
        return True
    if "_ops.deepseek_csa" in func:
        return False    # the dispatcher; a C++ kernel inside it is timed by _native
    if "cpp_fused" in func or "torchinductor" in func or func.endswith(".kernel>"):
        return True     # Inductor's compiled kernels: "<built-in method <hash>.kernel.kernel>"
    if "inductor_entry_cpp" in func:
        return True     # a graph compiled with Inductor's C++ wrapper: kernels and C++ only
    return "torch" in func and "torch._C._dynamo" not in func and "guard" not in func


def profile_steps(m, lg, cache, steps, cpp_wrapper=False):
    """(wall seconds of each step unprofiled, per-step dict of the profiled steps)."""
    walls, rows = [], []
    import deepseek_csa.torch as dct
    # the C++ kernels' CPU time (deepseek_csa.torch._native), which cProfile cannot see;
    # under Inductor's C++ wrapper they run inside inductor_entry_cpp, counted whole
    # (and a build from before the operators has neither: bench one for comparison)
    ops = getattr(dct, "ops", None)
    native = None if cpp_wrapper else getattr(ops, "_NATIVE", None)
    with torch.no_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
            walls.append(time.perf_counter() - t0)
        for _ in range(steps):
            pr = cProfile.Profile(time.thread_time)
            if native is not None:
                native.time_kernels(True)
                native.kernel_seconds()
            t0 = time.thread_time()
            pr.enable()
            lg = m(lg[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
            pr.disable()
            total = time.thread_time() - t0
            st = pstats.Stats(pr).stats
            compute = 0.0
            if native is not None:
                compute = native.kernel_seconds()
                native.time_kernels(False)
            top = {}
            for (fn, line, name), (cc, nc, tt, ct, callers) in st.items():
                if is_compute(name):
                    compute += tt
                key = name if fn == "~" else f"{Path(fn).name}:{line}({name})"
                top[key] = top.get(key, 0.0) + tt
            rows.append(dict(profiled_s=total, compute_s=compute,
                             python_dispatch_s=total - compute,
                             calls=sum(v[1] for v in st.values()),
                             top=sorted(top.items(), key=lambda kv: -kv[1])[:25]))
    return walls, rows, lg


def run_side(side, context, steps, threads, backend):
    from transformers import DynamicCache
    m = blm.load_hf(blm.MODEL_CACHE / blm.model_key() / "hf-bf16", threads, swapped=True,
                    bf16=True, quantized=True)
    ids = torch.tensor([blm.bench_ids(context, m.config.vocab_size)])
    compile_s = 0.0
    if side.startswith("compiled"):
        t0 = time.perf_counter()
        if side.startswith("compiled_cpp"):   # Inductor's C++ wrapper: no Python between kernels
            torch._inductor.config.cpp_wrapper = True
        if "+static" in side:    # a no-op since torch 2.13 (module docstring)
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                torch._dynamo.config.inline_inbuilt_nn_modules = False
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        # "+auto": torch.compile's default dynamic=None, where a size is static until it
        # changes.  With dynamic=True every size is a symbol, and each step re-checks the
        # symbolic relations in Python guards and passes the sizes to the graph as
        # tensors: 2.17 against 1.68 ms of Python + dispatch a step, same host, avx2
        dynamic = None if "+auto" in side else True
        m.forward = torch.compile(m.forward, dynamic=dynamic, backend=backend)
        # the run below once, untimed, on its own cache: every graph the measured steps
        # need is compiled first (as bench_llamacpp_model.compile_for_run does)
        with torch.no_grad():
            c = DynamicCache(config=m.config)
            lg = m(ids, past_key_values=c, use_cache=True, logits_to_keep=1).logits
            for _ in range(2 * steps):
                lg = m(lg[:, -1:].argmax(-1), past_key_values=c, use_cache=True).logits
        del c
        compile_s = time.perf_counter() - t0
        if "+skipguards" in side:   # steady state: only the guards that tell graphs apart
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        lg = m(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    walls, rows, _ = profile_steps(m, lg, cache, steps, cpp_wrapper=side.startswith("compiled_cpp"))
    graphs_during = counters["stats"]["unique_graphs"] - graphs
    med = sorted(walls)[len(walls) // 2]
    prof = sorted(rows, key=lambda r: r["profiled_s"])[len(rows) // 2]
    return dict(side=side, wall_s=med, walls=walls, compile_s=compile_s,
                graphs_compiled_while_measured=graphs_during,
                graphs=counters["stats"]["unique_graphs"],
                graph_breaks=dict(counters["graph_break"]),
                profiled_s=prof["profiled_s"], compute_s=prof["compute_s"],
                python_dispatch_s=prof["python_dispatch_s"], calls=prof["calls"],
                top=prof["top"], profiled_steps=[{k: v for k, v in r.items() if k != "top"}
                                                 for r in rows])


def plot(res, env, path):
    """One horizontal bar a side: its Python + dispatch per step (the quantity compared),
    with the compute beside it in the label (it dwarfs the rest on a common axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["sides"]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * len(rows)))
    y = list(range(len(rows)))[::-1]
    py = [r["python_dispatch_s"] * 1e3 for r in rows]
    ax.barh(y, py, color=["tab:orange" if "before" in r["side"] else "tab:blue" for r in rows])
    ax.set_yticks(y, [r["side"] for r in rows], fontsize=7)
    for yi, r, v in zip(y, rows, py):
        ax.text(v, yi, f" {v:.2f} ms (compute {r['compute_s'] * 1e3:.1f})", va="center", fontsize=7)
    ax.set_xlim(0, max(py) * 1.45)
    ax.set_xlabel("Python + dispatch, ms CPU a decode step on the calling thread (cProfile)")
    ax.set_title(f"decode step at {res['context']}, {env['cpu']}, ISA {env['isa']}, "
                 f"{env['threads']} thr, load {env['load_average'][0]:.1f}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--sides", default="eager,compiled")
    ap.add_argument("--side", help=argparse.SUPPRESS)     # one side, in this process
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    if a.side:
        print(json.dumps(run_side(a.side, a.context, a.steps, threads, a.backend)))
        return
    import subprocess
    env = dict(environment(threads), load_average=os.getloadavg())
    res = {"context": a.context, "steps": a.steps, "backend": a.backend, "sides": []}
    for side in a.sides.split(","):     # a fresh process each: compile caches, memory
        r = subprocess.run([sys.executable, __file__, "--side", side, "--context",
                            str(a.context), "--steps", str(a.steps), "--backend", a.backend],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr[-3000:])
        row = json.loads(r.stdout.strip().splitlines()[-1])
        res["sides"].append(row)
        print(f"{side:9s} wall {row['wall_s'] * 1e3:7.1f} ms  profiled {row['profiled_s'] * 1e3:7.1f}"
              f"  compute {row['compute_s'] * 1e3:7.1f}  python+dispatch "
              f"{row['python_dispatch_s'] * 1e3:6.1f} ms  ({row['calls']} calls, "
              f"{row['graphs']} graphs, {sum(row['graph_breaks'].values())} graph breaks)",
              flush=True)
    env["load_average_end"] = os.getloadavg()
    isa = os.environ.get("DEEPSEEK_CSA_ISA")
    out = Path(a.out) if a.out else RESULTS / f"decode_profile{'_' + isa if isa else ''}.json"
    out.write_text(json.dumps({"environment": env, **res}, indent=1))
    plot(res, env, out.with_suffix(".png"))
    print("wrote", out)


if __name__ == "__main__":
    main()
