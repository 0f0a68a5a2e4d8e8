"""Drop-ins with the call signatures of DeepSeek's released ``inference/model.py``
(see the package docstring of ``deepseek_csa.torch``)."""
from __future__ import annotations

import numpy as np

import deepseek_csa as _dc

from ._tensors import _f32, _inplace, _native_bf16, _out, _torch

__all__ = ["sparse_attn", "apply_rotary_emb", "rms_norm", "rms_norm_forward", "act_quant",
           "fp4_act_quant", "rotate_activation", "get_window_topk_idxs",
           "get_compress_topk_idxs", "compressor_forward", "indexer_forward",
           "indexer_forward_v41"]


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Released ``sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)``: q [B,S,H,D],
    kv [B,N,D], attn_sink [H] float32, topk_idxs [B,S,K] (-1 = none) -> [B,S,H,D] in q's
    dtype.  Differentiable in q, kv and attn_sink (autograd_attn._SparseAttnFn) when
    autograd records."""
    from .autograd import _records
    if _records(q, kv, attn_sink):
        from . import autograd_attn
        return autograd_attn._SparseAttnFn.apply(q, kv, attn_sink, topk_idxs, softmax_scale)
    torch = _torch()
    idx = topk_idxs.detach()
    idx = idx.numpy() if idx.dtype == torch.int32 else idx.to(torch.int32).numpy()
    if _native_bf16(q, kv):
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        _dc.sparse_attn(q.detach(), kv.detach(), _f32(attn_sink), idx, float(softmax_scale),
                        out=out)
        return out
    o = _dc.sparse_attn(_f32(q), _f32(kv), _f32(attn_sink), idx, float(softmax_scale))
    return _out(o, q)


def _cos_sin(freqs_cis):
    torch = _torch()
    fc = freqs_cis.detach()
    if fc.dtype != torch.complex64:
        fc = fc.to(torch.complex64)
    re = torch.view_as_real(fc).numpy()         # [S, half, 2] view of the complex table
    return re[..., 0], re[..., 1]


def apply_rotary_emb(x, freqs_cis, inverse=False):
    """Released ``apply_rotary_emb(x, freqs_cis, inverse=False)``: rotates x ([B,S,n] or
    [B,S,H,n], n = 2 * freqs_cis.shape[-1], e.g. ``q[..., -64:]``) in place; returns x."""
    torch = _torch()
    cos, sin = _cos_sin(freqs_cis)
    if torch.is_grad_enabled() and x.requires_grad:   # differentiable (autograd_norm_pool)
        from .autograd_norm_pool import apply_rotary
        return apply_rotary(x, cos, sin, bool(inverse))
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        _dc.apply_rope(x.detach(), cos, sin, inverse=bool(inverse))   # in place, no copy
        return x
    return _inplace(x, lambda a: _dc.apply_rope(a, cos, sin, inverse=bool(inverse)))


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm in float32, result in x's dtype; differentiable in x and weight."""
    torch = _torch()
    if torch.is_grad_enabled() and (x.requires_grad or getattr(weight, "requires_grad", False)):
        from .autograd_norm_pool import rms_norm as _rms_norm_grad
        return _rms_norm_grad(x, weight, eps)
    w = None if weight is None else _f32(weight)
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _dc.rms_norm(x.detach(), w, float(eps), out=out)
        return out
    return _out(_dc.rms_norm(_f32(x), w, float(eps)), x)


def rms_norm_forward(self, x):
    """Drop-in ``RMSNorm.forward(self, x)`` (uses ``self.weight`` and ``self.eps``)."""
    return rms_norm(x, self.weight, self.eps)


_ORIG = {}   # the model module's own functions, for the modes the drop-ins do not cover


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    """Released ``act_quant``: with ``inplace=True`` (the QAT rounding the attention uses)
    FP8 e4m3 quantize-dequantize of x in place over blocks of ``block_size``, power-of-two
    scales when ``scale_fmt`` is given or scale_dtype is e8m0.  The quantizing mode
    (``inplace=False``, used by FP8 GEMMs) is passed on to the model's own function."""
    if not inplace:
        orig = _ORIG.get("act_quant")
        if orig is None:
            raise NotImplementedError("deepseek_csa.torch.act_quant: only inplace=True")
        return orig(x, block_size, scale_fmt, scale_dtype)
    torch = _torch()
    e8 = getattr(torch, "float8_e8m0fnu", None)
    scale = "ue8m0" if (scale_fmt is not None or (e8 is not None and scale_dtype == e8)) \
        else "fp32"
    return _inplace(x, lambda a: _dc.fp8_round(a, int(block_size), scale=scale))


