/* One width and one dot-product instruction of the FP4 tile scorer (index_fp4_impl.h);
 * included once per (level, instruction) with these defined:
 *   IX4B_NAME  the function's name            IX4B_W  512 or 256 (vector bits)
 *   IX4B_VNNI  1: VPDPBUSD, 0: VPMADDUBSW + VPMADDWD
 * Keys sit in the int32 lanes (IX4B_W / 32 of them: the tile of index_fp4_impl.h), so
 * each lane runs the oracle's per-key float32 steps in the oracle's order, heads one
 * after the other. */

#if IX4B_W == 512
#define VI __m512i
#define VF __m512
#define I_SET1 _mm512_set1_epi32
#define I_ADD _mm512_add_epi32
#define I_LOAD(p) _mm512_load_si512((const void *)(p))
#define I_SLLI _mm512_slli_epi32
#define I_MAX0(a) _mm512_max_epi32(a, _mm512_setzero_si512())
#define F_CVT _mm512_cvtepi32_ps
#define F_MUL _mm512_mul_ps
#define F_ADD _mm512_add_ps
#define F_MAX _mm512_max_ps
#define F_SET1 _mm512_set1_ps
#define F_ZERO _mm512_setzero_ps
#define F_STOREU _mm512_storeu_ps
#define CASTF _mm512_castsi512_ps
#if IX4B_VNNI
/* The query dword straight from memory as VPDPBUSD's broadcast operand, the accumulator
 * updated in place: written with the intrinsics GCC 12 loaded each dword with its own
 * VPBROADCASTD and copied the accumulators between registers (vmovdqa32), three
 * instructions a dot product against one (a front-end bound loop: 63% of the level's
 * peak at Tc = 64K before, on the Xeon). */
#define DP2M(a, k0, k1, p0, p1)                                                            \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(k0), "m"(*(const int32_t *)(p0))); \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(k1), "m"(*(const int32_t *)(p1)))
#define DP2(a, k0, k1, q0, q1)                                                             \
    a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a, k0, _mm512_set1_epi32(q0)), k1,         \
                            _mm512_set1_epi32(q1))
#else
#define DP2(a, k0, k1, q0, q1)                                                             \
    a = _mm512_add_epi32(a, _mm512_madd_epi16(_mm512_add_epi16(                            \
            _mm512_maddubs_epi16(k0, _mm512_set1_epi32(q0)),                               \
            _mm512_maddubs_epi16(k1, _mm512_set1_epi32(q1))), _mm512_set1_epi16(1)))
#define DP2W(a, k0, k1, q0, q1)                                                            \
    a = _mm512_add_epi16(a, _mm512_add_epi16(_mm512_maddubs_epi16(k0, _mm512_set1_epi32(q0)), \
                                             _mm512_maddubs_epi16(k1, _mm512_set1_epi32(q1))))
#define WIDEN(a) _mm512_madd_epi16(a, _mm512_set1_epi16(1))
#endif
#else
#define VI __m256i
#define VF __m256
#define I_SET1 _mm256_set1_epi32
#define I_ADD _mm256_add_epi32
#define I_LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define I_SLLI _mm256_slli_epi32
#define I_MAX0(a) _mm256_max_epi32(a, _mm256_setzero_si256())
#define F_CVT _mm256_cvtepi32_ps
#define F_MUL _mm256_mul_ps
#define F_ADD _mm256_add_ps
#define F_MAX _mm256_max_ps
#define F_SET1 _mm256_set1_ps
#define F_ZERO _mm256_setzero_ps
#define F_STOREU _mm256_storeu_ps
#define CASTF _mm256_castsi256_ps
#define DP2(a, k0, k1, q0, q1)                                                             \
    a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_add_epi16(                            \
            _mm256_maddubs_epi16(k0, _mm256_set1_epi32(q0)),                               \
            _mm256_maddubs_epi16(k1, _mm256_set1_epi32(q1))), _mm256_set1_epi16(1)))
#define DP2W(a, k0, k1, q0, q1)                                                            \
    a = _mm256_add_epi16(a, _mm256_add_epi16(_mm256_maddubs_epi16(k0, _mm256_set1_epi32(q0)), \
                                             _mm256_maddubs_epi16(k1, _mm256_set1_epi32(q1))))
