"""Block-scaled FP8 / FP4 GEMMs, quantization to codes, and the hyper-connection
Sinkhorn split: the C side of DeepSeek's released ``kernel`` module (docs/kernels.md section 9).

fp8_gemm(a, a_s, b, b_s, *, b_index=None, out_dtype=None, out=None)
    e4m3 activations [..., K] (one scale per 128 columns) times e4m3 weights [N, K]
    (one scale per 128 x 128 block) -> [..., N] bfloat16 (default) or float32.
    With b_index (int32, a.shape[:-1]), b [E, N, K] stacks E weights and each row of a
    takes its own: routed experts, or a grouped projection, in one call; b_index -1:
    no weight, that row of the result is zeros.
fp4_gemm(a, a_s, b, b_s, *, b_index=None, out_dtype=None, out=None)
    the same against e2m1 weights packed two a byte [N, K/2], one scale per 32 of K.
wfp8_gemm(a, b, b_s, *, groups=1, out_dtype=None)
    weight-only FP8: float32 / bfloat16 activations [..., K] as they are (not
    quantized) times e4m3 weights [N, K] with 128 x 128 block scales -> [..., N]; with
    groups = G, a is [..., G, K] and the G slices of N / G weight rows each take their
    own activation slice (the einsum of the released model.py's wo_a).
wbf16_gemm(a, b, *, groups=1, out_dtype=None)
    the same arithmetic against bfloat16 weights [N, K] (no scales) -> float32 by
    default: float32 weights that are stored as bf16, read at half their bytes.
fp8_quant(x, block=128, *, scale="ue8m0", scale_dtype="float32") -> (codes, scales)
fp4_quant(x, block=32, *, scale="ue8m0", scale_dtype=None) -> (packed codes, scales)
hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6)
    -> (pre, post, comb)

Byte formats are taken as ml_dtypes arrays (float8_e4m3fn, float8_e8m0fnu), torch
tensors of the float8 / float4_e2m1fn_x2 dtypes (viewed as bytes without a copy) or
uint8 arrays of the codes; the quantizers return uint8 codes.  The arithmetic is in C
(csrc/gemm.c, csrc/qpack.c, csrc/sinkhorn.c); see each function's docstring.
"""
from ._core import (fp4_gemm, fp4_quant, fp8_gemm, fp8_quant, hc_split_sinkhorn, wbf16_gemm,
                    wfp8_gemm)

__all__ = ["fp8_gemm", "wfp8_gemm", "wbf16_gemm", "fp4_gemm", "fp8_quant", "fp4_quant", "hc_split_sinkhorn"]
