"""Indexer scoring and top-k selection (docs/kernels.md, section 4), window and HCA index lists
(docs/kernels.md, sections 4 and 6).

V4 CSA layers:     ``index_topk(q, k, w, cfg.index_topk, ratio=4, start_pos=p, offset=o)``
V4.1 index layers: ``select_candidate_blocks`` on a first level of scores, then
                   ``index_topk(..., order="position", candidates=mask)``
Tensor parallel:   ``index_scores`` per rank, sum across ranks, ``topk_indices``.
HCA layers:        ``compress_topk_idxs``; every layer: ``window_topk_idxs``.

Ranking (every selection here): higher score first, NaN above +inf (as torch.topk),
-0.0 == +0.0, equal scores by LOWER position first.  The selected set is unique,
identical at any thread count, and identical between ``index_topk`` and
``topk_indices(index_scores(...))``.  Entries a query cannot see (t >= (P+1)//ratio)
are never selected; rows with fewer eligible entries than the output width are
padded with -1 at the end.

bfloat16: ``q`` and ``k`` may both be bfloat16 (ml_dtypes.bfloat16 arrays or
torch.bfloat16 tensors, read in place, never copied to float32); ``weights`` may be
either dtype.  Mixing float32 and bfloat16 q/k raises TypeError.  Scores are float32
(as the released scorer returns them): bfloat16 products are exact in float32, so the
bf16 path equals the float32 reference on the bf16 values up to the order of float32
additions.  At ISA level 'amx' q . k run on AMX-BF16 tiles (several times the float32
throughput; bfloat16 subnormals count as zero there); at the other levels bfloat16
inputs give bitwise the float32 result.  Bits never depend on the thread count.

FP4 key rows (docs/kernels.md, section 4): ``fp4_pack(k)`` stores FP4-rounded index keys
as uint8 [..., D // 2 + D // 32] (68 bytes a row at D = 128 instead of 512), and a
uint8 ``k`` of that width is scored from that format by ``index_scores`` /
``index_topk`` with exact integer block dot products (q float32 / bfloat16, rounded to
FP4 per 32 features as the released indexer rounds its queries, or q packed too),
bitwise the same scores at every ISA level (at 'amx' on AMX-INT8 tiles; a process the
kernel refuses the tiles is told so once, with a RuntimeWarning, and runs AVX512_VNNI).
``fp4_unpack`` gives the float32 values back.

Gradients (docs/kernels.md, section 11.3; float32 only, bits independent of the thread
count): ``index_scores_backward(grad_scores, q, k, weights, *, ratio, start_pos=0)`` ->
(grad_q, grad_k, grad_weights); ``indexer_kl_loss(q, k, weights, topk_idxs, attn_target,
*, ratio, start_pos=0, positions=None, target="selected", clip=None, return_grads=False,
return_metrics=False)``, the indexer's KL training objective (sparse stage over the topk
slots, or the dense warm-up with ``topk_idxs=None``; the joint-attention variant, a
clamped log, per-query positions, kl_uniform / kl_captured metrics), loss and gradients
in one pass without an [S, Tc] array.
"""
from ._core import (compress_topk_idxs, fp4_pack, fp4_unpack, index_scores, index_topk,
                    select_candidate_blocks, topk_indices, window_topk_idxs)
# gradients (docs/kernels.md, section 11.3): float32 only, bits independent of threads
from ._core import index_scores_backward, indexer_kl_loss

__all__ = ["index_scores", "index_topk", "topk_indices", "select_candidate_blocks",
           "window_topk_idxs", "compress_topk_idxs", "fp4_pack", "fp4_unpack",
           "index_scores_backward", "indexer_kl_loss"]