def fp4_act_quant(x, block_size=32, inplace=True, scale_dtype=None):
    """Released ``fp4_act_quant``: FP4 e2m1 quantize-dequantize in place, power-of-two
    (ue8m0) scales, or e4m3 scales when ``scale_dtype`` is ``torch.float8_e4m3fn`` (V4.1's
    compressed KV: ``fp4_act_quant(latent, 16, True, scale_dtype=torch.float8_e4m3fn)``).
    The quantizing mode (``inplace=False``) is passed on to the model's own function."""
    if not inplace:
        orig = _ORIG.get("fp4_act_quant")
        if orig is None:
            raise NotImplementedError("deepseek_csa.torch.fp4_act_quant: only inplace=True")
        if scale_dtype is None:
            return orig(x, block_size, inplace)
        return orig(x, block_size, inplace, scale_dtype=scale_dtype)
    torch = _torch()
    if scale_dtype is None or scale_dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = "ue8m0"
    elif scale_dtype == torch.float8_e4m3fn:
        scale = "e4m3"
    else:
        raise ValueError(f"deepseek_csa.torch.fp4_act_quant: 'scale_dtype' must be None, "
                         f"torch.float8_e8m0fnu or torch.float8_e4m3fn, got {scale_dtype}")
    return _inplace(x, lambda a: _dc.fp4_round(a, int(block_size), scale=scale))


def rotate_activation(x):
    """Released ``rotate_activation``: normalised Hadamard transform of the last dim
    (any float dtype; the released one asserts bfloat16)."""
    torch = _torch()
    if _native_bf16(x):
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        _dc.hadamard(x.detach(), out=out)
        return out
    return _out(_dc.hadamard(_f32(x)), x)


def get_window_topk_idxs(window_size, bsz, seqlen, start_pos):
    """Released window index lists (int32 here; the released ones are int64)."""
    return _torch().from_numpy(_dc.window_topk_idxs(window_size, bsz, seqlen, start_pos))


def get_compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset):
    """Released HCA index lists (int32 here; the released ones are int64)."""
    return _torch().from_numpy(_dc.compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset))


def _mod_globals(module):
    return type(module).forward.__globals__


def compressor_forward(self, x, start_pos):
    """Drop-in ``Compressor.forward(self, x, start_pos)`` (V4: ape, overlap at ratio 4,
    norm + RoPE + QAT epilogue written to ``self.kv_cache``; V4.1: no ape, ratio 1 = norm
    of the projection, returns the normed latent before RoPE).  The pooling runs in
    deepseek_csa.gated_pool; the streaming state stays in the module's
    ``kv_state``/``score_state`` buffers in the released layout."""
    G = _mod_globals(self)
    r, dtype = self.compress_ratio, x.dtype
    b, s, _ = x.shape
    v4 = hasattr(self, "ape")
    if not v4 and r == 1:
        return self.norm(self.wkv(x))
    if _torch().is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for p in self.parameters())):     # differentiable (QAT: STE)
        from .autograd_norm_pool import compressor_forward_grad
        return compressor_forward_grad(self, G, x, start_pos)
    xf = x.float()
    kv_t, sc_t = self.wkv(xf), self.wgate(xf)
    kv, sc = _f32(kv_t), _f32(sc_t)
    ov = bool(getattr(self, "overlap", False))
    ape = _f32(self.ape) if v4 else None
    # Not the Compressor's C state on these buffers: that state is separate C-contiguous
    # [B, r, c*D] / [B, r, D] arrays plus a position per row, while the released module
    # keeps previous and open group in one [B, c*r, c*D] buffer (the previous group's
    # first halves interleaved with unused columns) and no positions, and its epilogue
    # must call the module's own norm / RoPE / act_quant (which other drop-ins replace).
    st_kv, st_sc = _f32(self.kv_state), _f32(self.score_state)
    if start_pos == 0:
        whole = s - s % r
        left = s - whole
        if ov and whole >= r:
            st_kv[:b, :r] = kv[:, whole - r:whole]
            st_sc[:b, :r] = sc[:, whole - r:whole] + ape
        if left:
            at = r if ov else 0
            st_kv[:b, at:at + left] = kv[:, whole:]
            st_sc[:b, at:at + left] = sc[:, whole:] + (ape[:left] if v4 else 0)
        if whole == 0:
            return None
        pooled = _dc.gated_pool(kv[:, :whole], sc[:, :whole], r, ape=ape, overlap=ov)
        rows = slice(0, whole, r)
    else:
        slot = start_pos % r
        row = r + slot if ov else slot
        st_kv[:b, row] = kv[:, 0]
        st_sc[:b, row] = sc[:, 0] + (ape[slot] if v4 else 0)
        if (start_pos + 1) % r:
            return None
        if ov:
            # previous group (rows :r) + this group (rows r:) pooled as two overlapping
            # groups; the second entry is the one this step completes
            pooled = _dc.gated_pool(st_kv[:b], st_sc[:b], r, overlap=True)[:, 1:]
            st_kv[:b, :r] = st_kv[:b, r:]
            st_sc[:b, :r] = st_sc[:b, r:]
        else:
            pooled = _dc.gated_pool(st_kv[:b], st_sc[:b], r)
        rows = slice(start_pos + 1 - r, start_pos + 2 - r)
    ent = self.norm(_out(pooled, xf).to(dtype))
    if not v4:
        return ent
    rd = self.rope_head_dim
    G["apply_rotary_emb"](ent[..., -rd:], self.freqs_cis[rows])
    if self.rotate:
        ent = G["rotate_activation"](ent)
        G["fp4_act_quant"](ent, G.get("fp4_block_size", 32), True)
    else:
        G["act_quant"](ent[..., :-rd], 64, G.get("scale_fmt"), G.get("scale_dtype"), True)
    first = 0 if start_pos == 0 else start_pos // r
    self.kv_cache[:b, first:first + ent.shape[1]] = ent
    return ent


