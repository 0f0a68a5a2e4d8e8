#include "qpack.h"
#include "quant.h"

#include <math.h>
#include <string.h>

#include "fpgrid_impl.h"

/* Code of an e4m3 grid value (|v| <= 448 or NaN): |v| * 2^-120 puts the e4m3 exponent
 * and mantissa in the float32 fields' top 7 bits (the e4m3 subnormals become float32
 * subnormals m * 2^20 ulps: exact), so the code is those bits.  (Vectorized, the
 * subnormal products cost little here: the integer form of p_code_e2m1 measured
 * 1.3x slower for e4m3.) */
static inline uint32_t p_code_e4m3(float v)
{
    const uint32_t b = q_bits(v), sign = (b >> 24) & 0x80u;
    if ((b & 0x7fffffffu) > 0x7f800000u) return sign | 0x7fu;
    return sign | (q_bits(q_float(b & 0x7fffffffu) * 0x1p-120f) >> 20);
}

/* Code of an e2m1 grid value (|v| <= 6): from 1 on, exponent and mantissa bit rebased
 * (code 2 is 1.0); 0.5 -> 1, 0 -> 0; NaN -> 0 with the sign.  Integer selects only,
 * so that the pair loop of the tuned body vectorizes. */
static inline uint32_t p_code_e2m1(float v)
{
    const uint32_t b = q_bits(v), sign = (b >> 28) & 0x8u, a = b & 0x7fffffffu;
    const uint32_t normal = ((a - 0x3f800000u) >> 22) + 2u, half = a == 0x3f000000u ? 1u : 0u;
    return sign | (a > 0x7f800000u ? 0u : a >= 0x3f800000u ? normal : half);
}

static int p_args_ok(csa_idx d, csa_idx block, int fmt, int scale, int s_bytes)
{
    if (block < 1 || d % block) return 0;
    if (fmt == CSA_Q_E4M3) {
        if (scale != CSA_QS_UE8M0 && scale != CSA_QS_FP32) return 0;
    } else if (fmt == CSA_Q_E2M1) {
        if (scale != CSA_QS_UE8M0 && scale != CSA_QS_E4M3) return 0;
        if (block % 2) return 0;
    } else {
        return 0;
    }
    return !(s_bytes && scale == CSA_QS_FP32);
}

static inline float p_ld(const void *x, int bf16, csa_idx i)
{
    return bf16 ? csa_bf16_to_f32(((const csa_bf16 *)x)[i]) : ((const float *)x)[i];
}

static inline void p_store_scale(void *s, int s_bytes, int scale, csa_idx i, float v)
{
    if (!s_bytes)
        ((float *)s)[i] = v;
    else if (scale == CSA_QS_UE8M0)
        ((uint8_t *)s)[i] = (uint8_t)((q_bits(v) >> 23) & 0xffu);
    else
        ((uint8_t *)s)[i] = (uint8_t)p_code_e4m3(v);   /* an e4m3 value already */
}

int csa_quant_pack_ref(const void *x, int x_bf16, csa_idx rows, csa_idx d, csa_idx sx_row,
                       csa_idx sx_col, csa_idx block, int fmt, int scale, uint8_t *q,
                       csa_idx sq_row, void *s, int s_bytes, csa_idx ss_row, csa_idx ss_col)
{
    if (!p_args_ok(d, block, fmt, scale, s_bytes)) return CSA_EINVAL;
    const float qmax = fmt == CSA_Q_E4M3 ? 448.0f : 6.0f;
    for (csa_idx r = 0; r < rows; r++)
        for (csa_idx b0 = 0; b0 < d; b0 += block) {
            float amax = 0.0f;
            for (csa_idx i = b0; i < b0 + block; i++) {
                const float a = fabsf(p_ld(x, x_bf16, r * sx_row + i * sx_col));
                if (a > amax || a != a) amax = a;
                if (a != a) break;
            }
            const float sc = csa_quant_scale(amax, fmt, scale);
            p_store_scale(s, s_bytes, scale, r * ss_row + (b0 / block) * ss_col, sc);
            for (csa_idx i = b0; i < b0 + block; i++) {
                float v = p_ld(x, x_bf16, r * sx_row + i * sx_col) / sc;
                v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                if (fmt == CSA_Q_E4M3) {
                    q[r * sq_row + i] = (uint8_t)p_code_e4m3(csa_round_e4m3(v));
                } else {
                    const uint32_t c = p_code_e2m1(csa_round_e2m1(v));
                    uint8_t *qb = q + r * sq_row + i / 2;
                    *qb = (uint8_t)(i & 1 ? (*qb & 0x0fu) | (c << 4) : c);
                }
            }
        }
    return CSA_OK;
}

#define CSA_IMPL "qpack_impl.h"
#include "csa_isa_variants.h"

int csa_quant_pack(const void *x, int x_bf16, csa_idx rows, csa_idx d, csa_idx sx_row,
                   csa_idx sx_col, csa_idx block, int fmt, int scale, uint8_t *q,
                   csa_idx sq_row, void *s, int s_bytes, csa_idx ss_row, csa_idx ss_col)
{
    if (!p_args_ok(d, block, fmt, scale, s_bytes)) return CSA_EINVAL;
    if (sx_col != 1 || block > 4096)
        return csa_quant_pack_ref(x, x_bf16, rows, d, sx_row, sx_col, block, fmt, scale, q,
                                  sq_row, s, s_bytes, ss_row, ss_col);
    CSA_DISPATCH(quant_pack_tuned,
                 (x, x_bf16, rows, d, sx_row, block, fmt, scale, q, sq_row, s, s_bytes, ss_row,
                  ss_col),
                 csa_quant_pack_ref(x, x_bf16, rows, d, sx_row, sx_col, block, fmt, scale, q,
                                    sq_row, s, s_bytes, ss_row, ss_col));
}
