#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "fpgrid_impl.h"

float csa_round_e4m3(float v) { return q_round_grid(v, Q_E4M3_EMIN, Q_E4M3_CSHIFT); }
float csa_round_e2m1(float v) { return q_round_grid(v, Q_E2M1_EMIN, Q_E2M1_CSHIFT); }

/* 2^ceil(log2(r)) for r > 0 from the exponent and mantissa fields, as the released
 * kernel does (no log2 that could be off at exact powers of two); inf stays inf, NaN
 * stays NaN.  r is a normal number whenever it comes from a floored amax (the floors
 * keep r >= 2^-126); a subnormal r is still handled exactly through frexpf. */
static inline float q_pow2_ceil(float r)
{
    const uint32_t b = q_bits(r);
    const uint32_t ef = (b >> 23) & 0xffu, m = b & 0x7fffffu;
    if (ef == 0xffu) return r;  /* inf or NaN */
    if (ef == 0) {              /* zero or subnormal: not reached behind the floors */
        if (r == 0.0f) return 0.0f;
        int e;
        const float f = frexpf(r, &e);
        return ldexpf(1.0f, f == 0.5f ? e - 1 : e);
    }
    const uint32_t ec = ef + (m != 0);
    return ec >= 0xffu ? INFINITY : q_float(ec << 23);
}

static inline float q_qmax(int fmt) { return fmt == CSA_Q_E4M3 ? 448.0f : 6.0f; }

static inline float q_scale(float amax, int fmt, int scale)
{
    if (amax != amax) return amax;  /* NaN in the block: the whole block becomes NaN */
    const float qmax = q_qmax(fmt);
    if (scale == CSA_QS_E4M3) {
        const float lo = 6.0f * 0x1p-9f;
        if (amax < lo) amax = lo;
        if (amax == INFINITY) return NAN;  /* e4m3fn has no infinity */
        float r = amax / qmax;
        if (r > 448.0f) r = 448.0f;        /* saturating cast, as the hardware's */
        return q_round_grid(r, Q_E4M3_EMIN, Q_E4M3_CSHIFT);
    }
    const float lo = fmt == CSA_Q_E4M3 ? 1e-4f : 6.0f * 0x1p-126f;
    if (amax < lo) amax = lo;
    const float r = amax * (fmt == CSA_Q_E4M3 ? (float)(1.0 / 448.0) : (float)(1.0 / 6.0));
    return scale == CSA_QS_UE8M0 ? q_pow2_ceil(r) : r;
}

float csa_quant_scale(float amax, int fmt, int scale) { return q_scale(amax, fmt, scale); }

static int q_args_ok(csa_idx d, csa_idx block, int fmt, int scale)
{
    if (block < 1 || d % block) return 0;
    if (fmt == CSA_Q_E4M3) return scale == CSA_QS_UE8M0 || scale == CSA_QS_FP32;
    if (fmt == CSA_Q_E2M1) return scale == CSA_QS_UE8M0 || scale == CSA_QS_E4M3;
    return 0;
}

/* ------------------------------------------------------------ scalar oracles */

int csa_quant_round_ref(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                        csa_idx sx_col, csa_idx block, int fmt, int scale, float *out,
                        csa_idx so_row, csa_idx so_col)
{
    if (!q_args_ok(d, block, fmt, scale)) return CSA_EINVAL;
    const float qmax = q_qmax(fmt);
    for (csa_idx r = 0; r < rows; r++) {
        for (csa_idx b0 = 0; b0 < d; b0 += block) {
            const float *xb = x + r * sx_row + b0 * sx_col;
            float *yb = out + r * so_row + b0 * so_col;
            float amax = 0.0f;
            for (csa_idx i = 0; i < block; i++) {
                const float a = fabsf(xb[i * sx_col]);
                if (a > amax || a != a) amax = a;
                if (a != a) break;
            }
            const float s = q_scale(amax, fmt, scale);
            for (csa_idx i = 0; i < block; i++) {
                float v = xb[i * sx_col] / s;
                v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                v = fmt == CSA_Q_E4M3 ? csa_round_e4m3(v) : csa_round_e2m1(v);
                yb[i * so_col] = v * s;
            }
        }
    }
    return CSA_OK;
}

int csa_quant_round_bf16_ref(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                             csa_idx sx_col, csa_idx block, int fmt, int scale,
                             csa_bf16 *out, csa_idx so_row, csa_idx so_col)
{
    if (!q_args_ok(d, block, fmt, scale)) return CSA_EINVAL;
    const float qmax = q_qmax(fmt);
    for (csa_idx r = 0; r < rows; r++) {
        for (csa_idx b0 = 0; b0 < d; b0 += block) {
            const csa_bf16 *xb = x + r * sx_row + b0 * sx_col;
            csa_bf16 *yb = out + r * so_row + b0 * so_col;
            float amax = 0.0f;
            for (csa_idx i = 0; i < block; i++) {
                const float a = fabsf(csa_bf16_to_f32(xb[i * sx_col]));
                if (a > amax || a != a) amax = a;
                if (a != a) break;
            }
            const float s = q_scale(amax, fmt, scale);
            for (csa_idx i = 0; i < block; i++) {
                float v = csa_bf16_to_f32(xb[i * sx_col]) / s;
                v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                v = fmt == CSA_Q_E4M3 ? csa_round_e4m3(v) : csa_round_e2m1(v);
                yb[i * so_col] = csa_f32_to_bf16(v * s);
            }
        }
    }
    return CSA_OK;
}

static int q_pow2(csa_idx n) { return n >= 1 && (n & (n - 1)) == 0; }

