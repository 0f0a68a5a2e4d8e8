"""A padded batch through transformers' DeepseekV4 (eager) vs the same model swapped onto
deepseek_csa (deepseek_csa.transformers), the workload of issue 29's benchmark bar:
"a padded batch of 4 prompts of 1024-2048 tokens through one V4-Flash CSA layer".

  model : a DeepseekV4ForCausalLM with ONE compressed-sparse-attention layer of
          V4-Flash's attention widths (bench_hf.flash_config: hidden 4096, 64 heads x 512,
          rope 64, q_lora 1024, 8 x 1024 output groups, window 128, ratio 4, 64 index
          heads x 128, top-512, hyper-connections x4), float32, random weights; what the
          model needs besides is kept small so that time and memory measure attention:
          vocabulary 256, 4 routed experts of width 64 (+1 shared).
  input : 4 prompts of different lengths (default 1024, 1365, 1707, 2048), left-padded
          to the longest as `tokenizer(..., padding=True)` gives them for generation: a
          2-D attention_mask and generate()'s position ids (cumsum(mask) - 1, pads 1).
  timed : one prefill forward (use_cache=True, a fresh DynamicCache, all logits), eager
          vs `with deepseek_csa.transformers.swapped(model)`; one call of each side per
          round, alternating order, after one untimed warm-up call each; a speed-up is
          the median of the per-round ratios.  Forward hooks also time, in the same
          calls, the attention module alone and its nn.Linear projections (the dense
          projections run in torch on both sides), so "attention non-proj" is the part
          the swap replaces.  Any fallback warning of the swap is an error.
  memory: each side in a fresh subprocess (model built, inputs made; nothing run
          before): peak resident memory above the starting point during the first
          prefill call and during a second one (VmHWM after /proc/self/clear_refs);
          the larger of the two is the side's peak.
  check : the swapped logits against eager's (max |diff| / max |eager|, over all rows
          and over the real tokens only) and the last hidden state likewise.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_hf_padded.py          # the bar
    .venv/bin/python benchmarks/bench_hf_padded.py --quick                    # smoke test

Writes benchmarks/results/hf_padded.json (+ .png); --quick writes hf_padded_quick.*.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from harness import RESULTS, environment  # noqa: E402
from bench_hf import flash_config, randomize, ProjTimer, interleaved  # noqa: E402

DEFAULT_LENGTHS = [1024, 1365, 1707, 2048]
QUICK_LENGTHS = [128, 171, 213, 256]


def build_model():
    from transformers import DeepseekV4ForCausalLM
    cfg = flash_config(n_layers=1, vocab=256)
    cfg.moe_intermediate_size = 64           # the MoE is not what is measured
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(cfg).eval()
    randomize(m)
    return m


def padded_batch(lengths, vocab, seed=3):
    """Left-padded ids (pad id 0), the 2-D mask and generate()'s position ids."""
    B, S = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (B, S), generator=g)
    am = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, S - n:] = 1
    ids = ids.masked_fill(am == 0, 0)
    pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    return ids, am, pos


def forward(m, ids, am, pos, swapped):
    """One prefill as generate() runs it: a fresh cache, the 2-D mask, per-row positions.
    Returns (logits, last hidden state)."""
    from transformers import DynamicCache
    import deepseek_csa.transformers as dch
    kw = dict(attention_mask=am, position_ids=pos, past_key_values=DynamicCache(config=m.config),
              use_cache=True)
    if not swapped:
        out = m(ids, **kw)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)     # a fallback is a failure
            with dch.swapped(m):
                out = m(ids, **kw)
    return out.logits, out.hidden_states


class Timer:
    """Seconds spent inside one module per call (forward pre/post hooks)."""

    def __init__(self, module):
        self.total = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, mod, inp):
        self._t0 = time.perf_counter()

    def _post(self, mod, inp, out):
        self.total += time.perf_counter() - self._t0


class Hidden:
    """The base model's last hidden state of the latest call (a forward hook), so the
    timed call needs no output_hidden_states."""

    def __init__(self, base):
        self.value = None
        base.register_forward_hook(self._post)

    def _post(self, mod, inp, out):
        self.value = out.last_hidden_state


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------- memory
def _status(field):
    return _status_file("/proc/self/status", field)


def _status_file(path, field):
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _peak_of(fn):
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    base = _status("VmRSS:")
    r = fn()
    return max(0, _status("VmHWM:") - base), reset, r


