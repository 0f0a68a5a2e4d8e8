"""Float32 torch reference of the QAT rounding and the Hadamard rotation, written from
docs/kernels.md, section 7 (and the released kernel's scale arithmetic: amax times the float32
constant 1/qmax, power-of-two scales from the exponent bits, e4m3 scales by torch's
own float8_e4m3fn cast).  Returns new tensors; the inputs are not modified."""
import math

import torch

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pow2_ceil(r):
    """2**ceil(log2(r)) for r > 0, exact at powers of two (frexp, no log2); inf and NaN
    pass through."""
    m, e = torch.frexp(r)
    e = e - (m == 0.5).to(e.dtype)
    s = torch.ldexp(torch.ones_like(r), e)
    return torch.where(torch.isfinite(r), s, r)


def round_e4m3(v):
    """Nearest-even onto the e4m3fn grid, by torch's own cast (v within +-448 or NaN)."""
    return v.to(torch.float8_e4m3fn).float()


def round_e2m1(v):
    """Nearest-even onto {0, .5, 1, 1.5, 2, 3, 4, 6} (v within +-6 or NaN) by an explicit
    table search: the nearest grid point, and on a tie the one with an even code (even
    index in the table = mantissa bit 0).  The sign (and -0) is kept."""
    a = v.abs().double()
    g = E2M1_GRID.double()
    dist = (a.unsqueeze(-1) - g).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best
    even = cand & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.int().argmax(-1), cand.int().argmax(-1))
    r = E2M1_GRID[idx]
    r = torch.where(torch.isnan(v), v, r)
    return torch.copysign(r, v)


def _blocks(x, block):
    return x.float().unflatten(-1, (-1, block))


def fp8_round(x, block, scale="ue8m0"):
    """kernels.md section 7 FP8: amax = max(|x|, 1e-4) per block, s = 2^ceil(log2(amax/448)) (or
    amax/448 with scale='fp32'), x = round_e4m3(clamp(x/s, -448, 448)) * s."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    r = amax * torch.tensor(1 / 448, dtype=torch.float32)
    s = pow2_ceil(r) if scale == "ue8m0" else r
    q = round_e4m3((xb / s).clamp(-448, 448))
    return (q * s).flatten(-2)


def fp4_round(x, block, scale="ue8m0"):
    """kernels.md section 7 FP4: amax = max(|x|, 6*2^-126), s = 2^ceil(log2(amax/6)),
    x = round_e2m1(clamp(x/s, -6, 6)) * s.  scale='e4m3' (V4.1 compressed KV): amax
    floored at 6*2^-9 and s = e4m3(amax/6), saturated at 448 like the hardware cast."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "e4m3":
        amax = amax.clamp_min(6 * 2.0 ** -9)
        r = amax / 6
        r = torch.where(torch.isinf(r), torch.full_like(r, math.nan), r.clamp_max(448))
        s = round_e4m3(r)
    else:
        amax = amax.clamp_min(6 * 2.0 ** -126)
        s = pow2_ceil(amax * torch.tensor(1 / 6, dtype=torch.float32))
    q = round_e2m1((xb / s).clamp(-6, 6))
    return (q * s).flatten(-2)


def hadamard_matrix(n):
    """Sylvester-order Hadamard matrix H_n (entries +-1), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(x, scale=None):
    """kernels.md section 7: x @ H_n * n^-0.5 over the last axis (H symmetric), in float64 then float32."""
    n = x.shape[-1]
    s = n ** -0.5 if scale is None else scale
    return (x.double() @ hadamard_matrix(n).double() * s).float()
