#include "norm.h"

#include <math.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
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


/* ---------------------------------------------------------------- backward */
#include <stdlib.h>
#include <string.h>

static inline float norm_ld(const void *p, int bf, csa_idx i)
{
    return bf ? csa_bf16_to_f32(((const csa_bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline const void *norm_off(const void *p, int bf, csa_idx i)
{
    return bf ? (const void *)((const csa_bf16 *)p + i) : (const void *)((const float *)p + i);
}

int csa_rms_norm_backward_ref(const void *dy, int dy_bf16, csa_idx sdy_row, const void *x,
                              int x_bf16, csa_idx sx_row, csa_idx rows, csa_idx d,
                              const float *w, float eps, void *dx, int dx_bf16, csa_idx sdx_row,
                              float *dw)
{
    if (rows < 0 || d < 0 || (dw && !w)) return CSA_EINVAL;
    const csa_idx nb = (rows + CSA_NORM_GRAD_ROWS - 1) / CSA_NORM_GRAD_ROWS;
    float *part = NULL;
    if (dw) {
        part = calloc((size_t)(nb > 0 ? nb : 1) * (size_t)(d > 0 ? d : 1), sizeof(float));
        if (!part) return CSA_ENOMEM;
    }
    for (csa_idx r = 0; r < rows; r++) {
        const void *xr = norm_off(x, x_bf16, r * sx_row), *gr = norm_off(dy, dy_bf16, r * sdy_row);
        float ss = 0.0f, dot = 0.0f;
        for (csa_idx i = 0; i < d; i++) {
            const float v = norm_ld(xr, x_bf16, i);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (csa_idx i = 0; i < d; i++) {
            const float g = w ? norm_ld(gr, dy_bf16, i) * w[i] : norm_ld(gr, dy_bf16, i);
            dot += g * norm_ld(xr, x_bf16, i);
        }
        const float k = inv * inv * inv * (dot / (float)d);
        float *pr = part ? part + (r / CSA_NORM_GRAD_ROWS) * d : NULL;
        for (csa_idx i = 0; i < d; i++) {
            const float v = norm_ld(xr, x_bf16, i), gy = norm_ld(gr, dy_bf16, i);
            const float g = w ? gy * w[i] : gy;
            const float o = inv * g - v * k;
            if (dx_bf16) ((csa_bf16 *)dx)[r * sdx_row + i] = csa_f32_to_bf16(o);
            else ((float *)dx)[r * sdx_row + i] = o;
            if (pr) pr[i] += gy * (v * inv);
        }
    }
    if (dw) {
        for (csa_idx i = 0; i < d; i++) dw[i] = 0.0f;
        for (csa_idx bk = 0; bk < nb; bk++)
            for (csa_idx i = 0; i < d; i++) dw[i] += part[bk * d + i];
        free(part);
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

int csa_rms_norm_backward(const void *dy, int dy_bf16, csa_idx sdy_row, const void *x,
                          int x_bf16, csa_idx sx_row, csa_idx rows, csa_idx d, const float *w,
                          float eps, void *dx, int dx_bf16, csa_idx sdx_row, float *dw)
{
    if (rows < 0 || d < 0 || (dw && !w)) return CSA_EINVAL;
    CSA_DISPATCH(rms_norm_backward_tuned,
                 (dy, dy_bf16, sdy_row, x, x_bf16, sx_row, rows, d, w, eps, dx, dx_bf16, sdx_row,
                  dw),
                 csa_rms_norm_backward_ref(dy, dy_bf16, sdy_row, x, x_bf16, sx_row, rows, d, w,
                                           eps, dx, dx_bf16, sdx_row, dw));
}
