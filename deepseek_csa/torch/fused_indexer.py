"""The released model.py's V4 Indexer with its decode-step scores from deepseek_csa's
FP4 kernel (``fuse_indexer``), the runner's default (``python -m deepseek_csa.generate
--indexer fused``).

At a decode step the released ``Indexer.forward`` scores every compressed entry with
torch in bfloat16: an einsum of the 64 query heads against the [end_pos // ratio, 128]
key cache, ``relu_``, times the per-head weights, a sum over the heads, then
``topk``.  After 64K tokens of context that is a [64, 16384] product and three passes
over a [64, 16384] bfloat16 tensor on one thread: ~6 ms of a ~18 ms step at the
released width (docs/peers.md section 9), where the kernel takes ~0.6.

``fuse_indexer(model)`` gives each released V4 Indexer an instance ``forward``.  On a
decode call (one new token, ``start_pos > 0``, no tensor parallelism, the model
module's FP4 rounding ours in blocks of 32, bfloat16 queries, keys and weights) it
runs the released lines up to the scores -- ``wq_b``, RoPE, Hadamard, the FP4 rounding
of q, the compressor, the weights -- then ``index_scores(..., rounding="bf16")`` on the
key cache's FP4 rows (packed beside the bfloat16 cache as the compressor adds rows)
and ``torch.topk`` of those scores as bfloat16, as released.  ``rounding="bf16"``
reproduces each rounding of the released expression (docs/kernels.md, section 4): the
per-head dot products, exact from FP4 rows, rounded to bfloat16; relu; times the
weight, rounded; the heads summed in float32 in the order torch sums that tensor; the
total rounded.  So the scores are the released bits wherever torch's float32 dot
product of those FP4-grid rows is exact (its 4 block sums, 13 bits each, within 2^11
of each other: always, for keys and queries whose block scales differ by less than
2^11), and ``torch.topk`` of the same bfloat16 row picks the same entries, ties
included.  Every other call runs the released forward; a key cache whose rows are not
on the FP4 grid is scored by the released expression.  ``unfuse_indexer`` restores the
released forward.
"""
from __future__ import annotations

import sys
import types

import torch

from . import ops
from .dropins import _fp4_keys, _rounds_fp4_32, _indexer_queries

__all__ = ["fuse_indexer", "unfuse_indexer"]


def _v4_indexers(model):
    import inspect
    for m in model.modules():
        if not (type(m).__name__.endswith("Indexer") and hasattr(m, "compressor")
                and hasattr(m, "kv_cache") and hasattr(m, "weights_proj")):
            continue
        try:
            params = list(inspect.signature(type(m).forward).parameters)
        except (TypeError, ValueError):
            continue
        if params == ["self", "x", "qr", "start_pos", "offset"]:    # V4 (V4.1 adds latent)
            yield m


def _released(self, x, qr, start_pos, offset):
    # the released forward rewrites key rows from start_pos // ratio on: their FP4
    # copies are stale from there
    self._csa_fp4_valid = min(getattr(self, "_csa_fp4_valid", 0), start_pos // self.compress_ratio)
    return type(self).forward(self, x, qr, start_pos, offset)


def _indexer_forward(self, x, qr, start_pos, offset):
    G = self._csa_globals
    bsz, seqlen, _ = x.size()
    bf = torch.bfloat16
    if (seqlen != 1 or (start_pos + 1) // self.compress_ratio == 0    # nothing to score yet
            or G.get("world_size", 1) > 1 or not _rounds_fp4_32(G)
            or torch.get_default_dtype() != bf or self.kv_cache.dtype != bf
            or self.weights_proj.weight.dtype != bf):
        return _released(self, x, qr, start_pos, offset)
    q, weights = _indexer_queries(self, G, x, qr, start_pos)
    n = (start_pos + 1) // self.compress_ratio            # the entries the step scores
    keys = self.kv_cache[:bsz, :n]
    kn = keys
    if q.dtype == bf and weights.dtype == bf:
        kn = _fp4_keys(self, keys, bsz, start_pos // self.compress_ratio, True)
    if kn.dtype == torch.uint8:
        score = ops.call("index_scores", q, kn, weights, self.compress_ratio, start_pos,
                         "bf16").to(bf)
    else:      # keys off the FP4 grid: the released expression
        if not getattr(self, "_csa_warned", False):
            import warnings
            self._csa_warned = True
            warnings.warn("fuse_indexer: this indexer's key cache holds rows off the FP4 "
                          "grid (its FP4 rounding did not run on them), so its decode steps "
                          "score them with the released bf16 einsum (slower)", RuntimeWarning,
                          stacklevel=2)
        per_head = torch.einsum("bshd,btd->bsht", q, keys).relu_()
        score = (per_head * weights.unsqueeze(-1)).sum(dim=2)
    return score.topk(min(self.index_topk, n), dim=-1)[1] + offset


def fuse_indexer(model):
    """Gives each released V4 Indexer under model (not one ``swap`` has replaced) the
    decode path of the module docstring.  Returns how many."""
    n = 0
    for m in _v4_indexers(model):
        if "forward" in m.__dict__:      # swapped, or fused already
            continue
        m._csa_globals = vars(sys.modules[type(m).__module__])
        m.forward = types.MethodType(_indexer_forward, m)
        m._csa_fused_indexer = True
        n += 1
    return n


def unfuse_indexer(model):
    """Restores the released forward of every Indexer fuse_indexer changed."""
    for m in model.modules():
        if m.__dict__.pop("_csa_fused_indexer", None):
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_csa_fp4_keys", None)
            m.__dict__.pop("_csa_fp4_valid", None)
    return model
