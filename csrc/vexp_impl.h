/* Vector e^x for x <= 0 or NaN (x = logit - running max): the softmax of gated
 * pooling and of sparse attention is all exp, and GCC does not vectorize expf
 * without -ffast-math.  Included inside a kernel's *_impl.h, so every ISA variant
 * gets its own copy (CSA_V names); the baseline variant defines nothing and its
 * callers use expf. */
#ifdef __AVX512F__
/* exp(x) for x <= 0 or NaN (x = l - max): the profile is all exp, and GCC does not
 * vectorize expf without -ffast-math.  Cephes' degree-6 polynomial on
 * x - n ln2, |x - n ln2| <= ln2/2, then vscalefps by 2^n: ~1 ulp, exact 0 below
 * the float range, NaN in -> NaN out (the max below keeps x when x is NaN). */
static inline __m512 CSA_V(exp512_neg)(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    const __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same exp on 8 lanes; without vscalefps, 2^n is built from its exponent bits,
 * so results below FLT_MIN (x < -87) are 0 instead of subnormal: relative to the
 * sum of the weights (>= 1) that is below 1e-38. */
static inline __m256 CSA_V(exp256_neg)(__m256 x)
{
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);          /* NaN stays x */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    const __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
    const __m256i k = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(k)));
}
#endif
