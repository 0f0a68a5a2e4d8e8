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
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 floats from a float32 or bfloat16 row; the last vector (`part`) reads n < 8 lanes
 * and zeros the rest, as the float32 mask load does. */
static inline __attribute__((always_inline)) __m256 CSA_V(pool_ld8)(const void *p, csa_idx i,
                                                                    __m256i mk, int part,
                                                                    csa_idx n, const int bf)
{
    if (bf) {
        __m128i h;
        if (part) {
            csa_bf16 t[8] = {0};
            memcpy(t, (const csa_bf16 *)p + i, (size_t)n * sizeof(csa_bf16));
            h = _mm_loadu_si128((const __m128i *)t);
        } else {
            h = _mm_loadu_si128((const __m128i *)((const csa_bf16 *)p + i));
        }
        return CSA_V(bf16_widen8)(h);
    }
    return _mm256_maskload_ps((const float *)p + i, mk);
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
/* Pass 1 of a chunk of fc features from f0: m = the running max of the logits; s and
 * acc start at zero. */
static inline __attribute__((always_inline)) void CSA_V(pool_max8)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, float *CSA_RESTRICT m,
    float *CSA_RESTRICT s, float *CSA_RESTRICT acc, __m256i tail, __m256i full,
    csa_idx nrem, csa_idx fv, const int scbf)
{
    for (csa_idx f = 0; f < fc; f += 8) {
        _mm256_store_ps(m + f, _mm256_set1_ps(-INFINITY));
        _mm256_store_ps(s + f, _mm256_setzero_ps());
        _mm256_store_ps(acc + f, _mm256_setzero_ps());
    }
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            for (csa_idx f = 0; f < fc; f += 8) {
                const int part = f == fv;
                const __m256i mk = part ? tail : full;
                __m256 l = CSA_V(pool_ld8)(sc, f, mk, part, nrem, scbf);
                if (ap) l = _mm256_add_ps(l, _mm256_maskload_ps(ap + f, mk));
                _mm256_store_ps(m + f, _mm256_max_ps(l, _mm256_load_ps(m + f)));
            }
        }
}

/* Pass 2: e = exp(l - m) into s += e and acc += e * kv. */
static inline __attribute__((always_inline)) void CSA_V(pool_sum8)(
    const pool_cands *c, int nc, csa_idx f0, csa_idx fc, const float *CSA_RESTRICT m,
    float *CSA_RESTRICT s, float *CSA_RESTRICT acc, __m256i tail, __m256i full,
    csa_idx nrem, csa_idx fv, const int kvbf, const int scbf)
{
    for (int k = 0; k < nc; k++)
        for (csa_idx j = 0; j < c[k].n; j++) {
            const void *sc = pool_off(c[k].sc, scbf, j * c[k].ssc + f0);
            const void *kv = pool_off(c[k].kv, kvbf, j * c[k].skv + f0);
            const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
            for (csa_idx f = 0; f < fc; f += 8) {
                const int part = f == fv;
                const __m256i mk = part ? tail : full;
                __m256 l = CSA_V(pool_ld8)(sc, f, mk, part, nrem, scbf);
                if (ap) l = _mm256_add_ps(l, _mm256_maskload_ps(ap + f, mk));
                const __m256 e = CSA_V(exp256_neg)(_mm256_sub_ps(l, _mm256_load_ps(m + f)));
                _mm256_store_ps(s + f, _mm256_add_ps(_mm256_load_ps(s + f), e));
                _mm256_store_ps(acc + f,
                                _mm256_fmadd_ps(e, CSA_V(pool_ld8)(kv, f, mk, part, nrem, kvbf),
                                                _mm256_load_ps(acc + f)));
            }
        }
}

/* The quotients acc / s into out (rounded to bfloat16 when obf; m is scratch then). */
static inline __attribute__((always_inline)) void CSA_V(pool_store8)(
    csa_idx f0, csa_idx fc, float *CSA_RESTRICT m, const float *CSA_RESTRICT s,
    const float *CSA_RESTRICT acc, __m256i tail, __m256i full, csa_idx fv, float *outf,
    csa_bf16 *outh, int obf)
{
    if (obf) {
        for (csa_idx f = 0; f < fc; f += 8)   /* m is free again: the quotients */
            _mm256_store_ps(m + f, _mm256_div_ps(_mm256_load_ps(acc + f),
                                                 _mm256_load_ps(s + f)));
        for (csa_idx f = 0; f < fc; f++) outh[f0 + f] = csa_f32_to_bf16(m[f]);
    } else {
        for (csa_idx f = 0; f < fc; f += 8)
            _mm256_maskstore_ps(outf + f0 + f, f == fv ? tail : full,
                                _mm256_div_ps(_mm256_load_ps(acc + f), _mm256_load_ps(s + f)));
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
    const int keep)
{
    /* m, s, acc in one buffer, staggered by 80 floats so that their addresses never
     * share the low 12 bits: 4 KiB apart, a store to one stalls the loads of the
     * others behind it (4K aliasing; ~1.3x on the whole kernel, measured). */
    float buf[3 * POOL_FC + 2 * 80] __attribute__((aligned(64)));
    float *CSA_RESTRICT m = buf, *CSA_RESTRICT s = buf + POOL_FC + 80;
    float *CSA_RESTRICT acc = buf + 2 * POOL_FC + 160;
    float *const outf = obf ? NULL : out;
    csa_bf16 *const outh = obf ? out : NULL;
    for (csa_idx f0 = 0; f0 < d; f0 += POOL_FC) {
        const csa_idx fc = d - f0 < POOL_FC ? d - f0 : POOL_FC;
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
        static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
        const csa_idx nrem = fc % 8 ? fc % 8 : 8;
        const __m256i tail = _mm256_loadu_si256((const __m256i *)(lanes + 8 - nrem));
        const __m256i full = _mm256_set1_epi32(-1);
        const csa_idx fv = fc - nrem;
        CSA_V(pool_max8)(c, nc, f0, fc, m, s, acc, tail, full, nrem, fv, scbf);
        CSA_V(pool_sum8)(c, nc, f0, fc, m, s, acc, tail, full, nrem, fv, kvbf, scbf);
        CSA_V(pool_store8)(f0, fc, m, s, acc, tail, full, fv, outf, outh, obf);
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
#ifdef __AVX512F__
    csa_idx ntot = 0;
    for (int k = 0; k < nc; k++) ntot += c[k].n;
    keep = ntot * (((d < POOL_FC ? d : POOL_FC) + 63) / 64 * 64) <= POOL_LBUF;
#endif
#define POOL_BODY(kb, sb)                                                       \
    (keep ? CSA_V(pool_entry_body)(c, nc, d, out, obf, kb, sb, 1)              \
          : CSA_V(pool_entry_body)(c, nc, d, out, obf, kb, sb, 0))
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
        CSA_V(pool_entry_tuned)(c, nc, d, (void *)pool_off(out, obf, b * sob + g * sog), obf);
    }
    return CSA_OK;
}
