/* Tuned quantize-to-codes bodies, compiled once per ISA level: rows split across
 * threads, each block widened into an L1 buffer and run through loops the compiler
 * vectorizes, with the oracle's operations (x * (1/s) equals x / s for the power-of-two
 * scales), so the codes and scales are the same bits at every level. */

static inline __attribute__((always_inline)) void CSA_V(p_block)(
    const float *CSA_RESTRICT xb, csa_idx block, const int fmt, int scale, uint8_t *CSA_RESTRICT qb,
    float *sc_out)
{
    const float qmax = fmt == CSA_Q_E4M3 ? 448.0f : 6.0f;
    const uint32_t emin = fmt == CSA_Q_E4M3 ? Q_E4M3_EMIN : Q_E2M1_EMIN;
    const uint32_t cshift = fmt == CSA_Q_E4M3 ? Q_E4M3_CSHIFT : Q_E2M1_CSHIFT;
    const float s = csa_quant_scale(q_block_amax(xb, block), fmt, scale);
    *sc_out = s;
    const int pow2 = scale == CSA_QS_UE8M0;
    const float inv = 1.0f / s;
    if (fmt == CSA_Q_E4M3) {
#pragma omp simd
        for (csa_idx i = 0; i < block; i++) {
            float v = pow2 ? xb[i] * inv : xb[i] / s;
            v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
            qb[i] = (uint8_t)p_code_e4m3(q_round_grid(v, emin, cshift));
        }
    } else {
        /* Round first, then code the pairs: one loop over both made gcc give up
         * vectorizing (scalar, ~11 ns a value against 0.6 for the rounding alone). */
        float r[256] __attribute__((aligned(64)));
        for (csa_idx c0 = 0; c0 < block; c0 += 256) {
            const csa_idx n = block - c0 < 256 ? block - c0 : 256;
#pragma omp simd
            for (csa_idx i = 0; i < n; i++) {
                float v = pow2 ? xb[c0 + i] * inv : xb[c0 + i] / s;
                v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                r[i] = q_round_grid(v, emin, cshift);
            }
#pragma omp simd
            for (csa_idx i = 0; i < n / 2; i++)
                qb[c0 / 2 + i] = (uint8_t)(p_code_e2m1(r[2 * i]) | (p_code_e2m1(r[2 * i + 1]) << 4));
        }
    }
}

static int CSA_V(quant_pack_tuned)(const void *x, int x_bf16, csa_idx rows, csa_idx d,
                                   csa_idx sx_row, csa_idx block, int fmt, int scale,
                                   uint8_t *q, csa_idx sq_row, void *s, int s_bytes,
                                   csa_idx ss_row, csa_idx ss_col)
{
    const int nt = csa_threads(rows, 1 + 16384 / (d > 0 ? d : 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        float buf[4096] __attribute__((aligned(64)));
        for (csa_idx b0 = 0; b0 < d; b0 += block) {
            const float *xb;
            if (x_bf16) {
                const csa_bf16 *src = (const csa_bf16 *)x + r * sx_row + b0;
#pragma omp simd
                for (csa_idx i = 0; i < block; i++) buf[i] = csa_bf16_to_f32(src[i]);
                xb = buf;
            } else {
                xb = (const float *)x + r * sx_row + b0;
            }
            float sc;
            if (fmt == CSA_Q_E4M3)
                CSA_V(p_block)(xb, block, CSA_Q_E4M3, scale, q + r * sq_row + b0, &sc);
            else
                CSA_V(p_block)(xb, block, CSA_Q_E2M1, scale, q + r * sq_row + b0 / 2, &sc);
            p_store_scale(s, s_bytes, scale, r * ss_row + (b0 / block) * ss_col, sc);
        }
    }
    return CSA_OK;
}
