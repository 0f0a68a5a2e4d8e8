/* Indexer scoring and top-k selection, window and HCA index lists (index.h).
 *
 * Selection works on a 32-bit key per score that orders like the score with NaN on
 * top and -0.0 == +0.0 (score_key); ties go to the lower position.  The tuned path
 * finds the k-th key with a radix select (4 histogram passes of 8 bits over the
 * shrinking candidate set), takes the winners in position order in one scan, and for
 * the V4 order sorts them with a stable LSD radix sort by descending key.  The `_ref`
 * oracle sorts composite (key, position) pairs with qsort instead. */
#include "index.h"
#include "amx.h"
#include "qpack.h"
#include "quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ ranking */

static inline uint32_t score_key(float f)
{
    if (f != f) return 0xFFFFFFFFu; /* NaN above +inf (0xFF800000) */
    if (f == 0.0f) return 0x80000000u;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static inline csa_idx visible(csa_idx pos, csa_idx ratio) { return (pos + 1) / ratio; }

static inline csa_idx imin(csa_idx a, csa_idx b) { return a < b ? a : b; }

/* Per-thread selection workspace: n entries of key/pos/cbuf, K of tkey/tpos. */
struct sel_ws {
    uint32_t *key, *cbuf, *tkey;
    int32_t *pos, *tpos;
};

static void sel_ws_free(struct sel_ws *w)
{
    free(w->key);
    free(w->cbuf);
    free(w->tkey);
    free(w->pos);
    free(w->tpos);
    memset(w, 0, sizeof *w);
}

static int sel_ws_alloc(struct sel_ws *w, csa_idx n, csa_idx K)
{
    n = n > 0 ? n : 1;
    K = K > 0 ? K : 1;
    w->key = malloc((size_t)n * sizeof(uint32_t));
    w->cbuf = malloc((size_t)n * sizeof(uint32_t));
    w->pos = malloc((size_t)n * sizeof(int32_t));
    w->tkey = malloc((size_t)K * sizeof(uint32_t));
    w->tpos = malloc((size_t)K * sizeof(int32_t));
    if (!w->key || !w->cbuf || !w->pos || !w->tkey || !w->tpos) {
        sel_ws_free(w);
        return CSA_ENOMEM;
    }
    return CSA_OK;
}

/* Keeps, in place and in their original (ascending position) order, the k = min(K, m)
 * best of the m entries key/pos[0..m) and returns k. */
static csa_idx select_keys(uint32_t *key, int32_t *pos, csa_idx m, csa_idx K, uint32_t *cbuf)
{
    if (K >= m) return m;
    if (K <= 0) return 0;
    const uint32_t *src = key;
    csa_idx n = m, need = K;
    uint32_t thr = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        uint32_t hist[256] = {0};
        for (csa_idx i = 0; i < n; i++) hist[(src[i] >> shift) & 255u]++;
        int b = 255;
        csa_idx above = 0;
        for (; b > 0; b--) {
            if (above + (csa_idx)hist[b] >= need) break;
            above += hist[b];
        }
        need -= above;
        thr |= (uint32_t)b << shift;
        csa_idx n2 = 0; /* branch-free gather: half the entries may go either way */
        for (csa_idx i = 0; i < n; i++) {
            cbuf[n2] = src[i];
            n2 += ((src[i] >> shift) & 255u) == (uint32_t)b;
        }
        src = cbuf;
        n = n2;
    }
    /* thr is the k-th best key; `need` of the entries equal to it win, the lowest
     * positions first. */
    csa_idx j = 0, eq = need;
    for (csa_idx i = 0; i < m; i++) {
        const uint32_t u = key[i];
        const csa_idx tie = u == thr, take = (u > thr) | (tie & (eq > 0));
        eq -= tie;
        key[j] = u;
        pos[j] = pos[i];
        j += take;
    }
    return j;
}

