/* Tuned QAT rounding and Hadamard bodies, compiled once per ISA level by
 * csa_isa_variants.h.  Unit inner strides; rows are split across threads and every
 * row (every block) is computed by the same operations in the same order as the
 * scalar oracle in quant.c, so the bits never depend on the level or thread count. */

#include "bf16_impl.h"

/* One block of `block` contiguous features: amax as the largest |x| bit pattern
 * (integer max: NaN patterns sort above inf, so a NaN wins, as torch's amax does),
 * then scale, divide (multiply by the exact inverse for power-of-two scales),
 * clamp, round onto the grid, multiply back.  `fmt` is a compile-time constant at
 * each call, so the grid constants fold. */
static inline __attribute__((always_inline)) void CSA_V(quant_block)(
    const float *xb, float *yb, csa_idx block, const int fmt, int scale)
{
    const float qmax = fmt == CSA_Q_E4M3 ? 448.0f : 6.0f;
    const uint32_t emin = fmt == CSA_Q_E4M3 ? Q_E4M3_EMIN : Q_E2M1_EMIN;
    const uint32_t cshift = fmt == CSA_Q_E4M3 ? Q_E4M3_CSHIFT : Q_E2M1_CSHIFT;
    const float s = q_scale(q_block_amax(xb, block), fmt, scale);
    if (scale == CSA_QS_UE8M0) {
        /* s = 2^k with |k| <= 126, or inf/NaN: x * (1/s) is x / s bit for bit. */
        const float inv = 1.0f / s;
#pragma omp simd
        for (csa_idx i = 0; i < block; i++) {
            float v = xb[i] * inv;
            v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
            yb[i] = q_round_grid(v, emin, cshift) * s;
        }
    } else {
#pragma omp simd
        for (csa_idx i = 0; i < block; i++) {
            float v = xb[i] / s;
            v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
            yb[i] = q_round_grid(v, emin, cshift) * s;
        }
    }
}

#ifdef __AVX512F__
/* The same block for block % 16 == 0 in AVX-512 registers (the compiler's version of
 * the loops above pays a loop setup and a scalar tail per block, which at blocks of
 * 16 or 32 costs more than the arithmetic).  Same operations, same bits. */
static inline __m512 CSA_V(round_grid16)(__m512 v, __m512i emin, __m512i cshift)
{
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    const __m512i b = _mm512_castps_si512(v);
    const __m512i e = _mm512_max_epu32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f800000)), emin);
    const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, cshift));
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(b, absm));
    const __m512 r = _mm512_sub_ps(_mm512_add_ps(a, c), c);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(r), _mm512_andnot_si512(absm, b)));
}

/* 16 bfloat16 <-> 16 floats in memory (bf16_impl.h). */
static inline __m512 CSA_V(q_ld16h)(const csa_bf16 *p)
{
    return CSA_V(bf16_widen16)(_mm256_loadu_si256((const __m256i *)p));
}

static inline void CSA_V(q_st16h)(csa_bf16 *p, __m512 v)
{
    _mm256_storeu_si256((__m256i *)p, CSA_V(bf16_narrow16)(v));
}

