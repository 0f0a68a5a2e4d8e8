/* bfloat16 <-> float32 in vector registers, one copy per ISA level: included inside
 * a kernel's *_impl.h (as vexp_impl.h is), so every variant gets its own CSA_V names.
 * Include it once per *_impl.h.
 *
 * Widening is a 16-bit shift: exact.  Narrowing is csa_f32_to_bf16 (csa.h), the one
 * float32 -> bfloat16 rule of the project: nearest-even, and a NaN keeps its sign and
 * top payload bits with the quiet bit set (never a canonical NaN). */
#ifdef __AVX512F__
/* 16 bfloat16 (in a 256-bit register) -> 16 floats. */
static inline __attribute__((always_inline)) __m512 CSA_V(bf16_widen16)(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 floats -> 16 bfloat16 (in a 256-bit register), as csa_f32_to_bf16. */
static inline __attribute__((always_inline)) __m256i CSA_V(bf16_narrow16)(__m512 v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(hi, _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 bfloat16 (in a 128-bit register) -> 8 floats. */
static inline __attribute__((always_inline)) __m256 CSA_V(bf16_widen8)(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
