"""QAT rounding and the Hadamard rotation: memory-bound, so GB/s against stream bandwidth.

The eager side is the reference formula in torch (what the released model's rounding
computes, written with torch ops); for hadamard it is ``x @ H`` with the explicit
Sylvester Hadamard matrix, the dense alternative.  The bf16 cases round bfloat16
arrays in place (2 bytes an element): the reference widens, rounds in float32 and
casts back, as the released model does on its bf16 activations.
"""
import ml_dtypes
import numpy as np
import torch

import deepseek_csa as dc
from harness import Case


def _pow2_ceil(r):
    m, e = torch.frexp(r)
    return torch.ldexp(torch.ones_like(r), e - (m == 0.5).to(e.dtype))


def _fp8_ref(x, block: int):
    """In place like the released kernel: x = e4m3(clamp(x/s)) * s per block."""
    xb = x.unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax * (1 / 448))
    q = (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    x.copy_((q * s).flatten(-2))
    return x


def _e2m1(v):
    a = v.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2,
                    torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(r, v)


def _fp4_ref(x, block: int):
    xb = x.unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = _pow2_ceil(amax * (1 / 6))
    x.copy_((_e2m1((xb / s).clamp(-6, 6)) * s).flatten(-2))
    return x


def _hadamard_matrix(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _had_ref(x, h):
    return x @ h


def _fp8_ref_bf16(x, block: int):
    """x.float() -> round -> .to(bfloat16), in place."""
    x.copy_(_fp8_ref(x.float(), block))
    return x


def _fp4_ref_bf16(x, block: int):
    x.copy_(_fp4_ref(x.float(), block))
    return x


def _had_ref_bf16(x, h):
    return (x.float() @ h).bfloat16()


def _tbf(a):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def cases(quick=False):
    rng = np.random.default_rng(0)
    out = []
    rows8 = 8192 if not quick else 1024
    x8 = rng.standard_normal((rows8, 448), dtype=np.float32)
    t8 = torch.from_numpy(x8.copy())
    out.append(Case("fp8_round", f"[{rows8},448] block 64, in place",
                    ours=lambda: dc.fp8_round(x8, 64),
                    eager=lambda: _fp8_ref(t8, 64), compile_fn=_fp8_ref, compile_args=(t8, 64),
                    bytes=2 * x8.nbytes))
    rows4 = 4096 * 64 if not quick else 4096
    x4 = rng.standard_normal((rows4, 128), dtype=np.float32)
    t4 = torch.from_numpy(x4.copy())
    out.append(Case("fp4_round", f"[{rows4},128] block 32, in place",
                    ours=lambda: dc.fp4_round(x4, 32),
                    eager=lambda: _fp4_ref(t4, 32), compile_fn=_fp4_ref, compile_args=(t4, 32),
                    bytes=2 * x4.nbytes))
    xh = rng.standard_normal((rows4, 128), dtype=np.float32)
    th = torch.from_numpy(xh)
    h = _hadamard_matrix(128) * 128 ** -0.5
    yh = dc.hadamard(xh)          # a 64-byte aligned array: the out= case streams too
    out.append(Case("hadamard", f"[{rows4},128] new array",
                    ours=lambda: dc.hadamard(xh),
                    eager=lambda: _had_ref(th, h), compile_fn=_had_ref, compile_args=(th, h),
                    bytes=2 * xh.nbytes))
    ty = torch.from_numpy(np.empty_like(xh))
    out.append(Case("hadamard", f"[{rows4},128] out=, vs matmul(out=)",
                    ours=lambda: dc.hadamard(xh, out=yh),
                    eager=lambda: torch.matmul(th, h, out=ty),
                    bytes=2 * xh.nbytes))
    bf = ml_dtypes.bfloat16
    x8b = rng.standard_normal((rows8, 448), dtype=np.float32).astype(bf)
    t8b = _tbf(x8b.copy())
    out.append(Case("fp8_round", f"[{rows8},448] block 64, in place bf16",
                    ours=lambda: dc.fp8_round(x8b, 64),
                    eager=lambda: _fp8_ref_bf16(t8b, 64), compile_fn=_fp8_ref_bf16,
                    compile_args=(t8b, 64), bytes=2 * x8b.nbytes))
    x4b = rng.standard_normal((rows4, 128), dtype=np.float32).astype(bf)
    t4b = _tbf(x4b.copy())
    out.append(Case("fp4_round", f"[{rows4},128] block 32, in place bf16",
                    ours=lambda: dc.fp4_round(x4b, 32),
                    eager=lambda: _fp4_ref_bf16(t4b, 32), compile_fn=_fp4_ref_bf16,
                    compile_args=(t4b, 32), bytes=2 * x4b.nbytes))
    xhb = rng.standard_normal((rows4, 128), dtype=np.float32).astype(bf)
    thb = _tbf(xhb)
    yhb = np.empty_like(xhb)
    out.append(Case("hadamard", f"[{rows4},128] new array bf16",
                    ours=lambda: dc.hadamard(xhb),
                    eager=lambda: _had_ref_bf16(thb, h), compile_fn=_had_ref_bf16,
                    compile_args=(thb, h), bytes=2 * xhb.nbytes))
    out.append(Case("hadamard", f"[{rows4},128] out= bf16",
                    ours=lambda: dc.hadamard(xhb, out=yhb), bytes=2 * xhb.nbytes))
    return out
