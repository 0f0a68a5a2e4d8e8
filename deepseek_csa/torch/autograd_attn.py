"""Sparse attention: sparse_attn (differentiable) and sparse_attn_weights (the indexer's target).

The conventions are autograd.py's.  torch is imported lazily (inside functions).

- ``_SparseAttnFn``: the differentiable form of the drop-in ``deepseek_csa.torch.sparse_attn``
  (dropins.py calls it when autograd records).  Forward: the C kernel with
  ``return_lse=True``; saves q, kv, attn_sink, topk_idxs (int32), out and lse -- the
  backward kernel's inputs, nothing recomputable.  Backward: ``sparse_attn_backward`` (float32;
  bfloat16 tensors are widened to float32 copies for it, and the gradients come back in
  each input's dtype).  Gradients for q, kv and attn_sink; none for the indices or the scale.
- ``sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale)`` -> float32 [B, S, K]:
  the attention probability of every slot summed over heads, from the forward's pass; no
  gradient (the KL loss's constant target).
"""
from __future__ import annotations

__all__ = ["sparse_attn_weights"]


def _idx32(topk_idxs):
    import torch
    idx = topk_idxs.detach()
    if idx.dtype != torch.int32 or idx.device.type != "cpu":
        idx = idx.to("cpu", torch.int32)
    return idx


def _kernel_view(t):
    """A float32 view of a CPU float32 tensor, bf16 CPU tensors as they are (the kernel
    reads bfloat16), anything else as a float32 copy."""
    import torch
    t = t.detach()
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16):
        return t
    return t.to("cpu", torch.float32)


def _f32_view(t):
    import torch
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return t
    return t.to("cpu", torch.float32)


def _make_fn():
    import torch

    import deepseek_csa as _dc

    class _SparseAttnFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, kv, attn_sink, topk_idxs, softmax_scale):
            qk, kvk = _kernel_view(q), _kernel_view(kv)
            if qk.dtype != kvk.dtype:
                qk, kvk = _f32_view(q), _f32_view(kv)
            idx = _idx32(topk_idxs)
            sink = _f32_view(attn_sink)
            scale = float(softmax_scale)
            out = torch.empty(q.shape, dtype=qk.dtype)
            _, lse = _dc.sparse_attn(qk, kvk, sink, idx, scale, out=out, return_lse=True)
            lse = torch.from_numpy(lse)
            ctx.scale = scale
            ctx.save_for_backward(q, kv, attn_sink, idx, out, lse)
            if out.dtype != q.dtype or q.device.type != "cpu":
                return out.to(q.device, q.dtype)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, kv, attn_sink, idx, out, lse = ctx.saved_tensors
            dq, dkv, dsink = _dc.sparse_attn_backward(
                _f32_view(grad_out), _f32_view(q), _f32_view(kv), _f32_view(attn_sink), idx,
                ctx.scale, _f32_view(out), lse)
            res = []
            for g, x, need in ((dq, q, ctx.needs_input_grad[0]), (dkv, kv, ctx.needs_input_grad[1]),
                               (dsink, attn_sink, ctx.needs_input_grad[2])):
                if not need:
                    res.append(None)
                    continue
                g = torch.from_numpy(g)
                if g.dtype != x.dtype or x.device.type != "cpu":
                    g = g.to(x.device, x.dtype)
                res.append(g)
            return res[0], res[1], res[2], None, None

    return _SparseAttnFn


_FN = None


def __getattr__(name):
    # _SparseAttnFn is built on first use, so importing this module does not import torch
    global _FN
    if name == "_SparseAttnFn":
        if _FN is None:
            _FN = _make_fn()
        return _FN
    raise AttributeError(name)


def sparse_attn_weights(q, kv, attn_sink, topk_idxs, softmax_scale):
    """float32 [B, S, K]: per slot of topk_idxs the attention probability of sparse_attn
    summed over heads (0 for a -1 slot; the sink's share is what a row does not sum to).
    Computed by the forward's kernel pass, no gradient (a constant target)."""
    import torch

    import deepseek_csa as _dc
    qk, kvk = _kernel_view(q), _kernel_view(kv)
    if qk.dtype != kvk.dtype:
        qk, kvk = _f32_view(q), _f32_view(kv)
    w = _dc.sparse_attn_weights(qk, kvk, _f32_view(attn_sink), _idx32(topk_idxs),
                                float(softmax_scale))
    t = torch.from_numpy(w)
    return t if q.device.type == "cpu" else t.to(q.device)
