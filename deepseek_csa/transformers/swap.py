"""swap / unswap / swapped: the per-model swap record, the model wrapper (the call's
fallback reason, its 2-D mask, the dense mask skipped) and the swapped ``generate``."""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Optional

from .attention import _make_forward, _make_hc_forward, _missing_grad_ops, _missing_reason
from .cache import _cache_classes
from .versions import _check_version, _torch

_ATTR = "_deepseek_csa_swap"


# ----------------------------------------------------------------------------- swap state
class _Swap:
    """Per-model swap record: the swapped attention modules, the model wrapper, the
    reason the current model call falls back (if any) and the warnings already given."""

    def __init__(self, model, base, layers, qat):
        self.model, self.base, self.layers, self.qat = model, base, set(layers), qat
        self.all_layers = hasattr(base, "layers") and len(self.layers) == len(base.layers)
        self.call_reason = None      # set by the model wrapper for one call
        self.mask_skipped = False
        self.pad_mask = None         # bool [B, past + S]: the call's 2-D attention mask
        self.arange_positions = False  # the call's positions are the model's arange
        self.warned = set()
        self.capture = None          # an IndexerCapture while capture_indexer is active

    def warn(self, reason):
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"deepseek_csa.transformers: falling back to transformers' own "
                          f"DeepseekV4Attention.forward: {reason}", RuntimeWarning, stacklevel=4)


def _hc_modules(layer):
    return [h for h in (getattr(layer, "attn_hc", None), getattr(layer, "ffn_hc", None))
            if h is not None and hasattr(h, "hc_sinkhorn_iters")]


