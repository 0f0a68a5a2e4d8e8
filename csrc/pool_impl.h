/* Tuned gated pooling body, compiled once per ISA level by csa_isa_variants.h.
 * Unit feature strides.  One entry = features in chunks of POOL_FC, two passes over
 * the candidate rows (max of the logits, then exp / sum / weighted sum), rows
 * streamed in order so the prefetchers see sequential reads; AVX-512 and AVX2 have
 * their own vector exp (masked tails: every feature goes through the same
 * instructions), the baseline calls expf.  bfloat16 kv / score are widened as they
 * are loaded (a 16-bit shift: exact) and a bfloat16 out is rounded on the final
 * store, so the float32 arithmetic, and its bits, are those of the float32 path on the
 * widened values.  The per-feature
 * arithmetic never depends on the chunk, the lane, the thread or where the rows
 * live, so prefill and decode (csa_pool_step) give the same bits. */

#ifndef POOL_FC
#define POOL_FC 1024
#endif
_Static_assert(POOL_FC % 64 == 0, "POOL_FC must be whole 64-feature blocks");
#ifndef POOL_RUN
#define POOL_RUN 8
#endif
/* Floats of the logits buffer (AVX-512): pass 1 keeps l = score + ape of every
 * candidate when they fit, so pass 2 neither reloads, widens nor adds them again
 * (ratio 2: ~10% less time for both dtypes, measured; 16 KiB: at 32 KiB, the ratio-4
 * overlap entry of 8 x 1024 logits crowded L1 and float32 lost 10%). */
#ifndef POOL_LBUF
#define POOL_LBUF 4096
#endif
/* AVX2: the floats of the logits buffer (16 KiB, as AVX-512's). */
#ifndef POOL_LBUF_AVX2
#define POOL_LBUF_AVX2 4096
#endif
#ifndef POOL_RG_AVX2
#define POOL_RG_AVX2 8   /* candidate rows a group of pass 2 (AVX2) */
#endif

#include "vexp_impl.h"
#include "bf16_impl.h"

#ifdef __AVX512F__
/* 16 floats from a float32 or bfloat16 row (masked lanes read as 0). */
static inline __attribute__((always_inline)) __m512 CSA_V(pool_ld16)(const void *p, csa_idx i,
                                                                     __mmask16 mk, const int bf)
{
    if (bf) return CSA_V(bf16_widen16)(_mm256_maskz_loadu_epi16(mk, (const csa_bf16 *)p + i));
    return _mm512_maskz_loadu_ps(mk, (const float *)p + i);
}
#endif

#ifdef __AVX512F__
/* Pass 1 of a chunk of fc features from f0: m = the running max of the logits (whole
 * 64-feature blocks, the padding zeroed: pass 2 reads them), kept in lb when `keep`. */
static inline __attribute__((always_inline)) void CSA_V(pool_max16)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, float *CSA_RESTRICT m, float *lb,
    csa_idx fcp, __mmask16 tail, csa_idx fv, const int kvbf, const int scbf, const int keep)
{
    csa_idx q = 0;   /* candidate row of the logits buffer */
    for (csa_idx f = 0; f < fc; f += 16)   /* whole 64-blocks: pass 2 reads them */
        _mm512_store_ps(m + f, _mm512_set1_ps(-INFINITY));
    for (csa_idx f = (fc + 15) / 16 * 16; f % 64; f += 16)
        _mm512_store_ps(m + f, _mm512_setzero_ps());
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            const void *kv = pool_off(c[k].kv, kvbf, j * c[k].skv + f0);
            const csa_idx pf = c[k].pf;
            for (csa_idx f = 0; f < fc; f += 16) {
                const __mmask16 mk = f == fv ? tail : (__mmask16)0xffff;
                /* pass 1 streams the rows once from memory: fetch the kv of pass 2
                 * and the sibling half rows the next entry needs along with them
                 * (bfloat16 rows: every other prefetch repeats a line) */
                _mm_prefetch((const char *)pool_off(kv, kvbf, f), _MM_HINT_T1);
                if (pf) {
                    _mm_prefetch((const char *)pool_off(sc, scbf, pf + f), _MM_HINT_T1);
                    _mm_prefetch((const char *)pool_off(kv, kvbf, pf + f), _MM_HINT_T1);
                }
                __m512 l = CSA_V(pool_ld16)(sc, f, mk, scbf);
                if (ap) l = _mm512_add_ps(l, _mm512_maskz_loadu_ps(mk, ap + f));
                if (keep) _mm512_mask_store_ps(lb + q * fcp + f, mk, l);
                /* max(l, m) returns m when l is NaN: the NaN shows in its exp */
                _mm512_store_ps(m + f, _mm512_max_ps(l, _mm512_load_ps(m + f)));
            }
            q++;
        }
}

/* Pass 2 of the chunk, in blocks of 64 features held in registers across all
 * candidates (no stores until the result): e = exp(l - m), the sum of e and of
 * e * kv, then out = the quotient (rounded to bfloat16 when obf). */
static inline __attribute__((always_inline)) void CSA_V(pool_sum16)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, const float *CSA_RESTRICT m,
    const float *lb, csa_idx fcp, __mmask16 tail, csa_idx fv, float *outf, csa_bf16 *outh,
    int obf, const int kvbf, const int scbf, const int keep)
{
    csa_idx q;
    for (csa_idx fb = 0; fb < fc; fb += 64) {
        __mmask16 mk[4];
        __m512 mv[4], sv[4], av[4];
        for (int v = 0; v < 4; v++) {
            const csa_idx f = fb + 16 * v;
            mk[v] = f > fv ? (__mmask16)0 : (f == fv ? tail : (__mmask16)0xffff);
            mv[v] = _mm512_load_ps(m + f);
            sv[v] = _mm512_setzero_ps();
            av[v] = _mm512_setzero_ps();
        }
        q = 0;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++, q++) {
                const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0 + fb);
                const void *kv = pool_off(c[k].kv, kvbf, j * c[k].skv + f0 + fb);
                const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 + fb : NULL;
                if (c[k].next) {
                    /* the memory-bound pass 1 of the next entry would otherwise wait
                     * for its rows after this compute-bound pass: fetch them now */
                    const char *ns = pool_off(sc, scbf, c[k].n * c[k].ssc);
                    const char *nk = pool_off(kv, kvbf, c[k].n * c[k].skv);
                    const csa_idx nb = scbf ? 128 : 256;   /* bytes of 64 features */
                    for (csa_idx o = 0; o < nb; o += 64) {
                        _mm_prefetch(ns + o, _MM_HINT_T1);
                        _mm_prefetch(nk + o, _MM_HINT_T1);
                    }
                }
                for (int v = 0; v < 4; v++) {
                    __m512 l;
                    if (keep) {
                        l = _mm512_maskz_load_ps(mk[v], lb + q * fcp + fb + 16 * v);
                    } else {
                        l = CSA_V(pool_ld16)(sc, 16 * v, mk[v], scbf);
                        if (ap) l = _mm512_add_ps(l, _mm512_maskz_loadu_ps(mk[v], ap + 16 * v));
                    }
                    const __m512 e = CSA_V(exp512_neg)(_mm512_sub_ps(l, mv[v]));
                    sv[v] = _mm512_add_ps(sv[v], e);
                    av[v] = _mm512_fmadd_ps(e, CSA_V(pool_ld16)(kv, 16 * v, mk[v], kvbf), av[v]);
                }
            }
        for (int v = 0; v < 4; v++) {
            const __m512 y = _mm512_div_ps(av[v], sv[v]);
            if (obf)
                _mm256_mask_storeu_epi16(outh + f0 + fb + 16 * v, mk[v], CSA_V(bf16_narrow16)(y));
            else
                _mm512_mask_storeu_ps(outf + f0 + fb + 16 * v, mk[v], y);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has 16 ymm registers of 8 lanes and no mask registers, so it has its own
 * body rather than the AVX-512 one at half width: full vectors use plain loads and
 * stores (vmaskmovps stores are slow on AMD cores; only the last vector of a row is
 * masked, and the last block of the output goes through a buffer), and pass 2 holds
 * the max, the sum and the weighted sum of a block of 16 features in 6 registers
 * while it walks a group of up to POOL_RG_AVX2 candidate rows (the exp's temporaries
 * take most of the other 10); the sums go to memory only between groups.  Rows are
 * whole chunks of POOL_FC features, read in order: a ratio-128 entry split into
 * feature chunks small enough for L2 was slower (segments of rows defeat the
 * prefetchers; 4.5 vs 6.5 ms for [1, 8192, 512], 1 thread, measured), and still was
 * with pass 2 prefetching the next chunk's rows (128 or 256 KiB chunks: 0.85-0.94x,
 * 1 and 2 threads, interleaved against whole rows). */

/* n <= 8 floats from a float32 or bfloat16 row at element i, the other lanes 0. */
static inline __attribute__((always_inline)) __m256 CSA_V(pool_ld8n)(const void *p, csa_idx i,
                                                                     csa_idx n, const int bf)
{
    static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    if (bf) {
        csa_bf16 t[8] = {0};
        memcpy(t, (const csa_bf16 *)p + i, (size_t)n * sizeof(csa_bf16));
        return CSA_V(bf16_widen8)(_mm_loadu_si128((const __m128i *)t));
    }
    return _mm256_maskload_ps((const float *)p + i,
                              _mm256_loadu_si256((const __m256i *)(lanes + 8 - n)));
}

