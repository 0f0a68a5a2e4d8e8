"""RMSNorm, rotary embedding and gated pooling, differentiable.

The conventions are autograd.py's.  torch is imported lazily (inside functions).

- ``gated_pool(kv, score, ratio, *, ape=None, overlap=False)``: the Compressor's pooling
  (``deepseek_csa.gated_pool``), differentiable in kv, score and ape.  Saves kv, score
  and ape (the backward recomputes the softmax weights from them; nothing else).
- ``_RMSNormFn`` (the drop-ins ``rms_norm`` / ``rms_norm_forward``): saves x and weight.
- ``_RotaryFn`` (the drop-in ``apply_rotary_emb``, in place as the released one):
  saves nothing but the cos / sin tables; the backward is the inverse rotation of the
  gradient (``apply_rope(grad, cos, sin, inverse=not inverse)``).

Gradients are computed in float32 by the C kernels and returned in each input's dtype.
"""
from __future__ import annotations

__all__ = ["gated_pool"]


def _torch():
    import torch
    return torch


def _arr(t):
    """A tensor for the NumPy entry points: CPU float32 as a NumPy view, CPU bfloat16 as
    itself detached (the glue views it), anything else as a float32 copy."""
    torch = _torch()
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return t.numpy()
    if t.device.type == "cpu" and t.dtype == torch.bfloat16:
        return t
    return t.to("cpu", torch.float32).numpy()


def _grad(a, like):
    """A float32 NumPy gradient as a tensor in like's dtype and device (no copy for f32)."""
    torch = _torch()
    t = torch.from_numpy(a)
    if like.dtype != torch.float32 or like.device.type != "cpu":
        t = t.to(like.device, like.dtype)
    return t


# ----------------------------------------------------------------------------- pooling
def _pool_forward(kv, score, ratio, ape, overlap):
    import deepseek_csa as dc
    torch = _torch()
    d = kv.shape[-1] // (2 if overlap else 1)
    shape = (kv.shape[0], kv.shape[1] // ratio, d)
    if kv.device.type == "cpu" and kv.dtype == torch.bfloat16:
        out = torch.empty(shape, dtype=torch.bfloat16)
        dc.gated_pool(_arr(kv), _arr(score), ratio, ape=_arr(ape), overlap=overlap, out=out)
        return out
    o = torch.from_numpy(dc.gated_pool(_arr(kv), _arr(score), ratio, ape=_arr(ape),
                                       overlap=overlap))
    if kv.dtype != torch.float32 or kv.device.type != "cpu":
        o = o.to(kv.device, kv.dtype)
    return o


def _gated_pool_fn():
    torch = _torch()
    global _GatedPoolFn
    if _GatedPoolFn is not None:
        return _GatedPoolFn

    class GatedPoolFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, kv, score, ape, ratio, overlap):
            ctx.ratio, ctx.overlap = ratio, overlap
            ctx.save_for_backward(kv, score, ape)
            return _pool_forward(kv, score, ratio, ape, overlap)

        @staticmethod
        def backward(ctx, grad):
            import deepseek_csa as dc
            kv, score, ape = ctx.saved_tensors
            gk, gs, ga = dc.gated_pool_backward(_arr(grad), _arr(kv), _arr(score), ctx.ratio,
                                                ape=_arr(ape), overlap=ctx.overlap)
            need = ctx.needs_input_grad
            return (_grad(gk, kv) if need[0] else None,
                    _grad(gs, score) if need[1] and score is not None else None,
                    _grad(ga, ape) if need[2] and ape is not None else None, None, None)

    _GatedPoolFn = GatedPoolFn
    return GatedPoolFn


_GatedPoolFn = None


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
    from .autograd import _records
    ratio, overlap = int(ratio), bool(overlap)
    if _records(kv, score, ape):
        return _gated_pool_fn().apply(kv, score, ape, ratio, overlap)
    return _pool_forward(kv, score, ratio, ape, overlap)


# ----------------------------------------------------------------------------- RMSNorm
def _rms_forward(x, weight, eps):
    import deepseek_csa as dc
    torch = _torch()
    w = None if weight is None else _arr(weight.float() if weight.dtype != torch.float32
                                         else weight)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dc.rms_norm(x.detach(), w, float(eps), out=out)
        return out
    return _grad(dc.rms_norm(_arr(x), w, float(eps)), x)


def _rms_norm_fn():
    torch = _torch()
    global _RMSNormFn
    if _RMSNormFn is not None:
        return _RMSNormFn

    class RMSNormFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            ctx.eps = float(eps)
            ctx.save_for_backward(x, weight)
            return _rms_forward(x, weight, eps)

        @staticmethod
        def backward(ctx, grad):
            import deepseek_csa as dc
            x, weight = ctx.saved_tensors
            w = None if weight is None else _arr(weight)
            gx, gw = dc.rms_norm_backward(_arr(grad), _arr(x), w, ctx.eps)
            need = ctx.needs_input_grad
            return (_grad(gx, x) if need[0] else None,
                    _grad(gw, weight) if need[1] and weight is not None else None, None)

    _RMSNormFn = RMSNormFn
    return RMSNormFn


_RMSNormFn = None


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm through _RMSNormFn (differentiable in x and weight)."""
    return _rms_norm_fn().apply(x, weight, eps)


# ----------------------------------------------------------------------------- RoPE
def _rotary_fn():
    torch = _torch()
    global _RotaryFn
    if _RotaryFn is not None:
        return _RotaryFn

    class RotaryFn(torch.autograd.Function):
        """Rotates x in place (marked dirty); the backward rotates the gradient back."""

        @staticmethod
        def forward(ctx, x, cos, sin, inverse):
            import deepseek_csa as dc
            ctx.inverse = bool(inverse)
            ctx.cos, ctx.sin = cos, sin        # NumPy tables, not tensors
            if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
                dc.apply_rope(x.detach(), cos, sin, inverse=ctx.inverse)
            else:
                tmp = x.detach().to("cpu", torch.float32)
                dc.apply_rope(tmp.numpy(), cos, sin, inverse=ctx.inverse)
                x.detach().copy_(tmp)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            import deepseek_csa as dc
            g = grad.detach().to("cpu", torch.float32, copy=True).contiguous()
            dc.apply_rope(g.numpy(), ctx.cos, ctx.sin, inverse=not ctx.inverse)
            if grad.dtype != torch.float32 or grad.device.type != "cpu":
                g = g.to(grad.device, grad.dtype)
            return g, None, None, None

    _RotaryFn = RotaryFn
    return RotaryFn


_RotaryFn = None


def apply_rotary(x, cos, sin, inverse=False):
    """Rotates x in place through _RotaryFn (cos, sin: NumPy float32 [S, n/2] tables)."""
    return _rotary_fn().apply(x, cos, sin, inverse)
