/* Tuned RoPE body: unit inner strides, half <= 4096.  Rows (i0, i1) are split
 * across threads; each pair's rotation is independent, so any split gives the same
 * bits.  bfloat16 rows are widened into a float32 scratch row, rotated by the same
 * code, and rounded back. */

#ifndef ROPE_PD
#define ROPE_PD 4   /* heads ahead of the one being rotated that are prefetched */
#endif

static inline void CSA_V(rotate_pairs)(float *CSA_RESTRICT v, const float *CSA_RESTRICT c,
                                       const float *CSA_RESTRICT sn, csa_idx half)
{
    csa_idx i0 = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    /* AVX2: 4 pairs a vector, rotated in place: v * (c c) + swap(v) * (-s s), the
     * pairs' two halves swapped in lanes instead of GCC's gathers of the strided
     * re / im (as re*c - im*s and re*s + im*c: one product rounded, then an fma) */
    const __m256 neg = _mm256_castsi256_ps(_mm256_set_epi32(0, (int)0x80000000u, 0, (int)0x80000000u,
                                                            0, (int)0x80000000u, 0, (int)0x80000000u));
    for (; i0 + 4 <= half; i0 += 4) {
        const __m128 c4 = _mm_loadu_ps(c + i0), s4 = _mm_loadu_ps(sn + i0);
        const __m256 cc = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
        const __m256 ss = _mm256_xor_ps(_mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4)), neg);
        const __m256 x = _mm256_loadu_ps(v + 2 * i0);
        const __m256 sw = _mm256_permute_ps(x, 0xb1);
        _mm256_storeu_ps(v + 2 * i0, _mm256_fmadd_ps(x, cc, _mm256_mul_ps(sw, ss)));
    }
#endif
#if defined(__FMA__)
    /* the AVX2 vectors' formula spelled out: which product the compiler would fuse
     * is its choice (GCC and clang chose differently at the AVX-512 level) */
    for (csa_idx i = i0; i < half; i++) {
        const float re = v[2 * i], im = v[2 * i + 1];
        v[2 * i] = fmaf(re, c[i], -(im * sn[i]));
        v[2 * i + 1] = fmaf(im, c[i], re * sn[i]);
    }
#else
    for (csa_idx i = i0; i < half; i++) {
        const float re = v[2 * i], im = v[2 * i + 1];
        v[2 * i] = re * c[i] - im * sn[i];
        v[2 * i + 1] = re * sn[i] + im * c[i];
    }
#endif
}

static int CSA_V(apply_rope_tuned)(void *x, int bf16, csa_idx n0, csa_idx n1, csa_idx n2,
                                   csa_idx half, csa_idx s0, csa_idx s1, csa_idx s2,
                                   const float *cos, csa_idx scr, const float *sin, csa_idx ssr,
                                   int inverse)
{
    const csa_idx rows = n0 * n1;
#ifdef CSA_MUTANT_ROPE_INVERSE /* planted (make mutants): the inverse rotation's sign dropped */
    const float sgn = 1.0f;
    (void)inverse;
#else
    const float sgn = inverse ? -1.0f : 1.0f;
#endif
    const int nt = csa_threads(rows, 1 + 2048 / (n2 * half + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const csa_idx i0 = r / n1, i1 = r % n1;
        const float *CSA_RESTRICT c = cos + i1 * scr;
        const float *CSA_RESTRICT s = sin + i1 * ssr;
        float sn[half > 0 ? half : 1], tmp[half > 0 ? 2 * half : 1];
#pragma omp simd
        for (csa_idx i = 0; i < half; i++) sn[i] = sgn * s[i];
        for (csa_idx h = 0; h < n2; h++) {
            const csa_idx off = i0 * s0 + i1 * s1 + h * s2;
            if (!bf16) {
                float *v = (float *)x + off;
                /* Rows sit a head stride apart, too far for the hardware prefetcher to
                 * follow: ask for the tail ROPE_PD heads ahead, into the next row's
                 * first heads at the end of a row (without that, every row started
                 * with ROPE_PD misses: 64 heads a row in the released shapes). */
                const float *pv = NULL;
                if (h + ROPE_PD < n2)
                    pv = v + ROPE_PD * s2;
                else if (r + 1 < rows && h + ROPE_PD - n2 < n2)
                    pv = (const float *)x + ((r + 1) / n1) * s0 + ((r + 1) % n1) * s1 +
                         (h + ROPE_PD - n2) * s2;
                if (pv)
                    for (csa_idx k = 0; k < 2 * half; k += 16) __builtin_prefetch(pv + k, 1);
                CSA_V(rotate_pairs)(v, c, sn, half);
            } else {
                csa_bf16 *CSA_RESTRICT v = (csa_bf16 *)x + off;
#pragma omp simd
                for (csa_idx k = 0; k < 2 * half; k++) tmp[k] = csa_bf16_to_f32(v[k]);
                CSA_V(rotate_pairs)(tmp, c, sn, half);
#pragma omp simd
                for (csa_idx k = 0; k < 2 * half; k++) v[k] = csa_f32_to_bf16(tmp[k]);
            }
        }
    }
    return CSA_OK;
}