/* 8 floats from a float32 or bfloat16 row at element i (all in bounds). */
static inline __attribute__((always_inline)) __m256 CSA_V(pool_ld8f)(const void *p, csa_idx i,
                                                                     const int bf)
{
    if (bf) return CSA_V(bf16_widen8)(_mm_loadu_si128((const __m128i *)((const csa_bf16 *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

/* Pass 1 of a chunk of fc features from f0: m = the running max of the logits
 * (padded with zeros to whole 16-feature blocks: pass 2 reads whole blocks), the
 * logits kept in lb (row stride fcp) when `keep`.  Pass 1 is the one that streams the
 * rows from memory: it prefetches the kv rows pass 2 reads and, with overlap, the
 * sibling half rows the next entry needs. */
static inline __attribute__((always_inline)) void CSA_V(pool_max8)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, float *CSA_RESTRICT m,
    float *CSA_RESTRICT lb, csa_idx fcp, csa_idx nrem, csa_idx fv, const int kvbf,
    const int scbf, const int keep)
{
    for (csa_idx f = 0; f < fc; f += 8) _mm256_store_ps(m + f, _mm256_set1_ps(-INFINITY));
    for (csa_idx f = (fc + 7) / 8 * 8; f % 16; f += 8) _mm256_store_ps(m + f, _mm256_setzero_ps());
    csa_idx q = 0;
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++, q++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const void *kv = pool_off(c[k].kv, kvbf, j * c[k].skv + f0);
            const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            const csa_idx pf = c[k].pf;
            float *lq = lb + q * fcp;
            csa_idx f = 0;
            for (; f < fv; f += 8) {
                if (!(f & 15)) {   /* one line of float32, half a line of bfloat16 */
                    _mm_prefetch((const char *)pool_off(kv, kvbf, f), _MM_HINT_T1);
                    if (pf) {
                        _mm_prefetch((const char *)pool_off(sc, scbf, pf + f), _MM_HINT_T1);
                        _mm_prefetch((const char *)pool_off(kv, kvbf, pf + f), _MM_HINT_T1);
                    }
                }
                __m256 l = CSA_V(pool_ld8f)(sc, f, scbf);
                if (ap) l = _mm256_add_ps(l, _mm256_loadu_ps(ap + f));
                if (keep) _mm256_store_ps(lq + f, l);
                /* max(l, m) returns m when l is NaN: the NaN shows in its exp */
                _mm256_store_ps(m + f, _mm256_max_ps(l, _mm256_load_ps(m + f)));
            }
            __m256 l = CSA_V(pool_ld8n)(sc, f, nrem, scbf);
            if (ap) l = _mm256_add_ps(l, CSA_V(pool_ld8n)(ap, f, nrem, 0));
            if (keep) _mm256_store_ps(lq + f, l);
            _mm256_store_ps(m + f, _mm256_max_ps(l, _mm256_load_ps(m + f)));
        }
}

/* A group of up to POOL_RG_AVX2 consecutive candidate rows of a chunk, at the chunk's
 * first feature: pass 2 walks the rows group by group, so a block of 16 features
 * touches at most 2 * POOL_RG_AVX2 lines at once (ratio 128 entries would otherwise
 * walk 256 rows 2 or 4 KiB apart per block: a few L1 sets, every load from L2). */
typedef struct {
    const void *sc[POOL_RG_AVX2], *kv[POOL_RG_AVX2];
    const float *ap[POOL_RG_AVX2];
    csa_idx nsc[POOL_RG_AVX2], nkv[POOL_RG_AVX2];   /* to the next entry's row; 0: none */
    int nr;
} CSA_V(pool_rows8);

/* Pass 2 of one block of 16 features at fb over one group of rows (q0: the flat
 * index of its first row, for lb; n0, n1 <= 8: the lanes of the block's two vectors;
 * `part`: the chunk's last block, whose loads are bounded by n0, n1).  e = exp(l - m),
 * the sum of e and of e * kv over the rows in order; the sums start at 0 (`first`)
 * or where the previous group left them in sb, ab; after the last group out = the
 * quotient (rounded to bfloat16 when obf), else the sums go back to sb, ab. */
static inline __attribute__((always_inline)) void CSA_V(pool_blk16)(
    const CSA_V(pool_rows8) *rw, csa_idx q0, csa_idx f0, csa_idx fb,
    const float *CSA_RESTRICT m, float *CSA_RESTRICT sb, float *CSA_RESTRICT ab,
    const float *lb, csa_idx fcp, csa_idx n0, csa_idx n1, float *outf, csa_bf16 *outh,
    int obf, int first, int last, const int kvbf, const int scbf, const int keep,
    const int part)
{
    const __m256 m0 = _mm256_load_ps(m + fb), m1 = _mm256_load_ps(m + fb + 8);
    __m256 s0, s1, a0, a1;
    if (first) {
        s0 = s1 = a0 = a1 = _mm256_setzero_ps();
    } else {
        s0 = _mm256_load_ps(sb + fb);
        s1 = _mm256_load_ps(sb + fb + 8);
        a0 = _mm256_load_ps(ab + fb);
        a1 = _mm256_load_ps(ab + fb + 8);
    }
    /* bfloat16 rows: 16 features are half a line, so every other block prefetches */
    const int pfb = !(kvbf && scbf) || !(fb & 31);
    for (int r = 0; r < rw->nr; r++) {
        const void *sc = pool_off(rw->sc[r], scbf, fb);
        const void *kv = pool_off(rw->kv[r], kvbf, fb);
        if (rw->nsc[r] && pfb) {
            /* the memory-bound pass 1 of the next entry would otherwise wait for its
             * rows after this compute-bound pass: fetch them now */
            _mm_prefetch((const char *)pool_off(sc, scbf, rw->nsc[r]), _MM_HINT_T1);
            _mm_prefetch((const char *)pool_off(kv, kvbf, rw->nkv[r]), _MM_HINT_T1);
        }
        __m256 l0, l1, k0, k1;
        if (keep) {
            const float *lq = lb + (q0 + r) * fcp + fb;
            l0 = _mm256_load_ps(lq);
            l1 = part && !n1 ? _mm256_setzero_ps() : _mm256_load_ps(lq + 8);
        } else if (part) {
            l0 = CSA_V(pool_ld8n)(sc, 0, n0, scbf);
            l1 = CSA_V(pool_ld8n)(sc, 8, n1, scbf);
            if (rw->ap[r]) {
                l0 = _mm256_add_ps(l0, CSA_V(pool_ld8n)(rw->ap[r] + fb, 0, n0, 0));
                l1 = _mm256_add_ps(l1, CSA_V(pool_ld8n)(rw->ap[r] + fb, 8, n1, 0));
            }
        } else {
            l0 = CSA_V(pool_ld8f)(sc, 0, scbf);
            l1 = CSA_V(pool_ld8f)(sc, 8, scbf);
            if (rw->ap[r]) {
                l0 = _mm256_add_ps(l0, _mm256_loadu_ps(rw->ap[r] + fb));
                l1 = _mm256_add_ps(l1, _mm256_loadu_ps(rw->ap[r] + fb + 8));
            }
        }
        if (part) {
            k0 = CSA_V(pool_ld8n)(kv, 0, n0, kvbf);
            k1 = CSA_V(pool_ld8n)(kv, 8, n1, kvbf);
        } else {
            k0 = CSA_V(pool_ld8f)(kv, 0, kvbf);
            k1 = CSA_V(pool_ld8f)(kv, 8, kvbf);
        }
        const __m256 e0 = CSA_V(exp256_neg)(_mm256_sub_ps(l0, m0));
        const __m256 e1 = CSA_V(exp256_neg)(_mm256_sub_ps(l1, m1));
        s0 = _mm256_add_ps(s0, e0);
        s1 = _mm256_add_ps(s1, e1);
        a0 = _mm256_fmadd_ps(e0, k0, a0);
        a1 = _mm256_fmadd_ps(e1, k1, a1);
    }
    if (!last) {
        _mm256_store_ps(sb + fb, s0);
        _mm256_store_ps(sb + fb + 8, s1);
        _mm256_store_ps(ab + fb, a0);
        _mm256_store_ps(ab + fb + 8, a1);
        return;
    }
    const __m256 y0 = _mm256_div_ps(a0, s0), y1 = _mm256_div_ps(a1, s1);
    if (!part) {
        if (obf) {
            _mm256_storeu_si256((__m256i *)(outh + f0 + fb), CSA_V(bf16_narrow8x2)(y0, y1));
        } else {
            _mm256_storeu_ps(outf + f0 + fb, y0);
            _mm256_storeu_ps(outf + f0 + fb + 8, y1);
        }
        return;
    }
    if (obf) {
        csa_bf16 t[16] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i *)t, CSA_V(bf16_narrow8x2)(y0, y1));
        memcpy(outh + f0 + fb, t, (size_t)(n0 + n1) * sizeof(csa_bf16));
    } else {
        float t[16] __attribute__((aligned(32)));
        _mm256_store_ps(t, y0);
        _mm256_store_ps(t + 8, y1);
        memcpy(outf + f0 + fb, t, (size_t)(n0 + n1) * sizeof(float));
    }
}

/* An entry of exactly two candidates a feature (ratio 2 without overlap), in one
 * pass.  With finite logits l0, l1 the larger one's weight is exp(0) = 1 exactly and
 * the other's is exp(-|l0 - l1|) (the same argument as l_small - max, negation being
 * exact), so one exp a feature instead of two: the same bits as the two-pass path.
 * A vector with a non-finite |l0 - l1| (an infinite or NaN logit, or an overflowing
 * difference) takes the two exps of that path.  The sums are formed as there:
 * s = (0 + e0) + e1, acc = fma(e1, kv1, fma(e0, kv0, 0)). */
static inline __attribute__((always_inline)) void CSA_V(pool_two8)(
    const pool_cands *c, int nc, csa_idx d, float *outf, csa_bf16 *outh, int obf,
    const int kvbf, const int scbf)
{
    const void *sr[2] = {NULL, NULL}, *kr[2] = {NULL, NULL};
    const float *ar[2] = {NULL, NULL};
    int q = 0;
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n && q < 2; j++, q++) {
            sr[q] = pool_off(c[k].sc, scbf, j * c[k].ssc);
            kr[q] = pool_off(c[k].kv, kvbf, j * c[k].skv);
            ar[q] = c[k].ape ? c[k].ape + j * c[k].sape : NULL;
        }
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    for (csa_idx f = 0; f < d; f += 8) {
        const csa_idx n = d - f < 8 ? d - f : 8;
        __m256 l0, l1, k0, k1;
        if (n == 8) {
            l0 = CSA_V(pool_ld8f)(sr[0], f, scbf);
            l1 = CSA_V(pool_ld8f)(sr[1], f, scbf);
            if (ar[0]) l0 = _mm256_add_ps(l0, _mm256_loadu_ps(ar[0] + f));
            if (ar[1]) l1 = _mm256_add_ps(l1, _mm256_loadu_ps(ar[1] + f));
            k0 = CSA_V(pool_ld8f)(kr[0], f, kvbf);
            k1 = CSA_V(pool_ld8f)(kr[1], f, kvbf);
        } else {
            l0 = CSA_V(pool_ld8n)(sr[0], f, n, scbf);
            l1 = CSA_V(pool_ld8n)(sr[1], f, n, scbf);
            if (ar[0]) l0 = _mm256_add_ps(l0, CSA_V(pool_ld8n)(ar[0], f, n, 0));
            if (ar[1]) l1 = _mm256_add_ps(l1, CSA_V(pool_ld8n)(ar[1], f, n, 0));
            k0 = CSA_V(pool_ld8n)(kr[0], f, n, kvbf);
            k1 = CSA_V(pool_ld8n)(kr[1], f, n, kvbf);
        }
        const __m256 df = _mm256_sub_ps(l0, l1);
        const __m256 a = _mm256_andnot_ps(sign, df);
        __m256 e0, e1;
        if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ)) == 0xff, 1)) {
            const __m256 es = CSA_V(exp256_neg)(_mm256_xor_ps(a, sign));
            const __m256 ge = _mm256_cmp_ps(df, zero, _CMP_GE_OQ);   /* l0 is the max */
            e0 = _mm256_blendv_ps(es, one, ge);
            e1 = _mm256_blendv_ps(one, es, ge);
        } else {
            /* pass 1's max: max(l, m) returns m when l is NaN */
            const __m256 m = _mm256_max_ps(l1, _mm256_max_ps(l0, _mm256_set1_ps(-INFINITY)));
            e0 = CSA_V(exp256_neg)(_mm256_sub_ps(l0, m));
            e1 = CSA_V(exp256_neg)(_mm256_sub_ps(l1, m));
        }
        const __m256 sm = _mm256_add_ps(_mm256_add_ps(zero, e0), e1);
        const __m256 ac = _mm256_fmadd_ps(e1, k1, _mm256_fmadd_ps(e0, k0, zero));
        const __m256 y = _mm256_div_ps(ac, sm);
        if (n == 8) {
            if (obf)
                _mm_storeu_si128((__m128i *)(outh + f), CSA_V(bf16_pack8)(CSA_V(bf16_round8)(y)));
            else
                _mm256_storeu_ps(outf + f, y);
        } else if (obf) {
            csa_bf16 t[8] __attribute__((aligned(16)));
            _mm_store_si128((__m128i *)t, CSA_V(bf16_pack8)(CSA_V(bf16_round8)(y)));
            memcpy(outh + f, t, (size_t)n * sizeof(csa_bf16));
        } else {
            float t[8] __attribute__((aligned(32)));
            _mm256_store_ps(t, y);
            memcpy(outf + f, t, (size_t)n * sizeof(float));
        }
    }
}

