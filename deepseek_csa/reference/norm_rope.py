"""Float32 torch reference of RMSNorm and RoPE/YaRN, written from docs/kernels.md, sections 1-2."""
import math

import torch


def rms_norm(x, w=None, eps=1e-6):
    """kernels.md section 1: computed in float32 whatever the input dtype; output in the input's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)


def rope_table(rope_dim, seqlen, base, original_seq_len=0, factor=1.0, beta_fast=32, beta_slow=1):
    """kernels.md section 2: float32 [seqlen, rope_dim//2] cos and sin."""
    i = torch.arange(rope_dim // 2, dtype=torch.float32)
    f = 1.0 / (base ** (2 * i / rope_dim))
    if original_seq_len > 0:
        def corr(n):
            return rope_dim * math.log(original_seq_len / (n * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
        span = 0.001 if high == low else high - low
        ramp = ((i - low) / span).clamp(0, 1)
        f = f / factor * ramp + f * (1 - ramp)
    a = torch.arange(seqlen, dtype=torch.float32)[:, None] * f[None, :]
    return torch.cos(a), torch.sin(a)


def apply_rope(x, cos, sin, inverse=False):
    """kernels.md section 2: rotates the last 2*cos.shape[-1] features of x ([B,S,D] or [B,S,H,D]) as
    adjacent pairs by the angle of row s of the tables; returns a new tensor."""
    half = cos.shape[-1]
    dt = x.dtype
    x = x.float()
    head, tail = x[..., :-2 * half], x[..., -2 * half:]
    re, im = tail[..., 0::2], tail[..., 1::2]
    shape = [1, cos.shape[0]] + [1] * (x.dim() - 3) + [half]
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    out = torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2)
    return torch.cat((head, out), dim=-1).to(dt)
