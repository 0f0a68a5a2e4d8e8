#include "attn.h"
#include "amx.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* Element i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array. */
static inline float ld(const void *p, csa_idx i, int bf16)
{
    return bf16 ? csa_bf16_to_f32(((const csa_bf16 *)p)[i]) : ((const float *)p)[i];
}

static float dot_ref(const void *a, const void *b, csa_idx n, int bf16)
{
    float s = 0.0f;
    for (csa_idx i = 0; i < n; i++) s += ld(a, i, bf16) * ld(b, i, bf16);
    return s;
}

/* The oracle's body; the indices are already checked.  Writes out (if set), lse (if
 * set) and weights (if set). */
static int attn_ref(const struct csa_attn_problem *a)
{
    const void *q = a->q, *kv = a->kv;
    void *out = a->out;
    const float *sink = a->sink;
    const int32_t *idx = a->idx;
    const csa_idx sq_b = a->sq_b, sq_s = a->sq_s, sq_h = a->sq_h, skv_b = a->skv_b,
                  skv_n = a->skv_n, si_b = a->si_b, si_s = a->si_s, so_b = a->so_b,
                  so_s = a->so_s, so_h = a->so_h, B = a->B, S = a->S, H = a->H, D = a->D,
                  K = a->K;
    const float scale = a->scale;
    const int bf16 = a->bf16;
    const size_t es = bf16 ? sizeof(csa_bf16) : sizeof(float);
    float *o = NULL;
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx s = 0; s < S; s++) {
            const int32_t *ir = idx + b * si_b + s * si_s;
            const char *kvb = (const char *)kv + (size_t)(b * skv_b) * es;
            csa_idx valid = 0;
            for (csa_idx k = 0; k < K; k++) valid += ir[k] >= 0;
            if (!o && !(o = malloc((size_t)(D > 0 ? D : 1) * sizeof(float)))) return CSA_ENOMEM;
            float *w = a->weights ? a->weights + b * a->sw_b + s * a->sw_s : NULL;
            if (w)
                for (csa_idx k = 0; k < K; k++) w[k] = 0.0f;
            for (csa_idx h = 0; h < H; h++) {
                const void *qh = (const char *)q + (size_t)(b * sq_b + s * sq_s + h * sq_h) * es;
                for (csa_idx d = 0; d < D; d++) o[d] = 0.0f;
                float den = 1.0f, m = sink[h];
                if (valid) {
                    /* pass 1: the maximum over the sink and the logits (a NaN logit never
                     * wins the comparison; it reaches the output through its exp) */
                    for (csa_idx k = 0; k < K; k++) {
                        if (ir[k] < 0) continue;
                        const float l = scale * dot_ref(qh, kvb + (size_t)(ir[k] * skv_n) * es, D, bf16);
                        if (l > m) m = l;
                    }
                    /* pass 2: weights, denominator with the sink, weighted sum of rows;
                     * bf16 multiplies the rows by the weight rounded to bf16 */
                    den = expf(sink[h] - m);
                    for (csa_idx k = 0; k < K; k++) {
                        if (ir[k] < 0) continue;
                        const void *v = kvb + (size_t)(ir[k] * skv_n) * es;
                        const float p = expf(scale * dot_ref(qh, v, D, bf16) - m);
                        const float pw = bf16 ? csa_bf16_to_f32(csa_f32_to_bf16(p)) : p;
                        den += p;
                        for (csa_idx d = 0; d < D; d++) o[d] += pw * ld(v, d, bf16);
                    }
                }
                const float lse = valid ? m + logf(den) : sink[h];
                if (a->lse) a->lse[b * a->sl_b + s * a->sl_s + h] = lse;
                if (w && valid) /* pass 3: the probabilities, summed over heads per slot */
                    for (csa_idx k = 0; k < K; k++) {
                        if (ir[k] < 0) continue;
                        const void *v = kvb + (size_t)(ir[k] * skv_n) * es;
                        w[k] += expf(scale * dot_ref(qh, v, D, bf16) - lse);
                    }
                if (!out) continue;
                const csa_idx off = b * so_b + s * so_s + h * so_h;
                for (csa_idx d = 0; d < D; d++) {
                    const float y = o[d] / den;
                    if (bf16)
                        ((csa_bf16 *)out)[off + d] = csa_f32_to_bf16(y);
                    else
                        ((float *)out)[off + d] = y;
                }
            }
        }
    free(o);
    return CSA_OK;
}

int csa_attn_bad_index(const struct csa_attn_problem *p, csa_idx *b, csa_idx *s, csa_idx *k)
{
    for (csa_idx bi = 0; bi < p->B; bi++)
        for (csa_idx si = 0; si < p->S; si++) {
            const int32_t *ir = p->idx + bi * p->si_b + si * p->si_s;
            for (csa_idx ki = 0; ki < p->K; ki++)
                if (ir[ki] < -1 || ir[ki] >= p->N) {
                    *b = bi;
                    *s = si;
                    *k = ki;
                    return 1;
                }
        }
    return 0;
}

