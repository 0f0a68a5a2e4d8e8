"""transformers' DeepseekV4 (eager) vs the same modules swapped onto deepseek_csa
(deepseek_csa.transformers), timed interleaved on this machine (one call of each side per
round, alternating order; a speed-up is the median of the per-round ratios).

  layer : one V4-Flash-shaped CSA attention layer (hidden 4096, 64 heads x 512, rope 64,
          q_lora 1024, 8 x 1024 output groups, window 128, ratio 4, 64 index heads x 128,
          top-512), float32, random weights; prefill S (the whole forward: projections,
          norms, RoPE, compressor, indexer, attention, output projections; eager also
          builds its dense mask, as the model does when layers are not all swapped) and
          one decode step at a long context (the cache built once, by chunked prefill,
          copied before every timed step).  The time spent inside the nn.Linear
          modules (the dense projections) is measured in the same calls by forward
          hooks, so "non-proj" = a side's time minus its own projections' time.
  model : a whole small DeepseekV4ForCausalLM (V4-Flash layer widths, few layers, small
          vocabulary and experts) generating new tokens greedily after a long prompt.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_hf.py            # everything
    .venv/bin/python benchmarks/bench_hf.py --prefill 1024 2048 --no-model --rounds 3

Writes benchmarks/results/hf.json (+ hf.png).  Peak memory is the resident high-water
mark above the starting point during each call (max over rounds).
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

from harness import RESULTS, environment  # noqa: E402


def _rss(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def measured(fn):
    """(seconds, peak extra resident bytes) of one call."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss("VmRSS:")
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return t, max(0, _rss("VmHWM:") - base)


def interleaved(sides, rounds, warm=True):
    """name -> (list of seconds, peak bytes); one call per side per round, alternating."""
    if warm:
        for fn in sides.values():
            fn()
    res = {k: ([], 0) for k in sides}
    order = list(sides)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t, m = measured(sides[k])
            ts, pk = res[k]
            ts.append(t)
            res[k] = (ts, max(pk, m))
    return res


class ProjTimer:
    """Seconds spent inside the nn.Linear modules (the dense projections, grouped one
    included) of a module tree, accumulated by forward hooks during each call."""

    def __init__(self, module):
        self.total = 0.0
        self._t0 = []
        for sub in module.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.register_forward_pre_hook(self._pre)
                sub.register_forward_hook(self._post)

    def _pre(self, mod, inp):
        self._t0.append(time.perf_counter())

    def _post(self, mod, inp, out):
        self.total += time.perf_counter() - self._t0.pop()


def flash_config(n_layers=1, layer_types=None, vocab=256):
    from transformers import DeepseekV4Config
    layer_types = layer_types or ["compressed_sparse_attention"] * n_layers
    cfg = DeepseekV4Config(vocab_size=vocab, num_hidden_layers=len(layer_types),
                           layer_types=layer_types, mlp_layer_types=["moe"] * len(layer_types),
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           moe_intermediate_size=512, num_nextn_predict_layers=0)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or name.endswith("scale"):
            p.fill_(1.0)
        elif name.endswith("position_bias") or name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif name.endswith("base") or name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


class Layer:
    """One CSA DeepseekV4Attention with what its forward needs, eager or swapped."""

    def __init__(self):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
        self.mdl = mdl
        self.cfg = flash_config()
        self.eager = mdl.DeepseekV4Attention(self.cfg, 0).eval()
        randomize(self.eager)
        self.ours = copy.deepcopy(self.eager)
        import deepseek_csa.transformers as dch
        dch.swap(self.ours)
        self.timers = {"eager": ProjTimer(self.eager), "ours": ProjTimer(self.ours)}
        self.rot = mdl.DeepseekV4RotaryEmbedding(self.cfg)

    def inputs(self, S, start=0, seed=1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((1, S, self.cfg.hidden_size), generator=g)
        pos = torch.arange(start, start + S)[None]
        pe = {k: self.rot(x, pos, layer_type=k) for k in ("main", "compress")}
        return x, pos, pe

    def cache(self):
        from transformers import DynamicCache
        return DynamicCache(config=self.cfg)

    def run_eager(self, x, pos, pe, cache):
        from transformers.masking_utils import create_sliding_window_causal_mask
        mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=x,
                                                 attention_mask=None, past_key_values=cache,
                                                 position_ids=pos)
        return self.eager(x, pe, pos, mask, cache)[0]

    def run_ours(self, x, pos, pe, cache):
        return self.ours(x, pe, pos, None, cache)[0]


