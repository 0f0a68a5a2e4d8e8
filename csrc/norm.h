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
#endif