def mem_child(side, lengths, threads):
    """Runs in a fresh process: peak extra resident bytes of a first and a second call."""
    torch.set_num_threads(threads)
    m = build_model()
    ids, am, pos = padded_batch(lengths, m.config.vocab_size)
    out = {}
    with torch.no_grad():
        for k in ("first", "second"):
            pk, reset, r = _peak_of(lambda: forward(m, ids, am, pos, side == "ours"))
            del r
            out[f"{k}_call_peak_bytes"] = pk
            out["hwm_reset"] = reset
    print("MEM " + json.dumps(out), flush=True)


def mem_side(side, lengths, threads):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-child", side,
           "--lengths", *map(str, lengths)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("MEM "):
            d = json.loads(line[4:])
            d["peak_bytes"] = max(d["first_call_peak_bytes"], d["second_call_peak_bytes"])
            return d
    raise RuntimeError(f"memory subprocess for {side} failed ({r.returncode}):\n"
                       f"{r.stderr[-3000:]}")


# ----------------------------------------------------------------------------- timing
def bench(lengths, rounds, threads, do_mem=True):
    m = build_model()
    ids, am, pos = padded_batch(lengths, m.config.vocab_size)
    attn = m.model.layers[0].self_attn
    t_attn, t_proj, hid = Timer(attn), ProjTimer(attn), Hidden(m.model)
    outs = {}
    per = {k: {"attn": [], "proj": []} for k in ("ours", "eager")}

    def side(k):
        def call():
            t_attn.total = t_proj.total = 0.0
            logits, _ = forward(m, ids, am, pos, k == "ours")
            outs[k] = (logits, hid.value)
            per[k]["attn"].append(t_attn.total)
            per[k]["proj"].append(t_proj.total)
        return call

    with torch.no_grad():
        res = interleaved({"ours": side("ours"), "eager": side("eager")}, rounds, warm=True)
    real = am.bool()
    (lo, ho), (le, he) = outs.pop("ours"), outs.pop("eager")
    row = {"case": f"padded batch {len(lengths)} x {max(lengths)} "
                   f"(lengths {', '.join(map(str, lengths))})",
           "lengths": list(lengths), "batch": len(lengths), "padded_len": max(lengths),
           "padding": "left", "rounds": rounds,
           "logits_max_rel_err": rel(lo, le),
           "logits_real_tokens_max_rel_err": rel(lo[real], le[real]),
           "hidden_max_rel_err": rel(ho, he),
           "hidden_real_tokens_max_rel_err": rel(ho[real], he[real])}
    del lo, ho, le, he
    for k, (ts, pk) in res.items():
        a, p = per[k]["attn"][-len(ts):], per[k]["proj"][-len(ts):]
        row[f"{k}_s"] = statistics.median(ts)
        row[f"{k}_times"] = ts
        row[f"{k}_attn_times"] = a
        row[f"{k}_attn_proj_times"] = p
        row[f"{k}_attn_s"] = statistics.median(a)
        row[f"{k}_attn_non_proj_s"] = statistics.median([x - y for x, y in zip(a, p)])
        row[f"{k}_inprocess_peak_mem_bytes"] = pk     # same process, after the other side
    e, o = res["eager"][0], res["ours"][0]
    ea, oa = per["eager"]["attn"][-len(e):], per["ours"]["attn"][-len(o):]
    ep, op = per["eager"]["proj"][-len(e):], per["ours"]["proj"][-len(o):]
    row["speedup"] = statistics.median([x / y for x, y in zip(e, o)])
    row["speedup_attn"] = statistics.median([x / y for x, y in zip(ea, oa)])
    row["speedup_attn_non_proj"] = statistics.median(
        [(x - z) / (y - w) for x, y, z, w in zip(ea, oa, ep, op)])
    del m, outs
    gc.collect()
    if do_mem:
        for k in ("ours", "eager"):
            d = mem_side(k, lengths, threads)
            row[f"{k}_peak_mem_bytes"] = d["peak_bytes"]
            row[f"{k}_mem"] = d
        row["peak_mem_ratio"] = row["ours_peak_mem_bytes"] / max(1, row["eager_peak_mem_bytes"])
    return row