#define WIDEN(a) _mm256_madd_epi16(a, _mm256_set1_epi16(1))
#endif
#define NKB (IX4B_W / 32)
/* heads a pass of the one-sum path: 8 accumulator chains cover VPDPBUSD's latency (5)
 * and each key register feeds 16 dot products (4 heads: 8, and a key load per 4).  At
 * 256 bits the 8 int16 chains of _fast16, 2 key and 2 query registers fit the 16 ymm
 * without spills; against 4 heads a pass (the per-group start values, bound check,
 * widen and epilogue loads spread over twice the heads) 5-6% less CPU time a call
 * (avx2, 1 thread, Tc = 64K: 6.42 -> 6.06 ms median, interleaved A/B processes, load
 * 1.4).  The pairs path (_fast) at 8 heads is the fallback of rare rows. */
#if IX4B_VNNI
/* VPDPBUSD issues on two ports with latency 5 here (Xeon: 5.3 G a CPU second): 8
 * chains cap it at 1.6 a cycle, 16 chains (two query groups of 8 heads) cover it; the
 * 16 accumulators and 2 key registers fit the 32 zmm. */
#define IX4B_HB 16
#else
#define IX4B_HB 8
#endif
#ifndef IX4B_HB16
#define IX4B_HB16 IX4B_HB
#endif

static inline int32_t IX4B_CAT(IX4B_NAME, _ld32)(const int8_t *q)
{
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}
#define LD32 IX4B_CAT(IX4B_NAME, _ld32)

/* 2^(e - 129) per lane, e = ekb + eq: the scale of a product of two 2x codes (the
 * range checks of the caller keep the exponent field in [1, 254]). */
#define SCALE(ekb, eq) CASTF(I_SLLI(I_ADD(ekb, I_SET1((eq) - 129)), 23))

/* Dots of NH heads (h0 ..) whose q is prescaled, against a tile of prescaled keys:
 * one integer sum over all Di features each, converted and scaled once (exact: see
 * index_fp4_impl.h). */
static inline __attribute__((always_inline)) void
IX4B_CAT(IX4B_NAME, _fast)(const int nh, const uint8_t *qop, const int32_t *hcorr,
                           const int32_t *hq23, const float *wf, csa_idx h0, csa_idx Di,
                           const uint8_t *kv, VI ek23, VF *dot)
{
    VI a[IX4B_HB];
#pragma GCC unroll 16
    for (int i = 0; i < nh; i++) a[i] = I_SET1(hcorr[h0 + i]);
    /* heads h0 .. h0+7 and h0+8 .. (the next group of 8: nh = 16, h0 a multiple of 8) */
    const int8_t *q = (const int8_t *)qop + IX4_QOFF(h0, 0, Di);
    const int8_t *q2 = q + (Di / 4) * 32;
#pragma GCC unroll 2
    for (csa_idx f = 0; f < Di / 4; f += 2) {
        const VI k0 = I_LOAD(kv + f * (NKB * 4)), k1 = I_LOAD(kv + (f + 1) * (NKB * 4));
#ifdef DP2M
#pragma GCC unroll 16
        for (int i = 0; i < nh; i++) {
            const int8_t *qi = i < 8 ? q + i * 4 : q2 + (i - 8) * 4;
            DP2M(a[i], k0, k1, qi + f * 32, qi + f * 32 + 32);
        }
#else
#pragma GCC unroll 16
        for (int i = 0; i < nh; i++) {
            const int8_t *qi = i < 8 ? q + i * 4 : q2 + (i - 8) * 4;
            DP2(a[i], k0, k1, LD32(qi + f * 32), LD32(qi + f * 32 + 32));
        }
#endif
    }
    if (wf) { /* the factored head sum's terms: relu(N) wf, rounded once */
#pragma GCC unroll 16
        for (int i = 0; i < nh; i++) dot[i] = F_MUL(F_CVT(I_MAX0(a[i])), F_SET1(wf[h0 + i]));
        return;
    }
    /* SCALE with the shifts done once a row (hq23) and a tile (ek23) */
#pragma GCC unroll 16
    for (int i = 0; i < nh; i++) dot[i] = F_MUL(F_CVT(a[i]), CASTF(I_ADD(ek23, I_SET1(hq23[h0 + i]))));
}

