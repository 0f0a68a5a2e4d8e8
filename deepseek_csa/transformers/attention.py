"""A swapped layer's attention (one path for inference, training, torch.compile and
torch.export), its hyper-connections, and the per-layer fallback checks."""
from __future__ import annotations

import sys

from . import capture as _cap
from .cache import _adopt_layer
from .versions import _norm_eps, _torch

_PKG = sys.modules[__package__]     # deepseek_csa.transformers (CHECKPOINT_ATTENTION)


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
        from ..torch import ops
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
    return None


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
# CHECKPOINT_ATTENTION (the package's, read at every call): see __init__.py.
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
                sel, rec = _cap._indexer_capture(st, m, layer, h, qr, cos, sin, pos, start,
                                                 off, T, grad_mode)
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
            _cap._capture_target(st, m, rec, query(q_pre.detach()), kvbuf, idx, pos, off, T)
    if _PKG.CHECKPOINT_ATTENTION and _records(q_pre, kvbuf, m.sinks):
        # keep q_pre and the rows only; the [S, H, D] norm / RoPE / attention results are
        # recomputed in the backward (bitwise the same: the kernels are deterministic)
        from torch.utils.checkpoint import checkpoint
        o = checkpoint(core, q_pre, kvbuf, m.sinks, use_reentrant=False)
    else:
        o = core(q_pre, kvbuf, m.sinks)
    del q_pre, qr, kvbuf    # peak memory: q [S, H, D] goes before the output projections
    grouped = m.o_a_proj(o.reshape(B, S, m.config.o_groups, -1)).flatten(2)
    return m.o_b_proj(grouped)
