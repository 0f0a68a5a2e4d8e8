"""Backward of gated pooling and RMSNorm (docs/kernels.md, section 11.2) at V4-Flash
shapes, float32, against torch eager autograd of the reference forward (forward +
backward: autograd needs its forward's saved tensors; ours recomputes the softmax
itself from the inputs, so both sides start from the same inputs and end with the same
gradients).  torch.compile is not run: compiling a function that calls
torch.autograd.grad breaks the graph at the call.  The eager reference is
deepseek_csa.reference.pool / a plain torch RMSNorm.

    python benchmarks/run.py -k grad_pool -k grad_rms --no-compile [--quick]
"""
import numpy as np
import torch

import deepseek_csa as dc
from deepseek_csa.reference.pool import pool as _pool_ref
from harness import Case


def _pool_case(rng, T, cd, ratio, overlap, name):
    d = cd // (2 if overlap else 1)
    kv = rng.standard_normal((1, T, cd), dtype=np.float32)
    sc = rng.standard_normal((1, T, cd), dtype=np.float32)
    ape = rng.standard_normal((ratio, cd), dtype=np.float32)
    dy = rng.standard_normal((1, T // ratio, d), dtype=np.float32)
    gk, gs, ga = np.empty_like(kv), np.empty_like(sc), np.empty_like(ape)
    tk, ts, ta = (torch.from_numpy(a).requires_grad_() for a in (kv, sc, ape))
    tdy = torch.from_numpy(dy)

    def eager():
        y = _pool_ref(tk, ts, ratio, ta, overlap)
        return torch.autograd.grad(y, (tk, ts, ta), tdy)

    return Case("gated_pool_backward", name,
                ours=lambda: dc.gated_pool_backward(dy, kv, sc, ratio, ape=ape, overlap=overlap,
                                                    grad_kv=gk, grad_score=gs, grad_ape=ga),
                eager=eager,
                # reads kv, score, dy, ape; writes d(kv), d(score) (d(ape)'s pass re-reads
                # d(score), not counted)
                bytes=2 * kv.nbytes + 2 * sc.nbytes + dy.nbytes + 2 * ape.nbytes)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rms_case(rng, R, D, name):
    x = rng.standard_normal((R, D), dtype=np.float32)
    dy = rng.standard_normal((R, D), dtype=np.float32)
    w = rng.standard_normal(D, dtype=np.float32)
    gx, gw = np.empty_like(x), np.empty_like(w)
    tx, tw = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    tdy = torch.from_numpy(dy)

    def eager():
        return torch.autograd.grad(_rms(tx, tw, 1e-6), (tx, tw), tdy)

    return Case("rms_norm_backward", name,
                ours=lambda: dc.rms_norm_backward(dy, x, w, 1e-6, grad_x=gx, grad_weight=gw),
                eager=eager, bytes=3 * x.nbytes)


def cases(quick=False):
    rng = np.random.default_rng(0)
    T = 8192 if not quick else 1024
    return [
        _pool_case(rng, T, 1024, 4, True, f"grad V4 CSA r4 overlap+ape [1,{T},1024]"),
        _pool_case(rng, T, 256, 4, True, f"grad V4 indexer r4 overlap+ape [1,{T},256]"),
        _pool_case(rng, T, 512, 128, False, f"grad V4 HCA r128 ape [1,{T},512]"),
        _pool_case(rng, T, 512, 2, False, f"grad V4.1 r2 [1,{T},512]"),
        _rms_case(rng, T // 2 if not quick else 512, 4096, f"grad rms [{T // 2 if not quick else 512},4096]"),
        _rms_case(rng, T, 512, f"grad rms [{T},512]"),
    ]
