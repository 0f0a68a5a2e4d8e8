#include "attn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

static float dot_ref(const float *a, const float *b, csa_idx n)
{
    float s = 0.0f;
    for (csa_idx i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

int csa_sparse_attn_ref(const float *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                        const float *kv, csa_idx skv_b, csa_idx skv_n,
                        const float *sink,
                        const int32_t *idx, csa_idx si_b, csa_idx si_s,
                        float *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                        csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                        float scale)
{
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx s = 0; s < S; s++) {
            const int32_t *ir = idx + b * si_b + s * si_s;
            const float *kvb = kv + b * skv_b;
            csa_idx valid = 0;
            for (csa_idx k = 0; k < K; k++) {
                if (ir[k] < -1 || ir[k] >= N) return CSA_EINDEX;
                valid += ir[k] >= 0;
            }
            for (csa_idx h = 0; h < H; h++) {
                const float *qh = q + b * sq_b + s * sq_s + h * sq_h;
                float *o = out + b * so_b + s * so_s + h * so_h;
                for (csa_idx d = 0; d < D; d++) o[d] = 0.0f;
                if (!valid) continue;
                /* pass 1: the maximum over the sink and the logits (a NaN logit never
                 * wins the comparison; it reaches the output through its exp) */
                float m = sink[h];
                for (csa_idx k = 0; k < K; k++) {
                    if (ir[k] < 0) continue;
                    const float l = scale * dot_ref(qh, kvb + ir[k] * skv_n, D);
                    if (l > m) m = l;
                }
                /* pass 2: weights, denominator with the sink, weighted sum of rows */
                float den = expf(sink[h] - m);
                for (csa_idx k = 0; k < K; k++) {
                    if (ir[k] < 0) continue;
                    const float *v = kvb + ir[k] * skv_n;
                    const float p = expf(scale * dot_ref(qh, v, D) - m);
                    den += p;
                    for (csa_idx d = 0; d < D; d++) o[d] += p * v[d];
                }
                for (csa_idx d = 0; d < D; d++) o[d] /= den;
            }
        }
    return CSA_OK;
}

/* Everything the tuned body needs, passed by pointer through the dispatch. */
struct csa_attn_args {
    const float *q;
    csa_idx sq_b, sq_s, sq_h;
    const float *kv;
    csa_idx skv_b, skv_n;
    const float *sink;
    const int32_t *idx;
    csa_idx si_b, si_s;
    float *out;
    csa_idx so_b, so_s, so_h;
    csa_idx B, S, H, D, N, K;
    float scale;
};

static int omp_tid(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Blocking of the tuned body (attn_impl.h).  None of them depends on the thread
 * count, and no head's arithmetic depends on which other heads share its chunk. */
#define ATTN_KB 64   /* gathered rows per online-softmax block */
#define ATTN_DB 64   /* features per pass of the logits tile: its Q^T slice stays in L1 */
#define ATTN_MR 6    /* gathered rows per logits tile */
#define ATTN_MH 8    /* heads per output tile */
#define ATTN_HC 64   /* most heads per work item (all of them for V4-Flash prefill) */
#define ATTN_HC_FEW 32 /* heads per work item when there are few queries (decode) */
#define ATTN_FEW_QUERIES 8

#define CSA_IMPL "attn_impl.h"
#include "csa_isa_variants.h"

int csa_sparse_attn(const float *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                    const float *kv, csa_idx skv_b, csa_idx skv_n,
                    const float *sink,
                    const int32_t *idx, csa_idx si_b, csa_idx si_s,
                    float *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                    csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                    float scale)
{
    /* No read out of bounds and no partial output: scan every index first. */
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx s = 0; s < S; s++) {
            const int32_t *ir = idx + b * si_b + s * si_s;
            for (csa_idx k = 0; k < K; k++)
                if (ir[k] < -1 || ir[k] >= N) return CSA_EINDEX;
        }
    if (B <= 0 || S <= 0 || H <= 0 || D <= 0) return CSA_OK;
    const struct csa_attn_args a = {q, sq_b, sq_s, sq_h, kv, skv_b, skv_n, sink, idx, si_b, si_s,
                                    out, so_b, so_s, so_h, B, S, H, D, N, K, scale};
    CSA_DISPATCH(sparse_attn_tuned, (&a),
                 csa_sparse_attn_ref(q, sq_b, sq_s, sq_h, kv, skv_b, skv_n, sink, idx, si_b, si_s,
                                     out, so_b, so_s, so_h, B, S, H, D, N, K, scale));
}
