"""Sparse attention: sparse_attn (differentiable) and sparse_attn_weights (the indexer's target).

The conventions are autograd.py's.  torch is imported lazily (inside functions).
"""
from __future__ import annotations

__all__ = []