/* 16 values at element i of a float32 (bf = 0) or bfloat16 (bf = 1) row. */
static inline __attribute__((always_inline)) __m512 CSA_V(q_ld16)(const void *p, csa_idx i,
                                                                  const int bf)
{
    return bf ? CSA_V(q_ld16h)((const csa_bf16 *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) void CSA_V(q_st16)(void *p, csa_idx i, __m512 v,
                                                                const int bf)
{
    if (bf)
        CSA_V(q_st16h)((csa_bf16 *)p + i, v);
    else
        _mm512_storeu_ps((float *)p + i, v);
}

/* The block kernel on float32 or (bf) bfloat16 rows: the bf16 values are widened in
 * registers and the float32 results narrowed on store, the arithmetic unchanged. */
static inline __attribute__((always_inline)) void CSA_V(quant_block16)(
    const void *xb, void *yb, csa_idx block, const int fmt, int scale, const int bf)
{
    const __m512 qmax = _mm512_set1_ps(fmt == CSA_Q_E4M3 ? 448.0f : 6.0f);
    const __m512 nqmax = _mm512_set1_ps(fmt == CSA_Q_E4M3 ? -448.0f : -6.0f);
    const __m512i emin = _mm512_set1_epi32((int)(fmt == CSA_Q_E4M3 ? Q_E4M3_EMIN : Q_E2M1_EMIN));
    const __m512i cshift =
        _mm512_set1_epi32((int)(fmt == CSA_Q_E4M3 ? Q_E4M3_CSHIFT : Q_E2M1_CSHIFT));
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    __m512i m = _mm512_setzero_si512();
    for (csa_idx i = 0; i < block; i += 16)
        m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(CSA_V(q_ld16)(xb, i, bf)),
                                                 absm));
    const float s = q_scale(q_float(_mm512_reduce_max_epu32(m)), fmt, scale);
    const __m512 sv = _mm512_set1_ps(s);
    const int pow2 = scale == CSA_QS_UE8M0;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    for (csa_idx i = 0; i < block; i += 16) {
        const __m512 xv = CSA_V(q_ld16)(xb, i, bf);
        __m512 v = pow2 ? _mm512_mul_ps(xv, inv) : _mm512_div_ps(xv, sv);
        /* min/max return their SECOND operand when one is NaN: NaN passes. */
        v = _mm512_max_ps(nqmax, _mm512_min_ps(qmax, v));
        CSA_V(q_st16)(yb, i, _mm512_mul_ps(CSA_V(round_grid16)(v, emin, cshift), sv), bf);
    }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The AVX2 counterpart for block % 8 == 0: same operations, same bits. */
static inline __m256 CSA_V(round_grid8)(__m256 v, __m256i emin, __m256i cshift)
{
    const __m256i absm = _mm256_set1_epi32(0x7fffffff);
    const __m256i b = _mm256_castps_si256(v);
    const __m256i e = _mm256_max_epu32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f800000)), emin);
    const __m256 c = _mm256_castsi256_ps(_mm256_add_epi32(e, cshift));
    const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(b, absm));
    const __m256 r = _mm256_sub_ps(_mm256_add_ps(a, c), c);
    return _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_castps_si256(r), _mm256_andnot_si256(absm, b)));
}

static inline __attribute__((always_inline)) void CSA_V(quant_block8)(
    const float *xb, float *yb, csa_idx block, const int fmt, int scale)
{
    const __m256 qmax = _mm256_set1_ps(fmt == CSA_Q_E4M3 ? 448.0f : 6.0f);
    const __m256 nqmax = _mm256_set1_ps(fmt == CSA_Q_E4M3 ? -448.0f : -6.0f);
    const __m256i emin = _mm256_set1_epi32((int)(fmt == CSA_Q_E4M3 ? Q_E4M3_EMIN : Q_E2M1_EMIN));
    const __m256i cshift =
        _mm256_set1_epi32((int)(fmt == CSA_Q_E4M3 ? Q_E4M3_CSHIFT : Q_E2M1_CSHIFT));
    const __m256i absm = _mm256_set1_epi32(0x7fffffff);
    __m256i m = _mm256_setzero_si256();
    for (csa_idx i = 0; i < block; i += 8)
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(xb + i)),
                                                 absm));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
    const float s = q_scale(q_float((uint32_t)_mm_cvtsi128_si32(m4)), fmt, scale);
    const __m256 sv = _mm256_set1_ps(s);
    const int pow2 = scale == CSA_QS_UE8M0;
    const __m256 inv = _mm256_set1_ps(1.0f / s);
    for (csa_idx i = 0; i < block; i += 8) {
        const __m256 xv = _mm256_loadu_ps(xb + i);
        __m256 v = pow2 ? _mm256_mul_ps(xv, inv) : _mm256_div_ps(xv, sv);
        v = _mm256_max_ps(nqmax, _mm256_min_ps(qmax, v));  /* NaN passes (second operand) */
        _mm256_storeu_ps(yb + i, _mm256_mul_ps(CSA_V(round_grid8)(v, emin, cshift), sv));
    }
}
#endif

