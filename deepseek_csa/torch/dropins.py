"""Drop-ins with the call signatures of DeepSeek's released ``inference/model.py``
(see the package docstring of ``deepseek_csa.torch``)."""
from __future__ import annotations

import torch

import deepseek_csa as _dc

from . import ops
from ._tensors import kernel_dtype, kernel_f32, kernel_i32, kernel_pair, to_like

__all__ = ["sparse_attn", "apply_rotary_emb", "rms_norm", "rms_norm_forward", "act_quant",
           "fp4_act_quant", "rotate_activation", "get_window_topk_idxs",
           "get_compress_topk_idxs", "compressor_forward", "indexer_forward",
           "indexer_forward_v41"]


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """Released ``sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)``: q [B,S,H,D],
    kv [B,N,D], attn_sink [H] float32, topk_idxs [B,S,K] (-1 = none) -> [B,S,H,D] in q's
    dtype (``torch.ops.deepseek_csa.sparse_attn``; differentiable in q, kv and
    attn_sink).  bfloat16 q and kv are read as they are; other dtypes as float32."""
    qk, kvk = kernel_pair(q, kv)
    out = ops.call("sparse_attn", qk, kvk, kernel_f32(attn_sink), kernel_i32(topk_idxs),
                   float(softmax_scale))[0]
    return to_like(out, q)


def _cos_sin(freqs_cis):
    """cos and sin [S, n/2] as strided float32 views of the complex table."""
    fc = freqs_cis.detach()
    if fc.dtype != torch.complex64:
        fc = fc.to(torch.complex64)
    re = torch.view_as_real(fc)
    return re[..., 0], re[..., 1]


def apply_rotary_emb(x, freqs_cis, inverse=False):
    """Released ``apply_rotary_emb(x, freqs_cis, inverse=False)``: rotates x ([B,S,n] or
    [B,S,H,n], n = 2 * freqs_cis.shape[-1], e.g. ``q[..., -64:]``) in place; returns x.
    When autograd records, the rotation is the differentiable ``apply_rope`` operator
    copied back into x (its backward rotates the gradient back)."""
    cos, sin = _cos_sin(freqs_cis)
    inverse = bool(inverse)
    if torch.is_grad_enabled() and x.requires_grad:
        x.copy_(ops.call("apply_rope", kernel_dtype(x), cos, sin, inverse))
    elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        ops.call("apply_rope_", x, cos, sin, inverse)      # in place, no copy
    else:
        t = kernel_f32(x)
        ops.call("apply_rope_", t, cos, sin, inverse)
        x.copy_(t)
    return x


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm in float32, result in x's dtype; differentiable in x and weight."""
    w = None if weight is None else kernel_f32(weight)
    return to_like(ops.call("rms_norm", kernel_dtype(x), w, float(eps)), x)


def rms_norm_forward(self, x):
    """Drop-in ``RMSNorm.forward(self, x)`` (uses ``self.weight`` and ``self.eps``)."""
    return rms_norm(x, self.weight, self.eps)


_ORIG = {}   # the model module's own functions, for the modes the drop-ins do not cover


def _round_inplace(name, x, block_size, scale):
    """A QAT rounding of x in place, as the released functions do it.  When autograd
    records, the rounding is the straight-through operator (identity gradient) copied
    back into x."""
    if torch.is_grad_enabled() and x.requires_grad:
        x.copy_(ops.call(name, kernel_dtype(x), int(block_size), scale))
    elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        ops.call(name + "_", x, int(block_size), scale)
    else:
        t = kernel_f32(x)
        ops.call(name + "_", t, int(block_size), scale)
        x.copy_(t)
    return x


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
    e8 = getattr(torch, "float8_e8m0fnu", None)
    scale = "ue8m0" if (scale_fmt is not None or (e8 is not None and scale_dtype == e8)) \
        else "fp32"
    return _round_inplace("fp8_round", x, block_size, scale)


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
    if scale_dtype is None or scale_dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = "ue8m0"
    elif scale_dtype == torch.float8_e4m3fn:
        scale = "e4m3"
    else:
        raise ValueError(f"deepseek_csa.torch.fp4_act_quant: 'scale_dtype' must be None, "
                         f"torch.float8_e8m0fnu or torch.float8_e4m3fn, got {scale_dtype}")
    return _round_inplace("fp4_round", x, block_size, scale)


