/* Tuned sparse attention body, compiled once per ISA level by csa_isa_variants.h.
 *
 * MQA structure: a query's H heads share every gathered KV row, so one work item is
 * (b, s, a chunk of up to ATTN_HC heads) and its arithmetic is two small GEMMs per
 * block of ATTN_KB gathered rows, both with the heads along the vector lanes:
 *
 *   L[k, h] = Q[h, :] . R_k        logits^T, tile ATTN_MR rows x 64 heads, reduction
 *                                 over D in ATTN_DB slices of Q^T (kept in L1)
 *   P[k, h] = e^(scale L - m_h)    online softmax, m_h the running max (starts at sink)
 *   OT[d, h] = alpha_h OT[d, h] + sum_k R_k[d] P[k, h]    tile 6 features x 64 heads
 *
 * R_k point at the gathered kv rows in place and are only ever broadcast from, so no
 * [S, K, D] block is built and no row needs copying (bf16 rows are widened one block
 * at a time into a tile).  There is no software prefetch of the rows: the L2 streamer
 * follows a 2 KB row from its first line, while prefetches of lines that come from
 * memory hold the L1 fill buffers that the logits tile's loads need (measured 5-10%
 * slower with them, on rows gathered from beyond L2).  Per-thread scratch (~0.4 MB for V4-Flash): Q^T [D, HCP],
 * L/P [KBP, HCP], OT [D, HCP], m, sum, alpha, the tile.  Every (h, d) result is a
 * fixed-order chain (over d for logits, over k for O and the softmax sums) that
 * depends neither on the thread count nor on the chunking of heads, so the output is
 * bitwise identical at any thread count. */

#include "vexp_impl.h"
#include "bf16_impl.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
/* Transposes the 8 x 8 block of floats in r[0..7] (AVX2's 16 registers hold it and its
 * temporaries): pairs of rows interleaved, then pairs of pairs, then the 128-bit halves
 * exchanged. */
static inline __attribute__((always_inline)) void CSA_V(transpose8)(__m256 r[8])
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

#ifdef __AVX512F__

/* Transposes the 16 x 16 block of 32-bit elements in r[0..15]: four stages that swap
 * off-diagonal blocks of 8, 4, 2 and 1 elements between rows i and i + s. */