/* Stable sort of key/pos[0..k) by descending key: LSD radix on ~key, the four 8-bit
 * digit histograms counted in one pass, passes whose digit is constant skipped;
 * *key / *pos are left pointing at the arrays holding the result (the inputs or
 * tkey/tpos). */
static void sort_desc(uint32_t **key, int32_t **pos, csa_idx k, uint32_t *tkey, int32_t *tpos)
{
    uint32_t *a = *key, *ta = tkey;
    int32_t *p = *pos, *tp = tpos;
    if (k <= 1) return;
    uint32_t hist[4][256];
    memset(hist, 0, sizeof hist);
    for (csa_idx i = 0; i < k; i++) {
        const uint32_t u = ~a[i];
        hist[0][u & 255u]++;
        hist[1][(u >> 8) & 255u]++;
        hist[2][(u >> 16) & 255u]++;
        hist[3][u >> 24]++;
    }
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 8 * pass;
        uint32_t *h = hist[pass];
        if (h[((~a[0]) >> shift) & 255u] == (uint32_t)k) continue;
        uint32_t sum = 0;
        for (int b = 0; b < 256; b++) {
            const uint32_t c = h[b];
            h[b] = sum;
            sum += c;
        }
        for (csa_idx i = 0; i < k; i++) {
            const uint32_t d = h[((~a[i]) >> shift) & 255u]++;
            ta[d] = a[i];
            tp[d] = p[i];
        }
        uint32_t *x = a;
        a = ta;
        ta = x;
        int32_t *y = p;
        p = tp;
        tp = y;
    }
    *key = a;
    *pos = p;
}

/* A row's candidate mask (NULL = all kept). */
static inline const uint8_t *cand_row(const struct csa_index_cand *c, csa_idx b, csa_idx s)
{
    return (c && c->mask) ? c->mask + b * c->scb + s * c->scs : NULL;
}

/* Whether a tile of keys [t, t + nk) lies wholly in unkept candidate blocks of size bs
 * (cm: the row's block mask, stride scn; NULL keeps everything): such tiles are skipped. */
static inline int cand_tile_skipped(const uint8_t *cm, csa_idx scn, csa_idx bs, csa_idx t,
                                    csa_idx nk)
{
    if (!cm) return 0;
    for (csa_idx j = t / bs; j <= (t + nk - 1) / bs; j++)
        if (cm[j * scn]) return 0;
    return 1;
}

/* Selects the top-K of the first nvis entries of one row of scores (stride sst) that
 * lie in kept blocks, writes K indices to out. */
static void select_row(const float *sc, csa_idx sst, csa_idx nvis, const uint8_t *cm,
                       const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                       int32_t *out, struct sel_ws *ws)
{
    uint32_t *key = ws->key;
    int32_t *pos = ws->pos;
    csa_idx m = 0;
    if (cm) {
        const csa_idx bs = c->block_size;
        for (csa_idx j = 0; j * bs < nvis; j++) {
            if (!cm[j * c->scn]) continue;
            const csa_idx t1 = imin(nvis, (j + 1) * bs);
            for (csa_idx t = j * bs; t < t1; t++) {
                key[m] = score_key(sc[t * sst]);
                pos[m++] = (int32_t)t;
            }
        }
    } else if (nvis > K && K > 0) {
        /* One pass keys the row and counts the top 11 key bits; a second keeps, in
         * position order, the entries of the bins that hold the K best (all others are
         * strictly below every one of them), so the radix select runs on a few
         * hundred entries instead of nvis: index_topk decode at Tc = 65536, K = 512
         * spent 0.5-0.9 ms here before, 0.2 after (AMD EPYC Zen 3). */
        uint32_t hist[2048] = {0};
        for (csa_idx t = 0; t < nvis; t++) {
            const uint32_t u = score_key(sc[t * sst]);
            key[t] = u;
            hist[u >> 21]++;
        }
        uint32_t bin = 2047;
        csa_idx above = 0;
        for (; bin > 0; bin--) {
            if (above + (csa_idx)hist[bin] >= K) break;
            above += hist[bin];
        }
        for (csa_idx t = 0; t < nvis; t++) { /* in place: m <= t */
            const uint32_t u = key[t];
            key[m] = u;
            pos[m] = (int32_t)t;
            m += (u >> 21) >= bin;
        }
    } else if (sst == 1) {
        for (csa_idx t = 0; t < nvis; t++) {
            key[t] = score_key(sc[t]);
            pos[t] = (int32_t)t;
        }
        m = nvis;
    } else {
        for (csa_idx t = 0; t < nvis; t++) {
            key[t] = score_key(sc[t * sst]);
            pos[t] = (int32_t)t;
        }
        m = nvis;
    }
    const csa_idx k = select_keys(key, pos, m, K, ws->cbuf);
    if (order == CSA_ORDER_SCORE) sort_desc(&key, &pos, k, ws->tkey, ws->tpos);
    for (csa_idx j = 0; j < k; j++) out[j] = (int32_t)(pos[j] + offset);
    for (csa_idx j = k; j < K; j++) out[j] = -1;
}

