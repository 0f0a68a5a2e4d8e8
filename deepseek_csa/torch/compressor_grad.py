"""The differentiable released ``Compressor.forward`` (the drop-in
``compressor_forward`` calls it when autograd records): pooling through the
``gated_pool`` operator, the Hadamard rotation through the ``hadamard`` operator, the
model's own QAT roundings straight-through, and a streaming state that carries the
gradient from a prefill into the decode steps after it."""
from __future__ import annotations

import torch

from .autograd import gated_pool


class _StraightThrough(torch.autograd.Function):
    """The value of ``rounded``, the gradient of ``x`` (QAT's straight-through estimator
    around whatever rounding the model's own functions do)."""

    @staticmethod
    def forward(ctx, x, rounded):
        return rounded

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _straight_through(x, round_inplace):
    """QAT rounding with the identity gradient: round_inplace(t) rounds a detached copy
    of x in place (the model's own act_quant / fp4_act_quant, or the drop-ins)."""
    q = x.detach().clone()
    round_inplace(q)
    return _StraightThrough.apply(x, q)


# ----------------------------------------------------------------------------- Compressor
def _state_from_buffers(mod, b, start_pos, r, ov, cd):
    """The open group (and with overlap the previous group) as detached tensors from the
    released module's buffers (logits = score + ape, as the buffers hold them), for a
    decode step whose earlier tokens went through the non-differentiable path."""
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
    from .dropins import compressor_epilogue
    return compressor_epilogue(mod, G, pooled.to(dtype), rows, start_pos, grad=True)
