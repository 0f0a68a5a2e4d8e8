/* Tuned gated pooling body, compiled once per ISA level by csa_isa_variants.h.
 * Unit feature strides.  One entry = features in chunks of POOL_FC, two passes over
 * the candidate rows (max of the logits, then exp / sum / weighted sum), rows
 * streamed in order so the prefetchers see sequential reads; AVX-512 and AVX2 have
 * their own vector exp (masked tails: every feature goes through the same
 * instructions), the baseline calls expf.  The per-feature
 * arithmetic never depends on the chunk, the lane, the thread or where the rows
 * live, so prefill and decode (csa_pool_step) give the same bits. */

#ifndef POOL_FC
#define POOL_FC 1024
#endif
_Static_assert(POOL_FC % 64 == 0, "POOL_FC must be whole 64-feature blocks");
#ifndef POOL_RUN
#define POOL_RUN 8
#endif

#include "vexp_impl.h"

static int CSA_V(pool_entry_tuned)(const pool_cands *c, int nc, csa_idx d, float *out)
{
    /* m, s, acc in one buffer, staggered by 80 floats so that their addresses never
     * share the low 12 bits: 4 KiB apart, a store to one stalls the loads of the
     * others behind it (4K aliasing; ~1.3x on the whole kernel, measured). */
    float buf[3 * POOL_FC + 2 * 80] __attribute__((aligned(64)));
    float *CSA_RESTRICT m = buf, *CSA_RESTRICT s = buf + POOL_FC + 80;
    float *CSA_RESTRICT acc = buf + 2 * POOL_FC + 160;
    for (csa_idx f0 = 0; f0 < d; f0 += POOL_FC) {
        const csa_idx fc = d - f0 < POOL_FC ? d - f0 : POOL_FC;
#ifdef __AVX512F__
        (void)s;
        (void)acc;
        for (csa_idx f = 0; f < fc; f += 16)   /* whole 64-blocks: pass 2 reads them */
            _mm512_store_ps(m + f, _mm512_set1_ps(-INFINITY));
        for (csa_idx f = (fc + 15) / 16 * 16; f % 64; f += 16)
            _mm512_store_ps(m + f, _mm512_setzero_ps());
        const __mmask16 tail = (__mmask16)((1u << (fc % 16 ? fc % 16 : 16)) - 1u);
        const csa_idx fv = fc - (fc % 16 ? fc % 16 : 16);   /* start of the last vector */
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                const float *sc = c[k].sc + j * c[k].ssc + f0;
                const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
                const float *kv = c[k].kv + j * c[k].skv + f0;
                const csa_idx pf = c[k].pf;
                for (csa_idx f = 0; f < fc; f += 16) {
                    const __mmask16 mk = f == fv ? tail : (__mmask16)0xffff;
                    /* pass 1 streams the rows once from memory: fetch the kv of pass 2
                     * and the sibling half rows the next entry needs along with them */
                    _mm_prefetch((const char *)(kv + f), _MM_HINT_T1);
                    if (pf) {
                        _mm_prefetch((const char *)(sc + pf + f), _MM_HINT_T1);
                        _mm_prefetch((const char *)(kv + pf + f), _MM_HINT_T1);
                    }
                    __m512 l = _mm512_maskz_loadu_ps(mk, sc + f);
                    if (ap) l = _mm512_add_ps(l, _mm512_maskz_loadu_ps(mk, ap + f));
                    /* max(l, m) returns m when l is NaN: the NaN shows in its exp */
                    _mm512_store_ps(m + f, _mm512_max_ps(l, _mm512_load_ps(m + f)));
                }
            }
        /* pass 2 in blocks of 64 features held in registers across all candidates:
         * no stores until the result */
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
            for (int k = 0; k < nc; k++)
                for (csa_idx j = 0; j < c[k].n; j++) {
                    const float *sc = c[k].sc + j * c[k].ssc + f0 + fb;
                    const float *kv = c[k].kv + j * c[k].skv + f0 + fb;
                    const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 + fb : NULL;
                    for (int v = 0; v < 4; v++) {
                        __m512 l = _mm512_maskz_loadu_ps(mk[v], sc + 16 * v);
                        if (ap) l = _mm512_add_ps(l, _mm512_maskz_loadu_ps(mk[v], ap + 16 * v));
                        const __m512 e = CSA_V(exp512_neg)(_mm512_sub_ps(l, mv[v]));
                        sv[v] = _mm512_add_ps(sv[v], e);
                        av[v] = _mm512_fmadd_ps(e, _mm512_maskz_loadu_ps(mk[v], kv + 16 * v), av[v]);
                    }
                }
            for (int v = 0; v < 4; v++)
                _mm512_mask_storeu_ps(out + f0 + fb + 16 * v, mk[v], _mm512_div_ps(av[v], sv[v]));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
        for (csa_idx f = 0; f < fc; f += 8) {
            _mm256_store_ps(m + f, _mm256_set1_ps(-INFINITY));
            _mm256_store_ps(s + f, _mm256_setzero_ps());
            _mm256_store_ps(acc + f, _mm256_setzero_ps());
        }
        const csa_idx nrem = fc % 8 ? fc % 8 : 8;
        const __m256i tail = _mm256_loadu_si256((const __m256i *)(lanes + 8 - nrem));
        const __m256i full = _mm256_set1_epi32(-1);
        const csa_idx fv = fc - nrem;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                const float *sc = c[k].sc + j * c[k].ssc + f0;
                const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
                for (csa_idx f = 0; f < fc; f += 8) {
                    const __m256i mk = f == fv ? tail : full;
                    __m256 l = _mm256_maskload_ps(sc + f, mk);
                    if (ap) l = _mm256_add_ps(l, _mm256_maskload_ps(ap + f, mk));
                    _mm256_store_ps(m + f, _mm256_max_ps(l, _mm256_load_ps(m + f)));
                }
            }
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                const float *sc = c[k].sc + j * c[k].ssc + f0;
                const float *kv = c[k].kv + j * c[k].skv + f0;
                const float *ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
                for (csa_idx f = 0; f < fc; f += 8) {
                    const __m256i mk = f == fv ? tail : full;
                    __m256 l = _mm256_maskload_ps(sc + f, mk);
                    if (ap) l = _mm256_add_ps(l, _mm256_maskload_ps(ap + f, mk));
                    const __m256 e = CSA_V(exp256_neg)(_mm256_sub_ps(l, _mm256_load_ps(m + f)));
                    _mm256_store_ps(s + f, _mm256_add_ps(_mm256_load_ps(s + f), e));
                    _mm256_store_ps(acc + f, _mm256_fmadd_ps(e, _mm256_maskload_ps(kv + f, mk),
                                                             _mm256_load_ps(acc + f)));
                }
            }
        for (csa_idx f = 0; f < fc; f += 8)
            _mm256_maskstore_ps(out + f0 + f, f == fv ? tail : full,
                                _mm256_div_ps(_mm256_load_ps(acc + f), _mm256_load_ps(s + f)));