/* One row of d features in blocks: the widest block kernel this level has. */
static inline __attribute__((always_inline)) void CSA_V(quant_row)(
    const float *xr, float *yr, csa_idx d, csa_idx block, int fmt, int scale)
{
#ifdef __AVX512F__
    if (block % 16 == 0) {
        if (fmt == CSA_Q_E4M3)
            for (csa_idx b0 = 0; b0 < d; b0 += block)
                CSA_V(quant_block16)(xr + b0, yr + b0, block, CSA_Q_E4M3, scale, 0);
        else
            for (csa_idx b0 = 0; b0 < d; b0 += block)
                CSA_V(quant_block16)(xr + b0, yr + b0, block, CSA_Q_E2M1, scale, 0);
        return;
    }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (block % 8 == 0) {
        if (fmt == CSA_Q_E4M3)
            for (csa_idx b0 = 0; b0 < d; b0 += block)
                CSA_V(quant_block8)(xr + b0, yr + b0, block, CSA_Q_E4M3, scale);
        else
            for (csa_idx b0 = 0; b0 < d; b0 += block)
                CSA_V(quant_block8)(xr + b0, yr + b0, block, CSA_Q_E2M1, scale);
        return;
    }
#endif
    if (fmt == CSA_Q_E4M3)
        for (csa_idx b0 = 0; b0 < d; b0 += block)
            CSA_V(quant_block)(xr + b0, yr + b0, block, CSA_Q_E4M3, scale);
    else
        for (csa_idx b0 = 0; b0 < d; b0 += block)
            CSA_V(quant_block)(xr + b0, yr + b0, block, CSA_Q_E2M1, scale);
}

static int CSA_V(quant_round_tuned)(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                                    csa_idx block, int fmt, int scale, float *out,
                                    csa_idx so_row)
{
    const int nt = csa_threads(rows, 1 + 16384 / (d > 0 ? d : 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        CSA_V(quant_row)(x + r * sx_row, out + r * so_row, d, block, fmt, scale);
#ifdef CSA_MUTANT_QUANT_SKIP /* planted (make mutants): a row's last block left unrounded */
        if (d >= block)
            memmove(out + r * so_row + d - block, x + r * sx_row + d - block,
                    (size_t)block * sizeof(float));
#endif
    }
    return CSA_OK;
}

/* bfloat16 rows for the bf16 entry points: widening is a 16-bit shift (exact),
 * narrowing rounds nearest-even once, NaN kept quiet (csa_f32_to_bf16). */
static inline void CSA_V(q_widen)(float *CSA_RESTRICT dst, const csa_bf16 *CSA_RESTRICT src,
                                  csa_idx n)
{
    csa_idx i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, CSA_V(q_ld16h)(src + i));
#endif
#pragma omp simd
    for (csa_idx j = i; j < n; j++) dst[j] = csa_bf16_to_f32(src[j]);
}

static inline void CSA_V(q_narrow)(csa_bf16 *CSA_RESTRICT dst, const float *CSA_RESTRICT src,
                                   csa_idx n)
{
    csa_idx i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) CSA_V(q_st16h)(dst + i, _mm512_loadu_ps(src + i));
#endif
    for (csa_idx j = i; j < n; j++) dst[j] = csa_f32_to_bf16(src[j]);
}

/* bfloat16 rows through the float32 row kernel, Q_BF16_CHUNK features of whole blocks
 * at a time widened into an L1-resident buffer, rounded in place there and narrowed
 * on the way out: memory sees only the 16-bit rows. */
static int CSA_V(quant_round_bf16_tuned)(const csa_bf16 *x, csa_idx rows, csa_idx d,
                                         csa_idx sx_row, csa_idx block, int fmt, int scale,
                                         csa_bf16 *out, csa_idx so_row)
{
    const int nt = csa_threads(rows, 1 + 16384 / (d > 0 ? d : 1));
    const csa_idx chunk = Q_BF16_CHUNK / block * block;   /* block <= Q_BF16_CHUNK */
#ifdef __AVX512F__
    if (block % 16 == 0) {   /* widened and narrowed in registers, no buffer */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx r = 0; r < rows; r++) {
            const csa_bf16 *xr = x + r * sx_row;
            csa_bf16 *yr = out + r * so_row;
            if (fmt == CSA_Q_E4M3)
                for (csa_idx b0 = 0; b0 < d; b0 += block)
                    CSA_V(quant_block16)(xr + b0, yr + b0, block, CSA_Q_E4M3, scale, 1);
            else
                for (csa_idx b0 = 0; b0 < d; b0 += block)
                    CSA_V(quant_block16)(xr + b0, yr + b0, block, CSA_Q_E2M1, scale, 1);
        }
        return CSA_OK;
    }
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        float buf[Q_BF16_CHUNK] __attribute__((aligned(64)));
        for (csa_idx c0 = 0; c0 < d; c0 += chunk) {
            const csa_idx n = d - c0 < chunk ? d - c0 : chunk;
            CSA_V(q_widen)(buf, x + r * sx_row + c0, n);
            CSA_V(quant_row)(buf, buf, n, block, fmt, scale);
            CSA_V(q_narrow)(out + r * so_row + c0, buf, n);
        }
    }
    return CSA_OK;
}

