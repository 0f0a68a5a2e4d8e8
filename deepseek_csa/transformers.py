"""Hugging Face transformers bridge: run ``DeepseekV4Attention`` layers of a
``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` (transformers 5.23 - 5.25) through deepseek_csa.

    import deepseek_csa.transformers as dch
    with torch.no_grad(), dch.swapped(model):          # every attention layer
        out = model.generate(ids, max_new_tokens=64)
    dch.swap(model, layers=[1, 3]); ...; dch.unswap(model)

torch and transformers are imported lazily; only the transformers releases in
``SUPPORTED_VERSIONS`` (5.23.0, 5.24.0, 5.25.0) and patch releases of their series are
accepted, other versions raise ``RuntimeError`` naming both (the modeling code of this
young model still changes between releases, and equivalence is only tested there; ``make
test-hf-versions`` runs the bridge tests under each).  5.24 names the cache argument
``cache`` (``past_key_values`` is its deprecated alias): both are accepted.  5.25 renames
the unweighted norms' ``eps`` ``variance_epsilon`` (read whichever the module has) and
opens assisted decoding to models whose cache can be cropped (below).

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
The swapped layers' hyper-connections (``attn_hc`` / ``ffn_hc``) split their mixes with
``hc_split_sinkhorn`` (one C call for the pre / post weights and the Sinkhorn comb).

``quantize(model)`` (independent of the swap) puts the projections the released
checkpoint stores as FP8 back on FP8 codes and the routed experts on FP4 codes
(``deepseek_csa.torch.FP8Linear`` / ``FP4Experts``), computed as the released model.py's
Linear computes them (activations rounded to e4m3 per 128 in front of each GEMM): 2.8x
less weight memory, and decode reads 2-4x fewer bytes (docs/layers.md, "FP8 / FP4
weights").

State lives where transformers keeps it: window rows in the model's cache layer
(``DynamicSlidingWindowLayer`` or the CSA/HCA layer's own window), the compressor's
buffers, overlap rows and compressed entries in the same fields of the CSA/HCA cache
layers, whose class is switched on first use to our subclasses ``CSACacheLayer`` /
``HCACacheLayer`` (same fields, so a layer can be unswapped mid-generation and
transformers' own forward continues from our state, and vice versa).  Ours add ``crop``
(after ``activate_past_recording()``, as for transformers' sliding layers) and keep
``reset`` / ``reorder_cache`` (beam search) working.  Chunked prefill (a multi-token
call at ``start_pos > 0``) and ``generate()`` from ``past_key_values`` work.

Assisted decoding (``generate(assistant_model=...)``, prompt lookup): 5.23 / 5.24 refuse
it for the model class.  5.25 runs it when every layer of the main model's cache can be
cropped (``is_croppable``: ours can, transformers' own CSA/HCA layers cannot), so with
every compressed layer swapped it gives greedy decoding's tokens, and with one unswapped
transformers refuses after the prefill.  transformers crops an assistant's cache
unchecked, so a swapped model's ``generate`` refuses (``ValueError``) a DeepseekV4
assistant whose compressed layers are not swapped too (docs/transformers.md).

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
and HCA layers, any subset of layers, and training: inference and training are one path,
every kernel a ``torch.ops.deepseek_csa`` operator (``rms_norm``, ``apply_rope``,
``gated_pool``, ``index_topk``, ``sparse_attn``, ...) called through
``deepseek_csa.torch.ops.call``, so with autograd recording ``loss.backward()`` runs on
our backward kernels (QAT roundings straight-through; the indexer's selection discrete,
no gradient), padded batches and per-row positions train as they infer, and a swapped
model compiles (``torch.compile``, no graph break of ours, ``fullgraph=True`` for a
layer) and exports (``torch.export``, non-strict; docs/transformers.md).  ``capture_indexer(model)`` hands back, per CSA layer, the indexer's q / k /
weights (from inputs detached from the main graph), its selection and the attention
target, for ``deepseek_csa.torch.indexer_kl_loss`` (docs/layers.md, "Training through
the transformers swap").

Padded batches reproduce transformers' eager semantics (docs/transformers.md): pad tokens
are masked out as keys of the sliding window only; the compressors pool them into the
compressed entries like any token (windows of ``ratio`` tokens by index, entry ``g`` at
RoPE position ``g * ratio``); a query sees the entries ``t < (position + 1) // ratio``
of its own position id (HCA decode steps see every entry, as in eager); RoPE of queries,
KV rows and indexer queries uses each row's positions.  The 2-D mask goes to the layers
as it is (never the dense [B, 1, S, L+T] mask when every layer is swapped).

Falls back to transformers' own forward (one warning per reason, never silently wrong):
a prebuilt 4-D / dict mask, a 2-D mask whose length is not cached + new tokens, position
ids not of shape [B or 1, S], attention dropout in training mode, autograd with a build
lacking the differentiable ops, ``output_attentions``, ``capture_indexer`` with a padded
batch or per-row / non-contiguous positions (its records take one start position),
tensors not on the CPU or not float32 / bfloat16.

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


__all__ = ["SUPPORTED_VERSIONS", "swap", "unswap", "swapped", "is_swapped", "quantize",
           "capture_indexer", "IndexerCapture", "IndexerRecord",
           "CSACacheLayer", "HCACacheLayer"]

# The transformers releases whose DeepseekV4 modeling code the bridge is tested against
# (`make test-hf-versions` runs the bridge tests on each, in its own environment).  A
# release in the same major.minor series as one of these (a patch release) is accepted
# too.  The next release: add it here and to pyproject's range, run the target.
SUPPORTED_VERSIONS = ("5.23.0", "5.24.0", "5.25.0")

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
    """The cache layer at idx, its class switched to ours (same fields: lossless).
    Not while torch.compile traces (it cannot reassign ``__class__``): a layer first
    met there keeps transformers' class -- the attention reads the same fields -- and
    gets ours (``crop``, the past recording) on its first eager call."""
    hca, csa = _cache_classes()
    layer = cache.layers[idx]
    if isinstance(layer, (hca, csa)) or _torch().compiler.is_compiling():
        return layer
    mdl = _check_version()
    if type(layer) is mdl.DeepseekV4CSACache:
        layer.__class__ = csa
    elif type(layer) is mdl.DeepseekV4HCACache:
        layer.__class__ = hca
    return layer


# ----------------------------------------------------------------------------- helpers
def _norm_eps(norm):
    """The epsilon of an RMSNorm module: transformers 5.25 renamed the unweighted norm's
    ``eps`` (``q_b_norm``, the hyper-connections' ``input_norm``) ``variance_epsilon``,
    the weighted norms' name."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


# Every kernel below is a deepseek_csa operator called through deepseek_csa.torch.ops.call:
# in plain eager inference (nothing to record) that is the C kernel itself, with no
# dispatcher in between; under autograd, torch.compile or torch.export it is the
# registered operator (its autograd formula, fake kernel), so the one path below serves
# inference, training, compilation and export.  The index lists are torch ops over the
# shapes and the position tensors (no NumPy, no Python branch on tensor values).
_OPS = []


def _call(name, *args):
    """deepseek_csa::<name> through ``ops.call`` (every schema argument, in order)."""
    if not _OPS:
        from .torch import ops
        _OPS.append(ops)
    return _OPS[0].call(name, *args)


def _records(*ts):
    """True when autograd records an op on these tensors."""
    torch = _torch()
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _f32(t):
    torch = _torch()
    return t if t.dtype == torch.float32 else t.float()


def _rope(x, cos, sin, inverse=False):
    """RoPE on the last 2 * cos.shape[-1] features of x [B, S, ...] with the tables
    cos / sin float32 [Bp, S, r] (Bp = 1: shared by every row, else one per row).  x must
    be a fresh result nothing else reads (a projection or an operator's output): without
    autograd to record it is rotated in place (``apply_rope_``), with it the functional
    ``apply_rope`` returns a rotated copy."""
    torch = _torch()
    B, S = x.shape[0], x.shape[1]
    rows = cos.shape[0] > 1
    if rows and x.stride(0) == S * x.stride(1):
        # one row per (b, s): x viewed as [1, B * S, ...] against the [B * S, r] tables,
        # one call instead of B (~10 us each at decode)
        cos, sin = cos.reshape(1, B * S, -1), sin.reshape(1, B * S, -1)
        y = _rope(x.view((1, B * S) + tuple(x.shape[2:])), cos, sin, inverse)
        return y.view(x.shape)
    if _records(x):
        if not rows:
            return _call("apply_rope", x, cos[0], sin[0], inverse)
        return torch.cat([_call("apply_rope", x[b:b + 1], cos[b], sin[b], inverse)
                          for b in range(B)], dim=0)
    if not rows:
        _call("apply_rope_", x, cos[0], sin[0], inverse)
    else:
        for b in range(B):
            _call("apply_rope_", x[b:b + 1], cos[b], sin[b], inverse)
    return x


def _norm(x, weight, eps):
    """rms_norm with the module's weight (float32, as the kernel reads it; None: none)."""
    return _call("rms_norm", x, None if weight is None else _f32(weight), eps)


def _rope_tables(position_embeddings, m, S):
    """float32 cos / sin [Bp, S, rd/2] of the layer's RoPE type (Bp = 1 or the batch)."""
    cos_t, sin_t = position_embeddings[m.rope_layer_type]
    return (_f32(cos_t.detach().reshape(-1, S, cos_t.shape[-1])),
            _f32(sin_t.detach().reshape(-1, S, sin_t.shape[-1])))


def _visible(pos, ratio, T):
    """Compressed entries each query sees (transformers: t < (position + 1) // ratio),
    clamped to [0, T].  pos: int64 [Bp, S] position ids."""
    return ((pos + 1) // ratio).clamp(0, T)


def _all_idx(vis, T, offset):
    """Every entry t < vis[b, s] (vis: [Bp, S]) as t + offset, -1 padded: [Bp, S, T]."""
    torch = _torch()
    t = torch.arange(T, dtype=torch.int32)
    return torch.where(t < vis[..., None], t + offset, -1).to(torch.int32)


def _window_lists(pad, B, S, L, W):
    """The window part of the index lists, int32 [B, S, min(W, L + S)]: query s
    (absolute start + s) over the rows of [L cached rows | S new rows], rows
    s + L - W + 1 .. s + L, ascending, -1 padded; with the call's 2-D mask (``pad``, bool
    [B, past + S]) its pad tokens dropped as keys (transformers' 2-D mask masks them in
    the sliding window only)."""
    torch = _torch()
    width = min(W, L + S)
    if S == 1:
        # a decode step: rows L + 1 - width .. L (one op: the general case's ten small
        # torch ops cost ~45 us a layer, measured, more than the step's attention)
        win = torch.arange(L + 1 - width, L + 1).view(1, width)
    else:
        s = torch.arange(S)[:, None]
        j = (s + (L - W + 1)).clamp(min=0) + torch.arange(width)[None, :]
        win = torch.where(j <= s + L, j, -1)                   # int64 [S, width]
    if pad is None:
        return win.to(torch.int32).expand(B, S, width)
    # buffer row j is token past - L + j of the mask
    keep = pad[:, pad.shape[1] - S - L:]                          # [B, L + S]
    ok = torch.gather(keep[:, None, :].expand(B, S, L + S), 2,
                      win.clamp(min=0)[None].expand(B, S, width)) & (win >= 0)
    return torch.where(ok, win, -1).to(torch.int32)


def _hca_lists(pos, B, S, ratio, T, off):
    """HCA lists [B, S, T]: transformers' HCA lets a decode step (S == 1) see every
    entry, a longer call the entries its (per-row) positions allow."""
    torch = _torch()
    if S == 1:
        return torch.arange(off, off + T, dtype=torch.int32).expand(B, 1, T)
    return _all_idx(_visible(pos, ratio, T), T, off).expand(B, S, T)


def _index_select(qi, keys, w, topk, ratio, pos, start, off):
    """The indexer's top-k lists [B, S, min(topk, T)] (entries as t + off, -1 padded):
    query (b, s) sees the entries t < min(T, (pos[b, s] + 1) // ratio), as transformers'
    indexer.  ``start`` (a Python int, or None): every row's positions are known to be
    start .. start + S - 1 (the cache's count; the model made the positions), so the
    kernel's own causal limit is the visibility.  Otherwise any per-query positions:
    the visibility goes in as ``candidates`` of block size 1, with a start position at
    which every entry is causally visible (the keys padded with unselectable rows so
    the last query's limit stays within them)."""
    torch = _torch()
    B, S = qi.shape[0], qi.shape[1]
    T = keys.shape[1]
    if start is not None:
        return _call("index_topk", qi, keys, w, topk, ratio, start, off, "score", None, 0)
    extra = (S - 1) // ratio
    if extra:
        keys = torch.cat([keys, keys.new_zeros((B, extra, keys.shape[2]))], dim=1)
    t = torch.arange(T + extra)
    cand = (t < _visible(pos, ratio, T)[..., None]).expand(B, S, T + extra).contiguous()
    sel = _call("index_topk", qi, keys, w, topk, ratio, T * ratio - 1, off, "score", cand, 1)
    return sel[..., :min(topk, T)]


def _qat_kv(x, rd):
    """model.py's FP8 rounding of KV rows / entries in front of the rope tail
    (straight-through under autograd)."""
    torch = _torch()
    D = x.shape[-1]
    return torch.cat([_call("fp8_round", x[..., :D - rd], 64, "ue8m0"), x[..., D - rd:]],
                     dim=-1)


def _qat_index(x, rd=None):
    """model.py's indexer rounding: Hadamard rotation, then FP4 in blocks of 32."""
    return _call("fp4_round", _call("hadamard", x, None), 32, "ue8m0")


def _cached_rows(m, cache, kv):
    """(the layer's compressor cache or None, every KV row so far): the new rows kv
    [B, S, D] appended to the cache's sliding-window buffer when there is a cache."""
    if cache is None:
        return None, kv
    layer = _adopt_layer(cache, m.layer_idx) if m.compressor is not None else None
    return layer, cache.update(kv.unsqueeze(1), kv.unsqueeze(1), m.layer_idx)[0][:, 0]


def _compression_windows(mod, layer, name, h):
    """A compressor's projections of the new tokens and the complete windows to pool:
    (kv, windows' kv, windows' gate, the first window's index, window count).  Without
    a cache the trailing partial window is left out; with one, the cache layer joins
    its buffered tokens (transformers' store_compression_weights)."""
    ratio = mod.compress_rate
    kv = mod.kv_proj(h)
    gate = mod.gate_proj(h)
    if layer is None:
        usable = (kv.shape[1] // ratio) * ratio
        ckv, cgate, first = kv[:, :usable], gate[:, :usable], 0
    else:
        ckv, cgate, first = layer.store_compression_weights(name, kv, gate)
    return kv, ckv, cgate, first, ckv.shape[1] // ratio


def _compress(mod, layer, name, h, overlap, qat_fn):
    """One compressor call (transformers' CSA/HCA compressor or the indexer's) at any
    start position: buffered + new tokens, complete windows pooled by ``gated_pool``
    (the scores with ``position_bias`` added as transformers adds it; the previous
    call's last window prepended as a group whose entry is dropped, for the overlap),
    then RMSNorm and RoPE at ``g * ratio``.  Returns all entries so far."""
    torch = _torch()
    B = h.shape[0]
    ratio, D = mod.compress_rate, mod.head_dim
    kv, ckv, cgate, first, n = _compression_windows(mod, layer, name, h)
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
        pooled = _call("gated_pool", ckv, score, ratio, None, overlap)
        new = _norm(pooled[:, drop:] if drop else pooled, mod.kv_norm.weight,
                    mod.kv_norm.variance_epsilon)
        pos = (torch.arange(n) * ratio + first).unsqueeze(0)
        cos, sin = mod.rotary_emb(new, position_ids=pos, layer_type="compress")
        rd = 2 * cos.shape[-1]
        new = _rope(new, _f32(cos), _f32(sin))
        if qat_fn is not None:
            new = qat_fn(new, rd)
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
        self.pad_mask = None         # bool [B, past + S]: the call's 2-D attention mask
        self.arange_positions = False  # the call's positions are the model's arange
        self.warned = set()
        self.capture = None          # an IndexerCapture while capture_indexer is active

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
    if m.training and m.attention_dropout:
        return f"attention dropout {m.attention_dropout} in training mode"
    if _needs_grad(m, h):
        missing = _missing_grad_ops()
        if missing:
            return _missing_reason(missing)
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
    if st.capture is not None and m.compressor is not None and \
            hasattr(m.compressor, "indexer"):
        r = _capture_reason(st.pad_mask, position_ids, S)
        if r is not None:
            return r
    return None


def _capture_reason(pad, position_ids, S):
    """capture_indexer's records take one start position (the KL loss's ``start_pos``):
    a padded batch or positions that differ per row / are not one arange fall back."""
    if pad is not None:
        return "capture_indexer with a padded batch (2-D attention mask with zeros)"
    if position_ids is not None:
        torch = _torch()
        p = position_ids.detach().reshape(-1, S)
        if not bool((p == p[:1, :1] + torch.arange(S)).all()):
            return "capture_indexer with position ids that differ per row or skip"
    return None


def _hc_modules(layer):
    return [h for h in (getattr(layer, "attn_hc", None), getattr(layer, "ffn_hc", None))
            if h is not None and hasattr(h, "hc_sinkhorn_iters")]


def _make_hc_forward(st, hc):
    """A swapped layer's hyper-connections (``attn_hc`` / ``ffn_hc``): transformers' norm
    and projection, then the pre / post / Sinkhorn comb split by ``hc_split_sinkhorn``
    (one C call instead of ~60 small torch ops: 0.74 -> 0.17 ms a call at V4-Flash width,
    decode, 2 threads, Zen 4).  The same formulas; the sums' order differs (float
    rounding, 6e-8 of comb).  With autograd recording (the operator has no gradient), or
    when the whole call falls back (st.call_reason), transformers' own forward."""
    torch = _torch()
    orig = type(hc).forward

    def forward(hidden_streams):
        if st.call_reason is not None or hidden_streams.device.type != "cpu" or \
                torch.is_grad_enabled() and (hidden_streams.requires_grad or any(
                    p.requires_grad for p in hc.parameters())):
            return orig(hc, hidden_streams)
        B, S = hidden_streams.shape[:2]
        h = hc.hc_mult
        with torch.no_grad():
            flat = hc.input_norm(hidden_streams.view(B, S, -1).float())
            mixes = torch.nn.functional.linear(flat, hc.fn.float())
            pre, post, comb = _call("hc_split_sinkhorn", mixes, _f32(hc.scale), _f32(hc.base),
                                    h, hc.hc_sinkhorn_iters, float(hc.hc_eps))
            collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
        return post, comb, collapsed

    forward._deepseek_csa = True
    return forward


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
        if _needs_grad(m, hidden_states):
            return _attention(st, m, hidden_states, position_embeddings, position_ids,
                              past_key_values, True), None
        grad_mode = torch.is_grad_enabled()      # the capture's indexer tensors use it
        with torch.no_grad():
            return _attention(st, m, hidden_states, position_embeddings, position_ids,
                              past_key_values, grad_mode), None

    forward._deepseek_csa = True
    return forward


# ----------------------------------------------------------------------------- attention
# The differentiable functions of deepseek_csa.torch (docs/kernels.md section 11): a
# build without them falls back in training, and capture_indexer (whose records'
# loss() is deepseek_csa.torch.indexer_kl_loss) refuses.
_GRAD_MAIN = ("sparse_attn_weights", "gated_pool")
# Training memory: autograd would keep four [B, S, H, D] tensors per swapped layer (the
# query projection for the norm's backward, the rotated query and the attention output
# for sparse_attn's, the de-rotated output for o_a_proj's); with this on, the per-head
# norm -> RoPE -> sparse_attn -> inverse RoPE segment is recomputed in the backward
# (torch.utils.checkpoint), so two are kept.  The recompute costs one sparse-attention
# forward, small next to the layer's projections.
CHECKPOINT_ATTENTION = True
_GRAD_ALL = ("sparse_attn_weights", "gated_pool", "index_scores", "indexer_kl_loss")


def _dct():
    import deepseek_csa.torch as dct
    return dct


def _missing_grad_ops(names=_GRAD_MAIN):
    try:
        dct = _dct()
    except ImportError:   # pragma: no cover
        return list(names)
    return [n for n in names if not hasattr(dct, n)]


def _missing_reason(missing):
    return ("autograd is enabled and this build of deepseek_csa.torch has no "
            f"differentiable ops ({', '.join(missing)} missing): run under torch.no_grad() "
            "or update deepseek_csa")


def _needs_grad(m, h):
    """True when autograd must record this attention call: grad enabled and the input or
    a parameter of the main path requires grad (the indexer's parameters do not count:
    its selection is discrete, it learns only through capture_indexer's KL loss)."""
    torch = _torch()
    if not torch.is_grad_enabled():
        return False
    if h.requires_grad:
        return True
    comp = m.compressor
    skip = {id(p) for p in comp.indexer.parameters()} if (
        comp is not None and hasattr(comp, "indexer")) else set()
    return any(p.requires_grad and id(p) not in skip for p in m.parameters())


def _indexer_select(st, m, layer, h, qr, cos, sin, pos, start, off, T):
    """The indexer's selection (callers detach its inputs: it is discrete): its
    compressor call (always: it keeps the cache state), then the top-k lists at
    ``offset=off`` ([B, S, K] int32, see ``_index_select``), None while there is no
    entry."""
    comp = m.compressor
    ix = comp.indexer
    B, S, _ = h.shape
    keys = _compress(ix, layer, "indexer", h, True, _qat_index if st.qat else None)
    if not T:
        return None
    qi = _rope(ix.q_b_proj(qr).view(B, S, ix.num_heads, ix.head_dim), cos, sin)
    if st.qat:
        qi = _qat_index(qi)
    w = ix.scorer.weights_proj(h).float() * (ix.scorer.weights_scaling
                                             * ix.scorer.softmax_scale)
    return _index_select(qi, keys.to(qi.dtype), w, ix.index_topk, comp.compress_rate, pos,
                         start, off)


def _indexer_inputs(h, qr):
    """The indexer's inputs cut from the main graph (it learns only from its KL loss)."""
    return h.detach(), qr.detach()


def _indexer_capture(st, m, layer, h, qr, cos, sin, pos, off, T, grad_mode):
    """The indexer under capture_indexer: q / k / weights computed by the operators
    from the *detached* hidden states and query residual (the indexer learns only from
    its KL loss), the selection from their values, recorded for the layer.  The
    positions are one row, one arange (``_layer_reason`` falls back otherwise: the KL
    loss takes one ``start_pos``)."""
    torch = _torch()
    comp = m.compressor
    ix = comp.indexer
    B, S, _ = h.shape
    start = int(pos[0, 0]) if pos.numel() else 0
    with torch.set_grad_enabled(grad_mode):
        hd, qrd = _indexer_inputs(h, qr)
        keys = _compress(ix, layer, "indexer", hd, True, _qat_index if st.qat else None)
        if not T:
            return None, None
        qi = _rope(ix.q_b_proj(qrd).view(B, S, ix.num_heads, ix.head_dim), cos, sin)
        if st.qat:
            qi = _qat_index(qi)
        w = ix.scorer.weights_proj(hd).float() * (ix.scorer.weights_scaling
                                                  * ix.scorer.softmax_scale)
        keys = keys.to(qi.dtype)
    with torch.no_grad():
        sel = _index_select(qi.detach(), keys.detach(), w.detach(), ix.index_topk,
                            comp.compress_rate, pos, start, off)
    sel_pos = torch.where(sel >= 0, sel - off, -1).to(torch.int32)
    rec = IndexerRecord(m.layer_idx, qi, keys, w, sel_pos, comp.compress_rate, start)
    st.capture._layers[m.layer_idx] = rec
    return sel, rec


def _capture_target(st, m, rec, q, kvbuf, idx, pos, off, T):
    """The record's attention targets from the main attention's own inputs (no grad):
    sparse_attn_weights over the layer's lists (window + selected entries; the selected
    slots are the last K), and with ``dense=True`` over window + every visible entry."""
    torch = _torch()
    B, S = idx.shape[0], idx.shape[1]
    K = rec.topk_idxs.shape[-1]
    qd, kd = q.detach(), kvbuf.detach()
    sink = _f32(m.sinks.detach()).contiguous()
    with torch.no_grad():
        w = _call("sparse_attn_weights", qd, kd, sink, idx, float(m.scaling))
        rec.attn_target = w[..., idx.shape[-1] - K:].float().contiguous()
        if st.capture.dense:
            win = idx[..., :idx.shape[-1] - K]
            a = _all_idx(_visible(pos, rec.ratio, T), T, off)
            full = torch.cat([win, a.expand(B, S, T)], dim=-1).contiguous()
            wd = _call("sparse_attn_weights", qd, kd, sink, full,
                       float(m.scaling))[..., win.shape[-1]:]
            dense = torch.zeros((B, S, T), dtype=torch.float32)
            dense[..., :wd.shape[-1]] = wd
            rec.dense_target = dense


def _attention(st, m, h, position_embeddings, position_ids, cache, grad_mode=False):
    """A swapped layer's attention, for inference and training alike: the projections
    are the module's own, everything else the deepseek_csa operators (autograd records
    them when it records this call: backward on our kernels), the index lists torch ops.
    The indexer's selection is discrete and computed without autograd.  Padded batches
    and per-row positions: pad keys dropped from the window, per-row visibility and
    RoPE tables.  ``grad_mode`` is the caller's grad mode (the tensors an indexer
    capture keeps)."""
    torch = _torch()
    B, S, _ = h.shape
    H, D = m.num_heads, m.head_dim
    cos, sin = _rope_tables(position_embeddings, m, S)
    rd = 2 * cos.shape[-1]
    pos = position_ids.reshape(-1, S)
    # positions the model made from the cache's count (no position ids given): every
    # row's are past .. past + S - 1, a Python int the cache tracks
    start = None
    if st.arange_positions:
        start = cache.get_seq_length(m.layer_idx) if cache is not None else 0

    qr = _norm(m.q_a_proj(h), m.q_a_norm.weight, m.q_a_norm.variance_epsilon)
    q_pre = m.q_b_proj(qr).view(B, S, H, D)
    kv = _rope(_norm(m.kv_proj(h), m.kv_norm.weight, m.kv_norm.variance_epsilon), cos, sin)
    qat_kv = _qat_kv if st.qat else None
    if qat_kv is not None:
        kv = qat_kv(kv, rd)

    layer, rows = _cached_rows(m, cache, kv)
    L = rows.shape[1] - S
    idx = [_window_lists(st.pad_mask, B, S, L, m.sliding_window)]
    kvbuf = rows
    rec = None
    off = T = 0
    comp = m.compressor
    if comp is not None:
        entries = _compress(comp, layer, "compressor", h,
                            comp.__class__.__name__.endswith("CSACompressor"), qat_kv)
        T = entries.shape[1]
        off = L + S
        if T:
            kvbuf = torch.cat([rows, entries.to(rows.dtype)], dim=1)
        if hasattr(comp, "indexer"):
            if st.capture is not None:
                sel, rec = _indexer_capture(st, m, layer, h, qr, cos, sin, pos, off, T,
                                            grad_mode)
            else:
                with torch.no_grad():
                    sel = _indexer_select(st, m, layer, h.detach(), qr.detach(), cos, sin,
                                          pos, start, off, T)
            if sel is not None:
                idx.append(sel)
        elif T:
            idx.append(_hca_lists(pos, B, S, comp.compress_rate, T, off))
    idx = (torch.cat(idx, dim=-1) if len(idx) > 1 else idx[0]).contiguous()
    kvbuf = kvbuf.contiguous()

    def query(q_pre):
        return _rope(_norm(q_pre, None, _norm_eps(m.q_b_norm)), cos, sin)

    def core(q_pre, kvbuf, sinks):
        """Per-head norm, RoPE, sparse attention, the output's inverse RoPE."""
        o, _ = _call("sparse_attn", query(q_pre), kvbuf, _f32(sinks).contiguous(), idx,
                     float(m.scaling))
        return _rope(o, cos, sin, inverse=True)

    if rec is not None:
        with torch.no_grad():
            _capture_target(st, m, rec, query(q_pre.detach()), kvbuf, idx, pos, off, T)
    if CHECKPOINT_ATTENTION and _records(q_pre, kvbuf, m.sinks):
        # keep q_pre and the rows only; the [S, H, D] norm / RoPE / attention results are
        # recomputed in the backward (bitwise the same: the kernels are deterministic)
        from torch.utils.checkpoint import checkpoint
        o = checkpoint(core, q_pre, kvbuf, m.sinks, use_reentrant=False)
    else:
        o = core(q_pre, kvbuf, m.sinks)
    del q_pre, qr, kvbuf    # peak memory: q [S, H, D] goes before the output projections
    grouped = m.o_a_proj(o.reshape(B, S, m.config.o_groups, -1)).flatten(2)
    return m.o_b_proj(grouped)

class IndexerRecord:
    """What one CSA layer's last forward used, for the indexer's KL objective:

    - ``q`` [B, S, Hi, Di], ``k`` [B, Tc, Di], ``weights`` [B, S, Hi] float32: the
      indexer's queries (after RoPE), compressed keys (all Tc entries so far) and head
      weights (scaled as the scorer does), computed from inputs detached from the main
      graph: they carry gradient to the indexer's own parameters only;
    - ``topk_idxs`` [B, S, K] int32: the selected entries (compressed positions, -1 =
      none), no gradient;
    - ``attn_target`` [B, S, K] float32: the main attention's probability at each
      selected slot summed over heads (``sparse_attn_weights``), no gradient;
    - ``dense_target`` [B, S, Tc] float32 (only under ``capture_indexer(dense=True)``):
      the same over every visible entry, from the attention over window + all of them;
    - ``ratio``, ``start_pos``, ``layer`` (the decoder layer index).
    """

    __slots__ = ("layer", "q", "k", "weights", "topk_idxs", "attn_target", "dense_target",
                 "ratio", "start_pos")

    def __init__(self, layer, q, k, weights, topk_idxs, ratio, start_pos):
        self.layer, self.q, self.k, self.weights = layer, q, k, weights
        self.topk_idxs, self.ratio, self.start_pos = topk_idxs, ratio, start_pos
        self.attn_target = self.dense_target = None

    def loss(self, dense=False):
        """``deepseek_csa.torch.indexer_kl_loss`` of this layer: the sparse stage (the
        selected set), or with ``dense=True`` the warm-up over every visible entry."""
        dct = _dct()
        if dense:
            if self.dense_target is None:
                raise RuntimeError("IndexerRecord.loss(dense=True) needs "
                                   "capture_indexer(model, dense=True)")
            return dct.indexer_kl_loss(self.q, self.k, self.weights, None, self.dense_target,
                                       ratio=self.ratio, start_pos=self.start_pos)
        return dct.indexer_kl_loss(self.q, self.k, self.weights, self.topk_idxs,
                                   self.attn_target, ratio=self.ratio,
                                   start_pos=self.start_pos)


class IndexerCapture:
    """Handed out by ``capture_indexer``: ``layers`` (one ``IndexerRecord`` per swapped
    CSA layer that had compressed entries in the last forward, in layer order) and
    ``loss()`` (the sum of their KL losses)."""

    def __init__(self, dense=False):
        self.dense = bool(dense)
        self._layers = {}

    @property
    def layers(self):
        return [self._layers[i] for i in sorted(self._layers)]

    def loss(self, dense=None):
        """Sum over the recorded layers of ``indexer_kl_loss`` (``dense`` defaults to the
        capture's own setting)."""
        dense = self.dense if dense is None else bool(dense)
        recs = self.layers
        if not recs:
            raise RuntimeError("capture_indexer: no CSA layer with compressed entries ran "
                               "in the captured forward")
        total = recs[0].loss(dense)
        for r in recs[1:]:
            total = total + r.loss(dense)
        return total

    def clear(self):
        self._layers = {}


@contextlib.contextmanager
def capture_indexer(model, *, dense: bool = False):
    """``with capture_indexer(model) as cap: model(ids); loss = cap.loss()``.

    Every swapped CSA layer records, per forward (the last one wins), its indexer's
    q / k / weights -- computed through the differentiable ops from its inputs *detached*
    from the main graph, so ``cap.loss().backward()`` reaches only the indexers'
    parameters (as DeepSeek trains the indexer: it learns only from its KL loss, the
    model only from the LM loss) -- the selected indices and their attention target
    (``sparse_attn_weights``, no grad).  ``dense=True`` also records the warm-up target
    over every visible entry (``cap.loss()`` then is the dense KL).  The model is swapped
    for the block if it was not.  Grad mode is the caller's: freeze the rest of the model
    (``requires_grad_(False)``) and the main path runs on the inference kernels."""
    missing = _missing_grad_ops(_GRAD_ALL)
    if missing:
        raise RuntimeError(f"capture_indexer needs the differentiable ops of "
                           f"deepseek_csa.torch ({', '.join(missing)} missing in this build)")
    base = _base(model)
    own = not is_swapped(model)
    if own:
        swap(model)
    st = getattr(base, _ATTR)
    if st.capture is not None:
        raise RuntimeError("capture_indexer: this model is already being captured")
    cap = st.capture = IndexerCapture(dense)
    try:
        yield cap
    finally:
        st.capture = None
        if own:
            unswap(model)


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
            elif st.capture is None or not bool(am.bool().all()):
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
            elif st.capture is not None:
                reason = _capture_reason(pad, pos, S)
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


# ----------------------------------------------------------------------------- FP8 / FP4 weights
# The projections the released checkpoint stores as FP8 (e4m3, ue8m0 128 x 128 blocks),
# by transformers' module names; the routed experts are its FP4 ones.  The compressors
# (float32 in the release), the indexer's weights_proj, the router, the embedding and the
# head keep their weights.
_FP8_ATTN = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")
_FP8_MLP = ("gate_proj", "up_proj", "down_proj")


def quantize(model, layers: Optional[Iterable[int]] = None, *,
             own_memory: bool = True) -> dict:
    """Holds the chosen decoder layers' (None: all) projections as the released checkpoint
    holds them and computes them as the released model.py does: attention projections
    (``q_a_proj``, ``q_b_proj``, ``kv_proj``, the grouped ``o_a_proj``, ``o_b_proj``), the
    indexer's ``q_b_proj`` and the shared expert become ``deepseek_csa.torch.FP8Linear``,
    the routed experts ``FP4Experts`` (docs/layers.md, "FP8 / FP4 weights").  For
    inference (``torch.no_grad()``); independent of ``swap`` (either order), one-way (the
    float weights are dropped: that is the memory it saves).

    Exact for a model loaded from a released FP8 / FP4 checkpoint (transformers
    dequantizes it; the codes come back bit for bit); other float weights are rounded to
    FP8 / FP4, with one warning naming how many modules were.  The outputs differ from
    transformers' own by the activation's e4m3 rounding in front of each projection (the
    released Linear's).

    ``own_memory`` (default): afterwards every parameter and buffer left in float is
    copied into memory of its own.  transformers memory-maps the checkpoint and its
    parameters are views of that file: the map, and every page of it the quantization
    read, stayed resident while any view was alive (3.2 GB RSS on the 3-layer bench
    model; 1.1 GB after the copies).  Returns ``{"fp8": [module names], "fp4": [...],
    "rounded": [...], "bytes_before": n, "bytes_after": n}`` (the weights' bytes)."""
    from .torch.quantized import FP4Experts, FP8Linear
    base = _base(model)
    if not hasattr(base, "layers"):
        raise TypeError("quantize() takes a DeepseekV4ForCausalLM or DeepseekV4Model, got "
                        f"{type(model).__name__}")
    n = len(base.layers)
    chosen = list(range(n)) if layers is None else sorted({int(i) for i in layers})
    for i in chosen:
        if not 0 <= i < n:
            raise ValueError(f"quantize(): layer {i} out of range (the model has {n} layers)")
    report = dict(fp8=[], fp4=[], rounded=[], bytes_before=0, bytes_after=0)

    def nbytes(mod):
        return sum(t.numel() * t.element_size() for t in
                   list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)))

    # every replacement is built before any is made: a module that cannot be held as
    # FP8 / FP4 (a shape off the 128 blocks, a non-finite weight) raises with the model
    # untouched
    plan = []
    for i in chosen:
        layer, p = base.layers[i], f"layers.{i}."
        attn = layer.self_attn
        owners = [(attn, a, p + "self_attn." + a, "fp8") for a in _FP8_ATTN]
        indexer = getattr(getattr(attn, "compressor", None), "indexer", None)
        if indexer is not None:
            owners.append((indexer, "q_b_proj", p + "self_attn.compressor.indexer.q_b_proj",
                           "fp8"))
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            owners += [(shared, a, p + "mlp.shared_experts." + a, "fp8") for a in _FP8_MLP]
        if hasattr(layer.mlp, "experts"):
            owners.append((layer.mlp, "experts", p + "mlp.experts", "fp4"))
        for owner, attr, name, kind in owners:
            old = getattr(owner, attr)
            if isinstance(old, (FP8Linear, FP4Experts)):
                continue
            try:
                new = (FP4Experts.from_experts(old) if kind == "fp4" else
                       FP8Linear.from_linear(old, groups=getattr(old, "n_groups", 1)))
            except ValueError as e:
                raise ValueError(f"quantize(): {name}: {e}") from None
            plan.append((owner, attr, old, new, name, kind))
    for owner, attr, old, new, name, kind in plan:
        report["bytes_before"] += nbytes(old)
        report["bytes_after"] += nbytes(new)
        setattr(owner, attr, new)
        report[kind].append(name)
        if not new.exact:
            report["rounded"].append(name)
    plan.clear()
    if own_memory:
        torch = _torch()
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
            for mod in model.modules():
                for key, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[key] = b.clone()
    if report["rounded"]:
        warnings.warn(f"quantize(): {len(report['rounded'])} modules' weights were not FP8 / "
                      f"FP4 values and were rounded (first: {report['rounded'][0]}); the "
                      "model's outputs change by more than the activation rounding",
                      stacklevel=2)
    return report
