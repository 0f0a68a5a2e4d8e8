"""QAT rounding and the Hadamard rotation (docs/kernels.md, section 7).

fp8_round(x, block, *, scale="ue8m0", out=None)
    FP8 e4m3 quantize-dequantize per block of the last axis; in place unless out=.
fp4_round(x, block, *, scale="ue8m0", out=None)
    FP4 e2m1 quantize-dequantize per block; scale="e4m3" for V4.1's compressed KV.
hadamard(x, *, scale=None, out=None)
    Normalized fast Walsh-Hadamard transform of the last axis (a new array unless out=).

All three take float32 or bfloat16 (ml_dtypes.bfloat16 arrays, torch bfloat16 tensors,
read and written in place without a copy): bfloat16 is widened, computed in float32
and rounded back to bfloat16 once, as ``x.float() -> op -> .to(torch.bfloat16)``.
The arithmetic is in C (csrc/quant.c); see each function's docstring.
"""
from ._core import fp4_round, fp8_round, hadamard

__all__ = ["fp8_round", "fp4_round", "hadamard"]