def eager_need(lengths, heads=64, ratio=4):
    """Bytes eager's attention holds at its peak: eager_attention_forward keeps three
    [B, heads, S, S + S/ratio] float32 tensors alive at once (scores + mask, the sink
    concatenation, the max-shifted logits / softmax), plus a margin for the rest."""
    B, S = len(lengths), max(lengths)
    return 3 * B * heads * S * (S + S // ratio) * 4 + 2 * 2**30


def fmt(r):
    s = (f"{r['case']}\n"
         f"  model forward  ours {r['ours_s']:8.3f} s  eager {r['eager_s']:8.3f} s  "
         f"x{r['speedup']:6.2f}\n"
         f"  attention      ours {r['ours_attn_s']:8.3f} s  eager {r['eager_attn_s']:8.3f} s  "
         f"x{r['speedup_attn']:6.2f}\n"
         f"  attn non-proj  ours {r['ours_attn_non_proj_s']:8.3f} s  "
         f"eager {r['eager_attn_non_proj_s']:8.3f} s  x{r['speedup_attn_non_proj']:6.2f}\n")
    if "peak_mem_ratio" in r:
        s += (f"  peak memory    ours {r['ours_peak_mem_bytes'] / 2**30:6.3f} GiB  "
              f"eager {r['eager_peak_mem_bytes'] / 2**30:6.3f} GiB  "
              f"ours/eager {r['peak_mem_ratio']:.3f} (1/{1 / max(r['peak_mem_ratio'], 1e-9):.1f})\n"
              f"    (first / second call in a fresh process: ours "
              f"{r['ours_mem']['first_call_peak_bytes'] / 2**30:.3f} / "
              f"{r['ours_mem']['second_call_peak_bytes'] / 2**30:.3f} GiB, eager "
              f"{r['eager_mem']['first_call_peak_bytes'] / 2**30:.3f} / "
              f"{r['eager_mem']['second_call_peak_bytes'] / 2**30:.3f} GiB)\n")
    s += (f"  max rel err    logits {r['logits_max_rel_err']:.1e} (real tokens "
          f"{r['logits_real_tokens_max_rel_err']:.1e})  hidden {r['hidden_max_rel_err']:.1e} "
          f"(real tokens {r['hidden_real_tokens_max_rel_err']:.1e})")
    return s


def plot(row, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    names = ["model forward", "attention", "attention\nnon-proj"]
    vals = [row["speedup"], row["speedup_attn"], row["speedup_attn_non_proj"]]
    axes[0].bar(names, vals, color=["tab:blue", "tab:orange", "tab:green"])
    axes[0].axhline(1, color="k", lw=0.8)
    axes[0].axhline(4, color="tab:red", lw=0.8, ls="--", label="bar: 4x")
    axes[0].set_ylabel("speed-up vs transformers eager (x)")
    axes[0].legend()
    if "peak_mem_ratio" in row:
        axes[1].bar(["eager", "swapped"], [row["eager_peak_mem_bytes"] / 2**30,
                                          row["ours_peak_mem_bytes"] / 2**30],
                    color=["tab:gray", "tab:blue"])
        axes[1].axhline(row["eager_peak_mem_bytes"] / 5 / 2**30, color="tab:red", lw=0.8,
                        ls="--", label="bar: 1/5 of eager")
        axes[1].set_ylabel("peak memory above start of call (GiB)")
        axes[1].legend()
    env = row.get("_env", {})
    fig.suptitle(f"{row['case']}\n{env.get('cpu', '?')}, ISA {env.get('isa', '?')}, "
                 f"{env.get('threads', '?')} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help=f"prompt lengths of the batch (default {DEFAULT_LENGTHS})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: lengths {QUICK_LENGTHS}, 1 round")
    ap.add_argument("--no-mem", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--force", action="store_true",
                    help="run even when MemAvailable looks too small for eager")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mem-child", choices=["ours", "eager"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    lengths = a.lengths or (QUICK_LENGTHS if a.quick else DEFAULT_LENGTHS)
    if a.mem_child:
        return mem_child(a.mem_child, lengths, threads)
    rounds = 1 if a.quick else a.rounds
    out = Path(a.out or RESULTS / ("hf_padded_quick.json" if a.quick else "hf_padded.json"))
    torch.set_num_threads(threads)
    import transformers
    env = dict(environment(threads), transformers=transformers.__version__)
    print(f"CPU {env['cpu']}, ISA level {env['isa']} (best {env['best_isa']}), "
          f"{threads} threads, torch {env['torch']}, transformers {env['transformers']}",
          flush=True)
    avail = _status_file("/proc/meminfo", "MemAvailable:")
    need = eager_need(lengths)
    print(f"memory available {avail / 2**30:.1f} GiB; eager needs about {need / 2**30:.1f} GiB "
          f"at its peak (3 live copies of its [B, heads, S, S + S/4] float32 scores + 2 GiB)",
          flush=True)
    if avail and avail < need and not a.force:
        sys.exit("not enough free memory for eager's side (an OOM would hit other processes "
                 "too); free memory or pass --force")
    row = bench(lengths, rounds, threads, do_mem=not a.no_mem)
    env["load_average"] = os.getloadavg()
    print(fmt(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": [row]}, indent=1))
    plot(dict(row, _env=env), out.with_suffix(".png"))
    print("wrote", out)


if __name__ == "__main__":
    main()