/* Element i of a float32 or bfloat16 array, widened exactly to float32. */
static inline float ld(const void *a, int bf16, csa_idx i)
{
    return bf16 ? csa_bf16_to_f32(((const csa_bf16 *)a)[i]) : ((const float *)a)[i];
}

/* ------------------------------------------------------------------ FP4 rows */

/* 2x the e2m1 value of a code (sign bit 3; 0, 0.5, 1, 1.5, 2, 3, 4, 6): the integers
 * the exact block sums run on. */
static const int8_t fp4_v2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int fp4_code(const uint8_t *row, csa_idx d) { return (row[d >> 1] >> (4 * (d & 1))) & 15; }

/* 2^(e - 127) for a ue8m0 byte e (2^-127 is a float32 subnormal, exact); 0xff is NaN. */
static inline float fp4_scale(uint8_t e)
{
    if (e == 0xff) return NAN;
    union { uint32_t u; float f; } v = {e ? (uint32_t)e << 23 : 0x00400000u};
    return v.f;
}

/* Packs the Hi query rows of (b, s) (float32 or bfloat16) into FP4 rows of
 * W = Di / 2 + Di / 32 bytes at dst (row stride W): the released indexer's query
 * rounding (block 32, ue8m0), stored as codes. */
static int fp4_pack_q(const struct csa_index_problem *p, csa_idx b, csa_idx s, uint8_t *dst,
                      int ref)
{
    const csa_idx W = p->Di / 2 + p->Di / 32;
    const size_t es = p->qk_bf16 ? 2 : 4;
    const char *q = (const char *)p->q + (size_t)(b * p->sqb + s * p->sqs) * es;
    if (ref)
        return csa_quant_pack_ref(q, p->qk_bf16, p->Hi, p->Di, p->sqh, 1, 32, CSA_Q_E2M1,
                                  CSA_QS_UE8M0, dst, W, dst + p->Di / 2, 1, W, 1);
    return csa_quant_pack(q, p->qk_bf16, p->Hi, p->Di, p->sqh, 1, 32, CSA_Q_E2M1, CSA_QS_UE8M0,
                          dst, W, dst + p->Di / 2, 1, W, 1);
}

/* float32 -> bfloat16 -> float32, nearest even, NaN -> 0x7fc0 (torch's rounding). */
static inline float round_bf16(float x)
{
    if (x != x) return csa_bf16_to_f32(0x7fc0);
    union { float f; uint32_t u; } v = {x};
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    return v.f;
}

/* torch's float32 sum over a non-innermost dimension (csa_index_problem, bf16_steps):
 * term n (1-based) goes into acc[0]; after every 16 terms acc[j-1] moves into acc[j]
 * while n is a multiple of 16^j. */