def rotate_activation(x):
    """Released ``rotate_activation``: normalised Hadamard transform of the last dim
    (any float dtype; the released one asserts bfloat16); differentiable."""
    return to_like(ops.call("hadamard", kernel_dtype(x), None), x)


def get_window_topk_idxs(window_size, bsz, seqlen, start_pos):
    """Released window index lists (int32 here; the released ones are int64)."""
    return ops.call("window_topk_idxs", int(window_size), int(bsz), int(seqlen), int(start_pos))


def get_compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset):
    """Released HCA index lists (int32 here; the released ones are int64)."""
    return ops.call("compress_topk_idxs", int(ratio), int(bsz), int(seqlen), int(start_pos),
                    int(offset))


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
    if torch.is_grad_enabled() and (x.requires_grad or any(
            p.requires_grad for p in self.parameters())):     # differentiable (QAT: STE)
        from .compressor_grad import compressor_forward_grad
        return compressor_forward_grad(self, G, x, start_pos)
    xf = x.float()
    kv, sc = self.wkv(xf), self.wgate(xf)
    ov = bool(getattr(self, "overlap", False))
    ape = kernel_f32(self.ape) if v4 else None
    # Not the Compressor's C state on these buffers: that state is separate C-contiguous
    # [B, r, c*D] / [B, r, D] arrays plus a position per row, while the released module
    # keeps previous and open group in one [B, c*r, c*D] buffer (the previous group's
    # first halves interleaved with unused columns) and no positions, and its epilogue
    # must call the module's own norm / RoPE / act_quant (which other drop-ins replace).
    st_kv, st_sc = self.kv_state, self.score_state      # float32, as the released module
    if start_pos == 0:
        whole = s - s % r
        left = s - whole
        if ov and whole >= r:
            st_kv[:b, :r] = kv[:, whole - r:whole]
            st_sc[:b, :r] = sc[:, whole - r:whole] + ape
        if left:
            at = r if ov else 0
            st_kv[:b, at:at + left] = kv[:, whole:]
            st_sc[:b, at:at + left] = (sc[:, whole:] + ape[:left]) if v4 else sc[:, whole:]
        if whole == 0:
            return None
        pooled = ops.call("gated_pool", kv[:, :whole], sc[:, :whole], r, ape, ov)
        rows = slice(0, whole, r)
    else:
        slot = start_pos % r
        row = r + slot if ov else slot
        st_kv[:b, row] = kv[:, 0]
        st_sc[:b, row] = (sc[:, 0] + ape[slot]) if v4 else sc[:, 0]
        if (start_pos + 1) % r:
            return None
        if ov:
            # previous group (rows :r) + this group (rows r:) pooled as two overlapping
            # groups; the second entry is the one this step completes
            pooled = ops.call("gated_pool", st_kv[:b], st_sc[:b], r, None, True)[:, 1:]
            st_kv[:b, :r] = st_kv[:b, r:]
            st_sc[:b, :r] = st_sc[:b, r:]
        else:
            pooled = ops.call("gated_pool", st_kv[:b], st_sc[:b], r, None, False)
        rows = slice(start_pos + 1 - r, start_pos + 2 - r)
    return compressor_epilogue(self, G, pooled.to(dtype), rows, start_pos)


