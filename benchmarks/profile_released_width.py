"""Where a decode step of the released-width layer (bench_released_width.py) spends the
time between our kernels, and what cutting it buys (docs/runner.md, "What it does" 10).

    flock /tmp/mem.lock flock /tmp/timing.lock env OMP_WAIT_POLICY=passive \
        .venv/bin/python benchmarks/profile_released_width.py --cpu-regions 32
    ... profile_released_width.py --compare 16 --block 4 --what indexer

One process (~4.2 GiB): the runner's model as bench_released_width's worker builds it
(its cached checkpoint; run its --prepare once), 64 tokens and 4 steps of warm-up, the
synthetic 4K fill, 4 steps, then
--cpu-regions N: N steps, the calling thread's CPU time of model.py's pieces (REGIONS)
  and of every deepseek_csa operator, inclusive and exclusive of the pieces inside;
--profile N: torch.profiler over N steps, operators by self CPU time (our operators'
  eager calls skip the dispatcher, so the profiler misses some: wfp8_gemm, wbf16_gemm);
--cprofile N: cProfile over N steps;
--compare R: R rounds, each `--block` steps as released then `--block` steps with the
  change (--what compile: compile_pieces below, the graphs built before the first
  round; --what indexer: the runner's fused indexer, deepseek_csa.torch.fused_indexer,
  against model.py's einsum), on the same caches (the positions advance through both);
  wall and calling-thread CPU time a step, medians and means.
Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_released_width as brw  # noqa: E402
import torch  # noqa: E402


# --what compile: Block.hc_pre / hc_post, ParallelHead.hc_head and RMSNorm.forward, each
# compiled for one-token calls (a prefill runs them as released)
PIECES = ("hc", "norm")


def _targets(model, pieces):
    """(module, method name) of the methods compile_pieces routes."""
    for m in model.modules():
        if "hc" in pieces and hasattr(m, "hc_pre") and hasattr(m, "hc_post"):
            yield m, "hc_pre"
            yield m, "hc_post"
        elif "hc" in pieces and hasattr(m, "hc_head") and hasattr(m, "get_logits"):
            yield m, "hc_head"
        elif ("norm" in pieces and type(m).__name__ == "RMSNorm"
              and hasattr(m, "eps") and hasattr(m, "weight")):
            yield m, "forward"


def _one_token(args):
    x = args[0]
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.size(1) == 1 and x.size(0) == 1


_COMPILED = {}


def _compiled(cls, name, cpp_wrapper):
    """One compiled function per (class, method): the module is its first argument, so
    every layer's call shares the graph (parameters are graph inputs)."""
    key = (cls, name, bool(cpp_wrapper))
    if key not in _COMPILED:
        import torch._dynamo
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[key] = torch.compile(getattr(cls, name), dynamic=False,
                                       options={"cpp_wrapper": bool(cpp_wrapper)})
    return _COMPILED[key]


def compile_pieces(model, pieces=PIECES, cpp_wrapper=True):
    """Routes the one-token calls of model.py's methods named by ``pieces`` (PIECES)
    under model through torch.compile (batch 1, one position: a prefill, or a batch of
    prompts, runs the method as released).  Returns how many methods were routed."""
    n = 0
    for m, name in _targets(model, pieces):
        cls = type(m)
        comp = _compiled(cls, name, cpp_wrapper)
        orig = getattr(cls, name)

        def method(self, *args, _comp=comp, _orig=orig):
            if _one_token(args):
                return _comp(self, *args)
            return _orig(self, *args)
        setattr(m, name, types.MethodType(method, m))
        n += 1
    return n


def eager_pieces(model):
    """Undoes compile_pieces (the compiled graphs stay cached for the next one)."""
    for m, name in _targets(model, PIECES):
        m.__dict__.pop(name, None)


REGIONS = ("Block.forward", "Block.hc_pre", "Block.hc_post", "ParallelEmbedding.forward", "RMSNorm.forward", "Attention.forward",
           "Indexer.forward", "Compressor.forward", "Gate.forward", "MoE.forward",
           "Expert.forward", "ParallelHead.forward", "apply_rotary_emb", "rotate_activation",
           "act_quant", "fp4_act_quant", "sparse_attn", "hc_split_sinkhorn", "linear",
           "get_window_topk_idxs")