static inline void cascade_add(float acc[4], float term, csa_idx n)
{
    acc[0] += term;
    if (n % 16) return;
    for (int j = 1; j < 4; j++) {
        acc[j] += acc[j - 1];
        acc[j - 1] = 0.0f;
        if (n & ((csa_idx)15 << (4 * j))) break;
    }
}

/* The plainest statement of the FP4 score: per head, per block, an integer sum of
 * the 2x codes, times the product of the scales (and 1/4), added in block order. */
static __attribute__((noinline)) float score_ref_fp4(const struct csa_index_problem *p,
                                                     const uint8_t *qrows, csa_idx sqh,
                                                     csa_idx b, csa_idx s, csa_idx t)
{
    const csa_idx Di = p->Di, nb = Di / 32;
    const uint8_t *kr = (const uint8_t *)p->k + b * p->skb + t * p->skt;
    const csa_idx w0 = b * p->swb + s * p->sws;
    float acc = 0.0f, cas[4] = {0.0f, 0.0f, 0.0f, 0.0f}, lane[4][4] = {{0.0f}}, rest[4];
    for (csa_idx h = 0; h < p->Hi; h++) {
        const uint8_t *qr = qrows + h * sqh;
        float dot = 0.0f;
        for (csa_idx j = 0; j < nb; j++) {
            int32_t isum = 0;
            for (csa_idx d = 32 * j; d < 32 * j + 32; d++)
                isum += fp4_v2[fp4_code(qr, d)] * fp4_v2[fp4_code(kr, d)];
            const float sc = fp4_scale(qr[Di / 2 + j]) * (fp4_scale(kr[Di / 2 + j]) * 0.25f);
            dot += (float)isum * sc;
        }
        const float w = ld(p->w, p->w_bf16, w0 + h * p->swh);
        if (p->bf16_steps) {
            const float d16 = round_bf16(dot);
            const float term = round_bf16((d16 < 0.0f ? 0.0f : d16) * w);
            if (t < p->Tc / 32 * 32)
                cascade_add(cas, term, h + 1);
            else if (h < p->Hi / 4 * 4)
                cascade_add(lane[h % 4], term, h / 4 + 1);
            else
                rest[h % 4] = term;   /* the last Hi % 4 heads */
            continue;
        }
        const float r = dot < 0.0f ? 0.0f : dot; /* keeps NaN */
        acc += r * w;
    }
    if (!p->bf16_steps) return acc;
    if (t < p->Tc / 32 * 32) return round_bf16(((cas[0] + cas[1]) + cas[2]) + cas[3]);
    float l[4];
    for (int k = 0; k < 4; k++) l[k] = ((lane[k][0] + lane[k][1]) + lane[k][2]) + lane[k][3];
    for (csa_idx h = p->Hi / 4 * 4; h < p->Hi; h++) l[0] += rest[h % 4];
    return round_bf16(((l[0] + l[1]) + l[2]) + l[3]);
}

/* The FP4 query rows of (b, s) for the oracle: q itself (q_fp4) or packed into buf. */
static const uint8_t *fp4_q_rows_ref(const struct csa_index_problem *p, csa_idx b, csa_idx s,
                                     uint8_t *buf, csa_idx *sqh)
{
    if (p->q_fp4) {
        *sqh = p->sqh;
        return (const uint8_t *)p->q + b * p->sqb + s * p->sqs;
    }
    *sqh = p->Di / 2 + p->Di / 32;
    fp4_pack_q(p, b, s, buf, 1);
    return buf;
}

/* ------------------------------------------------------------------ oracle */

