#include "rope.h"

#include <math.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

int csa_rope_table(float *cos_out, float *sin_out, csa_idx seqlen, csa_idx rope_dim,
                   double base, csa_idx original_seq_len, double factor,
                   double beta_fast, double beta_slow)
{
    const csa_idx half = rope_dim / 2;
    if (rope_dim <= 0 || rope_dim % 2 || half > 4096) return CSA_EINVAL;
    float freq[4096];
    for (csa_idx i = 0; i < half; i++)
        freq[i] = 1.0f / powf((float)base, (float)(2 * i) / (float)rope_dim);
    if (original_seq_len > 0) {
        /* YaRN: leave the fast (high-frequency) pairs alone, divide the slow ones by
         * `factor`, blend linearly in between. */
        const double two_pi = 6.283185307179586;
        const double lb = log(base);
        double lo = floor(rope_dim * log(original_seq_len / (beta_fast * two_pi)) / (2 * lb));
        double hi = ceil(rope_dim * log(original_seq_len / (beta_slow * two_pi)) / (2 * lb));
        if (lo < 0) lo = 0;
        if (hi > rope_dim - 1) hi = (double)(rope_dim - 1);
        const float span = (hi == lo) ? 0.001f : (float)(hi - lo);
        for (csa_idx i = 0; i < half; i++) {
            float ramp = ((float)i - (float)lo) / span;
            ramp = ramp < 0.0f ? 0.0f : (ramp > 1.0f ? 1.0f : ramp);
            freq[i] = freq[i] / (float)factor * ramp + freq[i] * (1.0f - ramp);
        }
    }
    for (csa_idx t = 0; t < seqlen; t++) {
        for (csa_idx i = 0; i < half; i++) {
            const float a = (float)t * freq[i];
            cos_out[t * half + i] = (float)cos((double)a);
            sin_out[t * half + i] = (float)sin((double)a);
        }
    }
    return CSA_OK;
}

/* Scalar oracle over any strides; bf16 selects csa_bf16 storage for x. */
static int apply_rope_ref(void *x, int bf16, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                          csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                          const float *cos, csa_idx scr, csa_idx scc,
                          const float *sin, csa_idx ssr, csa_idx ssc, int inverse)
{
    for (csa_idx i0 = 0; i0 < n0; i0++)
        for (csa_idx i1 = 0; i1 < n1; i1++)
            for (csa_idx h = 0; h < n2; h++) {
                const csa_idx off = i0 * s0 + i1 * s1 + h * s2;
                for (csa_idx i = 0; i < half; i++) {
                    const float c = cos[i1 * scr + i * scc];
                    const float s = inverse ? -sin[i1 * ssr + i * ssc] : sin[i1 * ssr + i * ssc];
                    const csa_idx a = off + 2 * i * s3, b = off + (2 * i + 1) * s3;
                    float re, im;
                    if (bf16) {
                        re = csa_bf16_to_f32(((csa_bf16 *)x)[a]);
                        im = csa_bf16_to_f32(((csa_bf16 *)x)[b]);
                    } else {
                        re = ((float *)x)[a];
                        im = ((float *)x)[b];
                    }
                    const float yr = re * c - im * s, yi = re * s + im * c;
                    if (bf16) {
                        ((csa_bf16 *)x)[a] = csa_f32_to_bf16(yr);
                        ((csa_bf16 *)x)[b] = csa_f32_to_bf16(yi);
                    } else {
                        ((float *)x)[a] = yr;
                        ((float *)x)[b] = yi;
                    }
                }
            }
    return CSA_OK;
}

int csa_apply_rope_ref(float *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                       csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                       const float *cos, csa_idx scr, csa_idx scc,
                       const float *sin, csa_idx ssr, csa_idx ssc, int inverse)
{
    return apply_rope_ref(x, 0, n0, n1, n2, half, s0, s1, s2, s3, cos, scr, scc, sin, ssr, ssc,
                          inverse);
}

#define CSA_IMPL "rope_impl.h"
#include "csa_isa_variants.h"

static int apply_rope_any(void *x, int bf16, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                          csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                          const float *cos, csa_idx scr, csa_idx scc,
                          const float *sin, csa_idx ssr, csa_idx ssc, int inverse)
{
    if (s3 != 1 || scc != 1 || ssc != 1 || half > 4096)
        return apply_rope_ref(x, bf16, n0, n1, n2, half, s0, s1, s2, s3, cos, scr, scc, sin, ssr,
                              ssc, inverse);
    CSA_DISPATCH(apply_rope_tuned,
                 (x, bf16, n0, n1, n2, half, s0, s1, s2, cos, scr, sin, ssr, inverse),
                 apply_rope_ref(x, bf16, n0, n1, n2, half, s0, s1, s2, s3, cos, scr, scc, sin,
                                ssr, ssc, inverse));
}

int csa_apply_rope(float *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                   csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                   const float *cos, csa_idx scr, csa_idx scc,
                   const float *sin, csa_idx ssr, csa_idx ssc, int inverse)
{
    return apply_rope_any(x, 0, n0, n1, n2, half, s0, s1, s2, s3, cos, scr, scc, sin, ssr, ssc,
                          inverse);
}

int csa_apply_rope_bf16(csa_bf16 *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                        csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                        const float *cos, csa_idx scr, csa_idx scc,
                        const float *sin, csa_idx ssr, csa_idx ssc, int inverse)
{
    return apply_rope_any(x, 1, n0, n1, n2, half, s0, s1, s2, s3, cos, scr, scc, sin, ssr, ssc,
                          inverse);
}
