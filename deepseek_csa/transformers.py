"""Hugging Face transformers bridge: run ``DeepseekV4Attention`` layers of a
``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` (transformers 5.23 / 5.24) through deepseek_csa.

    import deepseek_csa.transformers as dch
    with torch.no_grad(), dch.swapped(model):          # every attention layer
        out = model.generate(ids, max_new_tokens=64)
    dch.swap(model, layers=[1, 3]); ...; dch.unswap(model)

torch and transformers are imported lazily; only the transformers releases in
``SUPPORTED_VERSIONS`` (5.23.0, 5.24.0) and patch releases of their series are accepted,
other versions raise ``RuntimeError`` naming both (the modeling code of this young model
still changes between releases, and equivalence is only tested there; ``make
test-hf-versions`` runs the bridge tests under each).  5.24 names the cache argument
``cache`` (``past_key_values`` is its deprecated alias): both are accepted.

How a layer is swapped: the chosen ``DeepseekV4Attention`` modules get an instance
``forward`` with the module's signature that keeps the module's own projections
(``q_a_proj``, ``q_b_proj``, ``kv_proj``, the compressor's and indexer's projections,
``o_a_proj`` / ``o_b_proj``: quantized or bf16 weights keep working) and runs the
RMSNorms, RoPE, the compressor's gated pooling, the indexer's scoring and top-k, the index
lists and the sparse attention through our kernels.  The attention gathers the window
rows and the selected compressed entries (``sparse_attn``) instead of attending every
entry under a dense -inf mask, and the indexer never materializes its [B, S, T] scores
(``index_topk``).  When every attention layer is swapped the model's dense
[B, 1, S, L+T] mask is not built at all (the model gets a mask dict holding ``None``).

State lives where transformers keeps it: window rows in the model's cache layer
(``DynamicSlidingWindowLayer`` or the CSA/HCA layer's own window), the compressor's
buffers, overlap rows and compressed entries in the same fields of the CSA/HCA cache
layers, whose class is switched on first use to our subclasses ``CSACacheLayer`` /
``HCACacheLayer`` (same fields, so a layer can be unswapped mid-generation and
transformers' own forward continues from our state, and vice versa).  Ours add ``crop``
(after ``activate_past_recording()``, as for transformers' sliding layers) and keep
``reset`` / ``reorder_cache`` (beam search) working.  Chunked prefill (a multi-token
call at ``start_pos > 0``) and ``generate()`` from ``past_key_values`` work.

Semantics are transformers' (not DeepSeek's model.py): no QAT (``qat=True`` adds
model.py's FP8 rounding of the KV rows and compressed entries in front of the rope tail
and the Hadamard + FP4 rounding of indexer queries and keys); RoPE on the trailing
``rope_head_dim`` features with interleaved pairs and the model's own cos/sin tables
(YaRN and its attention factor included); compressed entry ``g`` at position
``g * ratio``; the sink as an extra logit.  Top-k ties are broken deterministically
(equal scores: the lower position wins), which ``torch.topk`` does not promise (its
order depends on the call shape, so transformers' own prefill and decode can disagree);
up to such ties the selection is transformers'.

Covered: float32 and bfloat16 CPU models, batch >= 1, padded batches (a 2-D attention
mask with left or right padding) and position ids that differ per row, prefill, chunked
prefill, decode, greedy / sampling / beam search through ``generate()``, sliding, CSA
and HCA layers, any subset of layers.

Padded batches reproduce transformers' eager semantics (docs/transformers.md): pad tokens
are masked out as keys of the sliding window only; the compressors pool them into the
compressed entries like any token (windows of ``ratio`` tokens by index, entry ``g`` at
RoPE position ``g * ratio``); a query sees the entries ``t < (position + 1) // ratio``
of its own position id (HCA decode steps see every entry, as in eager); RoPE of queries,
KV rows and indexer queries uses each row's positions.  The 2-D mask goes to the layers
as it is (never the dense [B, 1, S, L+T] mask when every layer is swapped).

Falls back to transformers' own forward (one warning per reason, never silently wrong):
a prebuilt 4-D / dict mask, a 2-D mask whose length is not cached + new tokens, position
ids not of shape [B or 1, S], autograd (grad enabled with inputs or weights requiring
grad) or ``model.training``, ``output_attentions``, tensors not on the CPU or not
float32 / bfloat16.

bfloat16: the kernels read bf16 activations in place and compute in float32 with one
rounding per op (norms, RoPE, pooled entries, attention output).  transformers' bf16 path
rounds more often (the RoPE cos/sin tables -- which we take from the model, so that one
is shared -- the softmax weights of the pooling and the pooled sums, the unweighted
query norm's scale), so swapped bf16 logits differ from transformers' bf16 by bf16
rounding noise and are typically closer to a float32 run.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Optional

import numpy as np

import deepseek_csa as _dc

__all__ = ["SUPPORTED_VERSIONS", "swap", "unswap", "swapped", "is_swapped",
           "CSACacheLayer", "HCACacheLayer"]

# The transformers releases whose DeepseekV4 modeling code the bridge is tested against
# (`make test-hf-versions` runs the bridge tests on each, in its own environment).  A
# release in the same major.minor series as one of these (a patch release) is accepted
# too.  The next release: add it here and to pyproject's range, run the target.
SUPPORTED_VERSIONS = ("5.23.0", "5.24.0")

_ATTR = "_deepseek_csa_swap"


def _torch():
    import torch
    return torch


def _supported(v):
    """True for a tested release or a final patch release of a tested major.minor."""
    if v in SUPPORTED_VERSIONS:
        return True
    parts = v.split(".")
    return (len(parts) == 3 and parts[2].isdigit() and
            any(parts[:2] == x.split(".")[:2] for x in SUPPORTED_VERSIONS))


def _check_version():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("deepseek_csa.transformers needs transformers "
                          f"{' or '.join(SUPPORTED_VERSIONS)} (pip install "
                          "'deepseek_csa[hf]')") from e
    v = transformers.__version__
    if not _supported(v):
        series = ", ".join(".".join(x.split(".")[:2]) + ".x" for x in SUPPORTED_VERSIONS)
        raise RuntimeError(f"deepseek_csa.transformers supports transformers {series} "
                           f"(tested: {', '.join(SUPPORTED_VERSIONS)}; its DeepseekV4 modeling "
                           f"code changes between releases), found {v}; install "
                           f"transformers=={SUPPORTED_VERSIONS[-1]}")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
    return mdl


# ----------------------------------------------------------------------------- cache layers
_CLASSES = {}


def _cache_classes():
    """(HCACacheLayer, CSACacheLayer), built on first use (transformers imported lazily)."""
    if _CLASSES:
        return _CLASSES["hca"], _CLASSES["csa"]
    mdl = _check_version()
    torch = _torch()

    def _tb(self):
        """The transformers class a layer of ours extends."""
        return (mdl.DeepseekV4CSACache if isinstance(self, mdl.DeepseekV4CSACache)
                else mdl.DeepseekV4HCACache)

    class _Mixin:
        """Crop support and its bookkeeping on top of transformers' CSA/HCA cache layers.

        Recording (``activate_past_recording()``, the switch of transformers' sliding
        layers) keeps every window row and, per compressor state and per forward call,
        the state at the call's start and the call's raw projections, so that
        ``crop(-n)`` can roll back any number of tokens of the calls since the last crop.
        """
        _layer_type = None   # never register in transformers' cache-layer mapping

        def _dc_log(self):
            log = self.__dict__.get("_dc_snapshots")
            if log is None:
                log = self._dc_snapshots = {}
            return log

        def update(self, key_states, value_states, *args, **kwargs):
            if not getattr(self, "record_past", False):
                return _tb(self).update(self, key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.values = self.keys
            self.cumulative_length += key_states.shape[-2]
            full = torch.cat([self.keys, key_states], dim=-2)
            self.keys = self.values = full      # kept whole until crop()
            n = self.sliding_window - 1 + key_states.shape[-2]
            return full[:, :, -n:], full[:, :, -n:]

        def store_compression_weights(self, name, kv, gate):
            if getattr(self, "record_past", False):
                snap = {"count": self.entry_count[name], "buf_kv": self.buffer_kv[name],
                        "buf_gate": self.buffer_gate[name], "kv": kv.detach(),
                        "gate": gate.detach()}
                if hasattr(self, "overlap_kv"):
                    snap["ov_kv"] = self.overlap_kv[name]
                    snap["ov_gate"] = self.overlap_gate[name]
                self._dc_log().setdefault(name, []).append(snap)
            return _tb(self).store_compression_weights(self, name, kv, gate)

        def reset(self):
            _tb(self).reset(self)
            self._dc_snapshots = {}

        def reorder_cache(self, beam_idx):
            _tb(self).reorder_cache(self, beam_idx)
            for snaps in self._dc_log().values():
                for snap in snaps:
                    for key, t in snap.items():
                        if isinstance(t, torch.Tensor):
                            snap[key] = t.index_select(0, beam_idx.to(t.device))

        def crop(self, tokens_to_remove: int) -> None:
            """Removes the last ``-tokens_to_remove`` tokens (a negative int, as
            transformers' ``Cache.crop``); ``crop(0)`` only trims the recorded window
            rows back to ``sliding_window - 1``.  Rolling back needs the rows and states
            recorded since ``activate_past_recording()`` (RuntimeError otherwise)."""
            if tokens_to_remove > 0:
                raise ValueError(f"crop() takes a negative number of tokens to remove, got "
                                 f"{tokens_to_remove}")
            r = -int(tokens_to_remove)
            cum = self.cumulative_length
            if r > cum:
                raise ValueError(f"crop({tokens_to_remove}): the cache holds {cum} tokens")
            n = cum - r
            if r and self.is_initialized:
                rows = self.keys.shape[-2]
                need = min(self.sliding_window - 1, n)
                if rows - r < need:
                    raise RuntimeError(
                        f"crop({tokens_to_remove}) needs window rows this cache layer no "
                        f"longer holds: call activate_past_recording() before the forward "
                        f"calls to roll back")
            plans = {}
            if r:
                for name in self.entry_count:
                    if self.entry_count[name] == 0 and self.buffer_kv[name] is None:
                        continue
                    snaps = self._dc_log().get(name, [])
                    pos = [s["count"] * self.compress_rate
                           + (0 if s["buf_kv"] is None else s["buf_kv"].shape[1]) for s in snaps]
                    ok = [i for i, p in enumerate(pos) if p <= n]
                    if not ok:
                        raise RuntimeError(
                            f"crop({tokens_to_remove}): the compressor state of "
                            f"{name!r} before token {n} was not recorded: call "
                            f"activate_past_recording() before the forward calls to roll back")
                    plans[name] = (snaps[ok[-1]], n - pos[ok[-1]])
            if self.is_initialized:
                keys = self.keys[:, :, :self.keys.shape[-2] - r]
                keys = keys[:, :, max(0, keys.shape[-2] - self.sliding_window + 1):]
                self.keys = self.values = keys
            self.cumulative_length = n
            for name, (snap, extra) in plans.items():
                count = snap["count"]
                self.entry_count[name] = count
                ckv = self.compressed_kv[name]
                if ckv is not None:
                    self.compressed_kv[name] = ckv[:, :count]
                parts_kv = [t for t in (snap["buf_kv"], snap["kv"][:, :extra]) if t is not None]
                parts_g = [t for t in (snap["buf_gate"], snap["gate"][:, :extra]) if t is not None]
                self.buffer_kv[name] = torch.cat(parts_kv, dim=1)
                self.buffer_gate[name] = torch.cat(parts_g, dim=1)
                if "ov_kv" in snap:
                    self.overlap_kv[name] = snap["ov_kv"]
                    self.overlap_gate[name] = snap["ov_gate"]
            self._dc_snapshots = {}

    # One base each (no mixin in the bases), so the object layout stays transformers'
    # and a live layer can switch class (see _adopt_layer).
    ns = {k: v for k, v in _Mixin.__dict__.items()
          if k not in ("__dict__", "__weakref__", "__module__", "__qualname__")}
    ns["is_croppable"] = True
    HCACacheLayer = type("HCACacheLayer", (mdl.DeepseekV4HCACache,),
                         dict(ns, __doc__="transformers' ``DeepseekV4HCACache`` (same "
                              "fields) plus ``crop``.\n\n" + _Mixin.__doc__))
    CSACacheLayer = type("CSACacheLayer", (mdl.DeepseekV4CSACache,),
                         dict(ns, __doc__="transformers' ``DeepseekV4CSACache`` (same "
                              "fields) plus ``crop``.\n\n" + _Mixin.__doc__))
    for c in (HCACacheLayer, CSACacheLayer):
        c.__module__ = __name__
    _CLASSES["hca"], _CLASSES["csa"] = HCACacheLayer, CSACacheLayer
    return HCACacheLayer, CSACacheLayer


def __getattr__(name):
    if name == "CSACacheLayer":
        return _cache_classes()[1]
    if name == "HCACacheLayer":
        return _cache_classes()[0]
    raise AttributeError(name)


def _adopt_layer(cache, idx):
    """The cache layer at idx, its class switched to ours (same fields: lossless)."""
    hca, csa = _cache_classes()
    layer = cache.layers[idx]
    if isinstance(layer, (hca, csa)):
        return layer
    mdl = _check_version()
    if type(layer) is mdl.DeepseekV4CSACache:
        layer.__class__ = csa
    elif type(layer) is mdl.DeepseekV4HCACache:
        layer.__class__ = hca
    return layer


# ----------------------------------------------------------------------------- helpers
def _f32np(t):
    """A float32 NumPy array of a (CPU) tensor: a view when it already is one."""
    torch = _torch()
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return np.ascontiguousarray(t.numpy())


def _window_idx(S, L, W):
    """Linear-window index lists: query s (absolute start+s) over the rows of
    [L cached rows | S new rows], rows s+L-W+1 .. s+L, ascending, -1 padded."""
    width = min(W, L + S)
    s = np.arange(S, dtype=np.int64)[:, None]
    j = np.maximum(0, s + L - W + 1) + np.arange(width, dtype=np.int64)[None, :]
    return np.where(j <= s + L, j, -1).astype(np.int32)


def _visible(pos, ratio, T):
    """Compressed entries each query sees (transformers: t < (position + 1) // ratio),
    clamped to [0, T].  pos: int64 [Bp, S] position ids."""
    return np.clip((pos + 1) // ratio, 0, T)


def _all_idx(vis, offset):
    """HCA lists: every entry t < vis[b, s] (vis: [Bp, S]), as t + offset, -1 padded."""
    width = int(vis.max()) if vis.size else 0
    t = np.arange(width, dtype=np.int64)
    return np.where(t < vis[..., None], t + offset, -1).astype(np.int32)


def _positions(position_ids, S):
    """Position ids as int64 NumPy [Bp, S] (Bp = 1 or the batch)."""
    return position_ids.detach().reshape(-1, S).to("cpu").numpy().astype(np.int64)


def _is_arange(p):
    return p.size == 0 or bool((p == p[0] + np.arange(p.size)).all())


def _rope_rows(x, cos, sin, inverse=False):
    """apply_rope with per-row tables: cos / sin [Bp, S, r] (Bp = 1: shared)."""
    if cos.shape[0] == 1:
        _dc.apply_rope(x, cos[0], sin[0], inverse=inverse)
    else:
        for b in range(cos.shape[0]):
            _dc.apply_rope(x[b:b + 1], cos[b], sin[b], inverse=inverse)


def _index_select(qi, keys, w, topk, ratio, pos, offset):
    """index_topk with per-query positions: query (b, s) sees the entries t <
    min(T, (pos[b, s] + 1) // ratio), as transformers' indexer.  Runs of consecutive
    positions go in one call (the kernel's start_pos); a row whose positions are one
    arange (no padding, or right padding) is one run, a left-padded row under
    generate() is its real tokens' run plus pad tokens that see nothing."""
    B, S = qi.shape[0], qi.shape[1]
    T = keys.shape[1]
    if pos.shape[0] == 1 and S and pos[0, 0] >= 0 and _is_arange(pos[0]) and \
            (pos[0, 0] + S) // ratio <= T:
        return _dc.index_topk(qi, keys, w, topk, ratio=ratio, start_pos=int(pos[0, 0]),
                              offset=offset)
    K = min(topk, T)
    out = np.full((B, S, K), -1, dtype=np.int32)
    for b in range(B):
        p = pos[b if pos.shape[0] > 1 else 0]
        s = 0
        while s < S:
            v = (p[s] + 1) // ratio
            if v <= 0:
                s += 1
                continue
            if v > T:                    # a position past the entries: it sees all T
                start, e = T * ratio - 1, s + 1
            else:
                start, e = int(p[s]), s + 1
                while e < S and p[e] == p[e - 1] + 1 and (p[e] + 1) // ratio <= T:
                    e += 1
            r = _dc.index_topk(qi[b:b + 1, s:e], keys[b:b + 1], w[b:b + 1, s:e], topk,
                               ratio=ratio, start_pos=start, offset=offset)
            out[b, s:e, :r.shape[-1]] = r[0]
            s = e
    return out


def _qat_kv(x, rd):
    """model.py's FP8 rounding of KV rows / entries in front of the rope tail."""
    _dc.fp8_round(x[..., :x.shape[-1] - rd], 64)


def _qat_index(x):
    """model.py's indexer rounding: Hadamard rotation, then FP4 in blocks of 32."""
    _dc.hadamard(x, out=x)
    _dc.fp4_round(x, 32)


def _compress(mod, layer, name, h, overlap, qat_fn):
    """One compressor call (transformers' CSA/HCA compressor or the indexer's) at any
    start position: buffered + new tokens, complete windows pooled by ``gated_pool``
    (the previous call's last window prepended as a group whose entry is dropped, for
    the overlap), then RMSNorm and RoPE at ``g * ratio``.  Returns all entries so far."""
    torch = _torch()
    B = h.shape[0]
    ratio, D = mod.compress_rate, mod.head_dim
    kv = mod.kv_proj(h)
    gate = mod.gate_proj(h)
    if layer is None:
        usable = (kv.shape[1] // ratio) * ratio
        ckv, cgate, first = kv[:, :usable], gate[:, :usable], 0
    else:
        ckv, cgate, first = layer.store_compression_weights(name, kv, gate)
    n = ckv.shape[1] // ratio
    if n == 0:
        new = kv.new_zeros((B, 0, D))
    else:
        c = ckv.shape[-1]
        score = (cgate.reshape(B, n, ratio, c) + mod.position_bias).reshape(B, n * ratio, c)
        drop = 0
        if overlap and layer is not None:
            prior_kv, prior_gate = layer.update_overlap_state(
                name, ckv.reshape(B, n, ratio, c), score.reshape(B, n, ratio, c), D)
            if prior_kv is not None:
                pkv = torch.cat([prior_kv.to(ckv.dtype), ckv.new_zeros((B, ratio, D))], dim=-1)
                pg = torch.cat([prior_gate.to(score.dtype), score.new_zeros((B, ratio, D))],
                               dim=-1)
                ckv = torch.cat([pkv, ckv], dim=1)
                score = torch.cat([pg, score], dim=1)
                drop = 1
        out = torch.empty((B, n + drop, D), dtype=ckv.dtype)
        _dc.gated_pool(ckv, score, ratio, overlap=overlap, out=out)
        new = out[:, drop:]
        _dc.rms_norm(new, mod.kv_norm.weight.detach().float(), mod.kv_norm.variance_epsilon,
                     out=new)
        pos = (torch.arange(n) * ratio + first).unsqueeze(0)
        cos, sin = mod.rotary_emb(new, position_ids=pos, layer_type="compress")
        rd = 2 * cos.shape[-1]
        _dc.apply_rope(new[..., D - rd:], _f32np(cos[0]), _f32np(sin[0]))
        if qat_fn is not None:
            qat_fn(new, rd)
        new = new.contiguous()
    if layer is None:
        return new
    return layer.update_compressor_states(name, new)


# ----------------------------------------------------------------------------- swap state
class _Swap:
    """Per-model swap record: the swapped attention modules, the model wrapper, the
    reason the current model call falls back (if any) and the warnings already given."""

    def __init__(self, model, base, layers, qat):
        self.model, self.base, self.layers, self.qat = model, base, set(layers), qat
        self.all_layers = hasattr(base, "layers") and len(self.layers) == len(base.layers)
        self.call_reason = None      # set by the model wrapper for one call
        self.mask_skipped = False
        self.pad_mask = None         # bool NumPy [B, past + S] of the call, when it pads
        self.warned = set()

    def warn(self, reason):
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"deepseek_csa.transformers: falling back to transformers' own "
                          f"DeepseekV4Attention.forward: {reason}", RuntimeWarning, stacklevel=4)


def _layer_reason(st, m, h, position_ids, past_key_values, kw):
    """Why this attention call cannot run on our kernels (None: it can)."""
    torch = _torch()
    if st.call_reason is not None:
        return st.call_reason
    if kw.get("output_attentions"):
        return "output_attentions"
    if m.training:
        return "the module is in training mode"
    if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad
                                                           for p in m.parameters())):
        return ("autograd is enabled (run under torch.no_grad() or torch.inference_mode(), "
                "as generate() does)")
    if h.device.type != "cpu" or h.dtype not in (torch.float32, torch.bfloat16):
        return f"hidden states on {h.device} in {h.dtype} (CPU float32 / bfloat16 only)"
    S = h.shape[1]
    if position_ids is None or position_ids.shape[-1] != S or \
            position_ids.reshape(-1, S).shape[0] not in (1, h.shape[0]):
        return "no position_ids of shape [B or 1, S]"
    if st.pad_mask is not None:
        past = past_key_values.get_seq_length(m.layer_idx) if past_key_values is not None else 0
        if st.pad_mask.shape != (h.shape[0], past + S):
            return (f"a 2-D attention mask of shape {tuple(st.pad_mask.shape)} for "
                    f"{past} cached + {S} new tokens")
    return None


def _make_forward(st, m):
    torch = _torch()
    orig = type(m).forward

    def forward(hidden_states, position_embeddings, position_ids, attention_mask,
                past_key_values=None, **kwargs):
        # transformers 5.24 names the cache `cache` (`past_key_values` stays an alias)
        if "cache" in kwargs:
            c = kwargs.pop("cache")
            past_key_values = c if past_key_values is None else past_key_values
        reason = _layer_reason(st, m, hidden_states, position_ids, past_key_values, kwargs)
        if reason is not None:
            if st.mask_skipped:
                raise RuntimeError(f"deepseek_csa.transformers: layer {m.layer_idx} cannot "
                                   f"run swapped ({reason}) after the dense mask was skipped")
            st.warn(reason)
            return orig(m, hidden_states, position_embeddings, position_ids, attention_mask,
                        past_key_values, **kwargs)
        with torch.no_grad():
            return _attention(st, m, hidden_states, position_embeddings, position_ids,
                              past_key_values), None

    forward._deepseek_csa = True
    return forward


def _attention(st, m, h, position_embeddings, position_ids, cache):
    torch = _torch()
    B, S, _ = h.shape
    H, D = m.num_heads, m.head_dim
    pos = _positions(position_ids, S)
    cos_t, sin_t = position_embeddings[m.rope_layer_type]
    cos, sin = _f32np(cos_t.reshape(-1, S, cos_t.shape[-1])), \
        _f32np(sin_t.reshape(-1, S, sin_t.shape[-1]))
    if cos.shape[0] > 1 and pos.shape[0] > 1 and (pos == pos[:1]).all():
        cos, sin, pos = cos[:1], sin[:1], pos[:1]        # one table shared by every row
    rd = 2 * cos.shape[-1]
    eps = m.q_a_norm.variance_epsilon

    qr = m.q_a_proj(h)
    _dc.rms_norm(qr, m.q_a_norm.weight.detach().float(), eps, out=qr)
    q = m.q_b_proj(qr).view(B, S, H, D)
    _dc.rms_norm(q, None, m.q_b_norm.eps, out=q)
    _rope_rows(q[..., D - rd:], cos, sin)

    kv = m.kv_proj(h)
    _dc.rms_norm(kv, m.kv_norm.weight.detach().float(), m.kv_norm.variance_epsilon, out=kv)
    _rope_rows(kv[..., D - rd:], cos, sin)
    qat_kv = _qat_kv if st.qat else None
    if qat_kv is not None:
        qat_kv(kv, rd)

    layer = None
    if cache is not None:
        if m.compressor is not None:
            layer = _adopt_layer(cache, m.layer_idx)
        rows = cache.update(kv.unsqueeze(1), kv.unsqueeze(1), m.layer_idx)[0][:, 0]
    else:
        rows = kv
    L = rows.shape[1] - S
    win = _window_idx(S, L, m.sliding_window)
    if st.pad_mask is not None:
        # pad tokens are never keys of the window (transformers' 2-D mask); buffer row j
        # is token past - L + j of the mask
        keep = st.pad_mask[:, st.pad_mask.shape[1] - S - L:]          # [B, L + S]
        ok = (win >= 0)[None] & np.take_along_axis(
            keep[:, None, :], np.maximum(win, 0)[None].repeat(B, 0), axis=2)
        idx = [np.where(ok, win[None], -1).astype(np.int32)]
    else:
        idx = [np.broadcast_to(win, (B,) + win.shape)]
    kvbuf = rows
    comp = m.compressor
    if comp is not None:
        entries = _compress(comp, layer, "compressor", h, comp.__class__.__name__.endswith(
            "CSACompressor"), qat_kv)
        T = entries.shape[1]
        off = L + S
        if T:
            kvbuf = torch.cat([rows, entries.to(rows.dtype)], dim=1)
        if hasattr(comp, "indexer"):
            ix = comp.indexer
            qfn = (lambda x, rd_: _qat_index(x)) if st.qat else None
            keys = _compress(ix, layer, "indexer", h, True, qfn)
            if T:
                qi = ix.q_b_proj(qr).view(B, S, ix.num_heads, ix.head_dim)
                _rope_rows(qi[..., ix.head_dim - rd:], cos, sin)
                if st.qat:
                    _qat_index(qi)
                w = ix.scorer.weights_proj(h).float() * (ix.scorer.weights_scaling
                                                         * ix.scorer.softmax_scale)
                keys = keys.to(qi.dtype)
                sel = _index_select(qi, keys, w, ix.index_topk, comp.compress_rate, pos, off)
                idx.append(sel)
                del qi, w       # [S, Hi, Di] is freed before the attention allocates
        elif T:
            # transformers' HCA: a decode step (S == 1) sees every entry, a longer call
            # the entries its positions allow
            vis = np.full((1, S), T) if S == 1 else _visible(pos, comp.compress_rate, T)
            a = _all_idx(vis, off)
            idx.append(np.broadcast_to(a, (B,) + a.shape[1:]) if a.shape[0] == 1 else a)
    idx = np.ascontiguousarray(np.concatenate(idx, axis=-1)) if len(idx) > 1 else \
        np.ascontiguousarray(idx[0])
    o = torch.empty((B, S, H, D), dtype=q.dtype)
    _dc.sparse_attn(q, kvbuf.contiguous() if kvbuf.stride(-1) != 1 else kvbuf,
                    m.sinks.detach().float().contiguous(), idx, float(m.scaling), out=o)
    del q, qr, kvbuf    # peak memory: q [S, H, D] goes before the output projections
    _rope_rows(o[..., D - rd:], cos, sin, inverse=True)
    grouped = m.o_a_proj(o.view(B, S, m.config.o_groups, -1)).flatten(2)
    return m.o_b_proj(grouped)


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
            elif not bool(am.bool().all()):
                pad = am.detach().to("cpu").bool().numpy()
        if reason is None and (bound.get("output_attentions") or
                               getattr(cfg, "output_attentions", False)):
            reason = "output_attentions"
        if reason is None and base.training:
            reason = "the model is in training mode"
        if reason is None and torch.is_grad_enabled():
            emb = bound.get("inputs_embeds")
            if (emb.requires_grad if emb is not None else
                    base.embed_tokens.weight.requires_grad):
                reason = ("autograd is enabled (run under torch.no_grad() or "
                          "torch.inference_mode(), as generate() does)")
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
            elif st.all_layers:
                skip = base.embed_tokens.weight.device.type == "cpu"
        prev = (st.call_reason, st.mask_skipped, st.pad_mask)
        st.call_reason, st.mask_skipped = reason, skip
        st.pad_mask = pad if reason is None else None
        try:
            if reason is not None:
                st.warn(reason)
            elif skip:
                kwargs = {k: v for k, v in bound.items()}
                kwargs["attention_mask"] = {"deepseek_csa: no dense mask": None}
                return orig(base, **kwargs)
            return orig(base, *args, **kwargs)
        finally:
            st.call_reason, st.mask_skipped, st.pad_mask = prev

    forward._deepseek_csa = True
    return forward


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
    base.forward = _make_model_forward(st, base)
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
    for attn in mods:
        if getattr(attn.__dict__.get("forward"), "_deepseek_csa", False):
            del attn.forward
    if getattr(base.__dict__.get("forward"), "_deepseek_csa", False):
        del base.forward
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
