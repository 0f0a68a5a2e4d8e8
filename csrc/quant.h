/* Quantization-aware rounding (FP8 e4m3, FP4 e2m1) and the Hadamard rotation
 * (docs/kernels.md, section 7). */
#ifndef CSA_QUANT_H
#define CSA_QUANT_H
#include "csa.h"

/* Element grids. */
enum csa_qfmt {
    CSA_Q_E4M3 = 0,  /* FP8 e4m3fn: max 448, 3 mantissa bits, subnormals down to 2^-9 */
    CSA_Q_E2M1 = 1,  /* FP4 e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 */
};

/* How a block's scale s follows from amax = max |x| over the block (NaN if the block
 * holds a NaN), after the floor (e4m3 grid: 1e-4; e2m1 grid: 6 * 2^-126, or 6 * 2^-9
 * with e4m3 scales), with qmax = 448 (e4m3) or 6 (e2m1) and inv = float32(1 / qmax):
 *   UE8M0: s = 2^ceil(log2(amax * inv)), from the exponent bits (exact at powers of two)
 *   FP32 : s = amax * inv
 *   E4M3 : s = round_e4m3(min(amax / qmax, 448)), nearest-even, saturating
 * amax = inf gives s = inf (UE8M0, FP32) or NaN (E4M3), so such a block becomes NaN. */
enum csa_qscale {
    CSA_QS_UE8M0 = 0,
    CSA_QS_FP32 = 1,
    CSA_QS_E4M3 = 2,
};

/* Fused quantize-dequantize over blocks of `block` consecutive features along the
 * last axis: out = round_fmt(clamp(x / s, -qmax, qmax)) * s, round-to-nearest-even,
 * with s per block as above.  x, out: [rows, d] with strides (sx_row, sx_col),
 * (so_row, so_col); d % block == 0 (else CSA_EINVAL).  out may be x itself (same
 * strides: in place), never a partial overlap of it. */
int csa_quant_round(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                    csa_idx block, int fmt, int scale, float *out, csa_idx so_row,
                    csa_idx so_col);
int csa_quant_round_ref(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                        csa_idx sx_col, csa_idx block, int fmt, int scale, float *out,
                        csa_idx so_row, csa_idx so_col);

/* The same over bfloat16 x and out (csa_bf16): each block is widened to float32
 * (exact), rounded by the float32 arithmetic above and rounded to bfloat16 once on
 * store (nearest-even), as the reference's `x.float() -> round -> .to(bfloat16)`:
 * bitwise the float32 kernel on the widened values, then the cast. */
int csa_quant_round_bf16(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                         csa_idx sx_col, csa_idx block, int fmt, int scale, csa_bf16 *out,
                         csa_idx so_row, csa_idx so_col);
int csa_quant_round_bf16_ref(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                             csa_idx sx_col, csa_idx block, int fmt, int scale,
                             csa_bf16 *out, csa_idx so_row, csa_idx so_col);

/* Scalar building blocks, for kernels that round in their own epilogue.  v must
 * already lie in [-qmax, qmax] (or be NaN); signs, -0 and NaN are kept. */
float csa_round_e4m3(float v);
float csa_round_e2m1(float v);
float csa_quant_scale(float amax, int fmt, int scale);

/* Fast Walsh-Hadamard transform of the last axis in natural (Sylvester) order,
 * out[r, :] = scale * H_n x[r, :] with H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]],
 * by log2(n) butterfly stages (h = 1, 2, 4, ...), then one multiply by `scale`.
 * x, out: [rows, n], n a power of two (else CSA_EINVAL); strides as above; out may be
 * x itself (same strides), never a partial overlap.  CSA_ENOMEM if a scratch row
 * cannot be allocated. */
int csa_hadamard(const float *x, csa_idx rows, csa_idx n, csa_idx sx_row, csa_idx sx_col,
                 float scale, float *out, csa_idx so_row, csa_idx so_col);
int csa_hadamard_ref(const float *x, csa_idx rows, csa_idx n, csa_idx sx_row, csa_idx sx_col,
                     float scale, float *out, csa_idx so_row, csa_idx so_col);

/* The same over bfloat16 x and out: each row widened to float32, transformed by the
 * float32 butterflies and rounded to bfloat16 once on store.  CSA_ENOMEM if a scratch
 * row cannot be allocated. */
int csa_hadamard_bf16(const csa_bf16 *x, csa_idx rows, csa_idx n, csa_idx sx_row,
                      csa_idx sx_col, float scale, csa_bf16 *out, csa_idx so_row,
                      csa_idx so_col);
int csa_hadamard_bf16_ref(const csa_bf16 *x, csa_idx rows, csa_idx n, csa_idx sx_row,
                          csa_idx sx_col, float scale, csa_bf16 *out, csa_idx so_row,
                          csa_idx so_col);
#endif
