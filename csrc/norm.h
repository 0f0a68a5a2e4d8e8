/* RMSNorm (docs/kernels.md, section 1). */
#ifndef CSA_NORM_H
#define CSA_NORM_H
#include "csa.h"

/* out[r, :] = w * x[r, :] * rsqrt(mean(x[r, :]^2) + eps) for r < rows, in float32.
 * x, out: [rows, d] with strides (sx_row, sx_col), (so_row, so_col); w: [d] with
 * stride sw, or NULL for w = 1.  out may be x itself (same strides), never a partial
 * overlap of it. */
int csa_rms_norm(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                 const float *w, csa_idx sw, float eps,
                 float *out, csa_idx so_row, csa_idx so_col);
int csa_rms_norm_ref(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                     const float *w, csa_idx sw, float eps,
                     float *out, csa_idx so_row, csa_idx so_col);

/* The same over bfloat16 x and out (w stays float32), computed in float32 and rounded
 * once on store, as the reference's `.to(dtype)` does. */
int csa_rms_norm_bf16(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                      csa_idx sx_col, const float *w, csa_idx sw, float eps,
                      csa_bf16 *out, csa_idx so_row, csa_idx so_col);

/* Backward of csa_rms_norm (docs/kernels.md, section 11.2), float32.  Per row, with
 * inv = 1 / sqrt(mean(x^2) + eps) and g = dy * w (dy when w is NULL):
 *   dx = inv * g - x * inv^3 * (sum_i g_i x_i) / d,
 *   dw = sum over rows of dy * x * inv   (when dw is not NULL; w must be given),
 * dw summed over fixed blocks of CSA_NORM_GRAD_ROWS rows (each block's rows in order),
 * then the block partials in block order: bits independent of the thread count.
 * dy, x, dx: [rows, d] (row strides, unit inner stride); w, dw: [d], unit stride.
 * x and dy: float32, or bfloat16 when x_bf16 / dy_bf16 (widened exactly); dx float32,
 * or bfloat16 when dx_bf16 (each element rounded once, csa_f32_to_bf16, as it is stored:
 * no float32 copy of dx is made).  CSA_ENOMEM if the partials cannot be allocated. */
#define CSA_NORM_GRAD_ROWS 64
int csa_rms_norm_backward(const void *dy, int dy_bf16, csa_idx sdy_row, const void *x,
                          int x_bf16, csa_idx sx_row, csa_idx rows, csa_idx d, const float *w,
                          float eps, void *dx, int dx_bf16, csa_idx sdx_row, float *dw);
int csa_rms_norm_backward_ref(const void *dy, int dy_bf16, csa_idx sdy_row, const void *x,
                              int x_bf16, csa_idx sx_row, csa_idx rows, csa_idx d,
                              const float *w, float eps, void *dx, int dx_bf16, csa_idx sdx_row,
                              float *dw);
#endif