def bench_prefill(layer, sizes, rounds, eager_max):
    rows = []
    for S in sizes:
        x, pos, pe = layer.inputs(S)
        outs, proj = {}, {"ours": [], "eager": []}

        def side(k, fn):
            def call():
                t = layer.timers[k]
                t.total = 0.0
                outs[k] = fn(x, pos, pe, layer.cache())
                proj[k].append(t.total)
            return call
        sides = {"ours": side("ours", layer.run_ours)}
        if S <= eager_max:
            sides["eager"] = side("eager", layer.run_eager)
        with torch.no_grad():
            res = interleaved(sides, rounds, warm=S <= 1024)
        err = None
        if "eager" in outs:       # agreement of the timed calls' outputs
            a, b = outs.pop("ours"), outs.pop("eager")
            err = float((a - b).abs().max() / b.abs().max())
        outs.clear()
        row = {"case": f"layer prefill S={S}", "S": S, "rounds": rounds, "max_rel_err": err}
        for k, (ts, pk) in res.items():
            pj = proj[k][-len(ts):]
            row[f"{k}_s"] = statistics.median(ts)
            row[f"{k}_times"] = ts
            row[f"{k}_proj_times"] = pj
            row[f"{k}_non_proj_s"] = statistics.median([a - b for a, b in zip(ts, pj)])
            row[f"{k}_peak_mem_bytes"] = pk
        if "eager" in res:
            e, o = res["eager"][0], res["ours"][0]
            pe_, po = proj["eager"][-len(e):], proj["ours"][-len(o):]
            row["speedup"] = statistics.median([a / b for a, b in zip(e, o)])
            row["speedup_non_proj"] = statistics.median(
                [(a - c) / (b - d) for a, b, c, d in zip(e, o, pe_, po)])
        rows.append(row)
        print(fmt(row), flush=True)
    return rows


def bench_decode(layer, context, rounds, chunk=2048):
    with torch.no_grad():
        cache = layer.cache()
        for s in range(0, context, chunk):
            x, pos, pe = layer.inputs(min(chunk, context - s), start=s, seed=100 + s)
            layer.run_ours(x, pos, pe, cache)
        x, pos, pe = layer.inputs(1, start=context, seed=7)
        a = layer.run_ours(x, pos, pe, copy.deepcopy(cache))
        b = layer.run_eager(x, pos, pe, copy.deepcopy(cache))
        err = float((a - b).abs().max() / b.abs().max())
        times = {"ours": [], "eager": []}
        for r in range(rounds + 1):
            for k in (("ours", "eager") if r % 2 == 0 else ("eager", "ours")):
                c = copy.deepcopy(cache)
                fn = layer.run_ours if k == "ours" else layer.run_eager
                t0 = time.perf_counter()
                fn(x, pos, pe, c)
                if r:
                    times[k].append(time.perf_counter() - t0)
    row = {"case": f"layer decode step at {context}", "context": context, "rounds": rounds,
           "max_rel_err": err, "ours_s": statistics.median(times["ours"]),
           "eager_s": statistics.median(times["eager"]),
           "speedup": statistics.median([a / b for a, b in zip(times["eager"], times["ours"])]),
           "ours_times": times["ours"], "eager_times": times["eager"]}
    print(fmt(row), flush=True)
    return row