def compressor_epilogue(mod, G, pooled, rows, start_pos, grad=False):
    """A Compressor's entries after the pooling (pooled [b, n, D] in the model's dtype,
    rows: the RoPE table's rows of those entries), through the module's own functions
    (G: the model module's globals): its norm; V4 also RoPE on the last rope_head_dim
    features, then the Hadamard rotation and the in-place FP4 rounding (the indexer's
    compressor, ``rotate``) or the FP8 rounding of the features before RoPE's, and the
    entries written to ``kv_cache`` from entry start_pos // ratio.  grad: the rotation
    through the differentiable ``hadamard`` operator and the roundings straight-through
    (QAT), the cache written detached.  V4.1 returns the normed entries."""
    ent = mod.norm(pooled)
    if not hasattr(mod, "ape"):
        return ent
    rd = mod.rope_head_dim
    G["apply_rotary_emb"](ent[..., -rd:], mod.freqs_cis[rows])
    if mod.rotate:
        blk = G.get("fp4_block_size", 32)
        ent = (to_like(ops.call("hadamard", kernel_dtype(ent), None), ent) if grad
               else G["rotate_activation"](ent))
        rnd = lambda t: G["fp4_act_quant"](t, blk, True)   # noqa: E731
    else:
        rnd = lambda t: G["act_quant"](t[..., :-rd], 64, G.get("scale_fmt"),   # noqa: E731
                                       G.get("scale_dtype"), True)
    if grad:
        from .compressor_grad import _straight_through
        ent = _straight_through(ent, rnd)
    else:
        rnd(ent)
    first = 0 if start_pos == 0 else start_pos // mod.compress_ratio
    with torch.no_grad():
        mod.kv_cache[:ent.shape[0], first:first + ent.shape[1]] = ent.detach()
    return ent