/* Pass 2 of the chunk: the rows in groups (in candidate order), each over whole
 * blocks of 16 features, then the last (partial) block. */
static inline __attribute__((always_inline)) void CSA_V(pool_sum8)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, const float *CSA_RESTRICT m,
    float *CSA_RESTRICT sb, float *CSA_RESTRICT ab, const float *lb, csa_idx fcp,
    float *outf, csa_bf16 *outh, int obf, const int kvbf, const int scbf, const int keep)
{
    const csa_idx nfull = (fc - 1) / 16 * 16;   /* the last block always takes the tail */
    const csa_idx rest = fc - nfull, n0 = rest < 8 ? rest : 8, n1 = rest > 8 ? rest - 8 : 0;
    csa_idx ntot = 0;
    for (int k = 0; k < nc; k++) ntot += c[k].n;
    int k = 0;
    csa_idx j = 0, q0 = 0;
    while (q0 < ntot) {
        CSA_V(pool_rows8) rw;
        rw.nr = 0;
        while (rw.nr < POOL_RG_AVX2 && q0 + rw.nr < ntot) {
            while (j >= c[k].n) {
                k++;
                j = 0;
            }
            const int r = rw.nr++;
            rw.sc[r] = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            rw.kv[r] = pool_off(c[k].kv, kvbf, j * c[k].skv + f0);
            rw.ap[r] = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            rw.nsc[r] = c[k].next ? c[k].n * c[k].ssc : 0;
            rw.nkv[r] = c[k].n * c[k].skv;
            j++;
        }
        const int first = q0 == 0, last = q0 + rw.nr == ntot;
        for (csa_idx fb = 0; fb < nfull; fb += 16)
            CSA_V(pool_blk16)(&rw, q0, f0, fb, m, sb, ab, lb, fcp, 8, 8, outf, outh, obf, first,
                              last, kvbf, scbf, keep, 0);
        CSA_V(pool_blk16)(&rw, q0, f0, nfull, m, sb, ab, lb, fcp, n0, n1, outf, outh, obf, first,
                          last, kvbf, scbf, keep, 1);
        q0 += rw.nr;
    }
}
#else
/* Pass 1 (scalar): m = the running max of the logits; s and acc start at zero. */
static inline __attribute__((always_inline)) void CSA_V(pool_max1)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, float *CSA_RESTRICT m,
    float *CSA_RESTRICT s, float *CSA_RESTRICT acc, const int scbf)
{
    for (csa_idx f = 0; f < fc; f++) {
        m[f] = -INFINITY;
        s[f] = 0.0f;
        acc[f] = 0.0f;
    }
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const float *CSA_RESTRICT ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            for (csa_idx f = 0; f < fc; f++) {
                const float x = pool_ld(sc, scbf, f);
                const float l = ap ? x + ap[f] : x;
                m[f] = l > m[f] ? l : m[f];
            }
        }
}

/* Pass 2 (scalar): s += e, acc += e * kv, then out = acc / s. */
static inline __attribute__((always_inline)) void CSA_V(pool_sum1)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, const float *CSA_RESTRICT m,
    float *CSA_RESTRICT s, float *CSA_RESTRICT acc, float *outf, csa_bf16 *outh, int obf,
    const int kvbf, const int scbf)
{
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const void *kv = pool_off(c[k].kv, kvbf, j * c[k].skv + f0);
            const float *CSA_RESTRICT ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            for (csa_idx f = 0; f < fc; f++) {
                const float x = pool_ld(sc, scbf, f);
                const float l = ap ? x + ap[f] : x;
                const float e = expf(l - m[f]);
                s[f] += e;
                acc[f] += e * pool_ld(kv, kvbf, f);
            }
        }
    if (obf)
        for (csa_idx f = 0; f < fc; f++) outh[f0 + f] = csa_f32_to_bf16(acc[f] / s[f]);
    else
        for (csa_idx f = 0; f < fc; f++) outf[f0 + f] = acc[f] / s[f];
}
#endif

/* The entry body for one combination of input types (kvbf, scbf: compile-time
 * constants at each call, so each combination gets its own loops); `obf` only
 * changes the final store.  Per chunk of POOL_FC features: pass 1 (the max of the
 * logits), pass 2 (exp, sums, quotient). */
