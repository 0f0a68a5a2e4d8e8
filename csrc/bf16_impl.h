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

/* 8 floats, none of them NaN -> their bfloat16 bits in the low half of each 32-bit
 * lane, rounded to nearest-even (bf16_round8 without its NaN test). */
static inline __attribute__((always_inline)) __m256i CSA_V(bf16_round8_finite)(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
}

/* 8 floats -> their bfloat16 bits in the low half of each 32-bit lane, rounded as
 * csa_f32_to_bf16 (nearest-even: u + 0x7fff + bit 16 of u; a NaN keeps its sign and top
 * payload with the quiet bit set).  The NaN blend runs only when the vector holds a NaN. */
static inline __attribute__((always_inline)) __m256i CSA_V(bf16_round8)(__m256 v)
{
    __m256i r = CSA_V(bf16_round8_finite)(v);
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0))
        r = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(r),
            _mm256_castsi256_ps(_mm256_or_si256(hi, _mm256_set1_epi32(0x40))), nan));
    return r;
}

/* 8 bfloat16 bits in the low halves of 32-bit lanes -> 8 packed bfloat16. */
static inline __attribute__((always_inline)) __m128i CSA_V(bf16_pack8)(__m256i r)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Two vectors of bfloat16 bits in the low halves of 32-bit lanes (ra: elements 0..7,
 * rb: 8..15) -> 16 packed bfloat16. */
static inline __attribute__((always_inline)) __m256i CSA_V(bf16_pack8x2)(__m256i ra, __m256i rb)
{
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xd8);
}

/* 16 floats (a: elements 0..7, b: 8..15) -> 16 bfloat16, as csa_f32_to_bf16. */
static inline __attribute__((always_inline)) __m256i CSA_V(bf16_narrow8x2)(__m256 a, __m256 b)
{
    return CSA_V(bf16_pack8x2)(CSA_V(bf16_round8)(a), CSA_V(bf16_round8)(b));
}
#endif
