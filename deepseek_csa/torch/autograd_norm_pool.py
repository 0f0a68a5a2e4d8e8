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


# ----------------------------------------------------------------------------- QAT, Hadamard
def _ste_fn():
    torch = _torch()
    global _SteFn
    if _SteFn is None:
        class SteFn(torch.autograd.Function):
            """The straight-through estimator: the value of `rounded`, the gradient of x."""

            @staticmethod
            def forward(ctx, x, rounded):
                return rounded

            @staticmethod
            def backward(ctx, grad):
                return grad, None

        _SteFn = SteFn
    return _SteFn


_SteFn = None


def _straight_through(x, round_inplace):
    """QAT rounding with the identity gradient: round_inplace(t) rounds a detached copy
    of x in place (the model's own act_quant / fp4_act_quant, or the drop-ins); the
    result has its values and passes the gradient through unchanged."""
    q = x.detach().clone()
    round_inplace(q)
    return _ste_fn().apply(x, q)


def _hadamard_fn():
    torch = _torch()
    global _HadamardFn
    if _HadamardFn is None:
        class HadamardFn(torch.autograd.Function):
            """rotate_activation: the normalized Hadamard transform of the last axis (float32
            inside, result in x's dtype); it is symmetric and orthogonal, so its backward is
            the same transform of the gradient."""

            @staticmethod
            def forward(ctx, x):
                import deepseek_csa as dc
                y = torch.from_numpy(dc.hadamard(_arr(x)))
                return y.to(x.dtype) if x.dtype != torch.float32 else y

            @staticmethod
            def backward(ctx, grad):
                import deepseek_csa as dc
                g = torch.from_numpy(dc.hadamard(_arr(grad.contiguous())))
                return g.to(grad.dtype) if grad.dtype != torch.float32 else g

        _HadamardFn = HadamardFn
    return _HadamardFn


_HadamardFn = None


# ----------------------------------------------------------------------------- Compressor
def _state_from_buffers(mod, b, start_pos, r, ov, cd):
    """The open group (and with overlap the previous group) as detached tensors from the
    released module's buffers (logits = score + ape, as the buffers hold them), for a
    decode step whose earlier tokens went through the non-differentiable path."""
    torch = _torch()
    slot, g = start_pos % r, start_pos // r
    d = cd // 2 if ov else cd
    kvs, scs = [], []
    if ov and g > 0:
        # previous group: first halves hold its features [0, D); the second halves are
        # never read by the entry this window completes (its first entry is discarded)
        kvs.append(mod.kv_state[:b, :r].detach().float())
        scs.append(mod.score_state[:b, :r].detach().float())
    at = r if ov else 0
    kvs.append(mod.kv_state[:b, at:at + slot].detach().float())
    scs.append(mod.score_state[:b, at:at + slot].detach().float())
    del d
    return torch.cat(kvs, 1), torch.cat(scs, 1)