static inline __attribute__((always_inline)) void CSA_V(transpose16)(__m512i r[16])
{
    static const int32_t idx[4][2][16] = {
        {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
        {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
         {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
        {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
         {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
        {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
         {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    };
    for (int st = 0, s = 8; st < 4; st++, s >>= 1) {
        const __m512i ia = _mm512_loadu_si512(idx[st][0]), ib = _mm512_loadu_si512(idx[st][1]);
        for (int i = 0; i < 16; i++) {
            if (i & s) continue;
            const __m512i x = r[i], y = r[i + s];
            r[i] = _mm512_permutex2var_epi32(x, ia, y);
            r[i + s] = _mm512_permutex2var_epi32(x, ib, y);
        }
    }
}

/* L[i, 0:16*NV] (+)= sum_{d0 <= d < d1} R_i[d] * QT[d, 0:16*NV] for ATTN_MR rows. */
static inline __attribute__((always_inline)) void
CSA_V(qk_tile)(const float *const *R, const float *QT, csa_idx hcp, csa_idx d0, csa_idx d1,
               float *L, int first, const int NV)
{
    __m512 acc[ATTN_MR][4];
    const float *r[ATTN_MR];
    for (int i = 0; i < ATTN_MR; i++) {
        r[i] = R[i];
        for (int j = 0; j < NV; j++)
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(L + i * hcp + 16 * j);
    }
    for (csa_idx d = d0; d < d1; d++) {
        const float *qt = QT + d * hcp;
        __m512 qv[4];
        for (int j = 0; j < NV; j++) qv[j] = _mm512_loadu_ps(qt + 16 * j);
        for (int i = 0; i < ATTN_MR; i++) {
            const __m512 x = _mm512_set1_ps(r[i][d]);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(x, qv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < ATTN_MR; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(L + i * hcp + 16 * j, acc[i][j]);
}

/* OT[d0 + i, 16 j ..] = alpha OT[d0 + i, 16 j ..] + sum_{k < kb} R_k[d0 + i] P[k, 16 j ..]
 * for ND features and NV vectors of heads (alpha NULL: 1, no multiply): the logits tile with the roles swapped, so
 * the rows are read by broadcasts only (no alignment needed, and each block's rows
 * pass through L1 once instead of once per group of heads). */
static inline __attribute__((always_inline)) void
CSA_V(pv_tile)(const float *const *R, csa_idx kb, const float *P, csa_idx hcp,
               const float *alpha, float *OT, csa_idx d0, int first, const int ND, const int NV)
{
    __m512 acc[6][4], al[4];
    for (int j = 0; j < NV; j++) al[j] = alpha ? _mm512_loadu_ps(alpha + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < ND; i++)
        for (int j = 0; j < NV; j++) {
            const __m512 o = first ? _mm512_setzero_ps() : _mm512_loadu_ps(OT + (d0 + i) * hcp + 16 * j);
            acc[i][j] = first || !alpha ? o : _mm512_mul_ps(o, al[j]);
        }
    for (csa_idx k = 0; k < kb; k++) {
        const float *pk = P + k * hcp, *rk = R[k] + d0;
        __m512 p[4];
        for (int j = 0; j < NV; j++) p[j] = _mm512_loadu_ps(pk + 16 * j);
        for (int i = 0; i < ND; i++) {
            const __m512 x = _mm512_set1_ps(rk[i]);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(x, p[j], acc[i][j]);
        }
    }
    for (int i = 0; i < ND; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(OT + (d0 + i) * hcp + 16 * j, acc[i][j]);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2 tiles in GNU vector extensions (8 floats = one ymm), sized for 16 vector
 * registers; the same per-element chains as the AVX-512 tiles.  (On the SSE2
 * baseline GCC lowers 8-wide vectors poorly, so it keeps the plain loops.) */
typedef float CSA_V(v8) __attribute__((vector_size(32), aligned(32)));
typedef float CSA_V(v8u) __attribute__((vector_size(32), aligned(4)));

/* L[i, 0:16] = sum_d R_i[d] * QT[d, 0:16] for ATTN_MR rows (QT, L 32-byte aligned). */
static inline void CSA_V(qk_tile_v8)(const float *const *R, const float *QT, csa_idx hcp,
                                     csa_idx D, float *L)
{
    CSA_V(v8) acc[ATTN_MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) acc[i][0] = acc[i][1] = (CSA_V(v8)){0};
    for (csa_idx d = 0; d < D; d++) {
        const CSA_V(v8) q0 = *(const CSA_V(v8) *)(QT + d * hcp);
        const CSA_V(v8) q1 = *(const CSA_V(v8) *)(QT + d * hcp + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ATTN_MR; i++) {
            const float x = R[i][d];
            acc[i][0] += x * q0;
            acc[i][1] += x * q1;
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) {
        *(CSA_V(v8) *)(L + i * hcp) = acc[i][0];
        *(CSA_V(v8) *)(L + i * hcp + 8) = acc[i][1];
    }
}

/* OT[d0 .. d0+6, 0:16] = alpha OT[..] + sum_k R_k[d0 ..] P[k, 0:16] (P, OT 32-byte aligned). */
static inline void CSA_V(pv_tile_v8)(const float *const *R, csa_idx kb, const float *P,
                                     csa_idx hcp, const float *alpha, float *OT, csa_idx d0,
                                     int first)
{
    CSA_V(v8) acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        acc[i][0] = first ? (CSA_V(v8)){0} : *(const CSA_V(v8) *)(OT + (d0 + i) * hcp);
        acc[i][1] = first ? (CSA_V(v8)){0} : *(const CSA_V(v8) *)(OT + (d0 + i) * hcp + 8);
    }
    if (alpha && !first) {
        const CSA_V(v8) a0 = *(const CSA_V(v8u) *)alpha, a1 = *(const CSA_V(v8u) *)(alpha + 8);
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) {
            acc[i][0] *= a0;
            acc[i][1] *= a1;
        }
    }
    for (csa_idx k = 0; k < kb; k++) {
        const float *r = R[k] + d0;
        const CSA_V(v8) p0 = *(const CSA_V(v8) *)(P + k * hcp), p1 = *(const CSA_V(v8) *)(P + k * hcp + 8);
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) {
            const float x = r[i];
            acc[i][0] += x * p0;
            acc[i][1] += x * p1;
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        *(CSA_V(v8) *)(OT + (d0 + i) * hcp) = acc[i][0];
        *(CSA_V(v8) *)(OT + (d0 + i) * hcp + 8) = acc[i][1];
    }
}
#endif

/* Logits of kbp (a multiple of ATTN_MR) gathered rows for all hcp heads: L[k, h]. */
static void CSA_V(attn_logits)(const float *const *R, csa_idx kbp, const float *QT, csa_idx hcp,
                               csa_idx D, float *L)
{
#ifdef __AVX512F__
    const csa_idx nvec = hcp / 16;
    for (csa_idx d0 = 0; d0 < D; d0 += ATTN_DB) {
        const csa_idx d1 = d0 + ATTN_DB < D ? d0 + ATTN_DB : D;
        for (csa_idx i0 = 0; i0 < kbp; i0 += ATTN_MR)
            for (csa_idx v0 = 0; v0 < nvec; v0 += 4) {
                const float *const *Ri = R + i0;
                float *Li = L + i0 * hcp + 16 * v0;
                const float *Q = QT + 16 * v0;
                switch (nvec - v0 < 4 ? nvec - v0 : 4) {
                case 4: CSA_V(qk_tile)(Ri, Q, hcp, d0, d1, Li, d0 == 0, 4); break;
                case 3: CSA_V(qk_tile)(Ri, Q, hcp, d0, d1, Li, d0 == 0, 3); break;
                case 2: CSA_V(qk_tile)(Ri, Q, hcp, d0, d1, Li, d0 == 0, 2); break;
                default: CSA_V(qk_tile)(Ri, Q, hcp, d0, d1, Li, d0 == 0, 1); break;
                }
            }
    }
#elif defined(__AVX2__)
    for (csa_idx i0 = 0; i0 < kbp; i0 += ATTN_MR)
        for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
            CSA_V(qk_tile_v8)(R + i0, QT + h0, hcp, D, L + i0 * hcp + h0);
#else
    for (csa_idx i = 0; i < kbp; i++) {
        float *CSA_RESTRICT Li = L + i * hcp;
        const float *CSA_RESTRICT r = R[i];
        for (csa_idx h = 0; h < hcp; h++) Li[h] = 0.0f;
        for (csa_idx d = 0; d < D; d++) {
            const float x = r[d];
            const float *CSA_RESTRICT qt = QT + d * hcp;
#pragma omp simd
            for (csa_idx h = 0; h < hcp; h++) Li[h] += x * qt[h];
        }
    }
#endif
}

/* Online softmax step over kb rows of L (scaled here): updates the running max m and
 * sum (which includes the sink's e^(sink - m)), turns L into P = e^(l - m), and sets
 * alpha = e^(m_old - m_new), the factor for what O accumulated so far.  A logit of
 * -inf weighs exactly 0 even when m is still -inf (sink = -inf). */
static void CSA_V(attn_softmax)(float *L, csa_idx kb, csa_idx hcp, float scale, float *m,
                                float *sum, float *alpha)
{
#ifdef __AVX512F__
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (csa_idx h = 0; h < hcp; h += 16) {
        const __m512 mold = _mm512_loadu_ps(m + h);
        __m512 mn = mold;
        for (csa_idx i = 0; i < kb; i++) {
            const __m512 l = _mm512_mul_ps(_mm512_loadu_ps(L + i * hcp + h), sc);
            _mm512_storeu_ps(L + i * hcp + h, l);
            mn = _mm512_max_ps(l, mn); /* a NaN logit never becomes the max */
        }
        __m512 al = CSA_V(exp512_neg)(_mm512_sub_ps(mold, mn));
        al = _mm512_mask_mov_ps(al, _mm512_cmp_ps_mask(mold, mn, _CMP_EQ_OQ),
                                _mm512_set1_ps(1.0f));
        __m512 s = _mm512_setzero_ps();
        for (csa_idx i = 0; i < kb; i++) {
            const __m512 l = _mm512_loadu_ps(L + i * hcp + h);
            __m512 p = CSA_V(exp512_neg)(_mm512_sub_ps(l, mn));
            p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(l, ninf, _CMP_NEQ_UQ), p);
            _mm512_storeu_ps(L + i * hcp + h, p);
            s = _mm512_add_ps(s, p);
        }
        _mm512_storeu_ps(sum + h, _mm512_fmadd_ps(_mm512_loadu_ps(sum + h), al, s));
        _mm512_storeu_ps(m + h, mn);
        _mm512_storeu_ps(alpha + h, al);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* The same per-head chains on 8 lanes, two vectors of heads at a time (hcp is a
     * multiple of 16): vector exp instead of expf, whose calls cost about a third of
     * the logits tile's time per block at this level. */
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (csa_idx h = 0; h < hcp; h += 16) {
        const __m256 mold0 = _mm256_loadu_ps(m + h), mold1 = _mm256_loadu_ps(m + h + 8);
        __m256 mn0 = mold0, mn1 = mold1;
        for (csa_idx i = 0; i < kb; i++) {
            float *li = L + i * hcp + h;
            const __m256 l0 = _mm256_mul_ps(_mm256_loadu_ps(li), sc);
            const __m256 l1 = _mm256_mul_ps(_mm256_loadu_ps(li + 8), sc);
            _mm256_storeu_ps(li, l0);
            _mm256_storeu_ps(li + 8, l1);
            mn0 = _mm256_max_ps(l0, mn0); /* a NaN logit never becomes the max */
            mn1 = _mm256_max_ps(l1, mn1);
        }
        const __m256 one = _mm256_set1_ps(1.0f);
        const __m256 al0 = _mm256_blendv_ps(CSA_V(exp256_neg)(_mm256_sub_ps(mold0, mn0)), one,
                                            _mm256_cmp_ps(mold0, mn0, _CMP_EQ_OQ));
        const __m256 al1 = _mm256_blendv_ps(CSA_V(exp256_neg)(_mm256_sub_ps(mold1, mn1)), one,
                                            _mm256_cmp_ps(mold1, mn1, _CMP_EQ_OQ));
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (csa_idx i = 0; i < kb; i++) {
            float *li = L + i * hcp + h;
            const __m256 l0 = _mm256_loadu_ps(li), l1 = _mm256_loadu_ps(li + 8);
            const __m256 p0 = _mm256_and_ps(CSA_V(exp256_neg)(_mm256_sub_ps(l0, mn0)),
                                            _mm256_cmp_ps(l0, ninf, _CMP_NEQ_UQ));
            const __m256 p1 = _mm256_and_ps(CSA_V(exp256_neg)(_mm256_sub_ps(l1, mn1)),
                                            _mm256_cmp_ps(l1, ninf, _CMP_NEQ_UQ));
            _mm256_storeu_ps(li, p0);
            _mm256_storeu_ps(li + 8, p1);
            s0 = _mm256_add_ps(s0, p0);
            s1 = _mm256_add_ps(s1, p1);
        }
        _mm256_storeu_ps(sum + h, _mm256_fmadd_ps(_mm256_loadu_ps(sum + h), al0, s0));
        _mm256_storeu_ps(sum + h + 8, _mm256_fmadd_ps(_mm256_loadu_ps(sum + h + 8), al1, s1));
        _mm256_storeu_ps(m + h, mn0);
        _mm256_storeu_ps(m + h + 8, mn1);
        _mm256_storeu_ps(alpha + h, al0);
        _mm256_storeu_ps(alpha + h + 8, al1);
    }
#else
    for (csa_idx h = 0; h < hcp; h++) {
        const float mold = m[h];
        float mn = mold;
        for (csa_idx i = 0; i < kb; i++) {
            const float l = L[i * hcp + h] * scale;
            L[i * hcp + h] = l;
            if (l > mn) mn = l;
        }
        const float al = mold == mn ? 1.0f : expf(mold - mn);
        float s = 0.0f;
        for (csa_idx i = 0; i < kb; i++) {
            const float l = L[i * hcp + h];
            const float p = l == -INFINITY ? 0.0f : expf(l - mn);
            L[i * hcp + h] = p;
            s += p;
        }
        sum[h] = sum[h] * al + s;
        m[h] = mn;
        alpha[h] = al;
    }
#endif
}

/* OT[d, h] = alpha_h OT[d, h] + sum_{k < kb} R_k[d] P[k, h] for feature d, all hcp heads. */
static void CSA_V(attn_pv_feature)(const float *const *R, csa_idx kb, const float *P, csa_idx hcp,
                                   const float *alpha, float *OT, csa_idx d, int first)
{
    float *CSA_RESTRICT o = OT + d * hcp;
#pragma omp simd
    for (csa_idx h = 0; h < hcp; h++) o[h] = first ? 0.0f : alpha ? o[h] * alpha[h] : o[h];
    for (csa_idx k = 0; k < kb; k++) {
        const float x = R[k][d];
        const float *CSA_RESTRICT pk = P + k * hcp;
#pragma omp simd
        for (csa_idx h = 0; h < hcp; h++) o[h] += x * pk[h];
    }
}

/* OT[d, h] = alpha_h OT[d, h] + sum_{k < kb} R_k[d] P[k, h] for d < D, h < hcp (first
 * block: OT[d, h] = the sum alone, so OT needs no clearing; alpha NULL: alpha_h = 1,
 * the product skipped -- x * 1 is x, so the bits are those of alpha = 1): the output is kept
 * transposed, [D, hcp], so that its tile has the logits tile's shape. */
static void CSA_V(attn_pv)(const float *const *R, csa_idx kb, const float *P, csa_idx hcp,
                           const float *alpha, float *OT, csa_idx D, int first)
{
#ifdef __AVX512F__
    const csa_idx nvec = hcp / 16, d6 = D - D % 6;
    for (csa_idx v0 = 0; v0 < nvec; v0 += 4) {
        const float *Pv = P + 16 * v0, *av = alpha ? alpha + 16 * v0 : NULL;
        float *Ov = OT + 16 * v0;
        const int nv = nvec - v0 < 4 ? (int)(nvec - v0) : 4;
        for (csa_idx d0 = 0; d0 < D; d0 += d0 < d6 ? 6 : 1) {
            const int nd = d0 < d6 ? 6 : 1;
#define ATTN_PV_CASE(NV)                                                            \
    case NV:                                                                        \
        if (nd == 6) CSA_V(pv_tile)(R, kb, Pv, hcp, av, Ov, d0, first, 6, NV);      \
        else CSA_V(pv_tile)(R, kb, Pv, hcp, av, Ov, d0, first, 1, NV);              \
        break;
            switch (nv) {
            ATTN_PV_CASE(4)
            ATTN_PV_CASE(3)
            ATTN_PV_CASE(2)
            default: ATTN_PV_CASE(1)
            }
#undef ATTN_PV_CASE
        }
    }
#elif defined(__AVX2__)
    const csa_idx d6 = D - D % 6;
    for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
        for (csa_idx d0 = 0; d0 < d6; d0 += 6)
            CSA_V(pv_tile_v8)(R, kb, P + h0, hcp, alpha ? alpha + h0 : NULL, OT + h0, d0, first);
    for (csa_idx d = d6; d < D; d++) CSA_V(attn_pv_feature)(R, kb, P, hcp, alpha, OT, d, first);
#else
    for (csa_idx d = 0; d < D; d++) CSA_V(attn_pv_feature)(R, kb, P, hcp, alpha, OT, d, first);
#endif
}

/* x[i] = x[i] rounded to bfloat16 (csa_f32_to_bf16) and widened back, i < n.  AVX2:
 * the rounding in integer lanes, 8 at a time (the scalar form, with its NaN branch,
 * does not vectorize). */
static void CSA_V(attn_round_bf16)(float *x, csa_idx n)
{
    csa_idx i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    for (; i + 8 <= n; i += 8) {
        const __m256i r = CSA_V(bf16_round8)(_mm256_loadu_ps(x + i));
        _mm256_storeu_ps(x + i, _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)));
    }
#endif
    for (; i < n; i++) x[i] = csa_bf16_to_f32(csa_f32_to_bf16(x[i]));
}

/* t[d] = src[d] widened to float32, d < D (exact: a 16-bit shift; AVX2 in registers). */
static void CSA_V(attn_widen_bf16)(const csa_bf16 *CSA_RESTRICT src, csa_idx D,
                                   float *CSA_RESTRICT t)
{
    csa_idx d = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(src + d));
        _mm256_storeu_ps(t + d, CSA_V(bf16_widen8)(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(t + d + 8, CSA_V(bf16_widen8)(_mm256_extracti128_si256(h, 1)));
    }
#endif
    for (; d < D; d++) t[d] = csa_bf16_to_f32(src[d]);
}

/* out[h, d] = OT[d, h] / sum_h for h < hc, d < D, in the output dtype (rows so_h apart),
 * through 16 x 16 blocks so that both sides are read and written in whole lines.  sum
 * NULL: no division (the backward's d(q); x / 1 is x, and the divisions were most of
 * this function's time: vdivps next to the transpose's permutes). */
static void CSA_V(attn_store)(const float *OT, csa_idx hcp, const float *sum, csa_idx hc,
                              csa_idx D, void *out, csa_idx so_h, int bf16)
{
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (!sum) {
        /* no divisor (the backward's d(q)): 8 x 8 blocks transposed in registers, the
         * tails by the scalar loop below -- the 16 x 16 staging through t[][] was 2.1% of
         * the samples of a forward + backward pair, as much as the forward's own store
         * (perf, avx2, float32, S = 512, 2 threads) */
        const csa_idx h8 = hc / 8 * 8, d8 = D / 8 * 8;
        for (csa_idx h0 = 0; h0 < h8; h0 += 8)
            for (csa_idx d0 = 0; d0 < d8; d0 += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(OT + (d0 + i) * hcp + h0);
                CSA_V(transpose8)(r);
                for (int j = 0; j < 8; j++) {
                    if (bf16)
                        _mm_storeu_si128((__m128i *)((csa_bf16 *)out + (h0 + j) * so_h + d0),
                                         CSA_V(bf16_pack8)(CSA_V(bf16_round8)(r[j])));
                    else
                        _mm256_storeu_ps((float *)out + (h0 + j) * so_h + d0, r[j]);
                }
            }
        for (csa_idx h = 0; h < hc; h++)
            for (csa_idx d = h < h8 ? d8 : 0; d < D; d++) {
                const float x = OT[d * hcp + h];
                if (bf16)
                    ((csa_bf16 *)out)[h * so_h + d] = csa_f32_to_bf16(x);
                else
                    ((float *)out)[h * so_h + d] = x;
            }
        return;
    }
#endif
    for (csa_idx h0 = 0; h0 < hc; h0 += 16) {
        const csa_idx nh = hc - h0 < 16 ? hc - h0 : 16;
        for (csa_idx d0 = 0; d0 < D; d0 += 16) {
            const csa_idx nd = D - d0 < 16 ? D - d0 : 16;
#ifdef __AVX512F__
            if (!bf16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = i < nd ? _mm512_loadu_si512(OT + (d0 + i) * hcp + h0) : _mm512_setzero_si512();
                CSA_V(transpose16)(r);
                const __mmask16 mk = (__mmask16)((1u << nd) - 1);
                for (csa_idx j = 0; j < nh; j++)
                    _mm512_mask_storeu_ps((float *)out + (h0 + j) * so_h + d0, mk,
                                          sum ? _mm512_div_ps(_mm512_castsi512_ps(r[j]),
                                                              _mm512_set1_ps(sum[h0 + j]))
                                              : _mm512_castsi512_ps(r[j]));
                continue;
            }
#endif
            float t[16][16];
            for (csa_idx i = 0; i < nd; i++)
                for (int j = 0; j < 16; j++) t[j][i] = OT[(d0 + i) * hcp + h0 + j];
            for (csa_idx j = 0; j < nh; j++) {
                const float den = sum ? sum[h0 + j] : 1.0f;
                if (bf16) {
                    csa_bf16 *CSA_RESTRICT o = (csa_bf16 *)out + (h0 + j) * so_h + d0;
                    csa_idx i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
                    const __m256 dv = _mm256_set1_ps(den);
                    for (; i + 8 <= nd; i += 8) {
                        /* rounded as csa_f32_to_bf16, then the top halves packed */
                        const __m256 x = _mm256_loadu_ps(&t[j][i]), y = sum ? _mm256_div_ps(x, dv) : x;
                        _mm_storeu_si128((__m128i *)(o + i), CSA_V(bf16_pack8)(CSA_V(bf16_round8)(y)));
                    }
#endif
                    for (; i < nd; i++) o[i] = csa_f32_to_bf16(sum ? t[j][i] / den : t[j][i]);
                } else {
                    float *CSA_RESTRICT o = (float *)out + (h0 + j) * so_h + d0;
                    if (!sum)
                        memcpy(o, t[j], (size_t)nd * sizeof(float));
                    else
#pragma omp simd
                        for (csa_idx i = 0; i < nd; i++) o[i] = t[j][i] / den;
                }
            }
        }
    }
}

/* QT[d, h] = q[h, d] for h < hc, 0 for the padding heads hc <= h < hcp. */
static void CSA_V(attn_transpose_q)(const void *qv, int bf16, csa_idx sq_h, csa_idx hc,
                                    csa_idx hcp, csa_idx D, float *QT)
{
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    /* 8 x 8 blocks transposed in registers (bfloat16 rows widened on the load, exact),
     * the padding heads and a D tail by the scalar loops below: the scalar transpose's
     * column stores were ~2.5% of the backward, which transposes q and dO a row */
    {
        const csa_idx h8 = hc / 8 * 8, d8 = D / 8 * 8;
        for (csa_idx h0 = 0; h0 < h8; h0 += 8)
            for (csa_idx d0 = 0; d0 < d8; d0 += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; j++)
                    r[j] = bf16 ? CSA_V(bf16_widen8)(_mm_loadu_si128(
                                      (const __m128i *)((const csa_bf16 *)qv + (h0 + j) * sq_h + d0)))
                                : _mm256_loadu_ps((const float *)qv + (h0 + j) * sq_h + d0);
                CSA_V(transpose8)(r);
                float *o = QT + d0 * hcp + h0;
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + i * hcp, r[i]);
            }
        for (csa_idx h = 0; h < hcp; h++)
            for (csa_idx d = h < h8 ? d8 : 0; d < D; d++)
                QT[d * hcp + h] = h >= hc ? 0.0f
                                  : bf16 ? csa_bf16_to_f32(((const csa_bf16 *)qv)[h * sq_h + d])
                                         : ((const float *)qv)[h * sq_h + d];
        return;
    }
#endif
#ifdef __AVX512F__
    /* 16 x 16 blocks: whole-line loads of 16 heads, transposed in registers; bfloat16
     * rows widened on the load (a 16-bit shift, exact: the scalar loop was ~2% of the
     * bfloat16 backward, perf, avx512) */
    for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
        for (csa_idx d0 = 0; d0 < D; d0 += 16) {
            const csa_idx nd = D - d0 < 16 ? D - d0 : 16;
            const __mmask16 mk = (__mmask16)((1u << nd) - 1);
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = h0 + j >= hc ? _mm512_setzero_si512()
                       : bf16 ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                                      mk, (const csa_bf16 *)qv + (h0 + j) * sq_h + d0)),
                                                  16)
                              : _mm512_maskz_loadu_epi32(mk, (const float *)qv + (h0 + j) * sq_h + d0);
            CSA_V(transpose16)(r);
            for (csa_idx i = 0; i < nd; i++) _mm512_storeu_si512(QT + (d0 + i) * hcp + h0, r[i]);
        }
    return;
#endif
    if (bf16) {
        const csa_bf16 *q = qv;
        for (csa_idx h = 0; h < hcp; h++)
            for (csa_idx d = 0; d < D; d++)
                QT[d * hcp + h] = h < hc ? csa_bf16_to_f32(q[h * sq_h + d]) : 0.0f;
        return;
    }
    const float *q = qv;
    for (csa_idx h = 0; h < hcp; h++) {
        const float *qh = q + h * sq_h;
        if (h < hc)
            for (csa_idx d = 0; d < D; d++) QT[d * hcp + h] = qh[d];
        else
            for (csa_idx d = 0; d < D; d++) QT[d * hcp + h] = 0.0f;
    }
}

/* In place: L[i, h] = e^(scale L[i, h] - lse[h]) for i < n, h < hcp (lse[h] = +inf
 * for padding heads gives 0); wsum[i] = sum_{h < hc} of them in head order when wsum
 * is not NULL. */
static void CSA_V(attn_probs)(float *L, csa_idx n, csa_idx hcp, float scale, const float *lse,
                              csa_idx hc, float *wsum)
{
    for (csa_idx i = 0; i < n; i++) {
        float *li = L + i * hcp;
        csa_idx h = 0;
#ifdef __AVX512F__
        const __m512 sc = _mm512_set1_ps(scale);
        for (; h + 16 <= hcp; h += 16) {
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(li + h), sc, _mm512_loadu_ps(lse + h));
            /* x > 0 only by rounding (lse >= every logit): clamped into exp's domain;
             * min(0, x) keeps a NaN x */
            _mm512_storeu_ps(li + h, CSA_V(exp512_neg)(_mm512_min_ps(_mm512_setzero_ps(), x)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 sc = _mm256_set1_ps(scale);
        for (; h + 8 <= hcp; h += 8) {
            const __m256 x = _mm256_fmsub_ps(_mm256_loadu_ps(li + h), sc, _mm256_loadu_ps(lse + h));
            _mm256_storeu_ps(li + h, CSA_V(exp256_neg)(_mm256_min_ps(_mm256_setzero_ps(), x)));
        }
#endif
        for (; h < hcp; h++) {
            const float x = li[h] * scale - lse[h];
            li[h] = expf(x > 0.0f ? 0.0f : x); /* NaN stays NaN */
        }
        if (wsum) {
            float t = 0.0f;
#ifdef CSA_MUTANT_ATTN_WEIGHTS_HEAD
            hc -= hc > 1; /* the last head left out of the sum */
#endif
            for (h = 0; h < hc; h++) t += li[h];
            wsum[i] = t;
        }
    }
}

/* One work item: query (b, s), heads h0 .. h0+hc-1.  ws: per-thread floats,
 * rows: per-thread pointers (K + ATTN_KB + ATTN_MR), keys: 2K uint32 of scratch. */
static void CSA_V(attn_item)(const struct csa_attn_problem *a, csa_idx b, csa_idx s, csa_idx h0,
                             csa_idx hc, csa_idx hcp, csa_idx dp, float *ws, const float **rows,
                             uint32_t *keys, float *LL)
{
    const csa_idx D = a->D;
    const int bf16 = a->bf16;
    const size_t es = bf16 ? sizeof(csa_bf16) : sizeof(float);
    const int32_t *ir = a->idx + b * a->si_b + s * a->si_s;
    const char *kvb = (const char *)a->kv + (size_t)(b * a->skv_b) * es;
    const char *q = (const char *)a->q + (size_t)(b * a->sq_b + s * a->sq_s + h0 * a->sq_h) * es;
    char *out = a->out ? (char *)a->out + (size_t)(b * a->so_b + s * a->so_s + h0 * a->so_h) * es
                       : NULL;

    /* the valid rows, in address order (a -1 entry weighs exactly 0 in the formula) */
    const float **valid = rows;  /* bf16: they point at bfloat16 rows */
    const csa_idx n = attn_sorted_valid(ir, a->K, keys, keys + a->K);
    for (csa_idx k = 0; k < n; k++)
        valid[k] = (const float *)(kvb + (size_t)((csa_idx)keys[k] * a->skv_n) * es);
    float *lse = a->lse ? a->lse + b * a->sl_b + s * a->sl_s + h0 : NULL;
    if (n == 0) {
        if (a->out)
            for (csa_idx h = 0; h < hc; h++) memset(out + (size_t)(h * a->so_h) * es, 0, (size_t)D * es);
        if (lse)
            for (csa_idx h = 0; h < hc; h++) lse[h] = a->sink[h0 + h];
        if (LL) memset(a->weights + b * a->sw_b + s * a->sw_s, 0, (size_t)a->K * sizeof(float));
        return;
    }
    const float **blk = rows + a->K;  /* one block's rows, padded to a multiple of ATTN_MR */
    const csa_idx kbp_max = ((ATTN_KB + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
    float *QT = ws, *L = QT + D * hcp, *OT = L + kbp_max * hcp;
    float *m = OT + D * hcp, *sum = m + hcp, *alpha = sum + hcp, *tile = alpha + hcp;

    CSA_V(attn_transpose_q)(q, bf16, a->sq_h, hc, hcp, D, QT);
    for (csa_idx h = 0; h < hcp; h++) {
        m[h] = h < hc ? a->sink[h0 + h] : 0.0f;
        sum[h] = 1.0f; /* e^(sink - m) with m = sink */
#ifdef CSA_MUTANT_ATTN_SINK /* planted (make mutants): the sink ignored */
        m[h] = -INFINITY;
        sum[h] = 0.0f;
#endif
    }
    /* float32 rows are read in place (by broadcasts only); bf16 rows, or float rows at a
     * misaligned address, are converted/copied one block at a time into the tile */
    const int direct = !bf16 && (uintptr_t)kvb % sizeof(float) == 0;

    for (csa_idx k0 = 0; k0 < n; k0 += ATTN_KB) {
        const csa_idx kb = n - k0 < ATTN_KB ? n - k0 : ATTN_KB;
        const csa_idx kbp = ((kb + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
        /* this block's rows, padded with zero rows to a whole logits tile */
        for (csa_idx i = 0; i < kbp; i++) {
            float *t = tile + i * dp;
            if (i < kb && direct) {
                blk[i] = valid[k0 + i];
            } else {
                if (i < kb && bf16) {
                    CSA_V(attn_widen_bf16)((const csa_bf16 *)valid[k0 + i], D, t);
                } else if (i < kb)
                    memcpy(t, valid[k0 + i], (size_t)D * sizeof(float));
                else
                    memset(t, 0, (size_t)D * sizeof(float));
                blk[i] = t;
            }
        }
        CSA_V(attn_logits)(blk, kbp, QT, hcp, D, L);
        if (LL) memcpy(LL + k0 * hcp, L, (size_t)(kb * hcp) * sizeof(float));
        CSA_V(attn_softmax)(L, kb, hcp, a->scale, m, sum, alpha);
        if (!a->out) continue;
        if (bf16)  /* the weights meet the bf16 rows as bf16 (sum keeps them unrounded) */
            CSA_V(attn_round_bf16)(L, kb * hcp);
        CSA_V(attn_pv)(blk, kb, L, hcp, alpha, OT, D, k0 == 0);
    }

#ifdef CSA_MUTANT_ATTN_OUT /* planted (make mutants): the output off by a relative 1e-4 */
    for (csa_idx h = 0; h < hc; h++) sum[h] *= 1.0f / (1.0f + 1e-4f);
#endif
    if (a->out) CSA_V(attn_store)(OT, hcp, sum, hc, D, out, a->so_h, bf16);
    /* the row's log-sum-exp: sum includes the sink's e^(sink - m) */
    for (csa_idx h = 0; h < hcp; h++) alpha[h] = h < hc ? m[h] + logf(sum[h]) : INFINITY;
#ifdef CSA_MUTANT_ATTN_LSE_NO_SINK
    for (csa_idx h = 0; h < hc; h++) alpha[h] = m[h] + logf(sum[h] - expf(a->sink[h0 + h] - m[h]));
#endif
    if (lse) memcpy(lse, alpha, (size_t)hc * sizeof(float));
    if (!LL) return;
    /* weights (all H heads are in this item): per valid entry (address order) the
     * probabilities e^(scale l - lse) summed over heads in head order, then copied to
     * every slot that lists the entry (a binary search of the sorted keys) */
    float *wv = LL + a->K * hcp;
    CSA_V(attn_probs)(LL, n, hcp, a->scale, alpha, hc, wv);
    float *w = a->weights + b * a->sw_b + s * a->sw_s;
    for (csa_idx k = 0; k < a->K; k++) {
        if (ir[k] < 0) {
            w[k] = 0.0f;
            continue;
        }
        csa_idx lo = 0, hi = n - 1;
        const uint32_t key = (uint32_t)ir[k];
        while (lo < hi) {
            const csa_idx mid = (lo + hi) / 2;
            if (keys[mid] < key) lo = mid + 1;
            else hi = mid;
        }
        w[k] = wv[lo];
    }
}

#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
#include "attn_amx_impl.h"
#endif

/* The forward's work items over all threads; with_weights: one item per query with
 * all heads (their sum over heads is the weights) and per-thread room for the row's
 * logits. */
static int CSA_V(sparse_attn_run)(const struct csa_attn_problem *a, int with_weights)
{
    const csa_idx nq = a->B * a->S, D = a->D, H = a->H;
    /* Chunks of heads per work item, chosen from the shape alone. */
    csa_idx hc_max = nq >= ATTN_FEW_QUERIES ? ATTN_HC : ATTN_HC_FEW;
    if (hc_max > H || with_weights) hc_max = H;
    const csa_idx nchunks = (H + hc_max - 1) / hc_max;
    const csa_idx items = nq * nchunks;
    const csa_idx hcp = ((hc_max + 15) / 16) * 16, dp = ((D + 15) / 16) * 16;
    const csa_idx kbp_max = ((ATTN_KB + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
    csa_idx per_thread = D * hcp + kbp_max * hcp + D * hcp + 3 * hcp + kbp_max * dp;
    if (with_weights) per_thread += a->K * hcp + a->K; /* LL [K, hcp], then K sums */
    per_thread = ((per_thread + 15) / 16) * 16;
    const csa_idx per_rows = a->K + kbp_max + a->K; /* pointers, then 2K uint32 of sort keys */
    const csa_idx ll_off = D * hcp + kbp_max * hcp + D * hcp + 3 * hcp + kbp_max * dp;

    const int nt = csa_threads(items, 1);
    float *ws = aligned_alloc(64, (size_t)(nt * per_thread) * sizeof(float));
    const float **rows = malloc((size_t)(nt * per_rows) * sizeof(*rows));
    if (!ws || !rows) {
        free(ws);
        free(rows);
        return CSA_ENOMEM;
    }

#pragma omp parallel num_threads(nt)
    {
        const int t = omp_tid();
#pragma omp for schedule(dynamic, 1)
        for (csa_idx it = 0; it < items; it++) {
            const csa_idx qi = it / nchunks, c = it % nchunks;
            const csa_idx h0 = c * hc_max, hc = H - h0 < hc_max ? H - h0 : hc_max;
            CSA_V(attn_item)(a, qi / a->S, qi % a->S, h0, hc, hcp, dp, ws + t * per_thread,
                             rows + t * per_rows, (uint32_t *)(rows + t * per_rows + a->K + kbp_max),
                             with_weights ? ws + t * per_thread + ll_off : NULL);
        }
    }
    free(ws);
    free(rows);
    return CSA_OK;
}

static int CSA_V(sparse_attn_tuned)(const struct csa_attn_problem *a)
{
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
    if (a->bf16 && csa_isa_get() >= CSA_ISA_AMX) return CSA_V(sparse_attn_amx)(a);
#endif
    return CSA_V(sparse_attn_run)(a, 0);
}

static int CSA_V(sparse_attn_weights_tuned)(const struct csa_attn_problem *a)
{
    return CSA_V(sparse_attn_run)(a, 1);
}

#include "attn_bwd_impl.h"