static int cmp_u64_desc(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

static int cmp_i32(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sorts (key, ~position) pairs: the plainest statement of the ranking. */
static int select_row_ref(const float *sc, csa_idx sst, csa_idx nvis, const uint8_t *cm,
                          const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                          int32_t *out)
{
    uint64_t *all = malloc((size_t)(nvis > 0 ? nvis : 1) * sizeof(uint64_t));
    if (!all) return CSA_ENOMEM;
    csa_idx m = 0;
    for (csa_idx t = 0; t < nvis; t++) {
        if (cm && !cm[(t / c->block_size) * c->scn]) continue;
        all[m++] = ((uint64_t)score_key(sc[t * sst]) << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)t);
    }
    qsort(all, (size_t)m, sizeof(uint64_t), cmp_u64_desc);
    const csa_idx k = imin(m, K);
    for (csa_idx j = 0; j < k; j++) out[j] = (int32_t)(0xFFFFFFFFu - (uint32_t)all[j]);
    if (order == CSA_ORDER_POSITION) qsort(out, (size_t)k, sizeof(int32_t), cmp_i32);
    for (csa_idx j = 0; j < k; j++) out[j] = (int32_t)(out[j] + offset);
    for (csa_idx j = k; j < K; j++) out[j] = -1;
    free(all);
    return CSA_OK;
}

static float score_ref(const struct csa_index_problem *p, csa_idx b, csa_idx s, csa_idx t)
{
    const int bf = p->qk_bf16;
    const csa_idx q0 = b * p->sqb + s * p->sqs, k0 = b * p->skb + t * p->skt;
    const csa_idx w0 = b * p->swb + s * p->sws;
    float acc = 0.0f;
    for (csa_idx h = 0; h < p->Hi; h++) {
        float dot = 0.0f;
        for (csa_idx d = 0; d < p->Di; d++)
            dot += ld(p->q, bf, q0 + h * p->sqh + d) * ld(p->k, bf, k0 + d);
        const float r = dot < 0.0f ? 0.0f : dot; /* keeps NaN */
        acc += r * ld(p->w, p->w_bf16, w0 + h * p->swh);
    }
    return acc;
}

static int fp4_args_ok(const struct csa_index_problem *p)
{
    if (p->q_fp4 && !p->k_fp4) return 0;
    if (p->bf16_steps && (!p->k_fp4 || p->Hi > 65536)) return 0;
    return !p->k_fp4 || p->Di % 32 == 0;
}

/* Query-row scratch of the FP4 oracle (NULL-safe size). */
static uint8_t *fp4_qbuf_ref(const struct csa_index_problem *p)
{
    return malloc((size_t)(p->Hi > 0 ? p->Hi : 1) * (size_t)(p->Di / 2 + p->Di / 32 + 1));
}

int csa_index_scores_ref(const struct csa_index_problem *p, float *out, csa_idx sob, csa_idx sos)
{
    if (!fp4_args_ok(p)) return CSA_EINVAL;
    uint8_t *qb = p->k_fp4 ? fp4_qbuf_ref(p) : NULL;
    if (p->k_fp4 && !qb) return CSA_ENOMEM;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            const csa_idx nv = visible(p->start_pos + s, p->ratio);
            float *o = out + b * sob + s * sos;
            csa_idx sqh = 0;
            const uint8_t *qr = p->k_fp4 && nv > 0 ? fp4_q_rows_ref(p, b, s, qb, &sqh) : NULL;
            for (csa_idx t = 0; t < p->Tc; t++)
                o[t] = t >= nv ? -INFINITY
                     : p->k_fp4 ? score_ref_fp4(p, qr, sqh, b, s, t) : score_ref(p, b, s, t);
        }
    free(qb);
    return CSA_OK;
}

int csa_index_topk_ref(const struct csa_index_problem *p, const struct csa_index_cand *c,
                       csa_idx K, csa_idx offset, int order, int32_t *out)
{
    if (!fp4_args_ok(p)) return CSA_EINVAL;
    float *row = malloc((size_t)(p->Tc > 0 ? p->Tc : 1) * sizeof(float));
    uint8_t *qb = p->k_fp4 ? fp4_qbuf_ref(p) : NULL;
    if (!row || (p->k_fp4 && !qb)) {
        free(row);
        free(qb);
        return CSA_ENOMEM;
    }
    int st = CSA_OK;
    for (csa_idx b = 0; b < p->B && !st; b++)
        for (csa_idx s = 0; s < p->S && !st; s++) {
            const csa_idx nv = visible(p->start_pos + s, p->ratio);
            csa_idx sqh = 0;
            const uint8_t *qr = p->k_fp4 && nv > 0 ? fp4_q_rows_ref(p, b, s, qb, &sqh) : NULL;
            for (csa_idx t = 0; t < nv; t++)
                row[t] = p->k_fp4 ? score_ref_fp4(p, qr, sqh, b, s, t) : score_ref(p, b, s, t);
            st = select_row_ref(row, 1, nv, cand_row(c, b, s), c, K, offset, order,
                                out + (b * p->S + s) * K);
        }
    free(row);
    free(qb);
    return st;
}

