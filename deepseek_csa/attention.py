"""Top-k sparse attention with an attention sink (docs/kernels.md, section 5).

``sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, *, out=None)`` has the
signature of the released reference kernel, so it can be dropped in:

    o = sparse_attn(q, kv, attn_sink, topk_idxs, D ** -0.5)

q [B, S, H, D] and kv [B, N, D] both float32 or both bfloat16 (K = V, one KV head
shared by all H heads), attn_sink [H] float32, topk_idxs [B, S, K] int32 with -1 for an
empty slot; returns [B, S, H, D] in q's dtype.  The softmax runs online over blocks of gathered rows
with the running maximum taken over the logits and the sink (same result as the
textbook formula, no overflow); the sink only enlarges the denominator; a query
whose indices are all -1 gets zeros.  Indices outside [-1, N) raise IndexError
before anything is written.

bfloat16 (the released model's dtype; ``ml_dtypes.bfloat16`` arrays or torch bf16
tensors, read in place): logits, softmax and the output accumulate in float32, the
weights are rounded to bf16 before they multiply kv (a bf16 GEMM), the output is
rounded once.  At ISA level 'amx' both products run on AMX-BF16 tiles.
"""
from ._core import sparse_attn, sparse_attn_backward, sparse_attn_weights

__all__ = ["sparse_attn", "sparse_attn_backward", "sparse_attn_weights"]