static inline __attribute__((always_inline)) int CSA_V(pool_entry_body)(
    const pool_cands *c, int nc, csa_idx d, void *out, int obf, const int kvbf, const int scbf,
    const int keep, const csa_idx chunk)
{
    /* m, s, acc in one buffer, staggered by 80 floats so that their addresses never
     * share the low 12 bits: 4 KiB apart, a store to one stalls the loads of the
     * others behind it (4K aliasing; ~1.3x on the whole kernel, measured). */
    float buf[3 * POOL_FC + 2 * 80] __attribute__((aligned(64)));
    float *CSA_RESTRICT m = buf, *CSA_RESTRICT s = buf + POOL_FC + 80;
    float *CSA_RESTRICT acc = buf + 2 * POOL_FC + 160;
    float *const outf = obf ? NULL : out;
    csa_bf16 *const outh = obf ? out : NULL;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (c[0].n + (nc > 1 ? c[1].n : 0) == 2) {
        CSA_V(pool_two8)(c, nc, d, outf, outh, obf, kvbf, scbf);
        return CSA_OK;
    }
#endif
    for (csa_idx f0 = 0; f0 < d; f0 += chunk) {
        const csa_idx fc = d - f0 < chunk ? d - f0 : chunk;
#ifdef __AVX512F__
        (void)s;
        (void)acc;
        float lb[keep ? POOL_LBUF : 1] __attribute__((aligned(64)));
        const csa_idx fcp = (fc + 63) / 64 * 64;
        const __mmask16 tail = (__mmask16)((1u << (fc % 16 ? fc % 16 : 16)) - 1u);
        const csa_idx fv = fc - (fc % 16 ? fc % 16 : 16);   /* start of the last vector */
        CSA_V(pool_max16)(c, nc, f0, fc, m, lb, fcp, tail, fv, kvbf, scbf, keep);
        CSA_V(pool_sum16)(c, nc, f0, fc, m, lb, fcp, tail, fv, outf, outh, obf, kvbf, scbf, keep);
#elif defined(__AVX2__) && defined(__FMA__)
        float lb[keep ? POOL_LBUF_AVX2 : 1] __attribute__((aligned(64)));
        const csa_idx fcp = (fc + 15) / 16 * 16;
        const csa_idx nrem = fc % 8 ? fc % 8 : 8;
        const csa_idx fv = fc - nrem;   /* start of the last vector */
        CSA_V(pool_max8)(c, nc, f0, fc, m, lb, fcp, nrem, fv, kvbf, scbf, keep);
        CSA_V(pool_sum8)(c, nc, f0, fc, m, s, acc, lb, fcp, outf, outh, obf, kvbf, scbf, keep);
#else
        CSA_V(pool_max1)(c, nc, f0, fc, m, s, acc, scbf);
        CSA_V(pool_sum1)(c, nc, f0, fc, m, s, acc, outf, outh, obf, kvbf, scbf);
#endif
    }
    return CSA_OK;
}

/* One entry; kv and score types are uniform over the candidates of a call.  `keep`
 * (AVX-512): the logits of every candidate of the widest chunk fit the buffer. */
static int CSA_V(pool_entry_tuned)(const pool_cands *c, int nc, csa_idx d, void *out, int obf)
{
    const int kvbf = c[0].kvbf, scbf = c[0].scbf;
    int keep = 0;
    csa_idx chunk = POOL_FC;
#ifdef __AVX512F__
    csa_idx ntot = 0;
    for (int k = 0; k < nc; k++) ntot += c[k].n;
    keep = ntot * (((d < POOL_FC ? d : POOL_FC) + 63) / 64 * 64) <= POOL_LBUF;
#elif defined(__AVX2__) && defined(__FMA__)
    csa_idx ntot = 0;
    for (int k = 0; k < nc; k++) ntot += c[k].n;
    keep = ntot * (((d < POOL_FC ? d : POOL_FC) + 15) / 16 * 16) <= POOL_LBUF_AVX2;
#endif
#define POOL_BODY(kb, sb)                                                       \
    (keep ? CSA_V(pool_entry_body)(c, nc, d, out, obf, kb, sb, 1, chunk)       \
          : CSA_V(pool_entry_body)(c, nc, d, out, obf, kb, sb, 0, chunk))
    if (kvbf && scbf) return POOL_BODY(1, 1);
    if (kvbf) return POOL_BODY(1, 0);
    if (scbf) return POOL_BODY(0, 1);
    return POOL_BODY(0, 0);
#undef POOL_BODY
}

static int CSA_V(gated_pool_tuned)(const struct csa_pool_problem *p)
{
    const void *kv = p->kv, *score = p->score;
    const float *ape = p->ape;
    void *out = p->out;
    const int kvbf = p->kv_bf16, scbf = p->sc_bf16, obf = p->out_bf16, overlap = p->overlap;
    const csa_idx skb = p->skb, skt = p->skt, ssb = p->ssb, sst = p->sst, sar = p->sar,
                  sob = p->sob, sog = p->sog, B = p->B, T = p->T, d = p->d, r = p->ratio;
    if (r <= 0 || B < 0 || T < 0 || d < 0) return CSA_EINVAL;
    const csa_idx G = T / r, items = B * G;
    if (r == 1 && !overlap) {
        const int nt = csa_threads(items, 1 + 16384 / (d + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx i = 0; i < items; i++)
            pool_copy((void *)pool_off(out, obf, (i / G) * sob + (i % G) * sog), obf,
                      pool_off(kv, kvbf, (i / G) * skb + (i % G) * skt), kvbf, d);
        return CSA_OK;
    }
    /* Runs of POOL_RUN consecutive entries per thread (with overlap, group g-1 is
     * still in cache), handed out dynamically: on a shared machine a descheduled
     * thread does not hold the others at the barrier.  Entries are independent, so
     * the bits do not depend on who computes which. */
    const int nt = csa_threads(items, 1 + 65536 / ((overlap ? 2 : 1) * r * d + 1));
#pragma omp parallel for num_threads(nt) schedule(dynamic, POOL_RUN)
    for (csa_idx i = 0; i < items; i++) {
        const csa_idx b = i / G, g = i % G;
        pool_cands c[2];
        const int nc = entry_cands(c, pool_off(kv, kvbf, b * skb), kvbf, skt, 1,
                                   pool_off(score, scbf, b * ssb), scbf, sst, 1, ape, sar, 1, d,
                                   r, overlap, g);
        for (int k = 0; k < nc; k++) c[k].next = g + 1 < G;
#ifdef CSA_MUTANT_POOL_GROUP /* planted (make mutants): off by one, a group's last token left out */
        for (int k = 0; k < nc; k++)
            if (c[k].n > 1) c[k].n--;
#endif
        CSA_V(pool_entry_tuned)(c, nc, d, (void *)pool_off(out, obf, b * sob + g * sog), obf);
    }
    return CSA_OK;
}

/* ---------------------------------------------------------------- backward (tuned)
 * csa_gated_pool_backward (pool.h).  The parallel items are fixed chunks of entries
 * (b, g) (grad_chunks, pool.c: the shape alone decides them), each over every feature:
 * every (token, feature) of kv / score feeds one entry, so its d(kv), d(score) elements
 * are written by one item; each chunk sums d(ape) over its entries in order into its
 * own partial (the first chunk into d(ape) itself), and the partials are added in chunk
 * order after, parallel over ape's rows.
 *
 * Vector levels (pgb_block): per entry, blocks of PGB_VB vectors (64 features at
 * avx512, 32 at avx2), three passes over the candidate rows with the block's
 * per-feature values in registers across the candidates:
 *
 *   1  l = score + ape into lb, m = max(m, l)
 *   2  e = exp(l - m) in lb, s += e, acc = fma(e, kv, acc); then y = acc / s, u = dy / s
 *   3  d(kv) = e u, d(score) = d(kv) (kv - y), d(ape) += d(score), both stored
 *
 * Per candidate and vector that is 7 loads and 5 stores; the previous body (one
 * function per pass over a 256-feature chunk, m / s / acc / y / u in memory, a mask
 * per vector) made 13 and 8, and its gradient pass took ~50% of the time (perf, 1
 * thread, ratio 4 bf16, avx512).  Backward / forward, 1 thread, CPU time, the two bodies
 * alternated on one host: avx512 ratio 4 f32 3.1x -> 1.5x, bf16 2.55x -> 1.87x, ratio
 * 128 bf16 3.05x -> 2.45-2.50x (docs/training.md has all rows).  Each operation where two operands can both be NaN has its operand order
 * pinned (pgo_*), the order the old body compiled to, so the NaN bits do not depend on
 * which unrolled copy a feature falls in -- nor on the thread count or where the
 * arrays start -- and are the old body's.  bfloat16 inputs are widened exactly in the
 * loads, so they get the bits of float32 inputs of the same values.  Gradients go out
 * with streaming stores where a vector covers whole lines (nothing reads them back; a
 * plain store first reads the line it fills), bfloat16 ones rounded once in the
 * register (no float32 copy); the block grid starts on d(kv)'s lines for that.
 *
 * The baseline build keeps the per-candidate-row passes (pg_logits, pg_expsum,
 * pg_grads) over chunks of up to POOL_GRAD_FC features. */
#ifndef POOL_GRAD_LB
#define POOL_GRAD_LB 8192
#endif
#ifndef POOL_GRAD_FC
#define POOL_GRAD_FC 256
#endif
_Static_assert(POOL_GRAD_FC % 16 == 0 && POOL_GRAD_LB % POOL_GRAD_FC == 0, "grad chunk");

/* 1 when the whole 64-byte line holding p (element f of a row segment of fc elements,
 * es bytes each) lies inside the segment: only such lines are streamed.  A line that
 * also takes a masked plain store (a segment's edge) is never streamed: a streaming store
 * to a line the plain store brought into the cache evicts it (bf16 d(kv) rows 16 bytes
 * past a line, ratio 128, avx512: 28x the forward when the halves of edge lines mixed). */
static inline __attribute__((always_inline)) int CSA_V(pg_line_inside)(const void *p, csa_idx es,
                                                                      csa_idx f, csa_idx fc)
{
    const csa_idx ls = f - (csa_idx)((uintptr_t)p % 64) / es;
    return (uintptr_t)p % (uintptr_t)es == 0 && ls >= 0 && ls + 64 / es <= fc;
}

#ifdef __AVX512F__
/* Lanes [lo, n) of 16. */
static inline __attribute__((always_inline)) __mmask16 CSA_V(pg_mask)(csa_idx lo, csa_idx n)
{
    const unsigned hi = n >= 16 ? 0xffffu : n <= 0 ? 0u : (1u << n) - 1u;
    return (__mmask16)(hi & ~((1u << lo) - 1u));
}

/* The masked lanes of p (float32 or bfloat16, widened exactly), 0 elsewhere. */
static inline __attribute__((always_inline)) __m512 CSA_V(pg_ld)(const void *p, int bf,
                                                                 __mmask16 mk)
{
    if (bf) return CSA_V(bf16_widen16)(_mm256_maskz_loadu_epi16(mk, p));
    return _mm512_maskz_loadu_ps(mk, p);
}

/* Stores the masked lanes of v at p (element f of fc) as float32 or bfloat16 (rounded
 * once); streamed when the vector is full and aligned and its line inside the row. */
static inline __attribute__((always_inline)) void CSA_V(pg_st)(void *p, int bf, __mmask16 mk,
                                                              __m512 v, csa_idx f, csa_idx fc)
{
    if (bf) {
        const __m256i h = CSA_V(bf16_narrow16)(v);
        if (mk == 0xffff && (uintptr_t)p % 32 == 0 && CSA_V(pg_line_inside)(p, 2, f, fc))
            _mm256_stream_si256((__m256i *)p, h);
        else
            _mm256_mask_storeu_epi16(p, mk, h);
    } else if (mk == 0xffff && (uintptr_t)p % 64 == 0) {
        _mm512_stream_ps((float *)p, v);
    } else {
        _mm512_mask_storeu_ps((float *)p, mk, v);
    }
}

#define PG_VL 16
/* The blocked body's vocabulary at this level (pgb_entry below). */
#define PGB_VB 4   /* vectors a block */
#define PGB_VH 4   /* vectors of passes 1 and 2 at once: m, s, acc + the exp's temporaries */
typedef __m512 CSA_V(pgv);
typedef struct {
    __mmask16 k;
} CSA_V(pgk);
static inline __attribute__((always_inline)) CSA_V(pgk) CSA_V(pgk_make)(csa_idx lo, csa_idx n)
{
    return (CSA_V(pgk)){CSA_V(pg_mask)(lo < 16 ? lo : 16, n)};   /* lanes [lo, n); lo < 64 */
}
#define PGB_LD(p, bf, km) CSA_V(pg_ld)(p, bf, (km).k)
#define PGB_LDF(p, km) _mm512_maskz_loadu_ps((km).k, p)
#define PGB_STF(p, km, v) _mm512_mask_storeu_ps(p, (km).k, v)
#define PGB_ST(p, bf, km, v, f, fc) CSA_V(pg_st)(p, bf, (km).k, v, f, fc)
#define PGB_LDA _mm512_load_ps
#define PGB_STA _mm512_store_ps
#define PGB_SET1 _mm512_set1_ps
#define PGB_ZERO _mm512_setzero_ps
#define PGB_ADD _mm512_add_ps
#define PGB_SUB _mm512_sub_ps
#define PGB_MUL _mm512_mul_ps
#define PGB_DIV _mm512_div_ps
#define PGB_MAX _mm512_max_ps
#define PGB_FMA _mm512_fmadd_ps
#define PGB_EXP CSA_V(exp512_neg)
/* The operations where two operands can both be NaN, with the operand order pinned (a
 * NaN result is the first NaN source's: the order decides its sign and payload, and GCC
 * may swap a commutative operation's operands differently in each unrolled copy, which
 * made the NaN bits depend on where a feature fell in a block).  The orders are the ones
 * the previous one-function-per-pass body compiled to, so its bits are kept. */
static inline __attribute__((always_inline)) __m512 CSA_V(pgo_add)(__m512 a, __m512 b)
{
    __m512 r;
    __asm__("vaddps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}
static inline __attribute__((always_inline)) __m512 CSA_V(pgo_mul)(__m512 a, __m512 b)
{
    __m512 r;
    __asm__("vmulps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}
/* a * b + c, as vfmadd132ps b, c, a */
static inline __attribute__((always_inline)) __m512 CSA_V(pgo_fma)(__m512 a, __m512 b, __m512 c)
{
    __asm__("vfmadd132ps %2, %1, %0" : "+v"(a) : "v"(c), "v"(b));
    return a;
}
#define PGB_GA(ga, ds) CSA_V(pgo_add)(ds, ga)

#elif defined(__AVX2__) && defined(__FMA__)
/* Lanes [lo, n) of 8 as an all-ones-lane mask. */
static inline __attribute__((always_inline)) __m256i CSA_V(pg_mask)(csa_idx lo, csa_idx n)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int hi = n > 8 ? 8 : n < 0 ? 0 : (int)n;
    return _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)lo), lane),
                               _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane));
}

