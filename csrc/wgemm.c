/* Weight-only FP8 GEMM (gemm.h: csa_wfp8_gemm): float activations times e4m3 weights
 * with 128 x 128 block scales, the oracle and the tuned entry. */
#include "gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

static inline float w_a(const struct csa_wgemm_args *g, csa_idx m, csa_idx n, csa_idx k)
{
    const csa_idx off = m * g->sa_row + (g->ng_rows > 0 ? (n / g->ng_rows) * g->sa_grp : 0) + k;
    return g->a_bf16 ? csa_bf16_to_f32(((const csa_bf16 *)g->a)[off]) : ((const float *)g->a)[off];
}

static inline float w_scale(const struct csa_wgemm_args *g, csa_idx n, csa_idx kb)
{
    const csa_idx i = (n / 128) * g->sbs_row + kb * g->sbs_col;
    return (g->bs_fmt == CSA_S_E8M0 ? csa_e8m0_to_f32(((const uint8_t *)g->bs)[i])
                                    : ((const float *)g->bs)[i]) * 256.0f;
}

/* The sixteen lanes reduced as gemm.h says: pairs, pairs of pairs, ... */
static inline float w_tree16(const float *l)
{
    float t[16];
    memcpy(t, l, sizeof t);
    for (int w = 1; w < 16; w *= 2)
        for (int i = 0; i < 16; i += 2 * w) t[i] = t[i] + t[i + w];
    return t[0];
}

static inline void w_store(const struct csa_wgemm_args *g, csa_idx m, csa_idx n, float v)
{
    if (g->out_bf16)
        ((csa_bf16 *)g->out)[m * g->so_row + n] = csa_f32_to_bf16(v);
    else
        ((float *)g->out)[m * g->so_row + n] = v;
}

int csa_wfp8_gemm_ref(const struct csa_wgemm_args *g)
{
    if (g->M < 0 || g->N < 0 || g->K < 0 || g->ng_rows < 0) return CSA_EINVAL;
    for (csa_idx m = 0; m < g->M; m++)
        for (csa_idx n = 0; n < g->N; n++) {
            const uint8_t *br = g->b + n * g->sb_row;
            float acc = 0.0f;
            for (csa_idx k0 = 0; k0 < g->K; k0 += 128) {
                float l[16] = {0};
                const csa_idx k1 = k0 + 128 < g->K ? k0 + 128 : g->K;
                for (csa_idx k = k0; k < k1; k++) {
                    const float w = g->b_bf16 ? csa_bf16_to_f32(((const csa_bf16 *)br)[k])
                                              : csa_e4m3_to_f32(br[k]) * (1.0f / 256.0f);
                    l[(k - k0) & 15] = fmaf(w_a(g, m, n, k), w, l[(k - k0) & 15]);
                }
                acc = g->b_bf16 ? acc + w_tree16(l) : fmaf(w_tree16(l), w_scale(g, n, k0 / 128), acc);
            }
            w_store(g, m, n, acc);
        }
    return CSA_OK;
}

#define CSA_IMPL "wgemm_impl.h"
#include "csa_isa_variants.h"

static int w_dispatch(const struct csa_wgemm_args *g)
{
    CSA_DISPATCH(wgemm_tuned, (g), csa_wfp8_gemm_ref(g));
}

/* Rows of bf16 activations up to which they are widened to float32 once, before the
 * weights are walked: the tuned bodies widen each 16 activations for every 4 weight rows
 * (a load-convert and a shift per 16 codes of each row, ~10% of the decode's vector
 * uops), and at decode the activation rows are a few KiB against MiBs of weights.  The
 * same values (bf16 -> float32 is exact), so the same bits. */
#define W_WIDEN_ROWS 16

int csa_wfp8_gemm(const struct csa_wgemm_args *g)
{
    if (g->M < 0 || g->N < 0 || g->K < 0 || g->ng_rows < 0) return CSA_EINVAL;
    if (g->M == 0 || g->N == 0) return CSA_OK;
    if (g->a_bf16 && g->M <= W_WIDEN_ROWS && g->K > 0) {
        const csa_idx G = g->ng_rows > 0 ? (g->N + g->ng_rows - 1) / g->ng_rows : 1;
        float *w = malloc((size_t)(g->M * G * g->K) * sizeof *w);
        if (w) {
            const csa_bf16 *a = g->a;
            for (csa_idx m = 0; m < g->M; m++)
                for (csa_idx j = 0; j < G; j++) {
                    const csa_bf16 *src = a + m * g->sa_row + (g->ng_rows > 0 ? j * g->sa_grp : 0);
                    float *dst = w + (m * G + j) * g->K;
                    for (csa_idx k = 0; k < g->K; k++) dst[k] = csa_bf16_to_f32(src[k]);
                }
            struct csa_wgemm_args h = *g;
            h.a = w;
            h.a_bf16 = 0;
            h.sa_row = G * g->K;
            h.sa_grp = g->K;
            const int st = w_dispatch(&h);
            free(w);
            return st;
        }
    }
    return w_dispatch(g);
}
