"""The kernels the released V4.1 model.py imports from ``.kernel_cpu``, on the CPU.

What model.py calls:
``act_quant(x, block, scale_fmt, scale_dtype[, inplace])`` (FP8 e4m3, blocks of 32),
``fp4_act_quant(x, block, inplace[, scale_dtype=float8_e4m3fn])``,
``fp8_gemm(x, s, w, w.scale, scale_dtype, block_size=32)``,
``fp4_gemm(x, s, w, w.scale, scale_dtype, act_block_size=32)``,
``hc_split_sinkhorn(mixes, scale, base, hc_mult, iters, eps)`` and
``sparse_attn(q, kv, sink, topk_idxs, softmax_scale)``.

The quantizers, the Sinkhorn split and the attention take the same arguments as
deepseek_csa's CPU kernel module (deepseek_csa.torch.kernel_module) and are its
functions.  Its GEMMs read 128-wide activation blocks; V4.1's are 32 wide, so the GEMMs
here dequantize both operands to float32 (e4m3 / e2m1 values times their block scales),
multiply in float32 and return ``torch.get_default_dtype()``, as the released GEMMs do.
"""
import torch

from deepseek_csa.reference.kernel_module import E2M1, e8m0_float
from deepseek_csa.torch import kernel_module as _K

act_quant = _K.act_quant
fp4_act_quant = _K.fp4_act_quant
hc_split_sinkhorn = _K.hc_split_sinkhorn
sparse_attn = _K.sparse_attn


def _scales(s):
    return e8m0_float(s) if s.dtype == torch.float8_e8m0fnu else s.float()


def _dequant_act(a, a_s, block):
    k = a.shape[-1]
    return a.float() * _scales(a_s).repeat_interleave(block, -1)[..., :k]


def fp8_gemm(a, a_s, b, b_s, scale_dtype=None, block_size=128):
    """a [..., K] e4m3 with scales [..., K/block]; b [N, K] e4m3 with [N/block, K/block]
    block scales -> a @ b^T [..., N] in the default dtype."""
    if block_size == 128:
        return _K.fp8_gemm(a, a_s, b, b_s, scale_dtype)
    n, k = b.shape
    bs = _scales(b_s).repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    w = b.float() * bs[:n, :k]
    return (_dequant_act(a, a_s, block_size) @ w.T).to(torch.get_default_dtype())


def fp4_gemm(a, a_s, b, b_s, scale_dtype=None, act_block_size=128):
    """a [..., K] e4m3 with scales [..., K/act_block_size]; b [N, K/2]
    float4_e2m1fn_x2 with scales [N, K/32] -> a @ b^T [..., N] in the default dtype."""
    if act_block_size == 128:
        return _K.fp4_gemm(a, a_s, b, b_s, scale_dtype)
    u = b.view(torch.uint8).long()
    w = torch.stack([E2M1[u & 15], E2M1[u >> 4]], -1).flatten(-2)
    w = w * _scales(b_s).repeat_interleave(32, 1)
    return (_dequant_act(a, a_s, act_block_size) @ w.T).to(torch.get_default_dtype())