/* Portable row transform: the oracle's stages in the same order.  Stages h = 1 and 2
 * run fused per group of 4 (the same additions, written so the compiler can pack
 * them), the others as contiguous loops that vectorize. */
static void CSA_V(fwht_row)(float *v, csa_idx n, float scale)
{
    csa_idx h = 1;
    if (n >= 4) {
        for (csa_idx i = 0; i < n; i += 4) {
            const float b0 = v[i] + v[i + 1], b1 = v[i] - v[i + 1];
            const float b2 = v[i + 2] + v[i + 3], b3 = v[i + 2] - v[i + 3];
            v[i] = b0 + b2;
            v[i + 1] = b1 + b3;
            v[i + 2] = b0 - b2;
            v[i + 3] = b1 - b3;
        }
        h = 4;
    }
    for (; h < n; h *= 2)
        for (csa_idx i = 0; i < n; i += 2 * h)
#pragma omp simd
            for (csa_idx j = i; j < i + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
#pragma omp simd
    for (csa_idx j = 0; j < n; j++) v[j] *= scale;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2: stages 1, 2, 4 inside one 8-float vector (as fwht16 below), then whole-vector
 * stages over the row in out (in cache), the last one followed by the scale. */
static inline __m256 CSA_V(fwht8)(__m256 v)
{
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));
    v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));
    return v;
}

static void CSA_V(fwht_row8)(const float *xr, float *yr, csa_idx n, float scale)
{
    for (csa_idx j = 0; j < n; j += 8)
        _mm256_storeu_ps(yr + j, CSA_V(fwht8)(_mm256_loadu_ps(xr + j)));
    for (csa_idx h = 8; h < n; h *= 2)
        for (csa_idx i = 0; i < n; i += 2 * h)
            for (csa_idx j = i; j < i + h; j += 8) {
                const __m256 a = _mm256_loadu_ps(yr + j), b = _mm256_loadu_ps(yr + j + h);
                _mm256_storeu_ps(yr + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(yr + j + h, _mm256_sub_ps(a, b));
            }
    const __m256 sc = _mm256_set1_ps(scale);
    for (csa_idx j = 0; j < n; j += 8)
        _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_loadu_ps(yr + j), sc));
}
#endif

#ifdef __AVX512F__
/* Butterfly stage h < 16 inside one 16-float vector: lanes with (lane & h) == 0 get
 * own + partner, the others partner - own (= a - b of the pair); own * (+-1) is exact,
 * so the fused multiply-add rounds exactly like the scalar a + b and a - b. */
static inline __m512 CSA_V(fwht16)(__m512 v)
{
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));
    return v;
}

/* A row of n = 16 * nv floats (nv <= 16) kept in vectors: stages 1..8 in-register,
 * then whole-vector stages, the last one fused with the scale. */
static inline __attribute__((always_inline)) void CSA_V(fwht_row_vec)(
    const void *xr, void *yr, csa_idx n, float scale, const int stream, const int bf)
{
    const csa_idx nv = n / 16;
    __m512 v[16];
    for (csa_idx k = 0; k < nv; k++) v[k] = CSA_V(fwht16)(CSA_V(q_ld16)(xr, 16 * k, bf));
    for (csa_idx hv = 1; hv < nv; hv *= 2)
        for (csa_idx i = 0; i < nv; i += 2 * hv)
            for (csa_idx k = i; k < i + hv; k++) {
                const __m512 a = v[k], b = v[k + hv];
                v[k] = _mm512_add_ps(a, b);
                v[k + hv] = _mm512_sub_ps(a, b);
            }
    const __m512 sc = _mm512_set1_ps(scale);
    if (stream && !bf)
        for (csa_idx k = 0; k < nv; k++)
            _mm512_stream_ps((float *)yr + 16 * k, _mm512_mul_ps(v[k], sc));
    else
        for (csa_idx k = 0; k < nv; k++) CSA_V(q_st16)(yr, 16 * k, _mm512_mul_ps(v[k], sc), bf);
}