#if !IX4B_VNNI
/* The one-sum path in int16 lanes: the VPMADDUBSW pair sums are added with VPADDW
 * (wrapping) and widened once per head by VPMADDWD, 2 vector operations a VPMADDUBSW
 * where _fast takes 2.5.  Each int16 lane starts at -OFF * (its query bytes' sum)
 * modulo 2^16 (hc16), so it ends at its true sum sum(k q) modulo 2^16, which is that
 * sum itself while |sum(k q)| <= 32767: the caller checks (12 << the tile's largest
 * prescale shift) * (the head's largest lane sum of |q|, hsq) <= 32767.  No pair sum
 * saturates (2 * 96 * 48 < 2^15).  The widened sums are _fast's integers exactly. */
static inline __attribute__((always_inline)) void
IX4B_CAT(IX4B_NAME, _fast16)(const int nh, const uint8_t *qop, const int32_t *hc16,
                             const int32_t *hq23, csa_idx h0, csa_idx Di, const uint8_t *kv,
                             VI ek23, VF *dot)
{
    VI a[IX4B_HB16];
#pragma GCC unroll 8
    for (int i = 0; i < nh; i++) a[i] = I_SET1(hc16[h0 + i]);
    const int8_t *q = (const int8_t *)qop + IX4_QOFF(h0, 0, Di);
#pragma GCC unroll 2
    for (csa_idx f = 0; f < Di / 4; f += 2) {
        const VI k0 = I_LOAD(kv + f * (NKB * 4)), k1 = I_LOAD(kv + (f + 1) * (NKB * 4));
#pragma GCC unroll 8
        for (int i = 0; i < nh; i++)
            DP2W(a[i], k0, k1, LD32(q + (f * 8 + i) * 4), LD32(q + (f * 8 + 8 + i) * 4));
    }
#pragma GCC unroll 8
    for (int i = 0; i < nh; i++) /* SCALE with the shifts done once a row and a tile */
        dot[i] = F_MUL(F_CVT(WIDEN(a[i])), CASTF(I_ADD(ek23, I_SET1(hq23[h0 + i]))));
}
#endif

/* The dot of head h block by block: each block's integer sum converted and scaled
 * (exact), added to the dot in block order, as the oracle does. */
static inline VF IX4B_CAT(IX4B_NAME, _blocks)(const uint8_t *qop, const int32_t *hcorrb,
                                              const int32_t *heqb, csa_idx h, csa_idx Di,
                                              const uint8_t *kv, const int32_t *ekb)
{
    const csa_idx nb = Di / 32;
    const int8_t *q = (const int8_t *)qop + IX4_QOFF(h, 0, Di);
    VF dot = F_ZERO();
    for (csa_idx j = 0; j < nb; j++) {
        VI a = I_SET1(hcorrb[h * nb + j]);
#pragma GCC unroll 4
        for (csa_idx f = 8 * j; f < 8 * j + 8; f += 2)
            DP2(a, I_LOAD(kv + f * (NKB * 4)), I_LOAD(kv + (f + 1) * (NKB * 4)), LD32(q + 32 * f),
                LD32(q + 32 * f + 32));
        const VF c = F_MUL(F_CVT(a), SCALE(I_LOAD(ekb + j * NKB), heqb[h * nb + j]));
        dot = F_ADD(dot, c);
    }
    return dot;
}

/* tot + relu(dot) * w, the product rounded on its own (the oracle's, never fused). */
static inline VF IX4B_CAT(IX4B_NAME, _acc)(VF tot, VF dot, float w)
{
#ifdef CSA_MUTANT_FP4_INDEX_FUSE /* planted (make mutants): one rounding, not the oracle's two */
#if IX4B_W == 512
    return _mm512_fmadd_ps(F_MAX(F_ZERO(), dot), F_SET1(w), tot);
#else
    return _mm256_fmadd_ps(F_MAX(F_ZERO(), dot), F_SET1(w), tot);
#endif
#else
    VF m = F_MUL(F_MAX(F_ZERO(), dot), F_SET1(w)); /* max(0, NaN) = NaN, max(0, -0) = -0 */
    __asm__("" : "+v"(m));
    return F_ADD(tot, m);
#endif
}