# ----------------------------------------------------------------------------- model wrapper
def _make_model_forward(st, base):
    torch = _torch()
    orig = type(base).forward
    import inspect
    names = list(inspect.signature(orig).parameters)[1:]

    def forward(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        am = bound.get("attention_mask")
        reason = None
        cfg = base.config
        pad = None
        if am is not None:
            if isinstance(am, dict) or am.dim() != 2:
                reason = "a prebuilt 4-D or per-layer-type attention mask"
            else:
                # the mask goes to the layers as it is (an all-ones mask drops nothing:
                # no branch on its values, which torch.compile would have to break at)
                pad = am.detach().bool()
        if reason is None and (bound.get("output_attentions") or
                               getattr(cfg, "output_attentions", False)):
            reason = "output_attentions"
        if reason is None and base.training and getattr(cfg, "attention_dropout", 0.0):
            reason = f"attention dropout {cfg.attention_dropout} in training mode"
        if reason is None and torch.is_grad_enabled() and any(
                p.requires_grad for p in base.parameters()):
            missing = _missing_grad_ops()
            if missing:
                reason = _missing_reason(missing)
        skip = False
        if reason is None:
            pos = bound.get("position_ids")
            pkv = bound.get("cache", bound.get("past_key_values"))
            x = bound.get("input_ids")
            x = x if x is not None else bound.get("inputs_embeds")
            B, S = x.shape[0], x.shape[1]
            past = pkv.get_seq_length() if pkv is not None else 0
            if pad is not None and pad.shape != (B, past + S):
                reason = (f"a 2-D attention mask of shape {tuple(pad.shape)} for {B} rows of "
                          f"{past} cached + {S} new tokens")
            elif pos is not None and (pos.shape[-1] != S or
                                      pos.reshape(-1, S).shape[0] not in (1, B)):
                reason = f"position_ids of shape {tuple(pos.shape)} for {B} x {S} tokens"
            if reason is None and st.all_layers:
                skip = base.embed_tokens.weight.device.type == "cpu"
        prev = (st.call_reason, st.mask_skipped, st.pad_mask, st.arange_positions)
        st.call_reason, st.mask_skipped = reason, skip
        st.pad_mask = pad if reason is None else None
        # without position ids the model numbers the tokens past .. past + S - 1 itself
        st.arange_positions = bound.get("position_ids") is None
        try:
            if reason is not None:
                st.warn(reason)
            elif skip:
                kwargs = {k: v for k, v in bound.items()}
                kwargs["attention_mask"] = {"deepseek_csa: no dense mask": None}
                return orig(base, **kwargs)
            return orig(base, *args, **kwargs)
        finally:
            st.call_reason, st.mask_skipped, st.pad_mask, st.arange_positions = prev

    forward._deepseek_csa = True
    return forward


def _unrollable(model):
    """The compressed (CSA / HCA) layers of a DeepseekV4 model that are not swapped:
    transformers' own cache layers of these cannot roll back rejected draft tokens
    (their ``crop`` is the sliding window's: the pooled entries and buffers keep them)."""
    mdl = _check_version()
    if not isinstance(model, (mdl.DeepseekV4ForCausalLM, mdl.DeepseekV4Model)):
        return []
    base = _base(model)
    st = getattr(base, _ATTR, None)
    rates = getattr(base.config, "compress_rates", None) or {}
    return [i for i, t in enumerate(base.config.layer_types)
            if t in rates and (st is None or i not in st.layers)]


def _make_generate(model):
    """The swapped model's ``generate``: refuses a DeepseekV4 assistant whose compressed
    layers are not swapped.  transformers (5.25) checks that the main model's cache can be
    cropped but crops the assistant's cache unchecked, and a draft computed from the
    unrolled compressor state makes eager's mask and cache disagree (measured: a
    RuntimeError on the mask's size after a 12-token draft) or drafts from a wrong state."""
    import inspect
    orig = type(model).generate
    sig = inspect.signature(orig)

    def generate(*args, **kwargs):
        a = sig.bind_partial(model, *args, **kwargs).arguments.get("assistant_model")
        bad = _unrollable(a) if a is not None else []
        if bad:
            raise ValueError(
                f"deepseek_csa.transformers: the assistant model's compressed attention "
                f"layers {bad} are not swapped: transformers' own CSA / HCA cache layers "
                f"cannot roll back the compressor state of rejected draft tokens, so the "
                f"assistant would draft from a wrong state or fail; swap the assistant too "
                f"(deepseek_csa.transformers.swap(assistant_model))")
        return orig(model, *args, **kwargs)

    generate._deepseek_csa = True
    return generate


# ----------------------------------------------------------------------------- public API
def _base(model):
    mdl = _check_version()
    if isinstance(model, mdl.DeepseekV4ForCausalLM):
        return model.model
    if isinstance(model, (mdl.DeepseekV4Model, mdl.DeepseekV4Attention)):
        return model
    raise TypeError(f"swap() takes a DeepseekV4ForCausalLM, DeepseekV4Model or "
                    f"DeepseekV4Attention, got {type(model).__name__}")


def _check_qat(cfg):
    rd, D, Di = cfg.qk_rope_head_dim, cfg.head_dim, cfg.index_head_dim
    if (D - rd) % 64 or Di % 32 or Di & (Di - 1):
        raise ValueError(f"swap(qat=True) needs model.py's shapes: head_dim - rope_head_dim "
                         f"a multiple of 64 (FP8 blocks, got {D - rd}) and index_head_dim a "
                         f"power of two >= 32 (Hadamard, FP4 blocks, got {Di})")


def is_swapped(model) -> bool:
    return getattr(_base(model), _ATTR, None) is not None


def swap(model, layers: Optional[Iterable[int]] = None, *, qat: bool = False):
    """Routes the attention of the chosen decoder layers (indices; None: all) of a
    ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` through deepseek_csa.  A single
    ``DeepseekV4Attention`` may be given too (layer-level use and benchmarks): it then
    ignores ``attention_mask`` (causal, no padding assumed; pass None) and the autograd /
    output_attentions / position checks still apply.  ``qat=True``
    adds model.py's QAT roundings (FP8 KV, Hadamard + FP4 indexer).  Swapping an already
    swapped model first unswaps it.  Returns the model."""
    base = _base(model)
    if is_swapped(model):
        unswap(model)
    if not hasattr(base, "layers"):          # one DeepseekV4Attention on its own
        if layers is not None:
            raise ValueError("swap(): 'layers' is for a model, not one attention module")
        _cache_classes()
        if qat:
            _check_qat(base.config)
        st = _Swap(base, base, [], bool(qat))
        base.forward = _make_forward(st, base)
        setattr(base, _ATTR, st)
        return model
    n = len(base.layers)
    chosen = list(range(n)) if layers is None else sorted({int(i) for i in layers})
    for i in chosen:
        if not 0 <= i < n:
            raise ValueError(f"swap(): layer {i} out of range (the model has {n} layers)")
    _cache_classes()
    if qat:
        _check_qat(base.config)
    st = _Swap(model, base, chosen, bool(qat))
    for i in chosen:
        attn = base.layers[i].self_attn
        attn.forward = _make_forward(st, attn)
        for hcm in _hc_modules(base.layers[i]):
            hcm.forward = _make_hc_forward(st, hcm)
    base.forward = _make_model_forward(st, base)
    if model is not base and hasattr(model, "generate"):
        model.generate = _make_generate(model)
    setattr(base, _ATTR, st)
    return model


def unswap(model):
    """Restores transformers' own forwards (the cache stays usable by both)."""
    base = _base(model)
    st = getattr(base, _ATTR, None)
    if st is None:
        return model
    mods = [base] if not hasattr(base, "layers") else [base.layers[i].self_attn
                                                        for i in st.layers]
    if hasattr(base, "layers"):
        mods += [h for i in st.layers for h in _hc_modules(base.layers[i])]
    for attn in mods:
        if getattr(attn.__dict__.get("forward"), "_deepseek_csa", False):
            del attn.forward
    if getattr(base.__dict__.get("forward"), "_deepseek_csa", False):
        del base.forward
    if getattr(st.model.__dict__.get("generate"), "_deepseek_csa", False):
        del st.model.generate
    delattr(base, _ATTR)
    return model


@contextlib.contextmanager
def swapped(model, layers: Optional[Iterable[int]] = None, *, qat: bool = False):
    """``with swapped(model): ...`` -- swap() for the block, unswap() after."""
    swap(model, layers, qat=qat)
    try:
        yield model
    finally:
        unswap(model)