int csa_topk_indices_ref(const float *scores, csa_idx B, csa_idx S, csa_idx Tc, csa_idx ssb,
                         csa_idx sss, csa_idx sst, csa_idx ratio, csa_idx start_pos,
                         const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                         int32_t *out)
{
    (void)Tc;
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx s = 0; s < S; s++) {
            int st = select_row_ref(scores + b * ssb + s * sss, sst,
                                    visible(start_pos + s, ratio), cand_row(c, b, s), c, K,
                                    offset, order, out + (b * S + s) * K);
            if (st) return st;
        }
    return CSA_OK;
}

/* ------------------------------------------------------------------ tuned */

/* What the tuned kernels read for q . k (index_impl.h): float32 q/k in place,
 * bfloat16 q/k widened to float32 copies for the float32 code, or bfloat16 q/k on
 * AMX-BF16 tiles (level 'amx' only). */
enum { IX_F32 = 0, IX_WIDEN = 1, IX_AMX = 2, IX_FP4 = 3 };

/* One tuned call: scores into sc (idx == NULL) or fused top-k into idx. */
struct ix_call {
    const struct csa_index_problem *p;
    const struct csa_index_cand *c;
    csa_idx K, offset;
    int order;
    int32_t *idx;
    float *sc;
    csa_idx sob, sos;
    /* FP4 keys: the FP4 query rows, bytes (q itself, or rounded and packed once) */
    const uint8_t *qp;
    csa_idx qpb, qps, qph;
};

#define CSA_IMPL "index_impl.h"
#include "csa_isa_variants.h"

int csa_index_scores(const struct csa_index_problem *p, float *out, csa_idx sob, csa_idx sos)
{
    CSA_DISPATCH(index_scores_tuned, (p, out, sob, sos), csa_index_scores_ref(p, out, sob, sos));
}

int csa_index_topk(const struct csa_index_problem *p, const struct csa_index_cand *c,
                   csa_idx K, csa_idx offset, int order, int32_t *out)
{
    CSA_DISPATCH(index_topk_tuned, (p, c, K, offset, order, out),
                 csa_index_topk_ref(p, c, K, offset, order, out));
}

int csa_topk_indices(const float *scores, csa_idx B, csa_idx S, csa_idx Tc, csa_idx ssb,
                     csa_idx sss, csa_idx sst, csa_idx ratio, csa_idx start_pos,
                     const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                     int32_t *out)
{
    if (csa_isa_get() == CSA_ISA_REF)
        return csa_topk_indices_ref(scores, B, S, Tc, ssb, sss, sst, ratio, start_pos, c, K,
                                    offset, order, out);
    const csa_idx rows = B * S;
    int err = CSA_OK;
#pragma omp parallel num_threads(csa_threads(rows, 16))
    {
        struct sel_ws ws;
        const int st = sel_ws_alloc(&ws, Tc, K);
        if (st) {
#pragma omp atomic write
            err = st;
        }
#pragma omp for schedule(dynamic, 16)
        for (csa_idx r = 0; r < rows; r++) {
            if (st) continue;
            const csa_idx b = r / S, s = r % S;
            select_row(scores + b * ssb + s * sss, sst, visible(start_pos + s, ratio),
                       cand_row(c, b, s), c, K, offset, order, out + r * K, &ws);
        }
        sel_ws_free(&ws);
    }
    return err;
}

