"""Float32 torch reference of one DeepSeek-V4 / V4.1 CSA attention layer, written from docs/kernels.md.

It is organised the way the released ``inference/model.py`` is, so that
``deepseek_csa.torch.swap`` can be exercised on it without the released file: the
operations are module-level functions under the released names (``apply_rotary_emb``,
``act_quant``, ``fp4_act_quant``, ``rotate_activation``, ``sparse_attn``,
``get_window_topk_idxs``, ``get_compress_topk_idxs``), the modules are ``RMSNorm``,
``Compressor``, ``Indexer`` and ``Attention`` with the released attribute names (so a
state dict of one loads into the other), and ``Attention.forward(x, start_pos)`` keeps
its caches in buffers.  The arithmetic is docs/kernels.md's, written independently.

Every op computes in float32 and stores in its input's dtype, so the same modules give
the bfloat16 path when their parameters and inputs are bfloat16.

V4.1 (CSA2) layers: ``Attention(..., v41=True)`` with ``ModelArgs.kv_source_layers`` /
``index_source_layers`` / ``candidate_source_layer``.  They are organised as the released
V4.1 file is: ``Attention.forward(x, start_pos)``, a V4.1 ``Compressor`` returning the
normed latent before RoPE, an ``Indexer.forward(x, qr, latent, start_pos, offset)`` that
owns index keys on kv-source layers, and one module-level ``shared_attn`` through which
sources publish (compressed KV, index keys, top-k, candidate mask) for the layers after
them.  V4.1's query has no per-head RMS rescale; its window KV is FP8 in blocks of 32
over all D features; its compressed KV is FP4 with e4m3 scales in blocks of 16.

The released V4.1 indexer republishes ``shared_attn.index_k`` only on calls where its
layer's compressor emits an entry; on a decode step where a ratio-2 group is still
filling, a ratio-2 index layer then scores against whichever owner published last.  This
reference does the same by default (so a swap into it must too); ``republish_index_k()``
switches to publishing on every call, which is what ``deepseek_csa.layer.CSALayer`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import nn

from .norm_rope import rope_table as _rope_table

# Large prefills are processed in query chunks so that the eager reference does not
# materialise [S, K, D] gathers or [S, Hi, Tc] score tensors of several GB.
QUERY_CHUNK = 512

# QAT settings, module globals as in the released file (its Transformer sets them):
# power-of-two FP8 scales, FP4 blocks of 32
scale_fmt = "ue8m0"
scale_dtype = None
fp4_block_size = 32


# ----------------------------------------------------------------------------- QAT
def _pow2_at_least(v):
    """2**ceil(log2(v)) exactly (frexp, no log rounding), for positive float32 v."""
    mant, expo = torch.frexp(v)
    expo = expo - (mant == 0.5).to(expo.dtype)
    return torch.ldexp(torch.ones_like(v), expo)


def _round_e2m1(y):
    """Nearest-even onto 0, .5, 1, 1.5, 2, 3, 4, 6 (sign kept); |y| <= 6 expected."""
    a = y.abs()
    step = torch.where(a < 2, torch.full_like(a, 0.5), torch.where(a < 4, torch.ones_like(a),
                                                                     torch.full_like(a, 2.0)))
    return torch.copysign(torch.round(a / step) * step, y)


def _e4m3_scale(amax):
    """V4.1's compressed-KV FP4 scale: amax/6 rounded to float8 e4m3 (nearest), not pow2."""
    return (amax / 6.0).to(torch.float8_e4m3fn).float()


