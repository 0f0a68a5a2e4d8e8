"""Indexer scoring and top-k selection (SPEC section 4), window and HCA index lists
(SPEC sections 4 and 6).

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
"""
from ._core import (compress_topk_idxs, index_scores, index_topk, select_candidate_blocks,
                    topk_indices, window_topk_idxs)

__all__ = ["index_scores", "index_topk", "topk_indices", "select_candidate_blocks",
           "window_topk_idxs", "compress_topk_idxs"]