def indexer_forward(self, x, qr, start_pos, offset):
    """Drop-in V4 ``Indexer.forward(self, x, qr, start_pos, offset)``: queries (RoPE,
    Hadamard, FP4), its compressor, then deepseek_csa.index_topk (fused scoring + top-k in
    descending score order; ties go to the lower position).  Under tensor parallelism the
    partial scores are all-reduced before the top-k, as the released code does."""
    torch = _torch()
    G = _mod_globals(self)
    b, s, _ = x.shape
    r, rd = self.compress_ratio, self.rope_head_dim
    end = start_pos + s
    if self.compressor.kv_cache is None:
        self.compressor.kv_cache = self.kv_cache
        self.compressor.freqs_cis = self.freqs_cis
    q = self.wq_b(qr).unflatten(-1, (getattr(self, "n_local_heads", self.n_heads), self.head_dim))
    G["apply_rotary_emb"](q[..., -rd:], self.freqs_cis[start_pos:end])
    q = G["rotate_activation"](q)
    G["fp4_act_quant"](q, G.get("fp4_block_size", 32), True)
    self.compressor(x, start_pos)
    w = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
    qn, kn, wn = _index_operands(q, self.kv_cache[:b, :end // r], w)
    kn = _fp4_keys(self, kn, b, 0 if start_pos == 0 else start_pos // r)
    k = self.index_topk                       # the kernels take min(k, visible) themselves
    if G.get("world_size", 1) > 1:
        sc = torch.from_numpy(_dc.index_scores(qn, kn, wn, ratio=r, start_pos=start_pos))
        G["dist"].all_reduce(sc)
        idx = _dc.topk_indices(sc.numpy(), k, ratio=r, start_pos=start_pos, offset=offset)
    else:
        idx = _dc.index_topk(qn, kn, wn, k, ratio=r, start_pos=start_pos, offset=offset,
                             order="score")
    return torch.from_numpy(idx).long()


def _fp4_keys(owner, kn, b, first):
    """The index keys kn [b, n, Di] (rows from `first` new since the last call) as FP4
    rows (docs/kernels.md, section 4) kept beside the module's key cache on `owner`, so
    the indexer scores 68-byte keys instead of float rows; kn itself when the keys are
    not on the FP4 grid (QAT off) or Di % 32 != 0."""
    n, Di = kn.shape[1], kn.shape[2]
    if Di % 32 or n == 0:
        return kn
    st = getattr(owner, "_csa_fp4_keys", None)
    # rows written while the module ran unswapped are repacked too
    first = min(first, getattr(owner, "_csa_fp4_valid", 0))
    if st is None or st.shape[0] < b or st.shape[1] < n:
        rows = max(n, 2 * st.shape[1]) if st is not None else n
        new = np.zeros((max(b, st.shape[0] if st is not None else 0), rows, Di // 2 + Di // 32),
                       np.uint8)
        st, first = new, 0
    try:
        _dc.fp4_pack(kn[:, first:n], out=st[:b, first:n])
    except ValueError:
        owner._csa_fp4_keys, owner._csa_fp4_valid = None, 0
        return kn
    owner._csa_fp4_keys, owner._csa_fp4_valid = st, n
    return st[:b, :n]


def _index_operands(q, kc, w):
    """NumPy views of the indexer's q, keys and weights: bf16 tensors as they are (the
    kernels read them in place), float32 ones as views, others as float32 copies."""
    if _native_bf16(q, kc):
        return q.detach(), kc.detach(), (w.detach() if _native_bf16(w) else _f32(w))
    return _f32(q), _f32(kc), _f32(w)


def indexer_forward_v41(self, x, qr, latent, start_pos, offset):
    """Drop-in V4.1 ``Indexer.forward(self, x, qr, latent, start_pos, offset)``.

    Reads and publishes the model module's ``shared_attn`` exactly as the released module
    does: an index-key owner (``owns_k``) turns a new ``latent`` into index keys (``wk``,
    ``k_norm``, RoPE at each group's first position, FP4) in its ``k_cache`` and publishes
    that cache as ``shared_attn.index_k`` -- only on calls where a latent came (on decode
    steps where a ratio-2 group is still filling, the layer scores against whichever owner
    published last, as the released file does); the queries (RoPE, FP4) are scored
    against ``shared_attn.index_k``; the candidate source publishes its kept blocks as
    ``shared_attn.candidates`` (the released bool [B, S, Tc] entry mask, so unswapped
    layers after it can read it); the index layers after it select inside them.  Top-k
    through deepseek_csa.index_topk / select_candidate_blocks / topk_indices in position
    order (ties to the lower position); int32 [B, S, K] + offset, -1 for none.  Under
    tensor parallelism the partial scores are all-reduced before selection."""
    torch = _torch()
    G = _mod_globals(self)
    sh = G["shared_attn"]
    b, s, _ = x.shape
    r, rd = self.compress_ratio, self.rope_head_dim
    end = start_pos + s
    n = end // r
    fp4_block = G.get("fp4_block_size", 32)
    if self.owns_k and latent is not None:
        first = start_pos // r
        g = latent.shape[1]
        k = self.k_norm(self.wk(latent))
        G["apply_rotary_emb"](k[..., -rd:], self.freqs_cis[first * r:(first + g) * r:r])
        G["fp4_act_quant"](k, fp4_block, True)
        self.k_cache[:b, first:first + g] = k
        sh.index_k = self.k_cache
        # FP4 rows of the new keys beside k_cache, published with it (_fp4_keys)
        kf = _fp4_keys(self, _index_operands(k, self.k_cache[:b, :first + g], k)[1], b, first)
        sh._csa_index_fp4 = ((self.k_cache, self._csa_fp4_keys, first + g)
                             if kf.dtype == np.uint8 else None)
    q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.index_head_dim))
    G["apply_rotary_emb"](q[..., -rd:], self.freqs_cis[start_pos:end])
    G["fp4_act_quant"](q, fp4_block, True)
    w = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
    qn, kn, wn = _index_operands(q, sh.index_k[:b, :n], w)
    pub = getattr(sh, "_csa_index_fp4", None)
    if pub is not None and pub[0] is sh.index_k and pub[2] >= n and pub[1].shape[0] >= b:
        kn = pub[1][:b, :n]
    bs = self.candidate_block_size
    kw = {}
    if self.uses_candidates and not self.is_candidate_source:
        # the released entry mask [b, s, n] is constant over each block: one column a block
        kw = dict(candidates=np.ascontiguousarray(sh.candidates.numpy()[..., ::bs]),
                  block_size=bs)
    k = self.index_topk
    if self.is_candidate_source or G.get("world_size", 1) > 1:
        sc = torch.from_numpy(_dc.index_scores(qn, kn, wn, ratio=r, start_pos=start_pos))
        if G.get("world_size", 1) > 1:
            G["dist"].all_reduce(sc)
        if self.is_candidate_source:
            blocks = _dc.select_candidate_blocks(sc.numpy(), self.candidate_topk_blocks, bs,
                                                 ratio=r, start_pos=start_pos)
            sh.candidates = torch.from_numpy(blocks).repeat_interleave(bs, -1)[..., :n]
        idx = _dc.topk_indices(sc.numpy(), k, ratio=r, start_pos=start_pos, offset=offset,
                               order="position", **kw)
    else:
        idx = _dc.index_topk(qn, kn, wn, k, ratio=r, start_pos=start_pos, offset=offset,
                             order="position", **kw)
    return torch.from_numpy(idx)