int csa_sparse_attn_ref(const struct csa_attn_problem *p)
{
    csa_idx b, s, k;
    if (csa_attn_bad_index(p, &b, &s, &k)) return CSA_EINDEX;
    return attn_ref(p);
}

int csa_sparse_attn_weights_ref(const struct csa_attn_problem *p)
{
    csa_idx b, s, k;
    if (!p->weights) return CSA_EINVAL;
    if (csa_attn_bad_index(p, &b, &s, &k)) return CSA_EINDEX;
    return attn_ref(p);
}

/* The backward oracle: one (b, s, h) after another, every sum in loop order, in
 * float32 (docs/kernels.md, section 11.1); float32 outputs (csa_sparse_attn_backward_ref
 * adds the bfloat16 ones). */
static int attn_bwd_ref(const struct csa_attn_bwd_problem *g)
{
    const struct csa_attn_problem *a = &g->f;
    csa_idx b, s, k;
    const int bf = a->bf16, dbf = g->dout_bf16;
    const csa_idx H = a->H, D = a->D, K = a->K;
    const float scale = a->scale;
    float *const dkv = g->dkv, *const dq = g->dq;
    for (b = 0; b < a->B; b++)
        for (csa_idx n = 0; n < a->N; n++)
            for (csa_idx d = 0; d < D; d++) dkv[b * g->sdkv_b + n * g->sdkv_n + d] = 0.0f;
    for (csa_idx h = 0; h < H; h++) g->dsink[h] = 0.0f;
    for (b = 0; b < a->B; b++)
        for (s = 0; s < a->S; s++) {
            const int32_t *ir = a->idx + b * a->si_b + s * a->si_s;
            for (csa_idx h = 0; h < H; h++) {
                const csa_idx qo = b * a->sq_b + s * a->sq_s + h * a->sq_h;
                const csa_idx oo = b * a->so_b + s * a->so_s + h * a->so_h;
                const csa_idx go = b * g->sdo_b + s * g->sdo_s + h * g->sdo_h;
                float *dqh = dq + b * g->sdq_b + s * g->sdq_s + h * g->sdq_h;
                for (csa_idx d = 0; d < D; d++) dqh[d] = 0.0f;
                csa_idx valid = 0;
                for (k = 0; k < K; k++) valid += ir[k] >= 0;
                if (!valid) continue;  /* the output is the constant 0 */
                const float lse = a->lse[b * a->sl_b + s * a->sl_s + h];
                float Dr = 0.0f;
                for (csa_idx d = 0; d < D; d++) Dr += ld(g->dout, go + d, dbf) * ld(a->out, oo + d, bf);
                g->dsink[h] -= expf(a->sink[h] - lse) * Dr;
                for (k = 0; k < K; k++) {
                    if (ir[k] < 0) continue;
                    const csa_idx vo = b * a->skv_b + ir[k] * a->skv_n;
                    float *dv = dkv + b * g->sdkv_b + ir[k] * g->sdkv_n;
                    float l = 0.0f, dp = 0.0f;
                    for (csa_idx d = 0; d < D; d++) {
                        l += ld(a->q, qo + d, bf) * ld(a->kv, vo + d, bf);
                        dp += ld(g->dout, go + d, dbf) * ld(a->kv, vo + d, bf);
                    }
                    const float p = expf(scale * l - lse);
                    const float ds = scale * (p * (dp - Dr));
                    for (csa_idx d = 0; d < D; d++) {
                        dqh[d] += ds * ld(a->kv, vo + d, bf);
                        dv[d] += p * ld(g->dout, go + d, dbf) + ds * ld(a->q, qo + d, bf);
                    }
                }
            }
        }
    return CSA_OK;
}

/* Runs body (the oracle or the tuned one) for g: directly when dq and dkv are float32
 * (or dq is bfloat16 and the body writes it itself: `own_dq`), else into float32
 * scratch that is then rounded once into them.  The tuned body rounds each row's d(q)
 * as it stores it; d(kv), which every row adds into, is summed in float32 scratch of
 * [B, N, D] (N kv rows, not the [B, S, H, D] of d(q)). */