def _label_regions(model):
    """Wraps model.py's classes' methods and module functions named in REGIONS in
    torch.profiler.record_function labels "model.py <name>" (inclusive CPU time)."""
    import functools
    import sys as _sys
    from torch.profiler import record_function
    mod = _sys.modules[type(model).__module__]

    def wrap(f, label):
        @functools.wraps(f)
        def g(*a, **k):
            with record_function(label):
                return f(*a, **k)
        return g
    for name in REGIONS:
        if "." in name:
            cls, meth = name.split(".")
            c = getattr(mod, cls)
            setattr(c, meth, wrap(getattr(c, meth), "model.py " + name))
        else:
            setattr(mod, name, wrap(getattr(mod, name), "model.py " + name))
    for m in model.modules():          # fuse_moe's instance forward
        if "forward" in m.__dict__ and type(m).__name__ == "MoE":
            m.forward = wrap(m.forward, "model.py MoE.forward (fused)")


def _thread_cpu_regions(model, acc):
    """Like _label_regions, but each label (and each deepseek_csa operator called
    through deepseek_csa.torch.ops.call, "op <name>") adds its inclusive thread CPU
    time to acc[label] = [calls, seconds]: robust to a loaded host, where wall times
    count the time a thread waits descheduled."""
    import functools
    import sys as _sys
    from deepseek_csa.torch import ops
    mod = _sys.modules[type(model).__module__]
    clock = time.thread_time

    stack = [0.0]                     # children's time of each open region

    def wrap(f, label):
        @functools.wraps(f)
        def g(*a, **k):
            t0 = clock()
            stack.append(0.0)
            try:
                return f(*a, **k)
            finally:
                dt = clock() - t0
                e = acc.setdefault(label, [0, 0.0, 0.0])
                e[0] += 1
                e[1] += dt
                e[2] += dt - stack.pop()
                stack[-1] += dt
        return g
    for name in REGIONS:
        if "." in name:
            cls, meth = name.split(".")
            c = getattr(mod, cls)
            setattr(c, meth, wrap(getattr(c, meth), name))
        else:
            setattr(mod, name, wrap(getattr(mod, name), name))
    for m in model.modules():
        if "forward" in m.__dict__ and type(m).__name__ == "MoE":
            m.forward = wrap(m.forward, "MoE.forward (fused)")
    call = ops.call

    def op_call(name, *a):
        return wrap(call, "op " + name)(name, *a)
    ops.call = op_call
    return stack


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--profile-compiled", action="store_true",
                    help="--profile the compiled steps instead of the eager ones")
    ap.add_argument("--compare", type=int, default=0, metavar="ROUNDS")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--what", choices=("compile", "indexer"), default="compile",
                    help="--compare: eager against compile_pieces' pieces compiled, or "
                         "model.py's indexer as released against the runner's fused one "
                         "(deepseek_csa.torch.fused_indexer)")
    ap.add_argument("--no-cpp-wrapper", action="store_true")
    ap.add_argument("--pieces", default="hc,norm",
                    help="what --what compile compiles (PIECES)")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--cpu-regions", type=int, default=0, metavar="N",
                    help="N eager steps with the calling thread's CPU time of model.py's "
                         "pieces and of every deepseek_csa operator (inclusive)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile over N eager steps (functions by own time)")
    ap.add_argument("--regions", action="store_true",
                    help="--profile also labels model.py's pieces (inclusive CPU time each)")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(a.threads)
    model, layer = brw.runner_model()
    ids = torch.tensor([brw.blm.bench_ids(max(a.ctx, 256), brw.CFG["vocab_size"])])
    lg = model(ids[:, :64], 0)                                 # as the worker warms up
    for p in range(64, 68):
        lg = model(lg.argmax(-1).view(1, 1), p)
    lg = brw.synthetic_fill(model, layer, ids, a.ctx)
    tok, pos = lg.argmax(-1).view(1, 1), a.ctx
    out = dict(ctx=a.ctx, threads=torch.get_num_threads(), loadavg_start=open("/proc/loadavg").read().split()[:3])

    def steps(n, times=None, cpu=None):
        nonlocal tok, pos
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            lg = model(tok, pos)
            tok = lg.argmax(-1, keepdim=True).view(1, 1)
            pos += 1
            if times is not None:
                times.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(time.thread_time() - c0)
        return lg

    compiled = (a.compare and a.what == "compile") or a.profile_compiled
    pieces = a.pieces.split(",")
    if a.compare and a.what == "indexer":
        from deepseek_csa.torch.fused_indexer import _indexer_forward, fuse_indexer
        fuse_indexer(model)
        idx = layer.attn.indexer

        def change_on(model, *args, **kw):          # the runner's fused indexer
            idx.forward = types.MethodType(_indexer_forward, idx)

        def change_off(model):                      # model.py's as released (its FP4
            idx.__dict__.pop("forward", None)       # rows catch up on the next fused step)
        change_off(model)
    else:
        change_on, change_off = compile_pieces, eager_pieces
    if compiled:
        t0 = time.perf_counter()
        change_on(model, pieces, cpp_wrapper=not a.no_cpp_wrapper)
        steps(4)                      # every graph built before the timed steps
        out["compile_s"] = time.perf_counter() - t0
        change_off(model)
    steps(4)
    if a.cpu_regions:
        acc = {}
        top = _thread_cpu_regions(model, acc)
        steps(4)
        acc.clear()
        top[0] = 0.0
        cpu = []
        steps(a.cpu_regions, [], cpu)
        out["cpu_regions_step_thread_cpu_ms"] = statistics.mean(cpu) * 1e3
        out["cpu_regions_outside_ms"] = (statistics.mean(cpu) - top[0] / a.cpu_regions) * 1e3
        out["cpu_regions"] = {k: dict(calls=v[0] / a.cpu_regions,
                                      ms=v[1] / a.cpu_regions * 1e3,
                                      exclusive_ms=v[2] / a.cpu_regions * 1e3)
                              for k, v in sorted(acc.items(), key=lambda kv: -kv[1][2])}
    if a.cprofile:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        steps(a.cprofile)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(a.rows)
        out["cprofile"] = buf.getvalue()
    if a.regions:
        _label_regions(model)
    if a.profile:
        if a.profile_compiled:
            change_on(model, pieces, cpp_wrapper=not a.no_cpp_wrapper)
        from torch.profiler import ProfilerActivity, profile
        times = []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            steps(a.profile, times)
        ev = prof.key_averages()
        rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)
        tot = sum(e.self_cpu_time_total for e in ev)
        out["profile_step_ms"] = statistics.median(times) * 1e3
        out["profile_self_ms_a_step"] = tot / a.profile / 1e3
        out["profile_calls_a_step"] = sum(e.count for e in ev) / a.profile
        if a.regions:
            out["regions"] = {e.key: dict(calls=e.count / a.profile,
                                          ms=e.cpu_time_total / a.profile / 1e3)
                              for e in ev if e.key.startswith("model.py ")}
        out["ops"] = [dict(name=e.key, calls=e.count / a.profile,
                           self_ms=e.self_cpu_time_total / a.profile / 1e3)
                      for e in rows[:a.rows]]
    if a.compare:
        eager, comp, ecpu, ccpu = [], [], [], []          # before, after
        for _ in range(a.compare):
            steps(a.block, eager, ecpu)
            change_on(model, pieces, cpp_wrapper=not a.no_cpp_wrapper)
            steps(a.block, comp, ccpu)
            change_off(model)
        out["before_ms"] = statistics.median(eager) * 1e3
        out["after_ms"] = statistics.median(comp) * 1e3
        # the calling thread's CPU time a step: its share of the kernels (the same on
        # both sides) and all of the Python and torch operators between them; on a
        # loaded host it does not count the time the thread waits descheduled
        out["before_thread_cpu_ms"] = statistics.median(ecpu) * 1e3
        out["after_thread_cpu_ms"] = statistics.median(ccpu) * 1e3
        # means: a cost paid every few steps (a new shape) is in the mean, not the median
        out["before_mean_ms"] = statistics.mean(eager) * 1e3
        out["after_mean_ms"] = statistics.mean(comp) * 1e3
        out["before_thread_cpu_mean_ms"] = statistics.mean(ecpu) * 1e3
        out["after_thread_cpu_mean_ms"] = statistics.mean(ccpu) * 1e3
        out["before_steps_ms"] = [round(t * 1e3, 2) for t in eager]
        out["after_steps_ms"] = [round(t * 1e3, 2) for t in comp]
    out["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