def bench_model(prompt, new, rounds, n_layers):
    from transformers import DeepseekV4ForCausalLM
    import deepseek_csa.transformers as dch
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    cfg = flash_config(layer_types=[kinds[i % 2] for i in range(n_layers)], vocab=1024)
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(cfg).eval()
    randomize(m)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    outs = {}

    def eager():
        outs["eager"] = m.generate(ids, **kw)

    def ours():
        with dch.swapped(m):
            outs["ours"] = m.generate(ids, **kw)

    with torch.no_grad():
        res = interleaved({"ours": ours, "eager": eager}, rounds, warm=False)
    same = int((outs["ours"][0, prompt:] == outs["eager"][0, prompt:]).sum())
    row = {"case": f"model {n_layers} layers generate {new} after {prompt}", "prompt": prompt,
           "new_tokens": new, "layers": n_layers, "rounds": rounds,
           "greedy_tokens_equal": same}
    for k, (ts, pk) in res.items():
        row[f"{k}_s"] = statistics.median(ts)
        row[f"{k}_times"] = ts
        row[f"{k}_tokens_per_s"] = new / statistics.median(ts)
        row[f"{k}_peak_mem_bytes"] = pk
    row["speedup"] = statistics.median([a / b for a, b in zip(res["eager"][0], res["ours"][0])])
    print(fmt(row), flush=True)
    return row


def fmt(r):
    s = f"{r['case']:<44} ours {r['ours_s']:8.3f} s"
    if "eager_s" in r:
        s += f"  eager {r['eager_s']:8.3f} s  x{r['speedup']:6.2f}"
    if "ours_non_proj_s" in r:
        s += f"  (non-proj ours {r['ours_non_proj_s']:.3f} s"
        if "speedup_non_proj" in r:
            s += f" eager {r['eager_non_proj_s']:.3f} s x{r['speedup_non_proj']:6.2f}"
        s += ")"
    if "ours_peak_mem_bytes" in r:
        s += f"  peak ours {r['ours_peak_mem_bytes'] / 2**30:5.2f} GiB"
    if "eager_peak_mem_bytes" in r:
        s += f" eager {r['eager_peak_mem_bytes'] / 2**30:5.2f} GiB"
    if "ours_tokens_per_s" in r:
        s += f"  tok/s ours {r['ours_tokens_per_s']:.2f} eager {r['eager_tokens_per_s']:.2f}"
    if r.get("max_rel_err") is not None:
        s += f"  err {r['max_rel_err']:.1e}"
    return s


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "speedup" in r]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in rows], 0.4, label="end to end")
    ax.bar([i + 0.2 for i in x], [r.get("speedup_non_proj", 0) for r in rows], 0.4,
           label="all but the dense projections")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speed-up vs transformers eager (x)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["case"] for r in rows], fontsize=7, rotation=20, ha="right")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--eager-max", type=int, default=4096, help="largest S run eagerly")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-context", type=int, default=16384)
    ap.add_argument("--decode-rounds", type=int, default=7)
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--model-layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--model-rounds", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "hf.json"))
    a = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    import transformers
    rows = []

    def save():          # after every row, so an interrupted run keeps what it measured
        out = {"environment": dict(environment(threads), transformers=transformers.__version__,
                                   load_average=os.getloadavg()), "rows": rows}
        RESULTS.mkdir(exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        plot(rows, Path(a.out).with_suffix(".png"))

    layer = Layer()
    for S in a.prefill:
        rows += bench_prefill(layer, [S], a.rounds, a.eager_max)
        save()
    if a.decode_context:
        rows.append(bench_decode(layer, a.decode_context, a.decode_rounds))
        save()
    del layer
    if not a.no_model:
        rows.append(bench_model(a.prompt, a.new, a.model_rounds, a.model_layers))
        save()
    print("wrote", a.out)


if __name__ == "__main__":
    main()
