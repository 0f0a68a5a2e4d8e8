"""The indexer: index_scores (differentiable) and indexer_kl_loss, its training objective.

The conventions are autograd.py's.  torch is imported lazily (inside functions).

- ``index_scores(q, k, weights, *, ratio, start_pos=0)`` -> float32 [B, S, Tc] (-inf for
  the entries a query cannot see), differentiable in q, k and weights.  The forward
  saves q, k and weights (the scores are recomputed by the backward kernel, never
  saved); the backward is ``deepseek_csa.index_scores_backward``.
- ``indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0)`` ->
  0-dim float32 tensor, differentiable in q, k and weights (``attn_target`` and the
  indices are constants).  The C kernel computes the loss and its gradients in one
  pass, so when autograd records, the forward keeps the three gradients (the size of
  q, k and weights; nothing of size [S, Tc] or [S, K, Hi]) and the backward only scales
  them by the incoming gradient.  ``topk_idxs=None`` is the dense warm-up.

The kernels run in float32: float32 CPU tensors are handed over as views; bfloat16 /
float64 / other devices are converted to float32 copies, and gradients come back in
each input's dtype and device.
"""
from __future__ import annotations

import numpy as np

import deepseek_csa as _dc

from ._tensors import _f32, _torch

__all__ = ["index_scores", "indexer_kl_loss"]

_FNS = {}


def _records(*ts):
    from .autograd import _records as r
    return r(*ts)


def _grad_like(a, t):
    """Tensor over the float32 result a, in t's dtype and device."""
    g = _torch().from_numpy(a)
    if g.dtype != t.dtype or t.device.type != "cpu":
        g = g.to(t.device, t.dtype)
    return g


def _idx32(topk_idxs):
    if topk_idxs is None:
        return None
    torch = _torch()
    if isinstance(topk_idxs, torch.Tensor):
        i = topk_idxs.detach()
        return i.numpy() if i.dtype == torch.int32 and i.device.type == "cpu" \
            else i.to("cpu", torch.int32).numpy()
    return np.asarray(topk_idxs, dtype=np.int32)


def _target32(t):
    torch = _torch()
    if isinstance(t, torch.Tensor):
        return _f32(t)
    return np.asarray(t, dtype=np.float32)


def _functions():
    if _FNS:
        return _FNS
    torch = _torch()

    class _IndexScoresFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, weights, ratio, start_pos):
            ctx.ratio, ctx.start_pos = ratio, start_pos
            ctx.save_for_backward(q, k, weights)
            sc = _dc.index_scores(_f32(q), _f32(k), _f32(weights), ratio=ratio,
                                  start_pos=start_pos)
            return torch.from_numpy(sc).to(q.device)

        @staticmethod
        def backward(ctx, grad):
            q, k, w = ctx.saved_tensors
            gq, gk, gw = _dc.index_scores_backward(
                _f32(grad), _f32(q), _f32(k), _f32(w), ratio=ctx.ratio, start_pos=ctx.start_pos)
            need = ctx.needs_input_grad
            return (_grad_like(gq, q) if need[0] else None,
                    _grad_like(gk, k) if need[1] else None,
                    _grad_like(gw, w) if need[2] else None, None, None)

    class _IndexerKLFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, weights, idx, target, ratio, start_pos):
            loss, gq, gk, gw = _dc.indexer_kl_loss(
                _f32(q), _f32(k), _f32(weights), idx, target, ratio=ratio,
                start_pos=start_pos, return_grads=True)
            ctx.save_for_backward(_grad_like(gq, q), _grad_like(gk, k), _grad_like(gw, weights))
            return torch.tensor(loss, dtype=torch.float32, device=q.device)

        @staticmethod
        def backward(ctx, grad):
            gq, gk, gw = ctx.saved_tensors
            need = ctx.needs_input_grad
            g = grad.to(gq.dtype)
            return (gq * g if need[0] else None, gk * g if need[1] else None,
                    gw * g if need[2] else None, None, None, None, None)

    _FNS.update(scores=_IndexScoresFn, kl=_IndexerKLFn)
    return _FNS


def index_scores(q, k, weights, *, ratio, start_pos=0):
    """Indexer scores ``sum_h weights[b,s,h] relu(q[b,s,h] . k[b,t])`` for the entries
    query s can see (t < (start_pos + s + 1) // ratio; -inf elsewhere), float32
    [B, S, Tc]; differentiable in q, k and weights."""
    torch = _torch()
    ratio, start_pos = int(ratio), int(start_pos)
    if _records(q, k, weights):
        return _functions()["scores"].apply(q, k, weights, ratio, start_pos)
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) \
            and k.dtype == q.dtype:
        args = (q.detach(), k.detach(),
                weights.detach() if weights.dtype in (torch.float32, torch.bfloat16)
                else _f32(weights))
    else:
        args = (_f32(q), _f32(k), _f32(weights))
    return torch.from_numpy(_dc.index_scores(*args, ratio=ratio, start_pos=start_pos)
                            ).to(q.device)


def indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0):
    """The indexer's KL objective (docs/kernels.md, section 11.3): the mean over query
    rows with slots and nonzero target mass of KL(p || softmax(I)) over the row's slots
    (``topk_idxs`` >= 0, or every visible entry when ``topk_idxs`` is None), p the
    L1-normalized ``attn_target``.  A 0-dim float32 tensor, differentiable in q, k and
    weights."""
    torch = _torch()
    ratio, start_pos = int(ratio), int(start_pos)
    idx, tgt = _idx32(topk_idxs), _target32(attn_target)
    if _records(q, k, weights):
        return _functions()["kl"].apply(q, k, weights, idx, tgt, ratio, start_pos)
    loss = _dc.indexer_kl_loss(_f32(q), _f32(k), _f32(weights), idx, tgt, ratio=ratio,
                               start_pos=start_pos)
    return torch.tensor(loss, dtype=torch.float32, device=q.device)
