"""RMSNorm, rotary embedding and gated pooling, differentiable.

The conventions are autograd.py's.  torch is imported lazily (inside functions).
"""
from __future__ import annotations

__all__ = []
