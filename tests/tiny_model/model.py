"""A tiny DeepSeek-V4-shaped transformer written for deepseek_csa's tests (NOT DeepSeek's
code): it uses DeepSeek's GPU-only modules the way the released ``inference/model.py``
does, so that ``deepseek_csa.torch.load_model_py`` can be tested without it:

* ``kernel`` is imported at import time (act_quant, fp4_act_quant, fp8_gemm, fp4_gemm,
  sparse_attn, hc_split_sinkhorn), ``fast_hadamard_transform`` inside every
  ``rotate_activation`` call, which asserts bfloat16;
* FP8 linears (``dtype="fp8"``: float8_e4m3fn weights with one scale per 128 x 128
  block) and FP4 experts (``expert_dtype="fp4"``: float4_e2m1fn_x2 weights, one e8m0
  scale per 32 along K) run as act_quant -> fp8_gemm / fp4_gemm, whose results come back
  in ``torch.get_default_dtype()`` (bf16: build and run with the default dtype bf16);
* ``Transformer.__init__`` sets the module globals world_size, rank, default_dtype,
  scale_fmt and scale_dtype (one import, one configuration).

Tensor parallel (under an initialized ``torch.distributed``, one rank per process), laid
out like the released file: the embedding splits the vocabulary (each rank looks up its
rows, zeros elsewhere, all-reduce), ColumnParallelLinear splits output features,
RowParallelLinear input features (each rank's partial output in the default dtype, then
a float32 all-reduce), the query heads and their sinks split across ranks, the routed
experts split across ranks (each rank sums its own experts' outputs, all-reduce, then the
replicated shared expert), the head splits the vocabulary (all-gather of the logits).
Window KV (one head) and the hyper-connections are replicated.  ``n_hash_layers`` > 0
routes the first layers by a token-id -> experts table (``tid2eid``) instead of the
gate's top-k, as the released hash layers do.

Each layer: hyper-connections (hc_mult residual copies mixed by hc_split_sinkhorn), a
sliding-window attention with one shared KV head and a sink (queries through a low-rank
projection, RoPE on the last rope_head_dim features, window KV FP8-rounded in place, a
Hadamard-rotated FP4-rounded probe), then a routed MoE with FP4 experts and an FP8
shared expert.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from kernel import act_quant, fp4_act_quant, fp8_gemm, fp4_gemm, sparse_attn, hc_split_sinkhorn

world_size = 1
rank = 0
default_dtype = torch.bfloat16
scale_fmt = None
scale_dtype = torch.float32
block_size = 128
fp4_block_size = 32


@dataclass
class ModelArgs:
    max_batch_size: int = 2
    max_seq_len: int = 64
    dtype: str = "fp8"            # "bf16" or "fp8": the dense linears
    expert_dtype: str = "fp4"     # "bf16", "fp8" or "fp4": the routed experts
    scale_fmt: Optional[str] = "ue8m0"
    vocab_size: int = 96
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 128
    rope_head_dim: int = 64
    q_lora_rank: int = 128
    window_size: int = 8
    n_routed_experts: int = 4
    n_activated_experts: int = 2
    moe_inter_dim: int = 256
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 6
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    n_hash_layers: int = 0        # the first n layers route by token id (tid2eid)


def _weight_dtype(kind):
    return {"bf16": torch.get_default_dtype(), "fp8": torch.float8_e4m3fn,
            "fp4": torch.float4_e2m1fn_x2}[kind]


def linear(x, weight, scale=None):
    """y = x @ W^T through the block-scaled GEMMs for FP8 / FP4 weights."""
    if weight.dtype == torch.float4_e2m1fn_x2:
        q, s = act_quant(x, block_size, scale_fmt, scale_dtype)
        return fp4_gemm(q, s, weight, scale, scale_dtype)
    if weight.dtype == torch.float8_e4m3fn:
        q, s = act_quant(x, block_size, scale_fmt, scale_dtype)
        return fp8_gemm(q, s, weight, scale, scale_dtype)
    return F.linear(x, weight)


class Linear(nn.Module):
    def __init__(self, in_features, out_features, dtype=None):
        super().__init__()
        dtype = dtype or default_dtype
        self.in_features, self.out_features = in_features, out_features
        cols = in_features // 2 if dtype == torch.float4_e2m1fn_x2 else in_features
        self.weight = nn.Parameter(torch.empty(out_features, cols, dtype=dtype),
                                   requires_grad=False)
        if dtype == torch.float8_e4m3fn:
            self.scale = nn.Parameter(torch.empty(math.ceil(out_features / 128),
                                                  math.ceil(in_features / 128), dtype=scale_dtype),
                                      requires_grad=False)
        elif dtype == torch.float4_e2m1fn_x2:
            self.scale = nn.Parameter(torch.empty(out_features, in_features // fp4_block_size,
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.register_parameter("scale", None)

    def forward(self, x):
        return linear(x, self.weight, self.scale)


def _split(n, what):
    if n % world_size:
        raise ValueError(f"{what}={n} is not divisible by world_size={world_size}")
    return n // world_size


class ColumnParallelLinear(Linear):
    """Output features split across ranks: rank r holds rows r*N/ws .. (r+1)*N/ws - 1;
    the output stays split (the caller works on its local features)."""

    def __init__(self, in_features, out_features, dtype=None):
        self.part_out_features = _split(out_features, "out_features")
        super().__init__(in_features, self.part_out_features, dtype)


class RowParallelLinear(Linear):
    """Input features split across ranks; each rank's partial product comes back in
    the default dtype and the ranks' partials are summed in float32."""

    def __init__(self, in_features, out_features, dtype=None):
        self.part_in_features = _split(in_features, "in_features")
        super().__init__(self.part_in_features, out_features, dtype)

    def forward(self, x):
        y = linear(x, self.weight, self.scale)
        if world_size > 1:
            y = y.float()
            dist.all_reduce(y)
        return y.type_as(x)


