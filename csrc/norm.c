#include "norm.h"

#include <math.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

int csa_rms_norm_ref(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                     const float *w, csa_idx sw, float eps,
                     float *out, csa_idx so_row, csa_idx so_col)
{
    for (csa_idx r = 0; r < rows; r++) {
        const float *xr = x + r * sx_row;
        float *yr = out + r * so_row;
        float ss = 0.0f;
        for (csa_idx i = 0; i < d; i++) ss += xr[i * sx_col] * xr[i * sx_col];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (csa_idx i = 0; i < d; i++) {
            const float y = xr[i * sx_col] * inv;
            yr[i * so_col] = w ? y * w[i * sw] : y;
        }
    }
    return CSA_OK;
}

static int rms_norm_bf16_ref(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                             csa_idx sx_col, const float *w, csa_idx sw, float eps,
                             csa_bf16 *out, csa_idx so_row, csa_idx so_col)
{
    for (csa_idx r = 0; r < rows; r++) {
        const csa_bf16 *xr = x + r * sx_row;
        csa_bf16 *yr = out + r * so_row;
        float ss = 0.0f;
        for (csa_idx i = 0; i < d; i++) {
            const float v = csa_bf16_to_f32(xr[i * sx_col]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (csa_idx i = 0; i < d; i++) {
            const float y = csa_bf16_to_f32(xr[i * sx_col]) * inv;
            yr[i * so_col] = csa_f32_to_bf16(w ? y * w[i * sw] : y);
        }
    }
    return CSA_OK;
}

#define CSA_IMPL "norm_impl.h"
#include "csa_isa_variants.h"

int csa_rms_norm(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                 const float *w, csa_idx sw, float eps,
                 float *out, csa_idx so_row, csa_idx so_col)
{
    if (sx_col != 1 || so_col != 1 || (w && sw != 1))
        return csa_rms_norm_ref(x, rows, d, sx_row, sx_col, w, sw, eps, out, so_row, so_col);
    CSA_DISPATCH(rms_norm_tuned, (x, rows, d, sx_row, w, eps, out, so_row),
                 csa_rms_norm_ref(x, rows, d, sx_row, sx_col, w, sw, eps, out, so_row, so_col));
}

int csa_rms_norm_bf16(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                      csa_idx sx_col, const float *w, csa_idx sw, float eps,
                      csa_bf16 *out, csa_idx so_row, csa_idx so_col)
{
    if (sx_col != 1 || so_col != 1 || (w && sw != 1))
        return rms_norm_bf16_ref(x, rows, d, sx_row, sx_col, w, sw, eps, out, so_row, so_col);
    CSA_DISPATCH(rms_norm_bf16_tuned, (x, rows, d, sx_row, w, eps, out, so_row),
                 rms_norm_bf16_ref(x, rows, d, sx_row, sx_col, w, sw, eps, out, so_row, so_col));
}