#else
        for (csa_idx f = 0; f < fc; f++) {
            m[f] = -INFINITY;
            s[f] = 0.0f;
            acc[f] = 0.0f;
        }
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                const float *CSA_RESTRICT sc = c[k].sc + j * c[k].ssc + f0;
                const float *CSA_RESTRICT ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
                for (csa_idx f = 0; f < fc; f++) {
                    const float l = ap ? sc[f] + ap[f] : sc[f];
                    m[f] = l > m[f] ? l : m[f];
                }
            }
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                const float *CSA_RESTRICT sc = c[k].sc + j * c[k].ssc + f0;
                const float *CSA_RESTRICT kv = c[k].kv + j * c[k].skv + f0;
                const float *CSA_RESTRICT ap = c[k].ape ? c[k].ape + j * c[k].sape + f0 : NULL;
                for (csa_idx f = 0; f < fc; f++) {
                    const float l = ap ? sc[f] + ap[f] : sc[f];
                    const float e = expf(l - m[f]);
                    s[f] += e;
                    acc[f] += e * kv[f];
                }
            }
        for (csa_idx f = 0; f < fc; f++) out[f0 + f] = acc[f] / s[f];
#endif
    }
    return CSA_OK;
}

static int CSA_V(gated_pool_tuned)(const float *kv, csa_idx skb, csa_idx skt,
                                   const float *score, csa_idx ssb, csa_idx sst,
                                   const float *ape, csa_idx sar,
                                   csa_idx B, csa_idx T, csa_idx d, csa_idx r, int overlap,
                                   float *out, csa_idx sob, csa_idx sog)
{
    if (r <= 0 || B < 0 || T < 0 || d < 0) return CSA_EINVAL;
    const csa_idx G = T / r, items = B * G;
    if (r == 1 && !overlap) {
        const int nt = csa_threads(items, 1 + 16384 / (d + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx i = 0; i < items; i++)
            memcpy(out + (i / G) * sob + (i % G) * sog, kv + (i / G) * skb + (i % G) * skt,
                   (size_t)d * sizeof(float));
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
        const int nc = entry_cands(c, kv + b * skb, skt, 1, score + b * ssb, sst, 1, ape, sar, 1,
                                   d, r, overlap, g);
        CSA_V(pool_entry_tuned)(c, nc, d, out + b * sob + g * sog);
    }
    return CSA_OK;
}
