"""``swap`` / ``unswap``: route chosen layers of a loaded ``model.py`` through the
drop-ins (see the package docstring of ``deepseek_csa.torch``)."""
from __future__ import annotations

from typing import Iterable, Optional

from . import dropins
from .dropins import (_ORIG, _mod_globals, compressor_forward, indexer_forward,
                      indexer_forward_v41, rms_norm_forward)

__all__ = ["OPS", "swap", "unswap", "Swap"]

OPS = ("sparse_attn", "rope", "rms_norm", "qat", "hadamard", "index_lists", "compressor",
       "indexer")

# the model module's functions each op replaces
_GLOBALS = {"sparse_attn": ("sparse_attn",), "rope": ("apply_rotary_emb",),
            "qat": ("act_quant", "fp4_act_quant"), "hadamard": ("rotate_activation",),
            "index_lists": ("get_window_topk_idxs", "get_compress_topk_idxs")}


def _attention_modules(model):
    """(layer id, module) of every attention module under model (model itself included)."""
    found = []
    for name, m in model.named_modules():
        if type(m).__name__ == "Attention" or (hasattr(m, "attn_sink") and hasattr(m, "wkv")):
            found.append(m)
    return [(getattr(m, "layer_id", i), m) for i, m in enumerate(found)]


def _set_forward(module, fn, undo):
    import types
    if "forward" in module.__dict__:
        undo.append((module, module.__dict__["forward"]))
    else:
        undo.append((module, None))
    module.forward = types.MethodType(fn, module)
    module._csa_swapped = True


def _make_attention_forward(names, orig_forward):
    def forward(self, *args, **kw):
        G = _mod_globals(self)
        saved, outer = {}, dict(_ORIG)
        for n in names:
            if n in G:
                # the drop-ins hand the modes they do not cover to THIS model's function
                # (a first-seen cache served another model's module: order-dependent tests)
                saved[n] = _ORIG[n] = G[n]
                G[n] = getattr(dropins, n)
        try:
            return orig_forward(*args, **kw)
        finally:
            G.update(saved)
            _ORIG.clear()
            _ORIG.update(outer)
    return forward


class Swap:
    """Handle returned by ``swap``: ``undo()`` restores the modules it changed; also a
    context manager (undoes on exit).  ``layers``: the swapped layer ids; ``ops``: the ops
    asked for; ``routed``: {layer id: the ops actually routed through deepseek_csa there}
    (an op a layer does not have, e.g. the indexer of a window-only layer, is absent)."""

    def __init__(self, undo, layers, ops, routed=None):
        self._undo, self.layers, self.ops = undo, layers, ops
        self.routed = routed or {}

    def undo(self):
        for module, prev in reversed(self._undo):
            if prev is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prev
            module.__dict__.pop("_csa_swapped", None)
        self._undo = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False

    def __repr__(self):
        return f"Swap(routed={self.routed})"


def _forward_params(m):
    import inspect
    try:
        return tuple(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return ()


def _compressor_dropin(m):
    """The drop-in for a released V4 or V4.1 Compressor, or None for another shape."""
    if not (hasattr(m, "wkv") and hasattr(m, "norm") and hasattr(m, "compress_ratio")):
        return None
    if hasattr(m, "ape") or m.compress_ratio == 1 or hasattr(m, "wgate"):
        return compressor_forward
    return None


def _indexer_dropin(m):
    """The drop-in for a released V4 or V4.1 Indexer (told apart by the forward
    signature: V4.1's takes the layer's latent), or None for another shape."""
    params = _forward_params(m)
    if "latent" in params and hasattr(m, "owns_k"):
        return indexer_forward_v41
    if "latent" not in params and hasattr(m, "compressor") and hasattr(m, "kv_cache"):
        return indexer_forward
    return None


def swap(model, layers: Optional[Iterable[int]] = None, ops: Optional[Iterable[str]] = None):
    """Routes the CSA computation of the chosen attention layers of ``model`` (a model.py
    ``Transformer`` of V4 or V4.1, any module containing its ``Attention`` modules, or an
    ``Attention``) through deepseek_csa.  ``layers``: layer ids (``Attention.layer_id``),
    default all; ``ops``: a subset of ``OPS``, default all.  Returns a ``Swap`` (context
    manager) whose ``routed`` says which ops each layer now runs on deepseek_csa.  A
    requested op that found nothing to route (a submodule of an unknown shape, or -- for
    ops named explicitly -- none of the op's functions in the model's module) is reported
    in one ``UserWarning`` naming the modules, never skipped silently."""
    import warnings
    explicit = ops is not None
    ops = tuple(OPS if ops is None else ops)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"swap(): unknown ops {bad}; choose from {OPS}")
    mods = _attention_modules(model)
    if not mods:
        raise ValueError("swap(): no Attention module found in the model")
    ids = [lid for lid, _ in mods]
    if layers is not None:
        layers = [int(l) for l in layers]
        missing = [l for l in layers if l not in ids]
        if missing:
            raise ValueError(f"swap(): no attention layer {missing}; the model has {ids}")
    chosen = [(lid, m) for lid, m in mods if layers is None or lid in layers]
    for lid, a in chosen:
        if getattr(a, "_csa_swapped", False):
            raise RuntimeError(f"swap(): layer {lid} is already swapped; unswap it first")
    names = [n for o in ops for n in _GLOBALS.get(o, ())]
    undo, routed, left = [], {}, []
    for lid, a in chosen:
        G = _mod_globals(a)
        done = [o for o in ops if o in _GLOBALS and any(n in G for n in _GLOBALS[o])]
        if explicit:
            left += [f"layer {lid}: {o} (its module {G.get('__name__')!r} has none of "
                     f"{list(_GLOBALS[o])})" for o in ops if o in _GLOBALS and o not in done]
        _set_forward(a, _make_attention_forward(names, type(a).forward.__get__(a)), undo)
        for name, m in a.named_modules():
            if m is a:
                continue
            cls = type(m).__name__
            where = f"layer {lid}: {name} ({cls})"
            if "rms_norm" in ops and cls == "RMSNorm":
                _set_forward(m, rms_norm_forward, undo)
                done.append("rms_norm")
            elif "compressor" in ops and cls.endswith("Compressor"):
                fn = _compressor_dropin(m)
                if fn is None:
                    left.append(f"{where}: compressor (unknown attributes)")
                else:
                    _set_forward(m, fn, undo)
                    done.append("compressor")
            elif "indexer" in ops and cls.endswith("Indexer"):
                fn = _indexer_dropin(m)
                if fn is None:
                    left.append(f"{where}: indexer (forward{_forward_params(m)} is neither "
                                "the V4 nor the V4.1 signature)")
                else:
                    _set_forward(m, fn, undo)
                    done.append("indexer")
        routed[lid] = tuple(o for o in OPS if o in done)
    if left:
        warnings.warn("deepseek_csa.torch.swap: these requested ops stay on torch: "
                      + "; ".join(left), UserWarning, stacklevel=2)
    return Swap(undo, [lid for lid, _ in chosen], ops, routed)


def unswap(model):
    """Restores every module under ``model`` that ``swap`` changed."""
    for m in model.modules():
        if m.__dict__.pop("_csa_swapped", None):
            m.__dict__.pop("forward", None)
    return model
