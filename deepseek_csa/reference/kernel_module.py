"""Float32 torch stand-ins of the functions the released model.py imports from its GPU
``kernel`` module and from ``fast_hadamard_transform`` (docs/kernels.md, section 9):
dequantize to float32, compute in float32, return what the released functions return
(the GEMMs in ``torch.get_default_dtype()``).

They are the oracle of the kernel-module tests (a recorded run replayed against
deepseek_csa's kernels) and the float32 side of benchmarks/bench_model_py.py.
``standin_modules()`` returns them as the two modules a model.py imports.
"""
import contextlib
import sys
import types

import numpy as np
import torch

from . import layer as R

__all__ = ["act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn",
           "hc_split_sinkhorn", "hadamard_transform", "e8m0_float", "e8m0_bits", "REFS",
           "standin_modules", "installed_in"]

# e2m1 code -> value (bit 3 is the sign)
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def e8m0_bits(s):
    """Power-of-two float32 scales -> their e8m0 bytes (the float32 exponent field)."""
    return ((s.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e8m0_float(u):
    """e8m0 bytes (uint8 or float8_e8m0fnu) -> float32 2^(u - 127); 0 -> 2^-127, 255 -> NaN."""
    u = u.view(torch.uint8).to(torch.int32)
    f = (u << 23).view(torch.float32)
    f = torch.where(u == 0, torch.full_like(f, 2.0 ** -127), f)
    return torch.where(u == 255, torch.full_like(f, float("nan")), f)


def _scale_f32(s):
    return e8m0_float(s) if s.dtype == torch.float8_e8m0fnu else s.float()


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=None, inplace=False):
    """FP8 e4m3 per block of `block_size` along the last axis, scale amax / 448 (a power
    of two when scale_fmt is set or the scales are e8m0).  inplace: x <- q * s; else
    (q float8_e4m3fn [..., K], s [..., K / block] float32 or float8_e8m0fnu)."""
    e8 = scale_dtype == torch.float8_e8m0fnu
    xb = x.float().unflatten(-1, (-1, block_size))
    s = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) * np.float32(1 / 448)
    if scale_fmt is not None or e8:
        s = R._pow2_at_least(s)
    q = (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.float() * s).flatten(-2))
        return x
    s = s.squeeze(-1)
    return q.flatten(-2), (e8m0_bits(s).view(torch.float8_e8m0fnu) if e8 else s)


def fp4_act_quant(x, block_size=32, inplace=True, scale_dtype=None):
    """In-place FP4 (e2m1, power-of-two scales per block) QAT rounding of x."""
    assert inplace, "the float32 stand-in has only the in-place form"
    x.copy_(R.fp4_qat(x.float(), block_size))
    return x


def _deq_a(a, a_s):
    k = a.shape[-1]
    return a.float() * _scale_f32(a_s).repeat_interleave(128, -1)[..., :k]


def fp8_weight_f32(b, b_s):
    """b [N, K] FP8 with [N / 128, K / 128] block scales -> float32 [N, K]."""
    n, k = b.shape
    return b.float() * _scale_f32(b_s).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def fp4_weight_f32(b, b_s):
    """b [N, K / 2] float4_e2m1fn_x2 with e8m0 scales [N, K / 32] -> float32 [N, K]."""
    u = b.view(torch.uint8).long()
    vals = torch.stack([E2M1[u & 15], E2M1[u >> 4]], -1).flatten(-2)
    return vals * _scale_f32(b_s).repeat_interleave(32, 1)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None, weight=fp8_weight_f32):
    """a [..., K] FP8 with scales [..., K / 128]; b [N, K] FP8 with [N / 128, K / 128]
    block scales -> a @ b^T [..., N] in the default dtype."""
    return (_deq_a(a, a_s) @ weight(b, b_s).T).to(torch.get_default_dtype())


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None, weight=fp4_weight_f32):
    """a [..., K] FP8 with scales [..., K / 128]; b [N, K / 2] float4_e2m1fn_x2 with e8m0
    scales [N, K / 32] -> a @ b^T [..., N] in the default dtype."""
    return (_deq_a(a, a_s) @ weight(b, b_s).T).to(torch.get_default_dtype())