def fp8_qat(x, block, pow2=True):
    """docs/kernels.md 7 FP8 quantize-dequantize of float32 x over blocks of the last dim."""
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = amax / 448.0
    if pow2:
        s = _pow2_at_least(s)
    y = (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return y.reshape(shp)


def fp4_qat(x, block, scale="ue8m0"):
    """docs/kernels.md 7 FP4 quantize-dequantize of float32 x over blocks of the last dim."""
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "ue8m0":
        s = _pow2_at_least(amax.clamp_min(6 * 2.0 ** -126) / 6.0)
    else:
        s = _e4m3_scale(amax).clamp_min(2.0 ** -9)
    y = _round_e2m1((xb / s).clamp(-6.0, 6.0)) * s
    return y.reshape(shp)


class _Switch:
    """Context setting a module-level switch (a one-element list) while it lasts."""

    def __init__(self, cell, on):
        self.cell, self.on = cell, on

    def __enter__(self):
        self.prev, self.cell[0] = self.cell[0], self.on
        return self

    def __exit__(self, *exc):
        self.cell[0] = self.prev
        return False


_QAT = [True]


def qat(on=True):
    """Context: ``qat(False)`` makes act_quant / fp4_act_quant leave x as it is (the
    Hadamard rotation stays), to compare with CSALayer(qat=False) without the rounding
    boundaries."""
    return _Switch(_QAT, on)


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    """In-place FP8 rounding of x (the only mode the attention uses); pow2 scales when
    scale_fmt is given, which is how the released model calls it."""
    if not inplace:
        raise NotImplementedError("the reference only simulates FP8 (inplace=True)")
    if not _QAT[0]:
        return x
    x.copy_(fp8_qat(x.float(), block_size, pow2=scale_fmt is not None))
    return x


def fp4_act_quant(x, block_size=32, inplace=True, scale_dtype=None):
    """In-place FP4 rounding: power-of-two scales, or e4m3 scales when scale_dtype is
    torch.float8_e4m3fn (how V4.1 rounds its compressed KV, in blocks of 16)."""
    if not inplace:
        raise NotImplementedError("the reference only simulates FP4 (inplace=True)")
    if not _QAT[0]:
        return x
    scale = "e4m3" if scale_dtype == torch.float8_e4m3fn else "ue8m0"
    x.copy_(fp4_qat(x.float(), block_size, scale=scale))
    return x


def fp4_act_quant_e4m3(x, block_size=16, inplace=True):
    """In-place FP4 rounding with e4m3 scales (V4.1 compressed KV)."""
    return fp4_act_quant(x, block_size, inplace, scale_dtype=torch.float8_e4m3fn)


def hadamard(x):
    """Normalised Walsh-Hadamard transform of the last dim, radix-2 butterflies, float32."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n).clone()
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)
        h *= 2
    return (y * n ** -0.5).reshape(x.shape)


def rotate_activation(x):
    return hadamard(x).to(x.dtype)


# ----------------------------------------------------------------------------- RoPE
def precompute_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
    """Complex [seqlen, dim//2] table of docs/kernels.md 2 (YaRN when original_seq_len > 0),
    in the released argument order, from the one table of reference.norm_rope."""
    cos, sin = _rope_table(dim, seqlen, base, original_seq_len, factor, beta_fast, beta_slow)
    return torch.complex(cos, sin)


def apply_rotary_emb(x, freqs_cis, inverse=False):
    """Rotates x ([B,S,n] or [B,S,H,n], n = 2 * freqs_cis.shape[-1]) in place."""
    c, s = freqs_cis.real, freqs_cis.imag
    if inverse:
        s = -s
    view = [1, x.shape[1]] + [1] * (x.dim() - 3) + [c.shape[-1]]
    c, s = c.reshape(view), s.reshape(view)
    xf = x.float()
    ev, od = xf[..., 0::2], xf[..., 1::2]
    x.copy_(torch.stack((ev * c - od * s, ev * s + od * c), dim=-1).flatten(-2))
    return x


# ----------------------------------------------------------------------------- indices
def get_window_topk_idxs(window_size, bsz, seqlen, start_pos):
    """docs/kernels.md 6 window index lists, int64 [bsz, seqlen, width]."""
    if start_pos == 0:
        s = torch.arange(seqlen)[:, None]
        j = torch.arange(min(seqlen, window_size))[None, :]
        pos = (s - window_size + 1).clamp_min(0) + j
        rows = torch.where(pos <= s, pos, torch.full_like(pos, -1))
    else:
        slots = (torch.arange(window_size) + start_pos + 1) % window_size
        rows = torch.where(slots <= start_pos, slots, torch.full_like(slots, -1))[None, :]
    return rows.unsqueeze(0).expand(bsz, -1, -1)


def get_compress_topk_idxs(ratio, bsz, seqlen, start_pos, offset):
    """docs/kernels.md 4 HCA lists: every visible compressed entry, int64 [bsz, seqlen, n]."""
    if start_pos == 0:
        t = torch.arange(seqlen // ratio)[None, :]
        vis = (torch.arange(seqlen)[:, None] + 1) // ratio
        rows = torch.where(t < vis, t + offset, torch.full_like(t, -1))
    else:
        rows = (torch.arange((start_pos + 1) // ratio) + offset)[None, :]
    return rows.unsqueeze(0).expand(bsz, -1, -1)


# ----------------------------------------------------------------------------- attention
def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """docs/kernels.md 5: top-k sparse MQA with a sink in the denominator; float32 inside."""
    b, s, h, d = q.shape
    out = torch.empty(b, s, h, d, dtype=torch.float32)
    kvf = kv.float()
    sink = attn_sink.float().view(1, 1, h)
    for lo in range(0, s, QUERY_CHUNK):
        hi = min(s, lo + QUERY_CHUNK)
        idx = topk_idxs[:, lo:hi].long()
        ok = idx >= 0
        rows = torch.stack([kvf[i][idx[i].clamp_min(0)] for i in range(b)])  # [b, c, k, d]
        logit = torch.einsum("bchd,bckd->bchk", q[:, lo:hi].float(), rows) * softmax_scale
        logit = logit.masked_fill(~ok[:, :, None, :], float("-inf"))
        m = logit.amax(-1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(logit - m[..., None])
        den = e.sum(-1) + torch.exp(sink - m)
        o = torch.einsum("bchk,bckd->bchd", e, rows) / den[..., None]
        o = torch.where(ok.any(-1)[:, :, None, None], o, torch.zeros_like(o))
        out[:, lo:hi] = o
    return out.to(q.dtype)


# ----------------------------------------------------------------------------- config
@dataclass
class ModelArgs:
    """Field names follow the released ModelArgs so configs port over."""
    max_batch_size: int = 2
    max_seq_len: int = 512
    dim: int = 256
    n_heads: int = 8
    head_dim: int = 128
    rope_head_dim: int = 64
    q_lora_rank: int = 64
    o_lora_rank: int = 32
    o_groups: int = 4
    window_size: int = 16
    compress_ratios: Tuple[int, ...] = (0, 4, 128)
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 4
    index_head_dim: int = 64
    index_topk: int = 16
    norm_eps: float = 1e-6
    # V4.1 (CSA2)
    kv_source_layers: Tuple[int, ...] = ()
    index_source_layers: Tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return y.to(x.dtype)


def _linear(n_in, n_out, dtype=None):
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype)


def _freqs_for(args, ratio):
    if ratio:
        return precompute_freqs_cis(args.rope_head_dim, args.max_seq_len, args.original_seq_len,
                                    args.compress_rope_theta, args.rope_factor, args.beta_fast,
                                    args.beta_slow)
    return precompute_freqs_cis(args.rope_head_dim, args.max_seq_len, 0, args.rope_theta,
                                args.rope_factor, args.beta_fast, args.beta_slow)


# ----------------------------------------------------------------------------- V4 modules
class Compressor(nn.Module):
    """V4 gated pooling (docs/kernels.md 3) with the released streaming state layout:
    kv_state/score_state [B, c*r, c*D] (with overlap rows :r hold the previous group)."""

    def __init__(self, args, compress_ratio=4, head_dim=512, rotate=False):
        super().__init__()
        self.dim, self.head_dim, self.rope_head_dim = args.dim, head_dim, args.rope_head_dim
        self.compress_ratio = compress_ratio
        self.overlap = compress_ratio == 4
        self.rotate = rotate
        c = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(compress_ratio, c * head_dim))
        self.wkv = _linear(args.dim, c * head_dim, torch.float32)
        self.wgate = _linear(args.dim, c * head_dim, torch.float32)
        self.norm = RMSNorm(head_dim, args.norm_eps)
        self.kv_cache = None
        self.freqs_cis = None
        nb = args.max_batch_size
        self.register_buffer("kv_state", torch.zeros(nb, c * compress_ratio, c * head_dim),
                             persistent=False)
        self.register_buffer("score_state", torch.full((nb, c * compress_ratio, c * head_dim),
                                                       float("-inf")), persistent=False)

    def _pool(self, kv, score):
        """kv, score [B, G, r, cD] (score includes ape) -> [B, G, D] float32."""
        d = self.head_dim
        if self.overlap:
            prev_kv = torch.cat((torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]), 1)
            prev_sc = torch.cat((torch.full_like(score[:, :1, :, :d], float("-inf")),
                                 score[:, :-1, :, :d]), 1)
            kv = torch.cat((prev_kv, kv[..., d:]), 2)
            score = torch.cat((prev_sc, score[..., d:]), 2)
        return (kv * torch.softmax(score, dim=2)).sum(2)

    def forward(self, x, start_pos):
        b, s, _ = x.shape
        r, d, rd = self.compress_ratio, self.head_dim, self.rope_head_dim
        c = 2 if self.overlap else 1
        xf = x.float()
        kv, score = self.wkv(xf), self.wgate(xf)
        if start_pos == 0:
            full = s - s % r
            if self.overlap and full >= r:
                self.kv_state[:b, :r] = kv[:, full - r:full]
                self.score_state[:b, :r] = score[:, full - r:full] + self.ape
            tail = s - full
            if tail:
                base = r if self.overlap else 0
                self.kv_state[:b, base:base + tail] = kv[:, full:]
                self.score_state[:b, base:base + tail] = score[:, full:] + self.ape[:tail]
            if full == 0:
                return None
            g = full // r
            pooled = self._pool(kv[:, :full].reshape(b, g, r, c * d),
                                score[:, :full].reshape(b, g, r, c * d) + self.ape)
            pos = torch.arange(g) * r
        else:
            slot = start_pos % r
            row = (r + slot) if self.overlap else slot
            self.kv_state[:b, row] = kv[:, 0]
            self.score_state[:b, row] = score[:, 0] + self.ape[slot]
            if (start_pos + 1) % r:
                return None
            if self.overlap:
                kvs = torch.cat((self.kv_state[:b, :r, :d], self.kv_state[:b, r:, d:]), 1)
                scs = torch.cat((self.score_state[:b, :r, :d], self.score_state[:b, r:, d:]), 1)
                pooled = (kvs * torch.softmax(scs, 1)).sum(1, keepdim=True)
                self.kv_state[:b, :r] = self.kv_state[:b, r:].clone()
                self.score_state[:b, :r] = self.score_state[:b, r:].clone()
            else:
                pooled = (self.kv_state[:b] * torch.softmax(self.score_state[:b], 1)).sum(
                    1, keepdim=True)
            pos = torch.tensor([start_pos + 1 - r])
        out = self.norm(pooled.to(x.dtype))
        apply_rotary_emb(out[..., -rd:], self.freqs_cis[pos])
        if self.rotate:
            out = rotate_activation(out)
            fp4_act_quant(out, 32, True)
        else:
            act_quant(out[..., :-rd], 64, scale_fmt, scale_dtype, True)
        first = 0 if start_pos == 0 else start_pos // r
        self.kv_cache[:b, first:first + out.shape[1]] = out
        return out


def _index_select(score, topk, ratio, start_pos, offset, by_position):
    """Top-k over masked scores -> int64 indices, -1 for invisible, + offset otherwise."""
    b, s, tc = score.shape
    k = min(topk, tc)
    # equal scores by lower position (a stable descending sort), as deepseek_csa does;
    # torch.topk leaves the order of ties unspecified
    idx = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    if by_position:
        idx = idx.sort(dim=-1).values
    if start_pos == 0:
        vis = ((torch.arange(s) + 1) // ratio)[None, :, None]
        return torch.where(idx < vis, idx + offset, torch.full_like(idx, -1))
    return idx + offset


def _causal_mask(score, ratio, start_pos):
    if start_pos == 0:
        s, tc = score.shape[1], score.shape[2]
        vis = ((torch.arange(s) + 1) // ratio)[:, None]
        score = score.masked_fill(torch.arange(tc)[None, :] >= vis, float("-inf"))
    return score


def _scores(q, k, w):
    """sum_h relu(q.k) * w in float32, chunked over queries. q [B,S,Hi,Di], k [B,T,Di]."""
    b, s = q.shape[:2]
    out = torch.empty(b, s, k.shape[1])
    for lo in range(0, s, QUERY_CHUNK):
        hi = min(s, lo + QUERY_CHUNK)
        sc = torch.einsum("bshd,btd->bsht", q[:, lo:hi].float(), k.float()).relu_()
        out[:, lo:hi] = (sc * w[:, lo:hi, :, None].float()).sum(2)
    return out


class Indexer(nn.Module):
    """V4 indexer: own ratio-4 compressor (Hadamard + FP4), scores, top-k by score."""

    def __init__(self, args, compress_ratio=4):
        super().__init__()
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.n_local_heads = self.n_heads  # one rank
        self.rope_head_dim, self.index_topk = args.rope_head_dim, args.index_topk
        self.compress_ratio = compress_ratio
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_b = _linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = _linear(args.dim, self.n_heads)
        self.compressor = Compressor(args, compress_ratio, self.head_dim, True)
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size,
                                                     args.max_seq_len // compress_ratio,
                                                     self.head_dim), persistent=False)
        self.freqs_cis = None

    def forward(self, x, qr, start_pos, offset):
        b, s, _ = x.shape
        r, rd = self.compress_ratio, self.rope_head_dim
        if self.compressor.kv_cache is None:
            self.compressor.kv_cache, self.compressor.freqs_cis = self.kv_cache, self.freqs_cis
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        apply_rotary_emb(q[..., -rd:], self.freqs_cis[start_pos:start_pos + s])
        q = rotate_activation(q)
        fp4_act_quant(q, 32, True)
        self.compressor(x, start_pos)
        w = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
        n = (start_pos + s) // r
        score = _causal_mask(_scores(q, self.kv_cache[:b, :n], w), r, start_pos)
        return _index_select(score, self.index_topk, r, start_pos, offset, False)


class Attention(nn.Module):
    """One V4 attention layer (ratio 0 window-only, 4 CSA, 128 HCA), or a V4.1 layer
    when ``v41`` (sharing through the module's ``shared_attn``)."""

    def __init__(self, layer_id, args, v41=False):
        super().__init__()
        self.layer_id, self.v41 = layer_id, v41
        self.dim, self.n_heads, self.head_dim = args.dim, args.n_heads, args.head_dim
        self.rope_head_dim, self.window_size = args.rope_head_dim, args.window_size
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.compress_ratio = args.compress_ratios[layer_id]
        self.eps = args.norm_eps
        self.softmax_scale = self.head_dim ** -0.5
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.wq_a = _linear(args.dim, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, self.eps)
        self.wq_b = _linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = _linear(args.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = _linear(self.n_heads * self.head_dim // self.n_groups,
                            self.n_groups * self.o_lora_rank)
        self.wo_b = _linear(self.n_groups * self.o_lora_rank, self.dim)
        r = self.compress_ratio
        self.register_buffer("freqs_cis", _freqs_for(args, r), persistent=False)
        if v41:
            self._init_v41(args)
            return
        if r:
            self.compressor = Compressor(args, r, self.head_dim)
            self.indexer = Indexer(args, r) if r == 4 else None
        n_cache = self.window_size + (args.max_seq_len // r if r else 0)
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, n_cache,
                                                     self.head_dim), persistent=False)

    # -- shared by V4 and V4.1
    def _queries(self, x, start_pos):
        b, s, _ = x.shape
        fr = self.freqs_cis[start_pos:start_pos + s]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if not self.v41:   # V4 rescales each head once more; V4.1 dropped that
            qf = q.float()
            q = (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + self.eps)).to(q.dtype)
        apply_rotary_emb(q[..., -self.rope_head_dim:], fr)
        return qr, q

    def _window_kv(self, x, start_pos, block, rope_too):
        fr = self.freqs_cis[start_pos:start_pos + x.shape[1]]
        kv = self.kv_norm(self.wkv(x))
        rd = self.rope_head_dim
        apply_rotary_emb(kv[..., -rd:], fr)
        act_quant(kv if rope_too else kv[..., :-rd], block, scale_fmt, scale_dtype, True)
        return kv

    def _ring_write(self, ring, kv, start_pos):
        b, s = kv.shape[:2]
        w = self.window_size
        if start_pos == 0:
            keep = min(s, w)
            slots = torch.arange(s - keep, s) % w
            ring[:b, slots] = kv[:, s - keep:]
        else:
            ring[:b, start_pos % w] = kv[:, 0]

    def _output(self, o, start_pos):
        b, s = o.shape[:2]
        apply_rotary_emb(o[..., -self.rope_head_dim:],
                         self.freqs_cis[start_pos:start_pos + s], True)
        og = o.reshape(b, s, self.n_groups, -1)
        wa = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        y = torch.einsum("bsgd,grd->bsgr", og, wa)
        return self.wo_b(y.flatten(2))

    def forward(self, x, start_pos):
        if self.v41:
            return self._forward_v41(x, start_pos)
        b, s, _ = x.shape
        w, r = self.window_size, self.compress_ratio
        qr, q = self._queries(x, start_pos)
        kv = self._window_kv(x, start_pos, 64, False)
        idx = get_window_topk_idxs(w, b, s, start_pos)
        if r:
            if self.compressor.kv_cache is None:
                self.compressor.kv_cache = self.kv_cache[:, w:]
                self.compressor.freqs_cis = self.freqs_cis
                if self.indexer is not None:
                    self.indexer.freqs_cis = self.freqs_cis
            off = s if start_pos == 0 else w
            cidx = (self.indexer(x, qr, start_pos, off) if self.indexer is not None
                    else get_compress_topk_idxs(r, b, s, start_pos, off))
            idx = torch.cat((idx, cidx), -1)
        idx = idx.int()
        self._ring_write(self.kv_cache, kv, start_pos)
        if start_pos == 0:
            allkv = kv
            if r:
                comp = self.compressor(x, start_pos)
                if comp is not None:
                    allkv = torch.cat((kv, comp), 1)
            o = sparse_attn(q, allkv, self.attn_sink, idx, self.softmax_scale)
        else:
            if r:
                self.compressor(x, start_pos)
            o = sparse_attn(q, self.kv_cache[:b], self.attn_sink, idx, self.softmax_scale)
        return self._output(o, start_pos)

    # -- V4.1 (CSA2)
    def _init_v41(self, args):
        lid, r = self.layer_id, self.compress_ratio
        self.is_kv_source = r > 0 and lid in args.kv_source_layers
        self.is_index_source = r > 0 and lid in args.index_source_layers
        self.compressor = V41Compressor(args, r, self.head_dim) if self.is_kv_source else None
        self.indexer = V41Indexer(args, lid) if self.is_index_source else None
        self.register_buffer("window_kv_cache", torch.zeros(args.max_batch_size,
                                                            self.window_size, self.head_dim),
                             persistent=False)
        if self.is_kv_source:
            self.register_buffer("compress_kv_cache",
                                 torch.zeros(args.max_batch_size, args.max_seq_len // r,
                                             self.head_dim), persistent=False)

    def _v41_topk(self, x, qr, latent, start_pos, offset, n):
        """Compressed positions per query: an index source runs its indexer and publishes
        the result; the layers between index sources reuse the last one published."""
        if not self.is_index_source:
            return shared_attn.topk_idxs
        if n == 0:
            idx = torch.zeros(x.shape[0], x.shape[1], 0, dtype=torch.int32)
        else:
            if self.indexer.freqs_cis is None:
                self.indexer.freqs_cis = self.freqs_cis
            idx = self.indexer(x, qr, latent, start_pos, offset)
        shared_attn.topk_idxs = idx
        return idx

    def _v41_compressed(self, x, qr, start_pos, offset):
        """(compressed KV rows this call attends, their top-k lists).  A kv source pools
        and publishes its cache; the indexer reads the latent before it is rotated and
        rounded; every other layer reads the cache the last source published."""
        b, s, _ = x.shape
        r, rd = self.compress_ratio, self.rope_head_dim
        n = (start_pos + s) // r
        latent = None
        if self.is_kv_source:
            latent = self.compressor(x, start_pos)
            shared_attn.compress_kv = self.compress_kv_cache
        idx = self._v41_topk(x, qr, latent, start_pos, offset, n)
        if latent is not None:
            first = 0 if start_pos == 0 else start_pos // r
            g = latent.shape[1]
            apply_rotary_emb(latent[..., -rd:], self.freqs_cis[torch.arange(first, first + g) * r])
            fp4_act_quant(latent, 16, True, scale_dtype=torch.float8_e4m3fn)
            self.compress_kv_cache[:b, first:first + g] = latent
        return shared_attn.compress_kv[:b, :n], idx

    def _forward_v41(self, x, start_pos):
        b, s, _ = x.shape
        w = self.window_size
        qr, q = self._queries(x, start_pos)
        kv = self._window_kv(x, start_pos, 32, True)
        self._ring_write(self.window_kv_cache, kv, start_pos)
        kv_all = kv if start_pos == 0 else self.window_kv_cache[:b]
        idx = get_window_topk_idxs(w, b, s, start_pos)
        if self.compress_ratio:
            ckv, cidx = self._v41_compressed(x, qr, start_pos, kv_all.shape[1])
            kv_all = torch.cat((kv_all, ckv), 1)
            idx = torch.cat((idx, cidx.long()), -1)
        o = sparse_attn(q, kv_all, self.attn_sink, idx.int(), self.softmax_scale)
        return self._output(o, start_pos)


# ----------------------------------------------------------------------------- V4.1 modules
class SharedAttention:
    """What V4.1 sources publish for the layers after them, one object per module (as in
    the released file): sources write before the layers that read run, so one slot each."""

    def __init__(self):
        self.compress_kv = self.index_k = self.topk_idxs = self.candidates = None


shared_attn = SharedAttention()
_REPUBLISH_INDEX_K = [False]


def reset_shared():
    """Empties ``shared_attn`` (the released module never does; tests that run several
    models one after another start each from a clean slate)."""
    shared_attn.__init__()


def republish_index_k(on=True):
    """Context: index-key owners publish their key cache on every call (CSALayer's
    behaviour), not only on calls where their compressor emits an entry (released)."""
    return _Switch(_REPUBLISH_INDEX_K, on)


class V41Compressor(nn.Module):
    """V4.1 pooling: no overlap, no ape; ratio 1 is norm(wkv(x)). Returns the normed latent
    before RoPE, or None while a group fills."""

    def __init__(self, args, ratio, head_dim):
        super().__init__()
        self.compress_ratio, self.head_dim = ratio, head_dim
        self.norm = RMSNorm(head_dim, args.norm_eps)
        self.wkv = _linear(args.dim, head_dim, torch.float32)
        if ratio > 1:
            self.wgate = _linear(args.dim, head_dim, torch.float32)
            nb = args.max_batch_size
            self.register_buffer("kv_state", torch.zeros(nb, ratio, head_dim), persistent=False)
            self.register_buffer("score_state", torch.full((nb, ratio, head_dim), float("-inf")),
                                 persistent=False)

    def forward(self, x, start_pos):
        b, s, _ = x.shape
        r = self.compress_ratio
        if r == 1:
            return self.norm(self.wkv(x.float()).to(x.dtype))
        xf = x.float()
        kv, sc = self.wkv(xf), self.wgate(xf)
        if start_pos == 0:
            full = s - s % r
            if s > full:
                self.kv_state[:b, :s - full] = kv[:, full:]
                self.score_state[:b, :s - full] = sc[:, full:]
            if full == 0:
                return None
            kvg = kv[:, :full].reshape(b, full // r, r, -1)
            scg = sc[:, :full].reshape(b, full // r, r, -1)
            pooled = (kvg * torch.softmax(scg, 2)).sum(2)
        else:
            self.kv_state[:b, start_pos % r] = kv[:, 0]
            self.score_state[:b, start_pos % r] = sc[:, 0]
            if (start_pos + 1) % r:
                return None
            pooled = (self.kv_state[:b] * torch.softmax(self.score_state[:b], 1)).sum(
                1, keepdim=True)
        return self.norm(pooled.to(x.dtype))


def select_candidate_blocks(score, n_visible, topk_blocks, block_size):
    """Boolean [.., Tc] mask of the kept blocks (V4.1 level one).
    n_visible: [S, 1] tensor (prefill) or int (decode)."""
    tc = score.shape[-1]
    nb = -(-tc // block_size)
    pad = torch.full((*score.shape[:-1], nb * block_size - tc), float("-inf"))
    bs = torch.cat((score, pad), -1).reshape(*score.shape[:-1], nb, block_size).amax(-1)
    newest = (torch.as_tensor(n_visible) - 1) // block_size
    bs = torch.where(torch.arange(nb) == newest, torch.full_like(bs, float("inf")), bs)
    vals, top = bs.topk(min(topk_blocks, nb), dim=-1)
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter(-1, top, vals > float("-inf"))
    return keep.repeat_interleave(block_size, -1)[..., :tc]


class V41Indexer(nn.Module):
    """V4.1 indexer.  On a kv source it owns the index keys (made from the layer's
    latent: wk, k_norm, RoPE at the group's first position, FP4) and publishes them in
    ``shared_attn.index_k``; every V4.1 indexer scores against what is published there.
    The candidate source publishes the kept blocks; the index layers after it score only
    inside them.  Returns int32 top-k lists in position order (+ offset, -1 = none)."""

    def __init__(self, args, layer_id):
        super().__init__()
        ratio = args.compress_ratios[layer_id]
        source = args.candidate_source_layer     # -1: no two-level top-k
        self.owns_k = layer_id in args.kv_source_layers
        self.is_candidate_source = source == layer_id
        self.uses_candidates = source >= 0 and layer_id > source
        self.candidate_topk_blocks, self.candidate_block_size = (
            args.candidate_topk_blocks, args.candidate_block_size)
        self.n_heads = self.n_local_heads = args.index_n_heads
        self.index_head_dim, self.rope_head_dim = args.index_head_dim, args.rope_head_dim
        self.index_topk, self.compress_ratio = args.index_topk, ratio
        self.softmax_scale = self.index_head_dim ** -0.5
        self.wq_b = _linear(args.q_lora_rank, self.n_heads * self.index_head_dim)
        self.weights_proj = _linear(args.dim, self.n_heads)
        self.freqs_cis = None
        if self.owns_k:
            self.wk = _linear(args.head_dim, self.index_head_dim)
            self.k_norm = RMSNorm(self.index_head_dim, args.norm_eps)
            self.register_buffer("k_cache", torch.zeros(args.max_batch_size,
                                                        args.max_seq_len // ratio,
                                                        self.index_head_dim), persistent=False)

    def forward(self, x, qr, latent, start_pos, offset):
        b, s, _ = x.shape
        r, rd = self.compress_ratio, self.rope_head_dim
        n = (start_pos + s) // r
        if self.owns_k and latent is not None:
            first = 0 if start_pos == 0 else start_pos // r
            g = latent.shape[1]
            k = self.k_norm(self.wk(latent))
            apply_rotary_emb(k[..., -rd:], self.freqs_cis[torch.arange(first, first + g) * r])
            fp4_act_quant(k, fp4_block_size, True)
            self.k_cache[:b, first:first + g] = k
            shared_attn.index_k = self.k_cache
        elif self.owns_k and _REPUBLISH_INDEX_K[0]:
            shared_attn.index_k = self.k_cache
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.index_head_dim))
        apply_rotary_emb(q[..., -rd:], self.freqs_cis[start_pos:start_pos + s])
        fp4_act_quant(q, fp4_block_size, True)
        w = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
        score = _causal_mask(_scores(q, shared_attn.index_k[:b, :n], w), r, start_pos)
        if self.is_candidate_source:
            nvis = ((torch.arange(s) + 1) // r)[:, None] if start_pos == 0 else n
            shared_attn.candidates = select_candidate_blocks(
                score, nvis, self.candidate_topk_blocks, self.candidate_block_size)
        elif self.uses_candidates:
            score = score.masked_fill(~shared_attn.candidates, float("-inf"))
        return _index_select(score, self.index_topk, r, start_pos, offset, True).int()


# ----------------------------------------------------------------------------- stacks
class AttnStack(nn.Module):
    """Attention layers chained with a residual, h = h + attn_i(h): enough to check that
    swapping one layer leaves the others' inputs and outputs unchanged.  (V4.1 layers
    share through the module's ``shared_attn``, as the released file's do.)"""

    def __init__(self, args, v41=False, layer_ids=None):
        super().__init__()
        ids = range(len(args.compress_ratios)) if layer_ids is None else layer_ids
        self.layers = nn.ModuleList(Attention(i, args, v41) for i in ids)
        self.v41 = v41

    def forward(self, h, start_pos=0):
        for a in self.layers:
            h = h + a(h, start_pos)
        return h


def randomize(module, seed=0, scale=None):
    """Deterministic random weights: N(0, 1/fan_in) projections, N(0, 1) ape, norms near 1,
    sinks ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2 and not name.endswith("ape"):
                p.copy_(torch.randn(p.shape, generator=g) * (scale or p.shape[1] ** -0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g))
    return module


# ----------------------------------------------------------------------------- swap checks
def record(model, run, substitute=None):
    """Runs ``run(model)`` under no_grad with hooks on every attention module and indexer;
    returns ({layer: [output per call]}, {layer: [top-k per call]}) as NumPy.
    ``substitute`` {layer: [output per call]}: those layers' outputs are recorded, then
    replaced by the given ones, so the layers after them see the same inputs as in the
    run the outputs came from."""
    from deepseek_csa.torch import _attention_modules
    outs, tks, hooks = {}, {}, []
    substitute = substitute or {}

    def on_out(m, i, o, l):
        outs[l].append(o.detach().float().numpy().copy())
        if l in substitute:
            return torch.from_numpy(substitute[l][len(outs[l]) - 1]).to(o.dtype)
        return None

    for lid, a in _attention_modules(model):
        outs[lid], tks[lid] = [], []
        hooks.append(a.register_forward_hook(lambda m, i, o, l=lid: on_out(m, i, o, l)))
        ix = getattr(a, "indexer", None)
        if ix is not None:
            hooks.append(ix.register_forward_hook(
                lambda m, i, o, l=lid: tks[l].append(o.detach().numpy().copy())))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for h in hooks:
            h.remove()
    return outs, tks


def rel_err(got, want):
    import numpy as np
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def norm_err(got, want):
    import numpy as np
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# The error budget of a layer (ours, or a swapped one) against the float32 reference,
# row by row (a row: one token's output vector; errors relative to the call's largest
# |want|).  Float32 alone: measured 2e-7 .. 9e-7, so QAT_TOL = 1e-5 (x ~10-50).  With
# the released QAT rounding, a value within an ulp of an FP8 / FP4 rounding boundary can
# round the other way (the two sides' last bits differ: other BLAS, another summation
# order, the sanitizer build's code generation); one step of an e4m3 / e2m1 grid moves
# the rows that read it by ~1e-3 .. 5e-3.  Those rows are allowed, up to QAT_FLIP_TOL,
# but only a few: QAT_MAX_FLIP_ROWS per call (measured: 0 in the -O3 build on these
# tests).  A wrong rounding (block, scale, skipped) or an attention output off by a
# relative 5e-4 moves every row, and fails.
QAT_TOL = 1e-5
QAT_FLIP_TOL = 1e-2
QAT_MAX_FLIP_ROWS = 4
# A flipped rounding in a KV row or a compressed entry moves every row that reads it: a
# window of rows, or every later row that selects the entry (with top-512 of a few
# hundred entries, nearly all).  Where the two sides' projections differ in their last
# bits (AMD EPYC Zen 4: torch's BLAS and NumPy's round a row block differently) such
# flips are a few per long call: measured, 16 rows of a window-16 layer up to 2.5e-3
# (norm-wise 5.8e-4) and 960 of 2064 rows of a V4-Flash-shaped layer up to 1.8e-4
# (norm-wise 1.5e-4), with the same calls within 1e-6 once QAT is off on both sides.
# qat_close_reach bounds those norm-wise by QAT_NORM_TOL; a rounding skipped or
# misplaced moves the output norm-wise by ~1e-2 (an e4m3 step is 2^-3 of the value).
QAT_NORM_TOL = 1e-3


def row_errs(got, want):
    """Per row (last axis) the largest |got - want|, over the largest |want| of the call."""
    import numpy as np
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    d = np.abs(got - want).reshape(-1, got.shape[-1] if got.ndim else 1)
    return d.max(-1) / max(np.abs(want).max(), 1e-30)


def qat_flips(got, want, tol=QAT_TOL):
    """The rows of a call outside tol (rows a QAT rounding flip may explain)."""
    import numpy as np
    return int((np.nan_to_num(row_errs(got, want), nan=np.inf) > tol).sum())


def qat_close(got, want, tol=QAT_TOL, flip_tol=QAT_FLIP_TOL, max_flips=QAT_MAX_FLIP_ROWS):
    """Every row within tol of the call's largest |want|, except at most max_flips rows
    (an FP8/FP4 QAT rounding that flipped: see QAT_TOL above), which stay within
    flip_tol.  No norm-wise fallback: an error spread over every row fails."""
    import numpy as np
    e = np.nan_to_num(row_errs(got, want), nan=np.inf)
    return int((e > tol).sum()) <= max_flips and bool((e <= flip_tol).all())


def qat_close_reach(got, want, flip_tol=QAT_FLIP_TOL, norm_tol=QAT_NORM_TOL):
    """Every row within flip_tol of the call's largest |want| and the whole call within
    norm_tol norm-wise: QAT flips in KV rows / compressed entries that many rows read
    (see QAT_NORM_TOL).  Weaker than qat_close: pair it with a comparison of the same
    calls with QAT off on both sides (``qat(False)``, ``CSALayer(qat=False)``) held to
    QAT_TOL on every row."""
    import numpy as np
    e = np.nan_to_num(row_errs(got, want), nan=np.inf)
    return bool((e <= flip_tol).all()) and norm_err(got, want) <= norm_tol


def topk_overlap(got, want):
    """Fraction of want's valid entries that got selects too (rows compared as sets)."""
    import numpy as np
    g, w = np.asarray(got), np.asarray(want)
    if w.size == 0 or g.size == 0:
        return 1.0 if g.shape == w.shape else 0.0
    rows = zip(g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1]))
    same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in rows)
    return same / max(int((w >= 0).sum()), 1)


def swap_report(make_model, run, layers=None, ops=None):
    """For each layer L: a fresh model from ``make_model()``, layer L swapped onto
    deepseek_csa, ``run``; compared with the unswapped run.  The swapped layer's output is
    handed on as the unswapped run's (``record(substitute=...)``): QAT rounding and top-k
    selection are discontinuous, so a 1e-7 change would otherwise flip roundings and
    selections downstream and hide what is being measured, the swapped layer itself.
    Returns one dict per swapped layer: 'layer', 'max_rel_err' (worst over every layer's
    output and every call), 'per_layer' {layer: worst rel err}, 'norm_err',
    'flipped_rows' (rows of the swapped layer outside QAT_TOL), 'topk_equal' (sorted
    top-k sets identical everywhere), 'topk_overlap', and 'ok': the swapped layer
    ``qat_close`` on every call, every other layer within QAT_TOL, and the top-k sets
    equal (or, after an FP4 flip in the indexer, 99% of them)."""
    import numpy as np
    import deepseek_csa.torch as dct
    base_out, base_tk = record(make_model(), run)
    report = []
    for lid in (sorted(base_out) if layers is None else layers):
        m = make_model()
        with dct.swap(m, layers=[lid], ops=ops):
            outs, tks = record(m, run, substitute={lid: base_out[lid]})
        per = {l: max(rel_err(g, w) for g, w in zip(outs[l], base_out[l])) for l in base_out}
        nrm = max(norm_err(g, w) for g, w in zip(outs[lid], base_out[lid]))
        # the swapped layer: qat_close on every call; the others see the same inputs
        close = len(outs[lid]) == len(base_out[lid]) and all(
            qat_close(g, w) for g, w in zip(outs[lid], base_out[lid]))
        flips = sum(qat_flips(g, w) for g, w in zip(outs[lid], base_out[lid]))
        others = max([e for l, e in per.items() if l != lid] or [0.0])
        ovl = min([topk_overlap(g, w) for l in base_tk for g, w in zip(tks[l], base_tk[l])]
                  or [1.0])
        same = all(len(tks[l]) == len(base_tk[l]) and
                   all(np.array_equal(np.sort(g, -1), np.sort(w, -1))
                       for g, w in zip(tks[l], base_tk[l])) for l in base_tk)
        report.append({"layer": lid, "max_rel_err": max(per.values()), "per_layer": per,
                       "norm_err": nrm, "flipped_rows": flips, "topk_equal": same,
                       "topk_overlap": ovl,
                       "ok": close and others < QAT_TOL and (same or ovl >= 0.99)})
    return report


def to_bf16(model):
    """The released dtypes: projections and caches bfloat16; the compressors' wkv/wgate,
    norms' weights, sinks, ape and streaming state stay float32."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not ("compressor.wkv" in name or "compressor.wgate" in name):
            mod.weight.data = mod.weight.data.bfloat16()
        for bn, b in list(mod._buffers.items()):
            if bn in ("kv_cache", "window_kv_cache", "compress_kv_cache", "k_cache"):
                mod._buffers[bn] = b.bfloat16()
    return model