/* Lanes [lo, hi) of p (float32 or bfloat16, widened exactly), 0 elsewhere. */
static inline __attribute__((always_inline)) __m256 CSA_V(pg_ld)(const void *p, int bf,
                                                                 __m256i mk, csa_idx lo, csa_idx hi)
{
    if (!bf) return _mm256_maskload_ps((const float *)p, mk);
    if (lo == 0 && hi >= 8) return CSA_V(bf16_widen8)(_mm_loadu_si128((const __m128i *)p));
    csa_bf16 t[8] = {0};
    for (csa_idx i = lo; i < hi && i < 8; i++) t[i] = ((const csa_bf16 *)p)[i];
    return CSA_V(bf16_widen8)(_mm_loadu_si128((const __m128i *)t));
}

/* Stores 8 packed bfloat16 h at p (element f of fc): streamed when p is aligned and its
 * line inside the row. */
static inline __attribute__((always_inline)) void CSA_V(pg_put8)(void *p, __m128i h, csa_idx f,
                                                                csa_idx fc)
{
    if ((uintptr_t)p % 16 == 0 && CSA_V(pg_line_inside)(p, 2, f, fc))
        _mm_stream_si128((__m128i *)p, h);
    else
        _mm_storeu_si128((__m128i *)p, h);
}

/* Stores lanes [lo, hi) of v at p (element f of fc) as float32 or bfloat16 (rounded
 * once); streamed when the vector is full and aligned and its line inside the row. */
static inline __attribute__((always_inline)) void CSA_V(pg_st)(void *p, int bf, __m256i mk,
                                                              csa_idx lo, csa_idx hi, __m256 v,
                                                              csa_idx f, csa_idx fc)
{
    const int full = lo == 0 && hi >= 8;
    if (bf) {
        const __m128i h = CSA_V(bf16_pack8)(CSA_V(bf16_round8)(v));
        if (full) {
            CSA_V(pg_put8)(p, h, f, fc);
        } else {
            csa_bf16 t[8];
            _mm_storeu_si128((__m128i *)t, h);
            for (csa_idx i = lo; i < hi && i < 8; i++) ((csa_bf16 *)p)[i] = t[i];
        }
    } else if (full && (uintptr_t)p % 32 == 0 && CSA_V(pg_line_inside)(p, 4, f, fc)) {
        _mm256_stream_ps((float *)p, v);
    } else {
        _mm256_maskstore_ps((float *)p, mk, v);
    }
}

/* 16 features of d(kv) (dk: two whole vectors) and of d(score) (ds), stored as bfloat16
 * at gk and gs (element f of fc): the bits of four pg_st calls, with one NaN test for
 * all four (ds = (kv - y) dk is NaN wherever dk is) and one pack a pair.  Rounding and
 * packing the bfloat16 gradients, with a NaN test a vector, was most of this level's
 * pass 3: Intel Xeon (Sapphire Rapids), DEEPSEEK_CSA_ISA=avx2, 2 threads, T 8192,
 * D 512, bf16 in and out, two builds alternating: ratio 4 + overlap + ape 6.77 / 5.87 ->
 * 5.62 / 5.97 ms (CPU-time ratio to the forward 2.60 / 2.39 -> 2.09 / 2.16), ratio 128
 * + ape 2.65 / 2.64 -> 2.15 / 2.17 ms. */
static inline __attribute__((always_inline)) void CSA_V(pg_st16)(void *gk, void *gs,
                                                                const __m256 *dk, const __m256 *ds,
                                                                csa_idx f, csa_idx fc)
{
#ifndef CSA_MUTANT_POOL_GRAD_PAIR_NAN
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(ds[0], ds[0], _CMP_UNORD_Q),
                                    _mm256_cmp_ps(ds[1], ds[1], _CMP_UNORD_Q));
#else /* planted (make mutants): the second vector's NaNs rounded as numbers */
    const __m256 nan = _mm256_cmp_ps(ds[0], ds[0], _CMP_UNORD_Q);
#endif
    if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0)) {
        const __m256i mk = _mm256_set1_epi32(-1);
        for (int i = 0; i < 2; i++) {
            CSA_V(pg_st)((char *)gk + 16 * i, 1, mk, 0, 8, dk[i], f + 8 * i, fc);
            CSA_V(pg_st)((char *)gs + 16 * i, 1, mk, 0, 8, ds[i], f + 8 * i, fc);
        }
        return;
    }
    void *dst[2] = {gk, gs};
    const __m256 *src[2] = {dk, ds};
    for (int a = 0; a < 2; a++) {
        const __m256i pk = CSA_V(bf16_pack8x2)(CSA_V(bf16_round8_finite)(src[a][0]),
                                               CSA_V(bf16_round8_finite)(src[a][1]));
        void *p = dst[a];
        if ((uintptr_t)p % 32 == 0 && CSA_V(pg_line_inside)(p, 2, f, fc)) {
            _mm256_stream_si256((__m256i *)p, pk);   /* both halves in one streamed line */
        } else {                                     /* each half as pg_st stores it */
            CSA_V(pg_put8)(p, _mm256_castsi256_si128(pk), f, fc);
            CSA_V(pg_put8)((char *)p + 16, _mm256_extracti128_si256(pk, 1), f + 8, fc);
        }
    }
}

