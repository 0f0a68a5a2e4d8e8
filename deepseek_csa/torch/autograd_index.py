"""The indexer: index_scores (differentiable) and indexer_kl_loss, its training objective.

The conventions are autograd.py's.  torch is imported lazily (inside functions).
"""
from __future__ import annotations

__all__ = []