/* bf16_steps (index.h): lanes rounded to bfloat16 (nearest even, NaN -> 0x7fc0), as
 * floats; the oracle's round_bf16. */
static inline VF IX4B_CAT(IX4B_NAME, _r16)(VF x)
{
#if IX4B_W == 512
    const __m512i u = _mm512_castps_si512(x);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), I_SET1(1)),
                                          I_SET1(0x7fff));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), I_SET1((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, I_SET1(0x7fc00000)));
#else
    const __m256i u = _mm256_castps_si256(x);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), I_SET1(1)),
                                          I_SET1(0x7fff));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, bias), I_SET1((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(I_SET1(0x7fc00000)), nan);
#endif
}

/* bf16_steps: head n's (1-based) term r16(relu(r16(dot)) w) into the cascade cas[4]
 * (the oracle's cascade_add, lane by lane). */
static inline void IX4B_CAT(IX4B_NAME, _acc16)(VF *cas, VF dot, float w, csa_idx n)
{
    const VF m = IX4B_CAT(IX4B_NAME, _r16)(F_MUL(F_MAX(F_ZERO(), IX4B_CAT(IX4B_NAME, _r16)(dot)),
                                            F_SET1(w)));
    cas[0] = F_ADD(cas[0], m);
#ifdef CSA_MUTANT_FP4_INDEX_CASCADE /* planted (make mutants): heads summed one by one */
    return;
#endif
    if (n % 16) return;
    for (int j = 1; j < 4; j++) {
        cas[j] = F_ADD(cas[j], cas[j - 1]);
        cas[j - 1] = F_ZERO();
        if (n & ((csa_idx)15 << (4 * j))) break;
    }
}

/* tot + m, m a rounded product the compiler must not fuse into the addition. */
static inline VF IX4B_CAT(IX4B_NAME, _add)(VF tot, VF m)
{
    __asm__("" : "+v"(m));
    return F_ADD(tot, m);
}

/* Scores of query row (b, s), packed in qb, against keys [t0, t1) whose tiles start at
 * kt0 = t0 in kc; tiles whose keys all lie in unkept candidate blocks are skipped. */
