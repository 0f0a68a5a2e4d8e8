"""Gated pooling (the Compressor): memory-bound prefill at V4-Flash shapes against the
torch eager reference pooling and torch.compile of it, and one decode step per kind.
The bf16 cases take bfloat16 kv / score (2 bytes an element, half the traffic) and
return bfloat16; their reference is the model's: widen, pool in float32, cast.  The eager
reference is deepseek_csa.reference.pool."""
import ml_dtypes
import numpy as np
import torch

import deepseek_csa as dc
from deepseek_csa.reference.pool import pool as _pool_ref
from harness import Case


def _prefill_case(rng, T, cd, ratio, overlap, name):
    kv = rng.standard_normal((1, T, cd), dtype=np.float32)
    sc = rng.standard_normal((1, T, cd), dtype=np.float32)
    ape = rng.standard_normal((ratio, cd), dtype=np.float32)
    d = cd // (2 if overlap else 1)
    out = np.empty((1, T // ratio, d), np.float32)
    tk, ts, ta = torch.from_numpy(kv), torch.from_numpy(sc), torch.from_numpy(ape)
    fn = _pool_ref
    args = (tk, ts, ratio, ta, overlap)
    return Case("gated_pool", name,
                ours=lambda: dc.gated_pool(kv, sc, ratio, ape=ape, overlap=overlap, out=out),
                eager=lambda: fn(*args), compile_fn=fn, compile_args=args,
                bytes=kv.nbytes + sc.nbytes + ape.nbytes + out.nbytes)


def _pool_ref_bf16(kv, score, ratio: int, ape, overlap: bool):
    """The reference on bfloat16 tensors, as the model runs it: float32 inside, the
    pooled entry cast to bfloat16."""
    return _pool_ref(kv, score, ratio, ape, overlap).bfloat16()


def _bf16_prefill_case(rng, T, cd, ratio, overlap, name):
    bf = ml_dtypes.bfloat16
    kv = rng.standard_normal((1, T, cd), dtype=np.float32).astype(bf)
    sc = rng.standard_normal((1, T, cd), dtype=np.float32).astype(bf)
    ape = rng.standard_normal((ratio, cd), dtype=np.float32)
    d = cd // (2 if overlap else 1)
    out = np.empty((1, T // ratio, d), bf)
    tk = torch.from_numpy(kv.view(np.int16)).view(torch.bfloat16)
    ts = torch.from_numpy(sc.view(np.int16)).view(torch.bfloat16)
    args = (tk, ts, ratio, torch.from_numpy(ape), overlap)
    return Case("gated_pool", name,
                ours=lambda: dc.gated_pool(kv, sc, ratio, ape=ape, overlap=overlap, out=out),
                eager=lambda: _pool_ref_bf16(*args), compile_fn=_pool_ref_bf16,
                compile_args=args, bytes=kv.nbytes + sc.nbytes + ape.nbytes + out.nbytes)


def _step_case(rng, ratio, overlap, D, n_tokens, bf16=False):
    """Compressor.step calls over a decode of n_tokens (one entry per `ratio` calls),
    batch 1, NumPy inputs (bfloat16 with bf16), no epilogue."""
    c = 2 if overlap else 1
    dt = ml_dtypes.bfloat16 if bf16 else np.float32
    kv = rng.standard_normal((1, n_tokens, c * D), dtype=np.float32).astype(dt)
    sc = rng.standard_normal((1, n_tokens, c * D), dtype=np.float32).astype(dt)
    ape = rng.standard_normal((ratio, c * D), dtype=np.float32) if ratio > 1 else None
    comp = dc.Compressor(1, ratio, D, overlap=overlap, ape=ape)
    toks = [(kv[:, p:p + 1], sc[:, p:p + 1] if ratio > 1 or overlap else None)
            for p in range(n_tokens)]

    def run():
        comp.reset()
        step = comp.step
        for p, (k, s) in enumerate(toks):
            step(k, s, p)

    # the harness times `run`; per call = time / n_tokens (printed in the name)
    return Case("compressor_step", f"r{ratio}{'ov' if overlap else ''} D{D}"
                f"{' bf16' if bf16 else ''}, {n_tokens} calls"
                + (" (ms = us per call)" if n_tokens == 1000 else ""),
                ours=run)


def cases(quick=False):
    rng = np.random.default_rng(0)
    T = 8192 if not quick else 1024
    out = [
        _prefill_case(rng, T, 1024, 4, True, f"V4 CSA r4 overlap+ape [1,{T},1024]"),
        _prefill_case(rng, T, 512, 128, False, f"V4 HCA r128 ape [1,{T},512]"),
        _prefill_case(rng, T, 512, 2, False, f"V4.1 r2 [1,{T},512]"),
        _prefill_case(rng, T, 1024, 128, False, f"r128 [1,{T},1024]"),
        _prefill_case(rng, T, 1024, 2, False, f"r2 [1,{T},1024]"),
        _prefill_case(rng, T, 256, 4, True, f"V4 indexer r4 overlap [1,{T},256]"),
        _bf16_prefill_case(rng, T, 1024, 4, True, f"V4 CSA r4 overlap+ape [1,{T},1024] bf16"),
        _bf16_prefill_case(rng, T, 512, 128, False, f"V4 HCA r128 ape [1,{T},512] bf16"),
        _bf16_prefill_case(rng, T, 512, 2, False, f"V4.1 r2 [1,{T},512] bf16"),
        _bf16_prefill_case(rng, T, 1024, 128, False, f"r128 [1,{T},1024] bf16"),
        _bf16_prefill_case(rng, T, 1024, 2, False, f"r2 [1,{T},1024] bf16"),
    ]
    n = 1000                      # so the time in ms reads as microseconds per call
    for ratio, overlap in ((4, True), (128, False), (2, False), (1, False)):
        out.append(_step_case(rng, ratio, overlap, 512, n))
    out.append(_step_case(rng, 4, True, 512, n, bf16=True))
    return out