class ParallelEmbedding(nn.Module):
    """The vocabulary split across ranks; ids outside a rank's rows look up zeros and
    the ranks' lookups are summed."""

    def __init__(self, vocab_size, dim):
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.part_vocab_size = _split(vocab_size, "vocab_size")
        self.vocab_start = rank * self.part_vocab_size
        self.weight = nn.Parameter(torch.empty(self.part_vocab_size, dim))

    def forward(self, tokens):
        if world_size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.part_vocab_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(y)
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def precompute_freqs_cis(rope_dim, seqlen, base):
    i = torch.arange(0, rope_dim, 2, dtype=torch.float32)
    freqs = 1.0 / (base ** (i / rope_dim))
    ang = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(ang), ang)


def apply_rotary_emb(x, freqs_cis, inverse=False):
    """Rotates adjacent pairs of x's last dim by the positions' angles, in place."""
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    fc = freqs_cis.conj() if inverse else freqs_cis
    fc = fc.view(1, z.size(1), *([1] * (z.dim() - 3)), z.size(-1))
    x.copy_(torch.view_as_real(z * fc).flatten(-2))
    return x


def rotate_activation(x):
    assert x.dtype == torch.bfloat16
    from fast_hadamard_transform import hadamard_transform
    return hadamard_transform(x, scale=x.size(-1) ** -0.5)


def get_window_topk_idxs(window_size, bsz, seqlen, start_pos):
    """Prefill: row s sees positions max(0, s - window + 1) .. s of this call's KV;
    decode: the ring slots, oldest first, -1 while the ring is filling."""
    if start_pos == 0:
        w = min(seqlen, window_size)
        s = torch.arange(seqlen).unsqueeze(1)
        j = s - (w - 1) + torch.arange(w).unsqueeze(0)
        idx = torch.where(j >= 0, j, torch.full_like(j, -1))
    else:
        slots = (start_pos + 1 + torch.arange(window_size)) % window_size
        pos = start_pos - window_size + 1 + torch.arange(window_size)
        idx = torch.where(pos >= 0, slots, torch.full_like(slots, -1)).view(1, window_size)
    return idx.to(torch.int32).view(1, seqlen, -1).expand(bsz, -1, -1)


class Attention(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_head_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.n_local_heads = _split(args.n_heads, "n_heads")
        self.window_size = args.window_size
        self.softmax_scale = args.head_dim ** -0.5
        self.wq_a = Linear(args.dim, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, args.n_heads * args.head_dim)
        self.wkv = Linear(args.dim, args.head_dim)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wo = RowParallelLinear(args.n_heads * args.head_dim, args.dim)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_local_heads, dtype=torch.float32))
        self.register_buffer("kv_cache", torch.zeros(args.max_batch_size, args.window_size,
                                                     args.head_dim), persistent=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(
            args.rope_head_dim, args.max_seq_len, args.rope_theta), persistent=False)

    def forward(self, x, start_pos):
        bsz, seqlen, _ = x.shape
        end, rd, win = start_pos + seqlen, self.rope_head_dim, self.window_size
        fc = self.freqs_cis[start_pos:end]
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.n_local_heads, self.head_dim))
        apply_rotary_emb(q[..., -rd:], fc)
        kv = self.kv_norm(self.wkv(x))
        apply_rotary_emb(kv[..., -rd:], fc)
        act_quant(kv[..., :-rd], 64, scale_fmt, scale_dtype, True)
        # a rotated, FP4-rounded probe of the keys added back at a small weight
        probe = rotate_activation(kv)
        fp4_act_quant(probe, fp4_block_size, True)
        kv = kv + 0.125 * rotate_activation(probe)
        if start_pos == 0:
            keep = min(seqlen, win)
            pos = torch.arange(seqlen - keep, seqlen)
            self.kv_cache[:bsz, pos % win] = kv[:, seqlen - keep:].to(self.kv_cache.dtype)
            kv_all = kv
        else:
            self.kv_cache[:bsz, start_pos % win] = kv[:, 0].to(self.kv_cache.dtype)
            kv_all = self.kv_cache[:bsz]
        idx = get_window_topk_idxs(win, bsz, seqlen, start_pos)
        o = sparse_attn(q, kv_all, self.attn_sink, idx, self.softmax_scale)
        apply_rotary_emb(o[..., -rd:], fc, True)
        return self.wo(o.flatten(2))