static void IX4B_NAME(const struct ix_call *x, const uint8_t *qb, csa_idx b, csa_idx s,
                      const uint8_t *kc, csa_idx kt0, csa_idx t0, csa_idx t1,
                      const uint8_t *cm, csa_idx scn, csa_idx bs, float *o)
{
    const struct csa_index_problem *p = x->p;
    const csa_idx Hi = p->Hi, Di = p->Di, nb = Di / 32;
    struct CSA_V(ix4_geo) g;
    CSA_V(ix4_row_geo)(p, &g);
    const size_t TB = CSA_V(ix4_tile_bytes)(Di, NKB);
    const int32_t *qh = (const int32_t *)qb;
    const uint8_t *qop = qb + g.qop;
    const int32_t *hnice = (const int32_t *)(qb + g.hnice), *hcorr = (const int32_t *)(qb + g.hcorr);
    const int32_t *hcorrb = (const int32_t *)(qb + g.hcorrb);
    const int32_t *heqb = (const int32_t *)(qb + g.heqb);
#if !IX4B_VNNI
    const int32_t *hc16 = (const int32_t *)(qb + g.hc16), *hsq = (const int32_t *)(qb + g.hsq);
#endif
    const int32_t *hq23 = (const int32_t *)(qb + g.hq23);
    const float *w = (const float *)(qb + g.w), *wf = (const float *)(qb + g.wf);
    const int b16 = p->bf16_steps;
    int lg_hi = 0;
    while (((csa_idx)1 << lg_hi) < Hi) lg_hi++;
    (void)wf;
    (void)lg_hi;
    const int fast_q = qh[3] && Di <= IX4_FAST_DI;
    for (csa_idx t = t0; t < t1; t += NKB) {
        const csa_idx nk = imin(NKB, t1 - t);
        if (cand_tile_skipped(cm, scn, bs, t, nk)) continue;
        const uint8_t *tile = kc + (size_t)((t - kt0) / NKB) * TB;
        const int32_t *th = (const int32_t *)tile;
        /* bf16_steps: the last Tc % 32 columns take torch's other head order (index.h),
         * at most 31 a row: the oracle's function */
        if (qh[0] || th[0] == IX4_TILE_SCALAR || th[1] + qh[1] < 130 || th[2] + qh[2] > 360 ||
            (b16 && t + nk > p->Tc / 32 * 32)) {
            CSA_V(ix4_scalar)(x, b, s, t, t + nk, o);
            continue;
        }
        const int32_t *ekb = (const int32_t *)(tile + 64);
        const uint8_t *kv = tile + 64 + (size_t)nb * NKB * 4;
        VF tot = F_ZERO();
        VF cas[4] = {F_ZERO(), F_ZERO(), F_ZERO(), F_ZERO()}; /* bf16_steps */
        const VI ek23 = I_SLLI(I_LOAD(ekb), 23);
        const int fast_k = th[0] == IX4_TILE_FAST && Di <= IX4_FAST_DI;
#if IX4B_VNNI
        /* The head sum factored (wfp): with wf = w 2^(eq - 129) exact and every head's
         * and key's bytes prescaled, relu(dot) w = 2^(ek - 127) relu(N) wf as real
         * numbers.  When every term relu(N) wf and every partial sum is normal (or 0)
         * and finite both as it is and times 2^(ek - 127), scaling by that power of 2
         * commutes with each rounding, so the oracle's head sum is 2^(ek - 127) times
         * the sum of the rounded relu(N) wf, added in head order: 4 vector operations
         * a head (max, convert, multiply, add) where the scaled terms take 6, and one
         * multiply a tile.  Sufficient: the nonzero terms and sums are multiples of
         * ulp(2^wlo) = 2^(wlo - 23) (|N| >= 1, |wf| >= 2^wlo), so normal at both scales
         * when wlo - 23 + min(ek - 127, 0) >= -126; they stay below Hi 2^(whi + 25)
         * (|N| < 2^24, |wf| < 2^(whi + 1)), finite when whi + 25 + log2(Hi) rounded up
         * + max(ek - 127, 0) <= 127; ek in [th[1], th[2]] inside [1, 254]. */
        const float *wfp = NULL;
        if (!b16 && fast_k && fast_q && qh[6] && th[1] >= 1 && th[2] <= 254 &&
#ifndef CSA_MUTANT_FP4_INDEX_FACTOR
            qh[7] - 23 + imin(th[1] - 127, 0) >= -126 &&
#endif
            qh[8] + 25 + lg_hi + (th[2] > 127 ? th[2] - 127 : 0) <= 127)
            wfp = wf;
#else
        const float *wfp = NULL;
#endif
#if !IX4B_VNNI
#ifndef CSA_MUTANT_FP4_INDEX_INT16
        const int32_t lim16 = 32767 / (12 << th[3]); /* _fast16's reach, per head: hsq */
#else /* planted (make mutants): the int16 lanes' bound twice too loose, sums wrap */
        const int32_t lim16 = 65535 / (12 << th[3]);
#endif
#endif
        csa_idx h = 0;
        if (fast_k)
            /* prescaled keys: the one-sum path, IX4B_HB heads a pass sharing each key
             * load, wherever a group's heads are all prescaled too (a query row with
             * one head past the reach keeps its other groups on this path) */
            for (; h + 8 <= Hi;) {
                /* IX4B_HB heads a pass, then 8 (Hi a multiple of 8, not of 16) */
                const int hb = h + IX4B_HB <= Hi ? IX4B_HB : 8;
                int all = 1;
                if (!fast_q)
                    for (int i = 0; i < hb; i++) all &= hnice[h + i] != 0;
                VF dot[IX4B_HB];
#if !IX4B_VNNI
                int ok16 = all;
                for (int i = 0; i < hb; i++) ok16 &= hsq[h + i] <= lim16;
                if (ok16) {
                    IX4B_CAT(IX4B_NAME, _fast16)(IX4B_HB, qop, hc16, hq23, h, Di, kv, ek23, dot);
                } else
#endif
                if (all && hb == IX4B_HB) {
                    IX4B_CAT(IX4B_NAME, _fast)(IX4B_HB, qop, hcorr, hq23, wfp, h, Di, kv, ek23, dot);
#if IX4B_HB > 8
                } else if (all) {
                    IX4B_CAT(IX4B_NAME, _fast)(8, qop, hcorr, hq23, wfp, h, Di, kv, ek23, dot);
#endif
                } else {
                    for (int i = 0; i < hb; i++) {
                        VF d1[IX4B_HB];
                        if (hnice[h + i])
                            IX4B_CAT(IX4B_NAME, _fast)(1, qop, hcorr, hq23, NULL, h + i, Di, kv, ek23, d1);
                        else
                            d1[0] = IX4B_CAT(IX4B_NAME, _blocks)(qop, hcorrb, heqb, h + i, Di, kv, ekb);
                        dot[i] = d1[0];
                    }
                }
                if (wfp) {
#pragma GCC unroll 16
                    for (int i = 0; i < hb; i++) tot = IX4B_CAT(IX4B_NAME, _add)(tot, dot[i]);
                } else if (b16) {
                    for (int i = 0; i < hb; i++)
                        IX4B_CAT(IX4B_NAME, _acc16)(cas, dot[i], w[h + i], h + i + 1);
                } else if (hb == IX4B_HB) {
#pragma GCC unroll 16
                    for (int i = 0; i < IX4B_HB; i++) tot = IX4B_CAT(IX4B_NAME, _acc)(tot, dot[i], w[h + i]);
                } else {
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++) tot = IX4B_CAT(IX4B_NAME, _acc)(tot, dot[i], w[h + i]);
                }
                h += hb;
            }
        for (; h < Hi; h++) {
            VF dot[IX4B_HB];
            if (wfp) { /* every head prescaled */
                IX4B_CAT(IX4B_NAME, _fast)(1, qop, hcorr, hq23, wfp, h, Di, kv, ek23, dot);
                tot = IX4B_CAT(IX4B_NAME, _add)(tot, dot[0]);
                continue;
            }
            if (fast_k && hnice[h])
                IX4B_CAT(IX4B_NAME, _fast)(1, qop, hcorr, hq23, NULL, h, Di, kv, ek23, dot);
            else
                dot[0] = IX4B_CAT(IX4B_NAME, _blocks)(qop, hcorrb, heqb, h, Di, kv, ekb);
            if (b16)
                IX4B_CAT(IX4B_NAME, _acc16)(cas, dot[0], w[h], h + 1);
            else
                tot = IX4B_CAT(IX4B_NAME, _acc)(tot, dot[0], w[h]);
        }
        if (wfp) tot = F_MUL(tot, CASTF(ek23)); /* times 2^(ek - 127), exact */
        if (b16)
            tot = IX4B_CAT(IX4B_NAME, _r16)(F_ADD(F_ADD(F_ADD(cas[0], cas[1]), cas[2]), cas[3]));
        if (nk == NKB) {
            F_STOREU(o + t, tot);
        } else {
            float tmp[NKB];
            F_STOREU(tmp, tot);
            for (csa_idx n = 0; n < nk; n++) o[t + n] = tmp[n];
        }
    }
}

#undef VI
#undef VF
#undef I_SET1
#undef I_ADD
#undef I_LOAD
#undef I_SLLI
#undef I_MAX0
#undef F_CVT
#undef F_MUL
#undef F_ADD
#undef F_MAX
#undef F_SET1
#undef F_ZERO
#undef F_STOREU
#undef CASTF
#undef DP2
#ifdef DP2W
#undef DP2W
#undef WIDEN
#endif
#undef IX4B_HB16
#ifdef DP2M
#undef DP2M
#endif
#undef NKB
#undef IX4B_HB
#undef LD32
#undef SCALE