sparse_attn = R.sparse_attn


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """(pre [..., h], post [..., h], comb [..., h, h]) in the released order: softmax +
    eps, a column normalization, then sinkhorn_iters - 1 times rows then columns."""
    h = hc_mult
    pre = torch.sigmoid(mixes[..., :h] * hc_scale[0] + hc_base[:h]) + eps
    post = 2 * torch.sigmoid(mixes[..., h:2 * h] * hc_scale[1] + hc_base[h:2 * h])
    c = mixes[..., 2 * h:].unflatten(-1, (h, h)) * hc_scale[2] + hc_base[2 * h:].view(h, h)
    c = torch.softmax(c, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def hadamard_transform(x, scale=1.0):
    """Unnormalized Walsh-Hadamard transform along the last axis, times `scale`."""
    return (R.hadamard(x) * (scale * x.shape[-1] ** 0.5)).to(x.dtype)


REFS = {"act_quant": act_quant, "fp4_act_quant": fp4_act_quant, "fp8_gemm": fp8_gemm,
        "fp4_gemm": fp4_gemm, "sparse_attn": sparse_attn,
        "hc_split_sinkhorn": hc_split_sinkhorn, "hadamard_transform": hadamard_transform}


def standin_modules():
    """{'kernel': module, 'fast_hadamard_transform': module} holding these stand-ins."""
    k = types.ModuleType("kernel", "float32 torch stand-ins (deepseek_csa.reference.kernel_module)")
    for n in ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn",
              "hc_split_sinkhorn"):
        setattr(k, n, REFS[n])
    f = types.ModuleType("fast_hadamard_transform")
    f.hadamard_transform = hadamard_transform
    return {"kernel": k, "fast_hadamard_transform": f}


def _no_round(x, *a, **kw):
    """act_quant / fp4_act_quant with the QAT rounding off (their in-place forms)."""
    return x


def _memo(fn, cache):
    def weight(b, b_s):
        key = (b.data_ptr(), b_s.data_ptr(), tuple(b.shape))
        if key not in cache:
            cache[key] = fn(b, b_s)
        return cache[key]
    return weight


@contextlib.contextmanager
def installed_in(mod, qat=True, cache_weights=False):
    """While the block runs, the functions a loaded model.py module ``mod`` imported
    from its ``kernel`` module are these stand-ins, and ``fast_hadamard_transform`` in
    sys.modules (imported by the released rotate_activation at each call) is a module
    holding ours: the file's own torch code on float32 reference kernels.
    ``qat=False``: the in-place FP8 / FP4 roundings leave their input as it is.
    ``cache_weights``: each FP8 / FP4 weight is dequantized once and kept (float32,
    4 bytes a weight) for the block's duration -- the same products, without the
    dequantization on every call that makes a long decode slow."""
    G = vars(mod)
    refs = dict(REFS)
    if not qat:
        refs.update(act_quant=_no_round, fp4_act_quant=_no_round)
    if cache_weights:
        cache = {}
        w8, w4 = _memo(fp8_weight_f32, cache), _memo(fp4_weight_f32, cache)
        refs.update(fp8_gemm=lambda a, a_s, b, b_s, scale_dtype=None: fp8_gemm(a, a_s, b, b_s, weight=w8),
                    fp4_gemm=lambda a, a_s, b, b_s, scale_dtype=None: fp4_gemm(a, a_s, b, b_s, weight=w4))
    saved = {n: G[n] for n in refs if n in G}
    had = "fast_hadamard_transform" in sys.modules
    fht = sys.modules.get("fast_hadamard_transform")
    G.update({n: refs[n] for n in saved})
    sys.modules["fast_hadamard_transform"] = standin_modules()["fast_hadamard_transform"]
    try:
        yield
    finally:
        G.update(saved)
        if had:
            sys.modules["fast_hadamard_transform"] = fht
        else:
            sys.modules.pop("fast_hadamard_transform", None)
