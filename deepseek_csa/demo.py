"""`make demo`: a DeepSeek-V4-Flash CSA layer (ratio 4) and an HCA layer (ratio 128) on random
weights, run through deepseek_csa: prefill of 4096 tokens, then 64 decode steps, with a
per-op timing table, tokens/s, and the agreement with the float32 torch reference layer.

NumPy only: torch is needed for the agreement check alone (it is skipped, with a note,
when torch is missing).

    python -m deepseek_csa.demo [--seqlen 4096] [--steps 64] [--check-len 1024] [--no-check]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import deepseek_csa as dc
from deepseek_csa.layer import CSALayer, random_layer_weights

OPS = ["projections", "rms_norm", "rope", "qat", "compressor", "indexer", "index_lists",
       "sparse_attn"]


def _bar(iterable=None, **kw):
    """A tqdm progress bar on a terminal; elsewhere (a log file, a pipe, CI) one line
    per finished stage on stderr instead of every redraw.  Plain iteration without tqdm."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(iterable, disable=None, **kw)
        except ImportError:  # tqdm is optional
            pass
    return _Stage(iterable, kw.get("desc"))


class _Stage:
    """The non-terminal stand-in of a bar: says once, when done, what finished."""

    def __init__(self, it, desc):
        self.it, self.desc, self.t0, self.done = it, desc, time.perf_counter(), False

    def __iter__(self):
        yield from self.it
        self.close()

    def update(self, n=1):
        pass

    def close(self):
        if not self.done and self.desc:
            self.done = True
            print(f"{self.desc}: done in {time.perf_counter() - self.t0:.2f} s",
                  file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def run_layer(name, cfg, ratio, seqlen, steps, seed):
    w = random_layer_weights(cfg, ratio, seed=seed)
    layer = CSALayer(w, cfg, ratio=ratio, batch=1, max_seq_len=seqlen + steps)
    rng = np.random.default_rng(seed + 100)
    x = rng.standard_normal((1, seqlen + steps, cfg.dim), dtype=np.float32)
    with _bar(total=1, desc=f"{name}: prefill {seqlen} tokens", leave=False) as b:
        t0 = time.perf_counter()
        layer(x[:, :seqlen], 0)
        t_pre = time.perf_counter() - t0
        b.update()
    pre = dict(layer.timings)
    layer.reset_timings()
    t_dec = []
    for p in _bar(range(seqlen, seqlen + steps), desc=f"{name}: decode", leave=False):
        t0 = time.perf_counter()
        layer(x[:, p:p + 1], p)
        t_dec.append(time.perf_counter() - t0)
    dec = {k: v / steps for k, v in layer.timings.items()}
    return {"name": name, "ratio": ratio, "weights": w, "x": x, "t_prefill": t_pre,
            "t_step": float(np.median(t_dec)), "prefill_ops": pre, "decode_ops": dec}


def check_against_reference(res, cfg, n, steps, qat=True):
    """Largest relative error of our layer vs the float32 torch reference layer on the first
    n tokens + `steps` decode steps (same weights and inputs), or a note why not.
    qat=False turns the FP8/FP4 rounding off on both sides."""
    try:
        import torch
        from deepseek_csa.reference import layer as R
    except ImportError:
        return None, "skipped: torch is not installed"
    ratio = res["ratio"]
    args = R.ModelArgs(max_batch_size=1, max_seq_len=n + steps, dim=cfg.dim,
                       n_heads=cfg.n_heads, head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim,
                       q_lora_rank=cfg.q_lora_rank, o_lora_rank=cfg.o_lora_rank,
                       o_groups=cfg.o_groups, window_size=cfg.window, compress_ratios=(ratio,),
                       compress_rope_theta=cfg.compress_rope_theta,
                       original_seq_len=cfg.original_seq_len, rope_theta=cfg.rope_theta,
                       rope_factor=cfg.yarn_factor, beta_fast=cfg.beta_fast,
                       beta_slow=cfg.beta_slow, index_n_heads=cfg.index_heads,
                       index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
                       norm_eps=cfg.norm_eps)
    ref = R.Attention(0, args)
    with torch.no_grad():
        for k, v in ref.state_dict().items():
            if k in res["weights"]:
                v.copy_(torch.from_numpy(res["weights"][k]))
    ours = CSALayer(res["weights"], cfg, ratio=ratio, batch=1, max_seq_len=n + steps, qat=qat)
    x = res["x"]
    worst = 0.0
    saved = (R.act_quant, R.fp4_act_quant)
    if not qat:
        R.act_quant = R.fp4_act_quant = lambda t, *a, **k: t
    try:
        with torch.no_grad():
            calls = [(0, n)] + [(n + i, 1) for i in range(steps)]
            for p, s in _bar(calls, desc=f"{res['name']}: float32 reference check", leave=False):
                want = ref(torch.from_numpy(x[:, p:p + s]), p).numpy()
                got = ours(x[:, p:p + s], p)
                worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    finally:
        R.act_quant, R.fp4_act_quant = saved
    return worst, f"{n}-token prefill + {steps} decode steps"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--check-len", type=int, default=1024,
                    help="prefill length of the float32 reference check (it is slow)")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    cfg = dc.V4_FLASH
    print(f"{cfg.name}: one attention layer on random weights, dim {cfg.dim}, H={cfg.n_heads}, "
          f"D={cfg.head_dim}, rope {cfg.rope_dim}, window {cfg.window}, indexer "
          f"{cfg.index_heads}x{cfg.index_head_dim} top-{cfg.index_topk}; ISA {dc.get_isa()}, "
          f"{dc.max_threads()} threads")
    results = [run_layer("CSA ratio 4", cfg, 4, a.seqlen, a.steps, 0),
               run_layer("HCA ratio 128", cfg, 128, a.seqlen, a.steps, 1)]

    print(f"\nprefill {a.seqlen} tokens, then {a.steps} decode steps (median step)\n")
    head = f"{'op':<14}" + "".join(f"{r['name'] + ' prefill ms':>28}{'step us':>10}"
                                  for r in results)
    print(head)
    print("-" * len(head))
    for op in OPS:
        row = f"{op:<14}"
        for r in results:
            row += f"{r['prefill_ops'].get(op, 0) * 1e3:28.1f}{r['decode_ops'].get(op, 0) * 1e6:10.0f}"
        print(row)
    row = f"{'total':<14}"
    for r in results:
        row += f"{r['t_prefill'] * 1e3:28.1f}{r['t_step'] * 1e6:10.0f}"
    print(row)
    print()
    for r in results:
        core = r["t_prefill"] - r["prefill_ops"].get("projections", 0)
        print(f"{r['name']:<14} prefill {a.seqlen / r['t_prefill']:9.0f} tokens/s "
              f"({a.seqlen / core:.0f} without the dense projections), "
              f"decode {1 / r['t_step']:7.1f} tokens/s ({r['t_step'] * 1e3:.2f} ms/step)")
    if not a.no_check:
        print()
        n = min(a.check_len, a.seqlen)
        for r in results:
            for qat in (False, True):
                err, note = check_against_reference(r, cfg, n, min(8, a.steps), qat=qat)
                what = "QAT rounding on " if qat else "QAT rounding off"
                if err is None:
                    print(f"{r['name']:<14} agreement with the float32 reference: {note}")
                    break
                print(f"{r['name']:<14} vs the float32 reference, {what} ({note}): "
                      f"max relative error {err:.2e}")
        print("(With the FP8/FP4 rounding on, a value within an ulp of a rounding boundary may "
              "round the other way on the two sides -- the float32 inputs to the rounding "
              "differ by ~1e-7 through BLAS and reduction order -- and move one KV feature "
              "by a whole e4m3/e2m1 step; that is the larger error when it happens.)")


if __name__ == "__main__":
    main()