/* The butterflies on a contiguous row, in place: stage h pairs (j, j + h) inside each
 * block of 2h as (a + b, a - b).  Every level runs exactly these operations in this
 * order, so the tuned kernels give the same bits. */
static void q_fwht_row(float *v, csa_idx n, float scale)
{
    for (csa_idx h = 1; h < n; h *= 2)
        for (csa_idx i = 0; i < n; i += 2 * h)
            for (csa_idx j = i; j < i + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
    for (csa_idx j = 0; j < n; j++) v[j] *= scale;
}

int csa_hadamard_ref(const float *x, csa_idx rows, csa_idx n, csa_idx sx_row, csa_idx sx_col,
                     float scale, float *out, csa_idx so_row, csa_idx so_col)
{
    if (!q_pow2(n)) return CSA_EINVAL;
    if (rows == 0) return CSA_OK;
    float *buf = malloc((size_t)n * sizeof *buf);
    if (!buf) return CSA_ENOMEM;
    for (csa_idx r = 0; r < rows; r++) {
        for (csa_idx j = 0; j < n; j++) buf[j] = x[r * sx_row + j * sx_col];
        q_fwht_row(buf, n, scale);
        for (csa_idx j = 0; j < n; j++) out[r * so_row + j * so_col] = buf[j];
    }
    free(buf);
    return CSA_OK;
}

int csa_hadamard_bf16_ref(const csa_bf16 *x, csa_idx rows, csa_idx n, csa_idx sx_row,
                          csa_idx sx_col, float scale, csa_bf16 *out, csa_idx so_row,
                          csa_idx so_col)
{
    if (!q_pow2(n)) return CSA_EINVAL;
    if (rows == 0) return CSA_OK;
    float *buf = malloc((size_t)n * sizeof *buf);
    if (!buf) return CSA_ENOMEM;
    for (csa_idx r = 0; r < rows; r++) {
        for (csa_idx j = 0; j < n; j++) buf[j] = csa_bf16_to_f32(x[r * sx_row + j * sx_col]);
        q_fwht_row(buf, n, scale);
        for (csa_idx j = 0; j < n; j++) out[r * so_row + j * so_col] = csa_f32_to_bf16(buf[j]);
    }
    free(buf);
    return CSA_OK;
}

/* Widest row (hadamard) / run of whole blocks (rounding) the tuned bfloat16 kernels
 * widen into a float32 buffer on the stack; longer ones take the `_ref` path. */
#define Q_BF16_CHUNK 4096

/* ------------------------------------------------------------ tuned entry points */

#define CSA_IMPL "quant_impl.h"
#include "csa_isa_variants.h"

int csa_quant_round(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row, csa_idx sx_col,
                    csa_idx block, int fmt, int scale, float *out, csa_idx so_row,
                    csa_idx so_col)
{
    if (!q_args_ok(d, block, fmt, scale)) return CSA_EINVAL;
    if (sx_col != 1 || so_col != 1)
        return csa_quant_round_ref(x, rows, d, sx_row, sx_col, block, fmt, scale, out, so_row,
                                   so_col);
    CSA_DISPATCH(quant_round_tuned, (x, rows, d, sx_row, block, fmt, scale, out, so_row),
                 csa_quant_round_ref(x, rows, d, sx_row, sx_col, block, fmt, scale, out, so_row,
                                     so_col));
}

int csa_hadamard(const float *x, csa_idx rows, csa_idx n, csa_idx sx_row, csa_idx sx_col,
                 float scale, float *out, csa_idx so_row, csa_idx so_col)
{
    if (!q_pow2(n)) return CSA_EINVAL;
    if (sx_col != 1 || so_col != 1)
        return csa_hadamard_ref(x, rows, n, sx_row, sx_col, scale, out, so_row, so_col);
    CSA_DISPATCH(hadamard_tuned, (x, rows, n, sx_row, scale, out, so_row),
                 csa_hadamard_ref(x, rows, n, sx_row, sx_col, scale, out, so_row, so_col));
}

int csa_quant_round_bf16(const csa_bf16 *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                         csa_idx sx_col, csa_idx block, int fmt, int scale, csa_bf16 *out,
                         csa_idx so_row, csa_idx so_col)
{
    if (!q_args_ok(d, block, fmt, scale)) return CSA_EINVAL;
    if (sx_col != 1 || so_col != 1 || block > Q_BF16_CHUNK)
        return csa_quant_round_bf16_ref(x, rows, d, sx_row, sx_col, block, fmt, scale, out,
                                        so_row, so_col);
    CSA_DISPATCH(quant_round_bf16_tuned, (x, rows, d, sx_row, block, fmt, scale, out, so_row),
                 csa_quant_round_bf16_ref(x, rows, d, sx_row, sx_col, block, fmt, scale, out,
                                          so_row, so_col));
}

int csa_hadamard_bf16(const csa_bf16 *x, csa_idx rows, csa_idx n, csa_idx sx_row,
                      csa_idx sx_col, float scale, csa_bf16 *out, csa_idx so_row,
                      csa_idx so_col)
{
    if (!q_pow2(n)) return CSA_EINVAL;
    if (sx_col != 1 || so_col != 1 || n > Q_BF16_CHUNK)
        return csa_hadamard_bf16_ref(x, rows, n, sx_row, sx_col, scale, out, so_row, so_col);
    CSA_DISPATCH(hadamard_bf16_tuned, (x, rows, n, sx_row, scale, out, so_row),
                 csa_hadamard_bf16_ref(x, rows, n, sx_row, sx_col, scale, out, so_row, so_col));
}