def indexer_forward(self, x, qr, start_pos, offset):
    """Drop-in V4 ``Indexer.forward(self, x, qr, start_pos, offset)``: queries (RoPE,
    Hadamard, FP4), its compressor, then deepseek_csa.index_topk (fused scoring + top-k in
    descending score order; ties go to the lower position).  Under tensor parallelism the
    partial scores are all-reduced before the top-k, as the released code does."""
    G = _mod_globals(self)
    b, s, _ = x.shape
    r = self.compress_ratio
    end = start_pos + s
    q, w = _indexer_queries(self, G, x, qr, start_pos)
    qn, kn, wn = _index_operands(q, self.kv_cache[:b, :end // r], w)
    kn = _fp4_keys(self, kn, b, 0 if start_pos == 0 else start_pos // r, _rounds_fp4_32(G))
    k = self.index_topk                       # the kernels take min(k, visible) themselves
    if G.get("world_size", 1) > 1:
        sc = ops.call("index_scores", qn, kn, wn, r, start_pos)
        G["dist"].all_reduce(sc)
        idx = ops.call("topk_indices", sc, k, r, start_pos, offset, "score", None, 0)
    else:
        idx = ops.call("index_topk", qn, kn, wn, k, r, start_pos, offset, "score", None, 0)
    return idx.long()


def _indexer_queries(self, G, x, qr, start_pos):
    """A V4 Indexer's work before it scores, in the released order (G: the model
    module's globals, whose RoPE, Hadamard and FP4 rounding it calls): the compressor
    takes the module's key cache and RoPE table on first use; the queries are qr
    through wq_b split per head, RoPE on their last rope_head_dim features, the Hadamard
    rotation and the in-place FP4 rounding; then the compressor's step (which may
    append a key row) and the per-head weights, weights_proj(x) times
    softmax_scale / sqrt(heads).  Returns (q [b, s, heads, Di], w [b, s, heads])."""
    comp = self.compressor
    if comp.kv_cache is None:
        comp.kv_cache, comp.freqs_cis = self.kv_cache, self.freqs_cis
    heads = getattr(self, "n_local_heads", self.n_heads)
    q = self.wq_b(qr).unflatten(-1, (heads, self.head_dim))
    rows = self.freqs_cis[start_pos:start_pos + x.shape[1]]
    G["apply_rotary_emb"](q[..., -self.rope_head_dim:], rows)
    q = G["rotate_activation"](q)
    G["fp4_act_quant"](q, G.get("fp4_block_size", 32), True)
    comp(x, start_pos)
    return q, self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)


def _rounds_fp4_32(G):
    """True when the model module's in-place FP4 rounding is ours (the drop-in or the
    kernel module's) in blocks of 32: the index keys it rounded are on fp4_pack's grid."""
    from . import kernel_module
    return G.get("fp4_block_size", 32) == 32 and \
        G.get("fp4_act_quant") in (fp4_act_quant, kernel_module.fp4_act_quant)


def _fp4_keys(owner, kn, b, first, on_grid=False):
    """The index keys kn [b, n, Di] (rows from `first` new since the last call) as FP4
    rows (docs/kernels.md, section 4) kept beside the module's key cache on `owner`, so
    the indexer scores 68-byte keys instead of float rows; kn itself when the keys are
    not on the FP4 grid (QAT off) or Di % 32 != 0.  on_grid: the keys were rounded by
    our FP4 QAT rounding in blocks of 32 (see _rounds_fp4_32)."""
    n, Di = kn.shape[1], kn.shape[2]
    if Di % 32 or n == 0:
        return kn
    st = getattr(owner, "_csa_fp4_keys", None)
    # rows written while the module ran unswapped are repacked too
    first = min(first, getattr(owner, "_csa_fp4_valid", 0))
    if st is None or st.shape[0] < b or st.shape[1] < n:
        rows = max(n, 2 * st.shape[1]) if st is not None else n
        new = torch.zeros((max(b, st.shape[0] if st is not None else 0), rows,
                           Di // 2 + Di // 32), dtype=torch.uint8)
        st, first = new, 0
    if torch.compiler.is_compiling():
        # inside a graph the packing is the fp4_pack operator, which cannot fall back
        # at run time: it runs where the keys are known to be on the FP4 grid (our
        # in-place FP4 rounding of blocks of 32 ran on them); elsewhere the float keys
        if not on_grid:
            return kn
        st[:b, first:n].copy_(ops.OPS["fp4_pack"](kn[:, first:n], False))
    else:
        try:
            _dc.fp4_pack(kn[:, first:n], out=st[:b, first:n])
        except ValueError:
            owner._csa_fp4_keys, owner._csa_fp4_valid = None, 0
            return kn
    owner._csa_fp4_keys, owner._csa_fp4_valid = st, n
    return st[:b, :n]


def _index_operands(q, kc, w):
    """The indexer's q, keys and weights for the kernels (no gradient: the selection is
    an integer result): bf16 q and keys as they are when both are, else float32."""
    qk, kk = kernel_pair(q.detach(), kc.detach())
    return qk, kk, kernel_dtype(w.detach())


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
        kf = _fp4_keys(self, _index_operands(k, self.k_cache[:b, :first + g], k)[1], b, first,
                       _rounds_fp4_32(G))
        sh._csa_index_fp4 = ((self.k_cache, self._csa_fp4_keys, first + g)
                             if kf.dtype == torch.uint8 else None)
    q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.index_head_dim))
    G["apply_rotary_emb"](q[..., -rd:], self.freqs_cis[start_pos:end])
    G["fp4_act_quant"](q, fp4_block, True)
    w = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
    qn, kn, wn = _index_operands(q, sh.index_k[:b, :n], w)
    pub = getattr(sh, "_csa_index_fp4", None)
    if pub is not None and pub[0] is sh.index_k and pub[2] >= n and pub[1].shape[0] >= b:
        kn = pub[1][:b, :n]
    bs = self.candidate_block_size
    if self.uses_candidates and not self.is_candidate_source:
        # the released entry mask [b, s, n] is constant over each block: one column a block
        cand = sh.candidates[..., ::bs].contiguous()
    else:
        cand, bs = None, 0
    k = self.index_topk
    if self.is_candidate_source or G.get("world_size", 1) > 1:
        sc = ops.call("index_scores", qn, kn, wn, r, start_pos)
        if G.get("world_size", 1) > 1:
            G["dist"].all_reduce(sc)
        if self.is_candidate_source:
            bsz = self.candidate_block_size
            blocks = ops.call("select_candidate_blocks", sc, self.candidate_topk_blocks, bsz, r,
                              start_pos)
            sh.candidates = blocks.repeat_interleave(bsz, -1)[..., :n]
        return ops.call("topk_indices", sc, k, r, start_pos, offset, "position", cand, bs)
    return ops.call("index_topk", qn, kn, wn, k, r, start_pos, offset, "position", cand, bs)