/* Longer rows: in-register stages per vector into out, then the whole-vector
 * stages over out (in cache), then the scale. */
static inline void CSA_V(fwht_row_long)(const float *xr, float *yr, csa_idx n, float scale)
{
    for (csa_idx j = 0; j < n; j += 16)
        _mm512_storeu_ps(yr + j, CSA_V(fwht16)(_mm512_loadu_ps(xr + j)));
    for (csa_idx h = 16; h < n; h *= 2)
        for (csa_idx i = 0; i < n; i += 2 * h)
            for (csa_idx j = i; j < i + h; j += 16) {
                const __m512 a = _mm512_loadu_ps(yr + j), b = _mm512_loadu_ps(yr + j + h);
                _mm512_storeu_ps(yr + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(yr + j + h, _mm512_sub_ps(a, b));
            }
    const __m512 sc = _mm512_set1_ps(scale);
    for (csa_idx j = 0; j < n; j += 16)
        _mm512_storeu_ps(yr + j, _mm512_mul_ps(_mm512_loadu_ps(yr + j), sc));
}
#endif

/* One row at this level's widest transform; `stream`: non-temporal stores. */
static inline __attribute__((always_inline)) void CSA_V(hadamard_row)(
    const float *xr, float *yr, csa_idx n, float scale, int stream)
{
#ifdef __AVX512F__
    if (n >= 16 && n <= 256) {
        if (stream)
            CSA_V(fwht_row_vec)(xr, yr, n, scale, 1, 0);
        else
            CSA_V(fwht_row_vec)(xr, yr, n, scale, 0, 0);
        return;
    }
    if (n > 256) {
        CSA_V(fwht_row_long)(xr, yr, n, scale);
        return;
    }
#else
    (void)stream;
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (n >= 8) {
        CSA_V(fwht_row8)(xr, yr, n, scale);
        return;
    }
#endif
    if (yr != xr) memcpy(yr, xr, (size_t)n * sizeof *yr);
    CSA_V(fwht_row)(yr, n, scale);
}

static int CSA_V(hadamard_tuned)(const float *x, csa_idx rows, csa_idx n, csa_idx sx_row,
                                 float scale, float *out, csa_idx so_row)
{
#ifdef CSA_MUTANT_HADAMARD_SCALE /* planted (make mutants): the scale off by a relative 1e-4 */
    scale *= 1.0f + 1e-4f;
#endif
    const int nt = csa_threads(rows, 1 + 8192 / n);
    int stream = 0;
#ifdef __AVX512F__
    /* A large out-of-place result goes around the caches with streaming stores (no
     * read-for-ownership of the destination lines): rows must start 64-byte aligned. */
    stream = out != x && (csa_idx)rows * n >= ((csa_idx)1 << 21) &&
             ((uintptr_t)out & 63) == 0 && (so_row * 4) % 64 == 0;
#endif
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (csa_idx r = 0; r < rows; r++)
            CSA_V(hadamard_row)(x + r * sx_row, out + r * so_row, n, scale, stream);
#ifdef __AVX512F__
        if (stream) _mm_sfence();  /* streamed lines visible before the region ends */
#endif
    }
    return CSA_OK;
}

/* bfloat16 rows (n <= Q_BF16_CHUNK): widened into an L1-resident buffer, transformed
 * there by the float32 row kernel, narrowed on the way out. */
static int CSA_V(hadamard_bf16_tuned)(const csa_bf16 *x, csa_idx rows, csa_idx n,
                                      csa_idx sx_row, float scale, csa_bf16 *out,
                                      csa_idx so_row)
{
    const int nt = csa_threads(rows, 1 + 8192 / n);
#ifdef __AVX512F__
    if (n >= 16 && n <= 256) {   /* the row lives in registers: widen / narrow there */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx r = 0; r < rows; r++)
            CSA_V(fwht_row_vec)(x + r * sx_row, out + r * so_row, n, scale, 0, 1);
        return CSA_OK;
    }
#endif
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        float buf[Q_BF16_CHUNK] __attribute__((aligned(64)));
        CSA_V(q_widen)(buf, x + r * sx_row, n);
        CSA_V(hadamard_row)(buf, buf, n, scale, 0);
        CSA_V(q_narrow)(out + r * so_row, buf, n);
    }
    return CSA_OK;
}