static int attn_bwd_outputs(const struct csa_attn_bwd_problem *g,
                            int (*body)(const struct csa_attn_bwd_problem *), int own_dq)
{
    if ((!g->dq_bf16 || own_dq) && !g->dkv_bf16) return body(g);
    const struct csa_attn_problem *a = &g->f;
    const csa_idx B = a->B, S = a->S, H = a->H, N = a->N, D = a->D;
    struct csa_attn_bwd_problem h = *g;
    float *tq = NULL, *tkv = NULL;
    if (g->dq_bf16 && !own_dq) {
        if (!(tq = malloc((size_t)(B * S * H * D > 0 ? B * S * H * D : 1) * sizeof(float)))) return CSA_ENOMEM;
        h.dq = tq, h.dq_bf16 = 0, h.sdq_b = S * H * D, h.sdq_s = H * D, h.sdq_h = D;
    }
    if (g->dkv_bf16) {
        if (!(tkv = malloc((size_t)(B * N * D > 0 ? B * N * D : 1) * sizeof(float)))) {
            free(tq);
            return CSA_ENOMEM;
        }
        h.dkv = tkv, h.dkv_bf16 = 0, h.sdkv_b = N * D, h.sdkv_n = D;
    }
    const int st = body(&h);
    if (st == CSA_OK && tq) {
        const int nt = csa_threads(B * S, 64);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx r = 0; r < B * S; r++)
            for (csa_idx hh = 0; hh < H; hh++) {
                csa_bf16 *o = (csa_bf16 *)g->dq + (r / S) * g->sdq_b + (r % S) * g->sdq_s + hh * g->sdq_h;
                const float *x = tq + (r * H + hh) * D;
                for (csa_idx d = 0; d < D; d++) o[d] = csa_f32_to_bf16(x[d]);
            }
    }
    if (st == CSA_OK && tkv) {
        const int nt = csa_threads(B * N, 256);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx r = 0; r < B * N; r++) {
            csa_bf16 *o = (csa_bf16 *)g->dkv + (r / N) * g->sdkv_b + (r % N) * g->sdkv_n;
            const float *x = tkv + r * D;
            for (csa_idx d = 0; d < D; d++) o[d] = csa_f32_to_bf16(x[d]);
        }
    }
    free(tq);
    free(tkv);
    return st;
}

int csa_sparse_attn_backward_ref(const struct csa_attn_bwd_problem *g)
{
    const struct csa_attn_problem *a = &g->f;
    csa_idx b, s, k;
    if (!a->out || !a->lse) return CSA_EINVAL;
    if (csa_attn_bad_index(a, &b, &s, &k)) return CSA_EINDEX;
    return attn_bwd_outputs(g, attn_bwd_ref, 0);
}

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

/* The valid entries (>= 0) of one query's K indices, ascending, into vi[0..n); returns
 * n.  Gathering the rows in address order lets the hardware prefetchers follow them
 * (4-6% faster than the top-k order on rows that come from memory); the order is a
 * function of the indices alone, so the results stay independent of the thread count.
 * A stable LSD radix sort, 8 bits a pass, as many passes as the largest index needs;
 * tmp: K more entries of scratch. */
static csa_idx attn_sorted_valid(const int32_t *ir, csa_idx K, uint32_t *vi, uint32_t *tmp)
{
    csa_idx n = 0;
    uint32_t all = 0;
    for (csa_idx k = 0; k < K; k++)
        if (ir[k] >= 0) {
            vi[n++] = (uint32_t)ir[k];
            all |= (uint32_t)ir[k];
        }
    uint32_t *src = vi, *dst = tmp;
    for (int sh = 0; sh < 32 && (all >> sh) != 0; sh += 8) {
        csa_idx cnt[257] = {0};
        for (csa_idx i = 0; i < n; i++) cnt[((src[i] >> sh) & 255u) + 1]++;
        for (int j = 0; j < 256; j++) cnt[j + 1] += cnt[j];
        for (csa_idx i = 0; i < n; i++) dst[cnt[(src[i] >> sh) & 255u]++] = src[i];
        uint32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != vi) memcpy(vi, src, (size_t)n * sizeof(*vi));
    return n;
}

#define CSA_IMPL "attn_impl.h"
#include "csa_isa_variants.h"

/* No read out of bounds and no partial output (every index is scanned first), then
 * the tuned body for this ISA level or the oracle's. */
int csa_sparse_attn(const struct csa_attn_problem *a)
{
    csa_idx b, s, k;
    if (csa_attn_bad_index(a, &b, &s, &k)) return CSA_EINDEX;
    if (a->B <= 0 || a->S <= 0 || a->H <= 0) return CSA_OK;
    if (a->D <= 0) return a->lse ? attn_ref(a) : CSA_OK;
    CSA_DISPATCH(sparse_attn_tuned, (a), attn_ref(a));
}

int csa_sparse_attn_weights(const struct csa_attn_problem *a)
{
    csa_idx b, s, k;
    if (!a->weights) return CSA_EINVAL;
    if (csa_attn_bad_index(a, &b, &s, &k)) return CSA_EINDEX;
    if (a->B <= 0 || a->S <= 0) return CSA_OK;
    if (a->H <= 0 || a->D <= 0 || a->K <= 0) return attn_ref(a); /* zeros, cheaply */
    CSA_DISPATCH(sparse_attn_weights_tuned, (a), attn_ref(a));
}

static int attn_bwd_tuned(const struct csa_attn_bwd_problem *g)
{
    CSA_DISPATCH(sparse_attn_backward_tuned, (g), attn_bwd_ref(g));
}

int csa_sparse_attn_backward(const struct csa_attn_bwd_problem *g)
{
    const struct csa_attn_problem *a = &g->f;
    csa_idx b, s, k;
    if (!a->out || !a->lse) return CSA_EINVAL;
    if (csa_attn_bad_index(a, &b, &s, &k)) return CSA_EINDEX;
    if (a->D <= 0 || a->K <= 0 || a->H <= 0 || a->B <= 0 || a->S <= 0 ||
        csa_isa_get() == CSA_ISA_REF)
        return attn_bwd_outputs(g, attn_bwd_ref, 0);
    return attn_bwd_outputs(g, attn_bwd_tuned, 1);
}
