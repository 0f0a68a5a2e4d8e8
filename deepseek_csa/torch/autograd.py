"""Differentiable CSA ops: ``torch.autograd.Function``s over the C forward and backward
kernels (docs/kernels.md, "Gradients").

One convention for every op here:

- ``_<Op>Fn(torch.autograd.Function)``: ``forward`` hands the tensors to the NumPy entry
  point (CPU float32 / bfloat16 tensors as views, no copies) and saves with
  ``ctx.save_for_backward`` exactly what the backward kernel reads -- the inputs it needs
  and the forward's own by-products (e.g. sparse attention's row log-sum-exp) -- never a
  recomputable intermediate; non-tensor arguments go on ``ctx`` as plain attributes.
  ``backward`` calls the ``<op>_backward`` entry point and returns each gradient in its
  input's dtype (``None`` for inputs that do not need one: ``ctx.needs_input_grad``).
- The public function ``<op>(...)`` calls ``_<Op>Fn.apply`` when autograd will record
  (grad enabled and an input requires grad), else the forward alone (nothing saved).
- Gradients are deterministic: the kernels sum scattered contributions in a fixed order,
  so the bits do not depend on the thread count.
- QAT roundings are straight-through (identity gradient).
"""
from __future__ import annotations

from .autograd_attn import *  # noqa: F401,F403  sparse attention and its weights
from .autograd_norm_pool import *  # noqa: F401,F403  rms_norm, apply_rotary_emb, gated_pool
from .autograd_index import *  # noqa: F401,F403  index_scores, indexer_kl_loss
from . import autograd_attn as _a, autograd_norm_pool as _n, autograd_index as _i

__all__ = _a.__all__ + _n.__all__ + _i.__all__


def _records(*tensors):
    """True when autograd would record a call on these tensors (grad enabled and one of
    them requires grad): the public functions then go through their Function."""
    import torch
    return torch.is_grad_enabled() and any(
        t is not None and getattr(t, "requires_grad", False) for t in tensors)