class Expert(nn.Module):
    def __init__(self, dim, inter, dtype=None):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, inter, dtype), Linear(inter, dim, dtype), \
            Linear(dim, inter, dtype)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.topk = args.n_activated_experts
        self.hash = layer_id < args.n_hash_layers
        self.gate = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if self.hash:
            self.tid2eid = nn.Parameter(torch.empty(args.vocab_size, self.topk,
                                                    dtype=torch.int32), requires_grad=False)
        n_local = _split(args.n_routed_experts, "n_routed_experts")
        self.experts_start, self.experts_end = rank * n_local, (rank + 1) * n_local
        edt = _weight_dtype(args.expert_dtype)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim, edt)
            if self.experts_start <= e < self.experts_end else None
            for e in range(args.n_routed_experts))
        self.shared_experts = Expert(args.dim, args.moe_inter_dim)

    def forward(self, x, input_ids=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = F.linear(x.float(), self.gate.float()).sigmoid()
        if self.hash:
            ids = self.tid2eid[input_ids.reshape(-1)].long()
            w = scores.gather(1, ids)
        else:
            w, ids = scores.topk(self.topk, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(self.experts_start, self.experts_end):
            rows, which = torch.where(ids == e)
            if rows.numel():
                y[rows] += self.experts[e](x[rows]).float() * w[rows, which, None]
        if world_size > 1:
            dist.all_reduce(y)
        y = y + self.shared_experts(x).float()
        return y.to(x.dtype).view(shape)


class Block(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        h, d = args.hc_mult, args.dim
        self.hc_mult, self.iters, self.hc_eps = h, args.hc_sinkhorn_iters, args.hc_eps
        self.attn_norm, self.ffn_norm = RMSNorm(d, args.norm_eps), RMSNorm(d, args.norm_eps)
        self.attn = Attention(layer_id, args)
        self.ffn = MoE(layer_id, args)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.empty((2 + h) * h, h * d,
                                                                    dtype=torch.float32)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros((2 + h) * h,
                                                                      dtype=torch.float32)))

    def hc_pre(self, x, part):
        xf = x.flatten(2).float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
        mixes = F.linear(xf, getattr(self, f"hc_{part}_fn"))
        pre, post, comb = hc_split_sinkhorn(mixes, getattr(self, f"hc_{part}_scale"),
                                            getattr(self, f"hc_{part}_base"), self.hc_mult,
                                            self.iters, self.hc_eps)
        y = (pre.unsqueeze(-1) * x.float()).sum(2)
        return y.to(x.dtype), post, comb

    def hc_post(self, y, residual, post, comb):
        mixed = torch.einsum("bsij,bsid->bsjd", comb, residual.float())
        return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(residual.dtype)

    def forward(self, x, start_pos, input_ids=None):
        y, post, comb = self.hc_pre(x, "attn")
        x = self.hc_post(self.attn(self.attn_norm(y), start_pos), x, post, comb)
        y, post, comb = self.hc_pre(x, "ffn")
        return self.hc_post(self.ffn(self.ffn_norm(y), input_ids), x, post, comb)


class Transformer(nn.Module):
    def __init__(self, args):
        global world_size, rank, default_dtype, scale_fmt, scale_dtype
        on = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if on else 1
        rank = dist.get_rank() if on else 0
        default_dtype = _weight_dtype(args.dtype)
        scale_fmt = args.scale_fmt
        scale_dtype = torch.float8_e8m0fnu if args.scale_fmt == "ue8m0" else torch.float32
        super().__init__()
        self.args = args
        self.embed = ParallelEmbedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Parameter(torch.empty(_split(args.vocab_size, "vocab_size"), args.dim,
                                             dtype=torch.float32))

    @torch.inference_mode()
    def forward(self, tokens, start_pos=0):
        h = self.embed(tokens).unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)
        for layer in self.layers:
            h = layer(h, start_pos, tokens)
        logits = F.linear(self.norm(h.mean(2)[:, -1]).float(), self.head)
        if world_size > 1:
            parts = [torch.empty_like(logits) for _ in range(world_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, -1)
        return logits