#define PG_VL 8
/* The blocked body's vocabulary at this level (pgb_entry below). */
#define PGB_VB 4   /* vectors a block: a line of bfloat16 gradients per row */
#define PGB_VH 2   /* 16 registers: m, s, acc of 2 vectors + the exp's temporaries */
typedef __m256 CSA_V(pgv);
typedef struct {
    __m256i mk;
    csa_idx lo, hi;
} CSA_V(pgk);
static inline __attribute__((always_inline)) CSA_V(pgk) CSA_V(pgk_make)(csa_idx lo, csa_idx n)
{
    lo = lo < 8 ? lo : 8;   /* lanes [lo, n); lo < 64 */
    return (CSA_V(pgk)){CSA_V(pg_mask)(lo, n), lo, n};
}
#define PGB_LD(p, bf, k) CSA_V(pg_ld)(p, bf, (k).mk, (k).lo, (k).hi)
#define PGB_LDF(p, k) _mm256_maskload_ps(p, (k).mk)
#define PGB_STF(p, k, v) _mm256_maskstore_ps(p, (k).mk, v)
#define PGB_ST(p, bf, k, v, f, fc) CSA_V(pg_st)(p, bf, (k).mk, (k).lo, (k).hi, v, f, fc)
#define PGB_LDA _mm256_load_ps
#define PGB_STA _mm256_store_ps
#define PGB_SET1 _mm256_set1_ps
#define PGB_ZERO _mm256_setzero_ps
#define PGB_ADD _mm256_add_ps
#define PGB_SUB _mm256_sub_ps
#define PGB_MUL _mm256_mul_ps
#define PGB_DIV _mm256_div_ps
#define PGB_MAX _mm256_max_ps
#define PGB_FMA _mm256_fmadd_ps
#define PGB_EXP CSA_V(exp256_neg)
/* NaN-sensitive operations with their operand order pinned, as at AVX-512 above. */
static inline __attribute__((always_inline)) __m256 CSA_V(pgo_add)(__m256 a, __m256 b)
{
    __m256 r;
    __asm__("vaddps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
    return r;
}
static inline __attribute__((always_inline)) __m256 CSA_V(pgo_mul)(__m256 a, __m256 b)
{
    __m256 r;
    __asm__("vmulps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
    return r;
}
/* a * b + c, as vfmadd132ps b, c, a */
static inline __attribute__((always_inline)) __m256 CSA_V(pgo_fma)(__m256 a, __m256 b, __m256 c)
{
    __asm__("vfmadd132ps %2, %1, %0" : "+x"(a) : "x"(c), "x"(b));
    return a;
}
#define PGB_GA(ga, ds) CSA_V(pgo_add)(ga, ds)

#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* One block of vb vectors from feature x0 of one entry (lanes outside [f_lo, f_hi)
 * masked off): the three passes over the candidate rows with the block's per-feature
 * values -- the max, the two sums, y and dy / s -- in registers throughout, so a pass
 * reads each candidate row once and stores only what the next pass needs (the logits,
 * then e = exp(l - m) in place, in lb; then the gradients). */
static inline __attribute__((always_inline)) void CSA_V(pgb_block)(
    const struct csa_pool_grad_problem *p, const pool_part *pt, int np, csa_idx b,
    csa_idx g, csa_idx x0, csa_idx f_lo, csa_idx f_hi, float *dape, float *CSA_RESTRICT lb,
    const int vb)
{
    const int kvbf = p->kv_bf16, scbf = p->sc_bf16, dybf = p->dy_bf16;
    const int gkbf = p->dkv_bf16, gsbf = p->dsc_bf16;
    const csa_idx W = vb * PG_VL;
    CSA_V(pgk) mk[PGB_VB];
    CSA_V(pgv) y[PGB_VB], u[PGB_VB];
#pragma GCC unroll 4
    for (int v = 0; v < vb; v++) {
        const csa_idx x = x0 + v * PG_VL;
        mk[v] = CSA_V(pgk_make)(x < f_lo ? f_lo - x : 0, f_hi - x);
    }
    /* each candidate row prefetches its score and kv lines of the block after this one:
     * the entry's next block on the same row, or after the entry's last block the next
     * entry's first, r rows on.  A block is a few lines of each of many rows, which the
     * hardware prefetchers do not follow.  Prefetching the same block of the next entry
     * instead (a whole entry ahead) left each chunk's first entry unfetched, 1 entry in 8
     * at ratio 128: backward / forward at ratio 128, T 8192, 2 threads, interleaved, load
     * 1.2-2.7: avx2 f32 2.53 -> 2.24, bf16 2.38 -> 2.24, avx512 f32 2.17 -> 1.97, bf16
     * 2.13 -> 2.09; ratio 4 within the noise (+-0.03). */
    const int nb = x0 + W < f_hi;
    const int pf = nb || g + 1 < p->T / p->ratio;
    const csa_idx pfs = W * (scbf ? 2 : 4), pfk = W * (kvbf ? 2 : 4);
    const csa_idx rs = nb ? W : p->ratio * p->sst - (x0 - f_lo);
    const csa_idx rk = nb ? W : p->ratio * p->skt - (x0 - f_lo);
    const int vh = vb < PGB_VH ? vb : PGB_VH;
    /* passes 1 and 2 in sub-blocks of vh vectors (the registers a level has for m, s, acc
     * and the exp); pass 3 over the whole block, whose d(kv) and d(score) per row are
     * whole lines: written a half line a row at a time (bfloat16, 16 features at avx2),
     * the lines left the write-combining buffers unfinished (7x the forward) */
    for (int h = 0; h < vb; h += vh) {
        CSA_V(pgv) m[PGB_VH], s[PGB_VH], acc[PGB_VH];
#pragma GCC unroll 4
        for (int v = 0; v < vh; v++) {
            m[v] = PGB_SET1(-INFINITY);
            s[v] = PGB_ZERO();
            acc[v] = PGB_ZERO();
        }
        const csa_idx xh = x0 + h * PG_VL;
        /* pass 1: l = score + ape into lb, m = max(m, l) */
        csa_idx q = 0;
        for (int k = 0; k < np; k++) {
            const csa_idx ff = pt[k].foff + xh;
            const void *sc = pool_off(p->score, scbf, b * p->ssb + pt[k].t0 * p->sst + ff);
            const void *kv = pool_off(p->kv, kvbf, b * p->skb + pt[k].t0 * p->skt + ff);
            const float *ap = p->ape ? p->ape + ff : NULL;
            for (csa_idx j = 0; j < pt[k].n; j++, q++) {
                if (pf && h == 0) {
                    const char *ns = (const char *)pool_off(sc, scbf, rs);
                    const char *nk = (const char *)pool_off(kv, kvbf, rk);
                    for (csa_idx c = 0; c < pfs; c += 64) _mm_prefetch(ns + c, _MM_HINT_T1);
                    for (csa_idx c = 0; c < pfk; c += 64) _mm_prefetch(nk + c, _MM_HINT_T1);
                }
#pragma GCC unroll 4
                for (int v = 0; v < vh; v++) {
                    CSA_V(pgv) l = PGB_LD(pool_off(sc, scbf, v * PG_VL), scbf, mk[h + v]);
                    if (ap) l = CSA_V(pgo_add)(l, PGB_LDF(ap + v * PG_VL, mk[h + v]));
                    PGB_STA(lb + q * W + (h + v) * PG_VL, l);
                    /* max(l, m) returns m when l is NaN: the NaN shows in its exp */
                    m[v] = PGB_MAX(l, m[v]);
                }
                sc = pool_off(sc, scbf, p->sst);
                kv = pool_off(kv, kvbf, p->skt);
                if (ap) ap += p->sar;
            }
        }
        /* pass 2: e = exp(l - m) in place, s += e, acc = fma(e, kv, acc) */
        q = 0;
        for (int k = 0; k < np; k++) {
            const void *kv = pool_off(p->kv, kvbf, b * p->skb + pt[k].t0 * p->skt + pt[k].foff + xh);
            for (csa_idx j = 0; j < pt[k].n; j++, q++) {
#pragma GCC unroll 4
                for (int v = 0; v < vh; v++) {
                    float *lq = lb + q * W + (h + v) * PG_VL;
                    const CSA_V(pgv) e = PGB_EXP(PGB_SUB(PGB_LDA(lq), m[v]));
                    PGB_STA(lq, e);
                    s[v] = CSA_V(pgo_add)(e, s[v]);
                    acc[v] = CSA_V(pgo_fma)(e, PGB_LD(pool_off(kv, kvbf, v * PG_VL), kvbf, mk[h + v]), acc[v]);
                }
                kv = pool_off(kv, kvbf, p->skt);
            }
        }
        /* y = acc / s; u = dy / s once per feature: the gradient pass multiplies each
         * candidate's e by it instead of dividing e by s (a 512-bit division is ~10x a
         * multiply's throughput: per candidate it was what bounded the bfloat16 rows) */
        const void *dyr = pool_off(p->dy, dybf, b * p->sdb + g * p->sdg + xh);
#pragma GCC unroll 4
        for (int v = 0; v < vh; v++) {
            CSA_V(pgv) dv = PGB_LD(pool_off(dyr, dybf, v * PG_VL), dybf, mk[h + v]);
#ifdef CSA_MUTANT_POOL_GRAD_FIRST_GROUP
            /* mutant: entry 0 with overlap treated as if group -1 were there */
            if (p->overlap && g == 0) dv = PGB_MUL(dv, PGB_SET1(0.999f));
#endif
            y[h + v] = PGB_DIV(acc[v], s[v]);
            u[h + v] = PGB_DIV(dv, s[v]);
#ifdef CSA_MUTANT_POOL_GRAD_Y
            y[h + v] = PGB_MUL(y[h + v], PGB_SET1(1.0f + 1e-4f));   /* mutant: y off 1e-4 */
#endif
        }
    }
    /* pass 3: d(kv) = e u, d(score) = d(kv) (kv - y), d(ape) += d(score); a line is
     * streamed only when this block writes all of it (sl, sn: the block's features
     * inside the item), else the write-combining buffer would hold its part until
     * the next block's, across all the other rows' lines */
    const csa_idx sl = x0 > f_lo ? x0 : f_lo, sn = (x0 + W < f_hi ? x0 + W : f_hi) - sl;
#if !defined(__AVX512F__)
    /* bfloat16 gradients of a whole block, two vectors at a time (pg_st16) */
    const int pair16 = gkbf && gsbf && vb % 2 == 0 && x0 >= f_lo && x0 + W <= f_hi;
#endif
    csa_idx q = 0;
    for (int k = 0; k < np; k++) {
        const csa_idx t0 = pt[k].t0, ff = pt[k].foff + x0;
        const void *kv = pool_off(p->kv, kvbf, b * p->skb + t0 * p->skt + ff);
        void *gk = (void *)pool_off(p->dkv, gkbf, b * p->sgkb + t0 * p->sgkt + ff);
        void *gs = (void *)pool_off(p->dsc, gsbf, b * p->sgsb + t0 * p->sgst + ff);
        float *ga = dape ? dape + ff : NULL;
        for (csa_idx j = 0; j < pt[k].n; j++, q++) {
#if !defined(__AVX512F__)
            if (pair16) {
#pragma GCC unroll 2
                for (int v = 0; v < vb; v += 2) {
                    const csa_idx o = v * PG_VL;
                    CSA_V(pgv) dk[2], ds[2];
                    for (int i = 0; i < 2; i++) {
                        dk[i] = CSA_V(pgo_mul)(PGB_LDA(lb + q * W + o + i * PG_VL), u[v + i]);
                        ds[i] = CSA_V(pgo_mul)(PGB_SUB(PGB_LD(pool_off(kv, kvbf, o + i * PG_VL), kvbf, mk[v + i]), y[v + i]), dk[i]);
                        if (ga) PGB_STF(ga + o + i * PG_VL, mk[v + i], PGB_GA(PGB_LDF(ga + o + i * PG_VL, mk[v + i]), ds[i]));
                    }
                    CSA_V(pg_st16)((void *)pool_off(gk, gkbf, o), (void *)pool_off(gs, gsbf, o),
                                   dk, ds, x0 + o - sl, sn);
                }
            } else
#endif
            {
#pragma GCC unroll 4
                for (int v = 0; v < vb; v++) {
                    const csa_idx o = v * PG_VL;
                    const CSA_V(pgv) dk = CSA_V(pgo_mul)(PGB_LDA(lb + q * W + o), u[v]);
                    const CSA_V(pgv) ds = CSA_V(pgo_mul)(PGB_SUB(PGB_LD(pool_off(kv, kvbf, o), kvbf, mk[v]), y[v]), dk);
                    if (ga) PGB_STF(ga + o, mk[v], PGB_GA(PGB_LDF(ga + o, mk[v]), ds));
                    PGB_ST((void *)pool_off(gk, gkbf, o), gkbf, mk[v], dk, x0 + o - sl, sn);
                    PGB_ST((void *)pool_off(gs, gsbf, o), gsbf, mk[v], ds, x0 + o - sl, sn);
                }
            }
            kv = pool_off(kv, kvbf, p->skt);
            gk = (void *)pool_off(gk, gkbf, p->sgkt);
            gs = (void *)pool_off(gs, gsbf, p->sgst);
            if (ga) ga += p->sgar;
        }
    }
}

/* Entry (b, g) over features [f_lo, f_hi): blocks of PGB_VB vectors on a grid that
 * starts where d(kv)'s vectors do, so whole vectors are whole lines (or aligned halves)
 * of d(kv) and go out as streaming stores.  lb: every candidate's logits of a block.
 * Narrower blocks write each row's gradients in pieces of a line, which the
 * write-combining buffers do not hold until the line is whole: one vector a block was
 * 20x the forward (1 thread, ratio 4 and 128, both levels, bf16 and at avx2 f32 too),
 * two at avx2 bf16 11-14x, two at avx512 1.0-1.3x the time of four.  Where the blocks
 * fall changes no bit: every element's arithmetic is its own. */
static void CSA_V(pg_entry)(const struct csa_pool_grad_problem *p, csa_idx b, csa_idx g,
                            csa_idx f_lo, csa_idx f_hi, float *dape, float *lb)
{
    pool_part pt[2];
    const int np = grad_parts(pt, g, p->ratio, p->d, p->overlap);
    const pool_part *pl = &pt[np - 1];
    const int gkbf = p->dkv_bf16;
    const csa_idx es = gkbf ? 2 : 4;
    const uintptr_t a0 = (uintptr_t)pool_off(p->dkv, gkbf, b * p->sgkb + pl->t0 * p->sgkt + pl->foff + f_lo);
    const csa_idx pre = a0 % (uintptr_t)es ? 0 : (csa_idx)((64 - a0 % 64) % 64) / es;
    for (csa_idx x0 = pre ? f_lo + pre - PGB_VB * PG_VL : f_lo; x0 < f_hi; x0 += PGB_VB * PG_VL)
        CSA_V(pgb_block)(p, pt, np, b, g, x0, f_lo, f_hi, dape, lb, PGB_VB);
}
#else
/* The baseline build: plain loops of the same arithmetic. */
static void CSA_V(pg_logits)(const void *sc, int scbf, const float *ap, float *l, float *m,
                             csa_idx fc, csa_idx fcp)
{
    for (csa_idx f = 0; f < fcp; f++) {
        const float v = f < fc ? pool_ld(sc, scbf, f) + (ap ? ap[f] : 0.0f) : 0.0f;
        l[f] = v;
        m[f] = v > m[f] ? v : m[f];
    }
}

static void CSA_V(pg_expsum)(float *l, const float *m, const void *kv, int kvbf, float *s,
                             float *acc, csa_idx fc, csa_idx fcp)
{
    for (csa_idx f = 0; f < fcp; f++) {
        const float e = expf(l[f] - m[f]);
        l[f] = e;
        s[f] += e;
        acc[f] += e * (f < fc ? pool_ld(kv, kvbf, f) : 0.0f);
    }
}

static void CSA_V(pg_grads)(const float *e, const float *u, const void *kv, int kvbf, const float *y, float *ga, void *gk, int gkbf, void *gs,
                            int gsbf, csa_idx fc)
{
    for (csa_idx f = 0; f < fc; f++) {
        const float dk = e[f] * u[f];
        const float ds = dk * (pool_ld(kv, kvbf, f) - y[f]);
        if (ga) ga[f] += ds;
        pool_st(gk, gkbf, f, dk);
        pool_st(gs, gsbf, f, ds);
    }
}
#define PG_VL 16

static void CSA_V(pg_entry)(const struct csa_pool_grad_problem *p, csa_idx b, csa_idx g,
                            csa_idx f_lo, csa_idx f_hi, float *dape)
{
    const csa_idx r = p->ratio, d = p->d;
    const int kvbf = p->kv_bf16, scbf = p->sc_bf16, dybf = p->dy_bf16;
    const int gkbf = p->dkv_bf16, gsbf = p->dsc_bf16;
    pool_part pt[2];
    const int np = grad_parts(pt, g, r, d, p->overlap);
    const csa_idx nc = pt[0].n + (np > 1 ? pt[1].n : 0);
    csa_idx fcm = POOL_GRAD_LB / (nc > 0 ? nc : 1) / 16 * 16;
    if (fcm > POOL_GRAD_FC) fcm = POOL_GRAD_FC;
    /* the buffers pg_grads reads at offsets down to -15 have 16 floats in front (1.0:
     * nothing there is ever stored, but every lane stays a number) */
#define PG_MARGIN 16
    float lbm[PG_MARGIN + POOL_GRAD_LB] __attribute__((aligned(64)));
    float sm[PG_MARGIN + POOL_GRAD_FC] __attribute__((aligned(64)));
    float ym[PG_MARGIN + POOL_GRAD_FC] __attribute__((aligned(64)));
    float dym[PG_MARGIN + POOL_GRAD_FC] __attribute__((aligned(64)));
    float m[POOL_GRAD_FC] __attribute__((aligned(64))), acc[POOL_GRAD_FC] __attribute__((aligned(64)));
    float *lb = lbm + PG_MARGIN, *s = sm + PG_MARGIN, *y = ym + PG_MARGIN, *dyv = dym + PG_MARGIN;
    for (int i = 0; i < PG_MARGIN; i++) lbm[i] = sm[i] = ym[i] = dym[i] = 1.0f;
#undef PG_MARGIN
    /* Chunk boundaries on d(kv)'s 64-byte lines: a line that two chunks share is written
     * by two masked plain stores, each reading the line first, instead of one streaming
     * store (rows 16 bytes past a line, as NumPy's large arrays are: ratio 128, 1 thread,
     * 5.1x -> 2.3x the forward at avx512, 4.6x -> 3.0x at avx2, vs lines aligned).  Where
     * the chunks end changes no bit: every element's arithmetic is its own. */
    const pool_part *pl = &pt[np - 1];
    const csa_idx es = gkbf ? 2 : 4, le = 64 / es;
    const uintptr_t a0 = (uintptr_t)pool_off(p->dkv, gkbf, b * p->sgkb + pl->t0 * p->sgkt + pl->foff + f_lo);
    const csa_idx head = a0 % (uintptr_t)es ? 0 : (csa_idx)((64 - a0 % 64) % 64) / es;
    for (csa_idx f0 = f_lo, fc; f0 < f_hi; f0 += fc) {
        const csa_idx lim = f0 == f_lo && head && fcm > le ? fcm - le + head : fcm;
        fc = f_hi - f0 < lim ? f_hi - f0 : lim;
        const csa_idx fcp = (fc + PG_VL - 1) / PG_VL * PG_VL;
        const void *dyr = pool_off(p->dy, dybf, b * p->sdb + g * p->sdg + f0);
        for (csa_idx f = 0; f < fcp; f++) {
            dyv[f] = f < fc ? pool_ld(dyr, dybf, f) : 0.0f;
#ifdef CSA_MUTANT_POOL_GRAD_FIRST_GROUP
            /* mutant: entry 0 with overlap treated as if group -1 were there */
            if (p->overlap && g == 0) dyv[f] *= 0.999f;
#endif
            m[f] = -INFINITY;
            s[f] = 0.0f;
            acc[f] = 0.0f;
        }
        csa_idx q = 0;
        for (int k = 0; k < np; k++)
            for (csa_idx j = 0; j < pt[k].n; j++, q++) {
                const csa_idx t = pt[k].t0 + j, ff = pt[k].foff + f0;
                const void *sc = pool_off(p->score, scbf, b * p->ssb + t * p->sst + ff);
                if (f0 + fc < f_hi) {
                    /* the candidate's next chunk of score and kv: with many candidates a
                     * chunk is a few lines of each of many rows, which the hardware
                     * prefetchers do not follow (ratio 128, 1 thread, avx512: 4.35x -> 3.44x
                     * the forward) */
                    const char *ns = (const char *)pool_off(sc, scbf, fc);
                    const char *nk = (const char *)pool_off(p->kv, kvbf, b * p->skb + t * p->skt + ff + fc);
                    const csa_idx nf = f_hi - f0 - fc < fc ? f_hi - f0 - fc : fc;
                    for (csa_idx c = 0; c < nf * (scbf ? 2 : 4); c += 64) __builtin_prefetch(ns + c, 0, 3);
                    for (csa_idx c = 0; c < nf * (kvbf ? 2 : 4); c += 64) __builtin_prefetch(nk + c, 0, 3);
                }
                CSA_V(pg_logits)(sc, scbf, p->ape ? p->ape + j * p->sar + ff : NULL, lb + q * fcp,
                                 m, fc, fcp);
            }
        q = 0;
        for (int k = 0; k < np; k++)
            for (csa_idx j = 0; j < pt[k].n; j++, q++) {
                const csa_idx t = pt[k].t0 + j, ff = pt[k].foff + f0;
                CSA_V(pg_expsum)(lb + q * fcp, m, pool_off(p->kv, kvbf, b * p->skb + t * p->skt + ff),
                                 kvbf, s, acc, fc, fcp);
            }
        /* u = dy / s once per feature: the gradient pass multiplies each candidate's e
         * by it instead of dividing e by s (a 512-bit division is ~10x a multiply's
         * throughput: per candidate it was what bounded the bfloat16 rows) */
#pragma omp simd
        for (csa_idx f = 0; f < fcp; f++) {
            y[f] = acc[f] / s[f];
            dyv[f] = dyv[f] / s[f];
        }
#ifdef CSA_MUTANT_POOL_GRAD_Y
        for (csa_idx f = 0; f < fc; f++) y[f] *= 1.0f + 1e-4f;   /* mutant: y off 1e-4 */
#endif
        q = 0;
        for (int k = 0; k < np; k++)
            for (csa_idx j = 0; j < pt[k].n; j++, q++) {
                const csa_idx t = pt[k].t0 + j, ff = pt[k].foff + f0;
                CSA_V(pg_grads)(lb + q * fcp, dyv,
                                pool_off(p->kv, kvbf, b * p->skb + t * p->skt + ff), kvbf, y,
                                dape ? dape + j * p->sgar + ff : NULL,
                                (void *)pool_off(p->dkv, gkbf, b * p->sgkb + t * p->sgkt + ff), gkbf,
                                (void *)pool_off(p->dsc, gsbf, b * p->sgsb + t * p->sgst + ff), gsbf,
                                fc);
            }
    }
}
#endif

/* ga[f] += pa[f], f < n: one chunk's partial d(ape) into the sum, with the operand order
 * of the chunks' own sums (the running sum first: a NaN's bits are the sum's). */
static void CSA_V(pg_ape_add)(float *ga, const float *pa, csa_idx n)
{
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    for (csa_idx f = 0; f < n; f += PG_VL) {
        const CSA_V(pgk) k = CSA_V(pgk_make)(0, n - f);
        PGB_STF(ga + f, k, PGB_GA(PGB_LDF(ga + f, k), PGB_LDF(pa + f, k)));
    }
#else
    for (csa_idx f = 0; f < n; f++) ga[f] += pa[f];
#endif
}

static int CSA_V(gated_pool_backward_tuned)(const struct csa_pool_grad_problem *p)
{
    const csa_idx B = p->B, T = p->T, d = p->d, r = p->ratio, G = T / r;
    const csa_idx cd = (p->overlap ? 2 : 1) * d;
    const int dybf = p->dy_bf16, gkbf = p->dkv_bf16;
    {
        const int nt = csa_threads(B * T, 1 + 16384 / (cd + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx i = 0; i < B * T; i++) grad_zero_row(p, i);
    }
    if (r == 1 && !p->overlap) {   /* ungated: out = kv */
        const int nt = csa_threads(B * T, 1 + 16384 / (d + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx i = 0; i < B * T; i++) {
            const csa_idx b = i / T, t = i % T;
            pool_copy((void *)pool_off(p->dkv, gkbf, b * p->sgkb + t * p->sgkt), gkbf,
                      pool_off(p->dy, dybf, b * p->sdb + t * p->sdg), dybf, d);
            if (p->dsc)
                memset((char *)p->dsc + (size_t)(b * p->sgsb + t * p->sgst) * (p->dsc_bf16 ? 2 : 4),
                       0, (size_t)d * (p->dsc_bf16 ? 2 : 4));
        }
        if (p->dape)
            for (csa_idx f = 0; f < cd; f++) p->dape[f] = 0.0f;
        return CSA_OK;
    }
    /* items: chunks of entries (grad_chunks, pool.c), each over every feature.  The
     * items were blocks of features (as many as threads), each over every entry, which
     * kept d(ape)'s one running sum in the `_ref`'s order, but at 2 threads each item
     * read every row in halves, and backward / forward was 2.2-3.2x against 1.5-2.5x at
     * 1 thread (the forward's items are entries); measured after the change in
     * docs/training.md. */
    const csa_idx E = B * G, nch = grad_chunks(p);
    float *part = NULL;   /* the partial d(ape) of chunks 1.. (chunk 0 sums into dape) */
    if (p->dape && nch > 1) {
        part = malloc((size_t)((nch - 1) * r * cd) * sizeof(float));
        if (!part) return CSA_ENOMEM;
    }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    /* every candidate's logits of one block, per item (up to 128 KiB: heap) */
    const size_t nlb = (size_t)((p->overlap ? 2 : 1) * r * PGB_VB * PG_VL);
#endif
    int status = CSA_OK;
    const int nt = csa_threads(nch, 1);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx c = 0; c < nch; c++) {
        struct csa_pool_grad_problem q = *p;
        float *da = p->dape;
        if (da && c > 0) {
            da = part + (c - 1) * r * cd;
            q.sgar = cd;
        }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        float *lb = aligned_alloc(64, (nlb * sizeof(float) + 63) / 64 * 64);
        if (!lb) {
#pragma omp atomic write
            status = CSA_ENOMEM;
            continue;
        }
#endif
        if (da)
            for (csa_idx j = 0; j < r; j++) memset(da + j * q.sgar, 0, (size_t)cd * sizeof(float));
        for (csa_idx e = c * E / nch; e < (c + 1) * E / nch; e++) {
            const csa_idx b = e / G, g = e % G;
            float *ga = da;
#ifdef CSA_MUTANT_POOL_GRAD_APE_DROP
            if (b == 0 && g == G - 1 && G > 1) ga = NULL;   /* mutant: one group dropped */
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
            CSA_V(pg_entry)(&q, b, g, 0, d, ga, lb);
#else
            CSA_V(pg_entry)(&q, b, g, 0, d, ga);
#endif
        }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        free(lb);
        _mm_sfence(); /* the streaming stores are visible to every thread after the loop */
#endif
    }
    if (status == CSA_OK && part) {
        /* d(ape) += the partials in chunk order, parallel over ape's rows */
        const int nr = csa_threads(r, 1 + 16384 / ((nch - 1) * cd + 1));
#pragma omp parallel for num_threads(nr) schedule(static)
        for (csa_idx j = 0; j < r; j++)
            for (csa_idx c = 1; c < nch; c++)
                CSA_V(pg_ape_add)(p->dape + j * p->sgar, part + ((c - 1) * r + j) * cd, cd);
    }
    free(part);
    return status;
}
#undef PG_VL
#undef PGB_VB
#undef PGB_VH
#undef PGB_LD
#undef PGB_LDF
#undef PGB_STF
#undef PGB_ST
#undef PGB_LDA
#undef PGB_STA
#undef PGB_SET1
#undef PGB_ZERO
#undef PGB_ADD
#undef PGB_SUB
#undef PGB_MUL
#undef PGB_DIV
#undef PGB_MAX
#undef PGB_FMA
#undef PGB_EXP
#undef PGB_GA
