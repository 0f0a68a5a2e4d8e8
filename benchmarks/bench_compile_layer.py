"""One V4-Flash CSA attention layer (transformers' DeepseekV4Attention, bench_hf.Layer),
four sides timed interleaved in one run: transformers eager, eager + torch.compile,
swapped onto deepseek_csa (deepseek_csa.transformers.swap), swapped + torch.compile.

  prefill S (default 2048): the whole forward into an empty cache.
  decode at a context (default 4096): one step after a prefill of that many tokens (the
          cache built once by the swapped layer, chunked, and deep-copied before every
          timed step, so every side starts from the same state).

The compiled sides are torch.compile(module) with the backend given (default
inductor); compilation happens in an untimed warm-up call (its time is reported as
compile_s).  Ratios are medians of the per-round ratios against transformers eager;
CPU time (time.process_time) is recorded beside the wall clock for every call, since
the shared host is often loaded.  float32, random weights.

    OMP_NUM_THREADS=2 flock /tmp/timing.lock .venv/bin/python benchmarks/bench_compile_layer.py

Writes benchmarks/results/compile_layer.json (+ .png).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from bench_hf import Layer  # noqa: E402
from harness import RESULTS, environment  # noqa: E402

SIDES = ("eager", "eager_compiled", "swap", "swap_compiled")


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _make_sides(layer, backend):
    """name -> fn(x, pos, pe, cache) for the four sides (the compiled modules wrap the
    very modules the eager sides run)."""
    ce = torch.compile(layer.eager, backend=backend)
    co = torch.compile(layer.ours, backend=backend)

    def eager_compiled(x, pos, pe, cache):
        from transformers.masking_utils import create_sliding_window_causal_mask
        mask = create_sliding_window_causal_mask(config=layer.cfg, inputs_embeds=x,
                                                 attention_mask=None, past_key_values=cache,
                                                 position_ids=pos)
        return ce(x, pe, pos, mask, cache)[0]

    return {"eager": layer.run_eager, "eager_compiled": eager_compiled,
            "swap": layer.run_ours, "swap_compiled": lambda x, pos, pe, cache: co(
                x, pe, pos, None, cache)[0]}


def _timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def run_case(name, sides, args, fresh_cache, rounds):
    """Warm-up (compile) then `rounds` interleaved rounds; a row."""
    x, pos, pe = args
    row = {"case": name, "rounds": rounds}
    outs = {}
    with torch.no_grad():
        for k, fn in sides.items():
            outs[k], t, c = _timed(lambda: fn(x, pos, pe, fresh_cache()))
            row[f"{k}_first_call_s"] = t
        times = {k: ([], []) for k in sides}
        order = list(sides)
        for r in range(rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                cache = fresh_cache()
                _, t, c = _timed(lambda: sides[k](x, pos, pe, cache))
                times[k][0].append(t)
                times[k][1].append(c)
    for k, (ts, cs) in times.items():
        row[f"{k}_s"] = statistics.median(ts)
        row[f"{k}_cpu_s"] = statistics.median(cs)
        row[f"{k}_times"] = ts
        row[f"{k}_cpu_times"] = cs
        row[f"{k}_max_rel_err_vs_eager"] = _rel(outs[k], outs["eager"])
        row[f"{k}_speedup"] = statistics.median([a / b for a, b in zip(times["eager"][0], ts)])
        row[f"{k}_cpu_speedup"] = statistics.median(
            [a / b for a, b in zip(times["eager"][1], cs)])
    row["load_average_end"] = os.getloadavg()
    print(name, "  ".join(f"{k} {row[k + '_s'] * 1e3:.1f} ms (x{row[k + '_speedup']:.2f}, "
                          f"cpu x{row[k + '_cpu_speedup']:.2f})" for k in sides), flush=True)
    return row


def plot(rows, env, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.2
    for i, k in enumerate(SIDES):
        ax.bar([j + (i - 1.5) * w for j in range(len(rows))],
               [r[f"{k}_speedup"] for r in rows], w, label=k.replace("_", " + "))
    ax.axhline(1, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows], fontsize=8)
    ax.set_ylabel("speed-up vs transformers eager (x, wall)")
    ax.set_title(f"V4-Flash CSA layer, {env['cpu']}, ISA {env['isa']}, {env['threads']} threads, "
                 f"backend {rows[0]['backend']}, load {env['load_average'][0]:.1f}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", default=str(RESULTS / "compile_layer.json"))
    a = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    import transformers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    layer = Layer()
    # bench_hf's projection timers are forward hooks calling time.perf_counter, which
    # Dynamo cannot trace: a graph break at every nn.Linear of the compiled sides
    for mod in (layer.eager, layer.ours):
        for sub in mod.modules():
            sub._forward_hooks.clear()
            sub._forward_pre_hooks.clear()
    sides = _make_sides(layer, a.backend)
    rows = []
    env = dict(environment(threads), transformers=transformers.__version__,
               load_average=os.getloadavg())

    def save():
        RESULTS.mkdir(exist_ok=True)
        Path(a.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        plot(rows, env, Path(a.out).with_suffix(".png"))

    if a.prefill:
        rows.append(dict(run_case(f"prefill S={a.prefill}", sides, layer.inputs(a.prefill),
                                  layer.cache, a.rounds), backend=a.backend, S=a.prefill))
        save()
    if a.context:
        with torch.no_grad():
            cache = layer.cache()
            for s in range(0, a.context, 2048):
                layer.run_ours(*layer.inputs(min(2048, a.context - s), start=s, seed=100 + s),
                               cache)
        rows.append(dict(run_case(f"decode at {a.context}", sides,
                                  layer.inputs(1, start=a.context, seed=7),
                                  lambda: copy.deepcopy(cache), a.rounds),
                         backend=a.backend, context=a.context))
        save()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