def compressor_forward_grad(mod, G, x, start_pos):
    """The differentiable ``Compressor.forward`` (the drop-in calls it when autograd
    records): the pooling through ``gated_pool``, the module's own norm and RoPE, the
    Hadamard rotation through a Function, QAT roundings straight-through.  The streaming
    state that carries gradient is kept on the module as tensors of the graph
    (``_csa_grad_state``: the kv and logits of the tokens a later entry reads), so a
    prefill + decode sequence gets the gradient of one pooling over the concatenation;
    the released ``kv_state`` / ``score_state`` buffers are kept current too (detached),
    so a no-grad decode can follow.  The entries written to ``kv_cache`` are detached;
    the returned ones carry the gradient."""
    torch = _torch()
    r, dtype = mod.compress_ratio, x.dtype
    b, s, _ = x.shape
    v4 = hasattr(mod, "ape")
    ov = bool(getattr(mod, "overlap", False))
    xf = x.float()
    kv, sc = mod.wkv(xf), mod.wgate(xf)
    cd = kv.shape[-1]
    ape = mod.ape if v4 else None

    def ape_rows(t0, n):          # ape rows of tokens t0 .. t0+n-1 (t0 % r == 0 or not)
        idx = torch.arange(t0, t0 + n) % r
        return ape[idx]

    with torch.no_grad():         # the released buffers, as the forward-only path keeps them
        kd, sd = kv.detach(), sc.detach()
        if start_pos == 0:
            whole = s - s % r
            if ov and whole >= r:
                mod.kv_state[:b, :r] = kd[:, whole - r:whole]
                mod.score_state[:b, :r] = sd[:, whole - r:whole] + (ape.detach() if v4 else 0)
            left = s - whole
            if left:
                at = r if ov else 0
                mod.kv_state[:b, at:at + left] = kd[:, whole:]
                mod.score_state[:b, at:at + left] = sd[:, whole:] + (
                    ape.detach()[:left] if v4 else 0)
        else:
            slot = start_pos % r
            row = r + slot if ov else slot
            mod.kv_state[:b, row] = kd[:, 0]
            mod.score_state[:b, row] = sd[:, 0] + (ape.detach()[slot] if v4 else 0)
            if ov and (start_pos + 1) % r == 0:
                mod.kv_state[:b, :r] = mod.kv_state[:b, r:].clone()
                mod.score_state[:b, :r] = mod.score_state[:b, r:].clone()

    if start_pos == 0:
        whole = s - s % r
        lo = whole - r if (ov and whole >= r) else whole
        lg = sc[:, lo:] + ape_rows(lo, s - lo) if v4 else sc[:, lo:]
        mod._csa_grad_state = (kv[:, lo:], lg, lo, b)
        if whole == 0:
            return None
        pooled = gated_pool(kv[:, :whole], sc[:, :whole], r, ape=ape, overlap=ov)
        rows = slice(0, whole, r)
    else:
        st = getattr(mod, "_csa_grad_state", None)
        slot = start_pos % r
        want0 = start_pos - slot - (r if ov and start_pos >= r else 0)
        if st is None or st[3] != b or st[2] != want0 or st[2] + st[0].shape[1] != start_pos:
            skv, slg = _state_from_buffers(mod, b, start_pos, r, ov, cd)
        else:
            skv, slg = st[0], st[1]
        lg = sc[:, :1] + ape[slot] if v4 else sc[:, :1]
        skv, slg = torch.cat([skv, kv[:, :1]], 1), torch.cat([slg, lg], 1)
        if (start_pos + 1) % r:
            mod._csa_grad_state = (skv, slg, want0, b)
            return None
        # the window: with overlap the previous group (if any) and this one; its last
        # entry is the one this step completes
        pooled = gated_pool(skv, slg, r, overlap=ov)[:, -1:]
        keep = r if ov else 0
        mod._csa_grad_state = (skv[:, skv.shape[1] - keep:], slg[:, slg.shape[1] - keep:],
                               start_pos + 1 - keep, b)
        rows = slice(start_pos + 1 - r, start_pos + 2 - r)
    ent = mod.norm(pooled.to(dtype))
    if not v4:
        return ent
    rd = mod.rope_head_dim
    G["apply_rotary_emb"](ent[..., -rd:], mod.freqs_cis[rows])
    if mod.rotate:
        ent = _hadamard_fn().apply(ent)
        blk = G.get("fp4_block_size", 32)
        ent = _straight_through(ent, lambda q: G["fp4_act_quant"](q, blk, True))
    else:
        ent = _straight_through(ent, lambda q: G["act_quant"](
            q[..., :-rd], 64, G.get("scale_fmt"), G.get("scale_dtype"), True))
    first = 0 if start_pos == 0 else start_pos // r
    with torch.no_grad():
        mod.kv_cache[:b, first:first + ent.shape[1]] = ent.detach()
    return ent
