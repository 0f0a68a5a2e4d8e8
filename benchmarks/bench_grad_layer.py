"""Training through the transformers swap: one V4-Flash-shaped CSA attention layer
(``DeepseekV4Attention``: hidden 4096, 64 heads x 512, rope 64, q_lora 1024, 8 x 1024
output groups, window 128, ratio 4, 64 index heads x 128, top-512; float32, random
weights) forward + backward at prefill S, transformers eager autograd vs the same module
swapped onto deepseek_csa (``deepseek_csa.transformers.swap``: the backward runs through
deepseek_csa.torch's differentiable ops).  The loss is ``(out * g).sum()`` for a fixed
random g; the input and every parameter require grad.  Timed interleaved (one call of
each side per round, alternating order); the speed-up is the median of the per-round
ratios; peak memory is the resident high-water mark above the starting point during a
call (max over rounds).  Issue 28's bar: swapped >= 3x eager, peak memory <= 1/5.
Above ``--eager-max`` (default 2048) only ours runs (eager's activations at S=4096
approach 24 GiB).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_grad_layer.py            # 1024, 2048
    .venv/bin/python benchmarks/bench_grad_layer.py --sizes 4096 --rounds 1       # ours alone
    .venv/bin/python benchmarks/bench_grad_layer.py --standin --sizes 256 --rounds 1
        # (--standin: tests/_grad_standin.py's plain-torch ops instead of the real ones,
        #  only to exercise the script before they land: its times mean nothing)

    OMP_NUM_THREADS=2 flock /tmp/mem.lock .venv/bin/python benchmarks/bench_grad_layer.py \
        --dtype bfloat16 --eager-max 0 --sizes 1024 2048 --rounds 2 --label after
        # the layer in bf16 (weights, activations, gradients), ours alone: peak memory of
        # bf16 training; rows are appended to grad_layer_bf16.json under --label, so a run
        # of this script against an older build of the package gives the "before" rows

Writes benchmarks/results/grad_layer.json (+ grad_layer.png), after every row
(grad_layer_bf16.json for --dtype bfloat16).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from bench_hf import flash_config, interleaved, randomize  # noqa: E402
from harness import RESULTS, environment  # noqa: E402


class GradLayer:
    """One CSA DeepseekV4Attention, eager and swapped copies, parameters requiring grad."""

    def __init__(self, dtype=torch.float32):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
        import deepseek_csa.transformers as dch
        self.cfg = flash_config()
        self.dtype = dtype
        self.eager = mdl.DeepseekV4Attention(self.cfg, 0).train()
        randomize(self.eager)
        self.eager.to(dtype)
        self.ours = copy.deepcopy(self.eager)
        dch.swap(self.ours)
        self.rot = mdl.DeepseekV4RotaryEmbedding(self.cfg)

    def inputs(self, S, seed=1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((1, S, self.cfg.hidden_size), generator=g).to(self.dtype)
        pos = torch.arange(S)[None]
        with torch.no_grad():
            pe = {k: self.rot(x, pos, layer_type=k) for k in ("main", "compress")}
        gout = torch.randn((1, S, self.cfg.hidden_size), generator=g).to(self.dtype)
        return x, pos, pe, gout

    def step(self, which, x, pos, pe, gout):
        """Forward + backward; returns (loss, x.grad, kv_proj grad, sinks grad)."""
        mod = self.eager if which == "eager" else self.ours
        mod.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        if which == "eager":
            from transformers.masking_utils import create_sliding_window_causal_mask
            mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=xi,
                                                     attention_mask=None,
                                                     past_key_values=None, position_ids=pos)
            out = mod(xi, pe, pos, mask, None)[0]
        else:
            out = mod(xi, pe, pos, None, None)[0]
        loss = (out * gout).float().sum()
        loss.backward()
        return (float(loss.detach()), xi.grad, mod.compressor.kv_proj.weight.grad,
                mod.sinks.grad)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def bench(layer, S, rounds, eager_max, label=None):
    x, pos, pe, gout = layer.inputs(S)
    outs = {}

    def side(k):
        def call():
            outs[k] = layer.step(k, x, pos, pe, gout)
        return call
    sides = {"ours": side("ours")}
    if S <= eager_max:
        sides["eager"] = side("eager")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # a fallback would be a lie
        res = interleaved(sides, rounds, warm=S <= 1024)
    row = {"case": f"CSA layer fwd+bwd S={S}", "S": S, "rounds": rounds,
           "dtype": str(layer.dtype).replace("torch.", "")}
    if label:
        row.update(label=label, case=f"{row['case']} {row['dtype']} {label}")
    if "eager" in outs:
        o, e = outs["ours"], outs["eager"]
        row["loss_rel_err"] = abs(o[0] - e[0]) / abs(e[0])
        row["grad_x_rel_err"] = rel(o[1], e[1])
        row["grad_compressor_kv_rel_err"] = rel(o[2], e[2])
        row["grad_sinks_rel_err"] = rel(o[3], e[3])
    outs.clear()
    for k, (ts, pk) in res.items():
        row[f"{k}_s"] = statistics.median(ts)
        row[f"{k}_times"] = ts
        row[f"{k}_peak_mem_bytes"] = pk
    if "eager" in res:
        e, o = res["eager"], res["ours"]
        row["speedup"] = statistics.median([a / b for a, b in zip(e[0], o[0])])
        row["memory_ratio"] = o[1] / e[1] if e[1] else None
        row["bar_met"] = bool(row["speedup"] >= 3 and row["memory_ratio"] is not None
                              and row["memory_ratio"] <= 0.2)
    print(fmt(row), flush=True)
    return row


def fmt(r):
    s = f"{r['case']:<28} ours {r['ours_s']:8.3f} s  {r['ours_peak_mem_bytes'] / 2**30:6.2f} GiB"
    if "eager_s" in r:
        s += (f"  eager {r['eager_s']:8.3f} s  {r['eager_peak_mem_bytes'] / 2**30:6.2f} GiB"
              f"  x{r['speedup']:5.2f}  mem {r['memory_ratio']:.3f}"
              f"  grad err x {r['grad_x_rel_err']:.1e} kv {r['grad_compressor_kv_rel_err']:.1e}"
              f" sink {r['grad_sinks_rel_err']:.1e}")
    return s


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["case"].replace("CSA layer fwd+bwd ", "") for r in rows]
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["ours_s"] for r in rows], 0.4, label="swapped (ours)")
    a.bar([i + 0.2 for i in x], [r.get("eager_s", 0) for r in rows], 0.4, label="eager")
    a.set_yscale("log")
    a.set_ylabel("forward + backward (s)")
    b.bar([i - 0.2 for i in x], [r["ours_peak_mem_bytes"] / 2**30 for r in rows], 0.4,
          label="swapped (ours)")
    b.bar([i + 0.2 for i in x], [r.get("eager_peak_mem_bytes", 0) / 2**30 for r in rows],
          0.4, label="eager")
    b.set_ylabel("peak extra resident memory (GiB)")
    for ax in (a, b):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names)
        ax.legend()
    fig.suptitle("V4-Flash CSA DeepseekV4Attention, forward + backward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--eager-max", type=int, default=2048, help="largest S run eagerly")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--standin", action="store_true",
                    help="use tests/_grad_standin.py's plain-torch ops (script check only)")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="keep the attention segment's tensors for the backward instead of "
                         "recomputing them (deepseek_csa.transformers.CHECKPOINT_ATTENTION)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the layer's dtype (weights, activations, gradients)")
    ap.add_argument("--label", default=None,
                    help="names the rows (e.g. before / after a change) and appends them to "
                         "the JSON's rows of other labels")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import deepseek_csa.transformers as dch
    dch.CHECKPOINT_ATTENTION = not a.no_checkpoint
    import deepseek_csa.torch as dct
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _grad_standin import NAMES, real_ops_available
    import _grad_standin
    if a.standin:
        for n in NAMES:
            setattr(dct, n, getattr(_grad_standin, n))
    elif not real_ops_available():
        sys.exit("bench_grad_layer: this build of deepseek_csa.torch has no differentiable "
                 "ops yet (--standin runs the script on the plain-torch stand-in)")
    stem = "grad_layer" + ("_bf16" if a.dtype == "bfloat16" else "")
    out_path = Path(a.out or RESULTS / (stem + "_standin.json" if a.standin else stem + ".json"))
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    import transformers
    rows = []
    if a.label and out_path.exists():   # keep the rows of other labels (another build's run)
        rows = [r for r in json.loads(out_path.read_text())["rows"]
                if r.get("label") != a.label or r["S"] not in a.sizes]
    layer = GradLayer(getattr(torch, a.dtype))
    for S in a.sizes:
        rows.append(bench(layer, S, a.rounds, a.eager_max, a.label))
        rows[-1]["environment"] = dict(environment(threads), load_average=os.getloadavg(),
                                       package=str(Path(dct.__file__).resolve().parent.parent))
        out = {"environment": dict(environment(threads), transformers=transformers.__version__,
                                   load_average=os.getloadavg()),
               "ops": "standin (tests/_grad_standin.py)" if a.standin else "deepseek_csa",
               "checkpoint_attention": dch.CHECKPOINT_ATTENTION,
               "rows": rows}
        out_path.parent.mkdir(exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1))
        plot(rows, out_path.with_suffix(".png"))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
