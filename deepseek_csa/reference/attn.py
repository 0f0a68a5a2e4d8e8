"""Torch reference of top-k sparse attention with a sink, written from docs/kernels.md, section 5.

Gathers kv[idx] into [B, S, K, D] the way an eager implementation does, then a softmax
over the K gathered logits with the sink as one extra logit that has no value."""
import torch


def sparse_attn(q, kv, sink, idx, scale):
    """q [B,S,H,D], kv [B,N,D], sink [H], idx [B,S,K] (-1 = skip): out [B,S,H,D] in q's
    dtype, computed in q's dtype (float32, or bfloat16 for the bf16 run)."""
    B, S, H, D = q.shape
    K = idx.shape[-1]
    dt = q.dtype
    valid = idx >= 0
    if kv.shape[1] == 0:  # nothing to gather; every index is -1
        kv = kv.new_zeros(B, 1, D)
    g = kv.to(dt)[torch.arange(B)[:, None, None], idx.clamp(min=0).long()]  # [B,S,K,D]
    logits = torch.einsum("bshd,bskd->bshk", q, g) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sinks = sink.to(dt).view(1, 1, H, 1).expand(B, S, H, 1)
    probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :K]
    out = torch.einsum("bshk,bskd->bshd", probs, g)
    none = ~valid.any(-1)  # no valid index: zeros (docs/kernels.md)
    return out.masked_fill(none[:, :, None, None], 0.0)
