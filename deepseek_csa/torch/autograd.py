"""The differentiable CSA functions of ``deepseek_csa.torch`` that have no released
counterpart: pooling, the indexer's scores and training objective, and the attention
weights the objective is fitted to.  Each is one ``torch.ops.deepseek_csa`` operator
(deepseek_csa/torch/ops.py), whose registered autograd formula calls the backward
kernels as operators too; these functions only bring arguments to the kernels' dtypes
(float32 / bfloat16 CPU tensors as they are, anything else as a float32 copy -- a
differentiable conversion, so gradients come back in each input's dtype).

Gradients are deterministic: the kernels sum scattered contributions in a fixed order,
so the bits do not depend on the thread count.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import ops
from ._tensors import kernel_dtype, kernel_f32, kernel_pair, kernel_i32

__all__ = ["gated_pool", "sparse_attn_weights", "index_scores", "indexer_kl_loss",
           "IndexerKLMetrics"]


def gated_pool(kv, score, ratio, *, ape=None, overlap=False):
    """``deepseek_csa.gated_pool`` on tensors, differentiable in kv, score and ape.

    kv, score : [B, T, c*D] float32 / bfloat16 tensors (c = 2 with overlap); score may
                be None at ratio 1 without overlap (the ungated entry: out = kv).
    ape       : [ratio, c*D] or None.
    Returns [B, T // ratio, D] in kv's dtype.  Backward (docs/kernels.md, section 11.2):
    d(kv_j) = w_j dy, d(score_j) = w_j dy (kv_j - y), d(ape) summed over rows and groups
    in a fixed order; the T % ratio trailing tokens get 0.  Pooling a prefill and then
    the decode tokens is pooling the concatenation, so its gradient is this one's on the
    whole sequence (the Compressor's streaming state only holds the open group)."""
    k = kernel_dtype(kv)
    out = ops.call("gated_pool", k, None if score is None else kernel_dtype(score), int(ratio),
                   None if ape is None else kernel_f32(ape), bool(overlap))
    return out if out.dtype == kv.dtype and out.device == kv.device else out.to(kv.device, kv.dtype)


def sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale):
    """float32 [B, S, K]: per slot of topk_idxs the attention probability of sparse_attn
    summed over heads (0 for a -1 slot; the sink's share is what a row does not sum to).
    Computed by the forward's kernel pass, no gradient (a constant target)."""
    qk, kvk = kernel_pair(q, kv)
    w = ops.call("sparse_attn_weights", qk.detach(), kvk.detach(), kernel_f32(attn_sink).detach(),
                 kernel_i32(topk_idxs), float(softmax_scale))
    return w if q.device.type == "cpu" else w.to(q.device)


def index_scores(q, k, weights, *, ratio, start_pos=0):
    """Indexer scores ``sum_h weights[b,s,h] relu(q[b,s,h] . k[b,t])`` for the entries
    query s can see (t < (start_pos + s + 1) // ratio; -inf elsewhere), float32
    [B, S, Tc]; differentiable in q, k and weights (the backward kernel recomputes the
    products; nothing of size [S, Tc, H] is saved).  The backward reads float32: a
    bfloat16 q / k takes the float32 path when a gradient is recorded."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, weights)):
        qk, kk, wk = kernel_f32(q), kernel_f32(k), kernel_f32(weights)
    else:
        qk, kk = kernel_pair(q, k)
        wk = kernel_dtype(weights)
    s = ops.call("index_scores", qk, kk, wk, int(ratio), int(start_pos))
    return s if q.device.type == "cpu" else s.to(q.device)


class IndexerKLMetrics(NamedTuple):
    """``indexer_kl_loss(..., return_metrics=True)``'s second result: 0-dim tensors,
    no gradient (docs/kernels.md, section 11.3, "Metrics")."""
    kl: torch.Tensor               # the loss's value
    kl_uniform: torch.Tensor       # the target's KL to uniform over each row's slots
    kl_captured: torch.Tensor      # 1 - kl / kl_uniform (nan when kl_uniform is 0)
    rows: torch.Tensor             # rows taking part
    degenerate_rows: torch.Tensor  # of which: slots = every entry the row can see


def indexer_kl_loss(q, k, weights, topk_idxs, attn_target, *, ratio, start_pos=0,
                    positions=None, target="selected", clip=None, return_metrics=False):
    """The indexer's KL objective (docs/kernels.md, section 11.3): the mean over query
    rows with slots and nonzero target mass of KL(p || softmax(I)) over the row's slots
    (``topk_idxs`` >= 0, or every visible entry when ``topk_idxs`` is None), p the
    L1-normalized ``attn_target``; ``target="joint"`` weighs each row by its target mass
    (``attn_target`` then holds joint attention probabilities: ``sparse_attn_weights``
    divided by the number of heads); ``clip`` (e.g. -100) clamps log softmax(I) below in
    the loss, and clamped slots pass no gradient.  ``positions`` (int [B or 1, S]): each
    query's position (padded batches), instead of ``start_pos + s``.  A 0-dim float32
    tensor, differentiable in q, k and weights; the kernel computes the loss and its
    gradients in one pass (memory O(S K)), and the backward scales them by the incoming
    gradient.  ``return_metrics=True``: ``(loss, IndexerKLMetrics)``."""
    idx = None if topk_idxs is None else kernel_i32(torch.as_tensor(topk_idxs))
    pos = None
    if positions is not None:      # [B or 1, S]: one row serves every batch row
        pos = kernel_i32(torch.as_tensor(positions))
        pos = pos.expand(q.shape[0], pos.shape[-1]) if pos.dim() == 2 else pos
    tgt = kernel_f32(torch.as_tensor(attn_target)).detach()
    out = ops.call("indexer_kl_loss", kernel_f32(q), kernel_f32(k), kernel_f32(weights), idx,
                   tgt, int(ratio), int(start_pos), pos, str(target),
                   None if clip is None else float(clip))
    loss = out[0] if q.device.type == "cpu" else out[0].to(q.device)
    if not return_metrics:
        return loss
    m = out[4]
    return loss, IndexerKLMetrics(m[0], m[1], m[2], m[3].long(), m[4].long())