int csa_select_candidate_blocks(const float *scores, csa_idx B, csa_idx S, csa_idx Tc,
                                csa_idx ssb, csa_idx sss, csa_idx sst, csa_idx ratio,
                                csa_idx start_pos, csa_idx topk_blocks, csa_idx bs,
                                uint8_t *out)
{
    const csa_idx nb = (Tc + bs - 1) / bs, rows = B * S;
    int err = CSA_OK;
#pragma omp parallel num_threads(csa_threads(rows, 64))
    {
        struct sel_ws ws;
        const int st = sel_ws_alloc(&ws, nb, 1);
        if (st) {
#pragma omp atomic write
            err = st;
        }
#pragma omp for schedule(static)
        for (csa_idx r = 0; r < rows; r++) {
            if (st) continue;
            const csa_idx b = r / S, s = r % S;
            const float *sc = scores + b * ssb + s * sss;
            uint8_t *o = out + r * nb;
            memset(o, 0, (size_t)nb);
            const csa_idx nv = imin(visible(start_pos + s, ratio), Tc);
            if (nv <= 0) continue;
            const csa_idx forced = (nv - 1) / bs; /* newest visible entry's block */
            o[forced] = 1;
            /* Blocks before `forced` are fully visible. */
            for (csa_idx j = 0; j < forced; j++) {
                uint32_t best = 0;
                for (csa_idx t = j * bs; t < (j + 1) * bs; t++) {
                    const uint32_t u = score_key(sc[t * sst]);
                    best = u > best ? u : best;
                }
                ws.key[j] = best;
                ws.pos[j] = (int32_t)j;
            }
            const csa_idx k = select_keys(ws.key, ws.pos, forced, topk_blocks - 1, ws.cbuf);
            for (csa_idx j = 0; j < k; j++) o[ws.pos[j]] = 1;
        }
        sel_ws_free(&ws);
    }
    return err;
}

/* ------------------------------------------------------------------ index lists */

int csa_window_topk_idxs(int32_t *out, csa_idx window, csa_idx B, csa_idx S, csa_idx start_pos)
{
    if (window <= 0 || (start_pos > 0 && S != 1)) return CSA_EINVAL;
    if (start_pos == 0) {
        const csa_idx W = imin(S, window), rows = B * S;
#pragma omp parallel for num_threads(csa_threads(rows, 4096 / (W + 1) + 1)) schedule(static)
        for (csa_idx r = 0; r < rows; r++) {
            const csa_idx s = r % S, lo = s - window + 1 > 0 ? s - window + 1 : 0;
            int32_t *o = out + r * W;
            for (csa_idx j = 0; j < W; j++) o[j] = lo + j <= s ? (int32_t)(lo + j) : -1;
        }
        return CSA_OK;
    }
    for (csa_idx b = 0; b < B; b++) {
        int32_t *o = out + b * window;
        for (csa_idx j = 0; j < window; j++) {
            if (start_pos >= window - 1)
                o[j] = (int32_t)((start_pos + 1 + j) % window);
            else
                o[j] = j <= start_pos ? (int32_t)j : -1;
        }
    }
    return CSA_OK;
}

int csa_compress_topk_idxs(int32_t *out, csa_idx ratio, csa_idx B, csa_idx S,
                           csa_idx start_pos, csa_idx offset)
{
    if (ratio <= 0 || (start_pos > 0 && S != 1)) return CSA_EINVAL;
    const csa_idx W = (start_pos + S) / ratio, rows = B * S;
#pragma omp parallel for num_threads(csa_threads(rows, 4096 / (W + 1) + 1)) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const csa_idx nv = visible(start_pos + r % S, ratio);
        int32_t *o = out + r * W;
        for (csa_idx t = 0; t < W; t++) o[t] = t < nv ? (int32_t)(t + offset) : -1;
    }
    return CSA_OK;
}
