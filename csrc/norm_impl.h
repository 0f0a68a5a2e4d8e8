/* Tuned RMSNorm body, compiled once per ISA level by csa_isa_variants.h.
 * Unit inner strides; one row per loop iteration so a row's sum never depends on
 * the thread count. */

#include "bf16_impl.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 rows: the sum of squares in four 8-lane chains (element i goes to lane i % 32;
 * the chains, then the lanes, are added in a fixed order, so a row's bits depend on d
 * alone), and bfloat16 widened / narrowed in integer lanes, 16 at a time.  Measured
 * on AMD EPYC (Zen 3), 1 thread: the generic loop's bf16 rows ran at 40% of its
 * float32 GB/s, its csa_f32_to_bf16 NaN branch kept scalar. */
static inline float CSA_V(norm_hsum4)(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

static inline __m256 CSA_V(norm_widen8)(const csa_bf16 *p)
{
    return CSA_V(bf16_widen8)(_mm_loadu_si128((const __m128i *)p));
}

/* 16 floats (a, b) -> 16 bfloat16 at p. */
static inline void CSA_V(norm_narrow16)(__m256 a, __m256 b, csa_bf16 *p)
{
    _mm256_storeu_si256((__m256i *)p, CSA_V(bf16_narrow8x2)(a, b));
}

static float CSA_V(norm_ss_f32)(const float *xr, csa_idx d)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    csa_idx i = 0;
    for (; i + 32 <= d; i += 32) {
        const __m256 x0 = _mm256_loadu_ps(xr + i), x1 = _mm256_loadu_ps(xr + i + 8);
        const __m256 x2 = _mm256_loadu_ps(xr + i + 16), x3 = _mm256_loadu_ps(xr + i + 24);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
        a2 = _mm256_fmadd_ps(x2, x2, a2);
        a3 = _mm256_fmadd_ps(x3, x3, a3);
    }
    float ss = CSA_V(norm_hsum4)(a0, a1, a2, a3);
    for (; i < d; i++) ss += xr[i] * xr[i];
    return ss;
}

/* Output rows of a call whose output is at least NORM_NT_BYTES (an L3 cache) go
 * around the caches (non-temporal stores on the whole 64-byte lines of each row): a
 * row the caller reads next is not in cache anyway at that size, and a store that
 * misses first reads its line (the output's bytes crossed the memory bus twice).
 * Measured on AMD EPYC (Zen 3, 32 MiB L3), 1 thread, interleaved: [4096, 4096]
 * float32 1.55x; at [8192, 512] (16 MiB out) 0.94x for float32 and 0.74x for
 * bfloat16 with an 8 MiB threshold (inputs and outputs that fit L3 stay there from
 * call to call otherwise), hence 32 MiB.  Same values, other instructions: the bits do
 * not change. */
#ifndef NORM_NT_BYTES
#define NORM_NT_BYTES (32 << 20)
#endif

/* y[i] = x[i] * inv (* w[i]) for a float32 row, streamed past the caches. */
static void CSA_V(norm_out_f32_nt)(const float *CSA_RESTRICT xr, const float *CSA_RESTRICT w,
                                   float inv, float *CSA_RESTRICT yr, csa_idx d)
{
    csa_idx i = 0;
    for (; i < d && ((uintptr_t)(yr + i) & 63); i++) yr[i] = w ? xr[i] * inv * w[i] : xr[i] * inv;
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 16 <= d; i += 16) {   /* whole lines only: a partial one is flushed slowly */
        __m256 y0 = _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv);
        __m256 y1 = _mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), iv);
        if (w) {
            y0 = _mm256_mul_ps(y0, _mm256_loadu_ps(w + i));
            y1 = _mm256_mul_ps(y1, _mm256_loadu_ps(w + i + 8));
        }
        _mm256_stream_ps(yr + i, y0);
        _mm256_stream_ps(yr + i + 8, y1);
    }
    for (; i < d; i++) yr[i] = w ? xr[i] * inv * w[i] : xr[i] * inv;
}

static float CSA_V(norm_ss_bf16)(const csa_bf16 *xr, csa_idx d)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    csa_idx i = 0;
    for (; i + 32 <= d; i += 32) {
        const __m256 x0 = CSA_V(norm_widen8)(xr + i), x1 = CSA_V(norm_widen8)(xr + i + 8);
        const __m256 x2 = CSA_V(norm_widen8)(xr + i + 16), x3 = CSA_V(norm_widen8)(xr + i + 24);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
        a2 = _mm256_fmadd_ps(x2, x2, a2);
        a3 = _mm256_fmadd_ps(x3, x3, a3);
    }
    float ss = CSA_V(norm_hsum4)(a0, a1, a2, a3);
    for (; i < d; i++) {
        const float v = csa_bf16_to_f32(xr[i]);
        ss += v * v;
    }
    return ss;
}
#endif

#if !(defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__))
/* The other levels' sum of squares: one vector chain of NORM_VL lanes (element i in
 * lane i % NORM_VL, FMAs where the level has them), lanes added by halving, then the
 * tail in order.  Written out rather than left to `omp simd reduction`, whose lane
 * count and number of chains are the compiler's choice: GCC and clang chose
 * differently, and the bits of the two builds differed. */
#if defined(__AVX512F__)
#define NORM_VL 16
#else
#define NORM_VL 4
#endif
typedef float CSA_V(norm_vf) __attribute__((vector_size(NORM_VL * 4)));
typedef float CSA_V(norm_vfu) __attribute__((vector_size(NORM_VL * 4), aligned(4)));

static inline float CSA_V(norm_ss_vec)(const float *CSA_RESTRICT x, csa_idx d)
{
    CSA_V(norm_vf) acc = {0};
    csa_idx i = 0;
    for (; i + NORM_VL <= d; i += NORM_VL) {
        const CSA_V(norm_vf) v = *(const CSA_V(norm_vfu) *)(x + i);
        acc += v * v;
    }
    for (int w = NORM_VL / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float ss = acc[0];
    for (; i < d; i++) ss += x[i] * x[i];
    return ss;
}
#undef NORM_VL
#endif

static int CSA_V(rms_norm_tuned)(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                                 const float *w, float eps, float *out, csa_idx so_row)
{
    const int nt = csa_threads(rows, 4096 / (d > 0 ? d : 1) + 1);
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    const int nts = (double)rows * (double)d * sizeof(float) >= NORM_NT_BYTES;
#endif
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const float *CSA_RESTRICT xr = x + r * sx_row;
        float *CSA_RESTRICT yr = out + r * so_row;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        const float ss = CSA_V(norm_ss_f32)(xr, d);
#else
        const float ss = CSA_V(norm_ss_vec)(xr, d);
#endif
#ifdef CSA_MUTANT_NORM_MEAN /* planted (make mutants): the mean square over d + 1 */
        const float inv = 1.0f / sqrtf(ss / (float)(d + 1) + eps);
#else
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        if (nts) {
            CSA_V(norm_out_f32_nt)(xr, w, inv, yr, d);
            continue;
        }
#endif
        if (w) {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
        } else {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++) yr[i] = xr[i] * inv;
        }
    }
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (nts) _mm_sfence();   /* each thread's streamed stores are visible at the barrier */
#endif
    }
    return CSA_OK;
}

static int CSA_V(rms_norm_bf16_tuned)(const csa_bf16 *x, csa_idx rows, csa_idx d,
                                      csa_idx sx_row, const float *w, float eps,
                                      csa_bf16 *out, csa_idx so_row)
{
    const int nt = csa_threads(rows, 4096 / (d > 0 ? d : 1) + 1);
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    const int nts = (double)rows * (double)d * sizeof(csa_bf16) >= NORM_NT_BYTES;
#endif
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const csa_bf16 *CSA_RESTRICT xr = x + r * sx_row;
        csa_bf16 *CSA_RESTRICT yr = out + r * so_row;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        const float ss = CSA_V(norm_ss_bf16)(xr, d);
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        const __m256 iv = _mm256_set1_ps(inv);
        csa_idx i0 = 0;
        if (nts) {   /* the streamed body: the row's whole 64-byte lines */
            for (; i0 < d && ((uintptr_t)(yr + i0) & 63); i0++) {
                const float y = csa_bf16_to_f32(xr[i0]) * inv;
                yr[i0] = csa_f32_to_bf16(w ? y * w[i0] : y);
            }
            for (; i0 + 32 <= d; i0 += 32)
                for (int h = 0; h < 32; h += 16) {
                    __m256 y0 = _mm256_mul_ps(CSA_V(norm_widen8)(xr + i0 + h), iv);
                    __m256 y1 = _mm256_mul_ps(CSA_V(norm_widen8)(xr + i0 + h + 8), iv);
                    if (w) {
                        y0 = _mm256_mul_ps(y0, _mm256_loadu_ps(w + i0 + h));
                        y1 = _mm256_mul_ps(y1, _mm256_loadu_ps(w + i0 + h + 8));
                    }
                    _mm256_stream_si256((__m256i *)(yr + i0 + h), CSA_V(bf16_narrow8x2)(y0, y1));
                }
        }
        for (; i0 + 16 <= d; i0 += 16) {
            __m256 y0 = _mm256_mul_ps(CSA_V(norm_widen8)(xr + i0), iv);
            __m256 y1 = _mm256_mul_ps(CSA_V(norm_widen8)(xr + i0 + 8), iv);
            if (w) {
                y0 = _mm256_mul_ps(y0, _mm256_loadu_ps(w + i0));
                y1 = _mm256_mul_ps(y1, _mm256_loadu_ps(w + i0 + 8));
            }
            CSA_V(norm_narrow16)(y0, y1, yr + i0);
        }
        for (csa_idx i = i0; i < d; i++) {
            const float y = csa_bf16_to_f32(xr[i]) * inv;
            yr[i] = csa_f32_to_bf16(w ? y * w[i] : y);
        }
#else
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (csa_idx i = 0; i < d; i++) {
            const float v = csa_bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (csa_idx i = 0; i < d; i++) {
            const float y = csa_bf16_to_f32(xr[i]) * inv;
            yr[i] = csa_f32_to_bf16(w ? y * w[i] : y);
        }
#endif
    }
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (nts) _mm_sfence();   /* each thread's streamed stores are visible at the barrier */
#endif
    }
    return CSA_OK;
}

/* ---------------------------------------------------------------- backward (tuned)
 * csa_rms_norm_backward (norm.h): one parallel item per block of CSA_NORM_GRAD_ROWS
 * rows (d(x) of its rows, and its partial of d(w) summed over its rows in order), then
 * the partials summed in block order, parallel over feature chunks.  The blocks are
 * fixed by the row count alone, so the bits do not depend on the thread count. */
/* The row sums of the backward as one explicit vector chain of NB_VL lanes (element i in
 * lane i % NB_VL), the lanes added by halving, then the tail in order: the order is
 * written out, not left to `omp simd reduction` (whose lanes and chains are each
 * compiler's choice), so the bits are the same for float32 and bfloat16 inputs of the
 * same values and for any compiler with the same FMA contraction (-ffp-contract=fast). */
#if defined(__AVX512F__)
#define NB_VL 16
#elif defined(__AVX2__)
#define NB_VL 8
#else
#define NB_VL 4
#endif
typedef float CSA_V(nb_vf) __attribute__((vector_size(NB_VL * 4)));

/* sum_i a_i * (w_i) * b_i (w NULL: 1); a, b float32 or bfloat16 (abf, bbf). */
static inline __attribute__((always_inline)) float CSA_V(nb_dot)(
    const void *a, const int abf, const float *CSA_RESTRICT w, const void *b, const int bbf,
    csa_idx d)
{
    CSA_V(nb_vf) acc = {0};
    csa_idx i = 0;
    for (; i + NB_VL <= d; i += NB_VL) {
        CSA_V(nb_vf) va = {0}, vb = {0};
        for (int l = 0; l < NB_VL; l++) {
            va[l] = w ? norm_ld(a, abf, i + l) * w[i + l] : norm_ld(a, abf, i + l);
            vb[l] = norm_ld(b, bbf, i + l);
        }
        acc += va * vb;
    }
    for (int h = NB_VL / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) acc[l] += acc[l + h];
    float r = acc[0];
    for (; i < d; i++) {
        const float va = w ? norm_ld(a, abf, i) * w[i] : norm_ld(a, abf, i);
        r += va * norm_ld(b, bbf, i);
    }
    return r;
}
#undef NB_VL

/* dx = inv * g - x * k, with the one contraction written out where the level has FMA. */
static inline __attribute__((always_inline)) float CSA_V(nb_dx)(float inv, float g, float x,
                                                               float k)
{
#if defined(__FMA__)
    return fmaf(-x, k, inv * g);
#else
    return inv * g - x * k;
#endif
}

static inline __attribute__((always_inline)) void CSA_V(nb_rows)(
    const void *dy, const int dybf, csa_idx sdy_row, const void *x, const int xbf,
    csa_idx sx_row, csa_idx r0, csa_idx r1, csa_idx d, const float *CSA_RESTRICT w, float eps,
    void *dx, const int dxbf, csa_idx sdx_row, float *CSA_RESTRICT pr, float *CSA_RESTRICT row)
{
    if (pr)
        for (csa_idx i = 0; i < d; i++) pr[i] = 0.0f;
    for (csa_idx r = r0; r < r1; r++) {
        const void *xr = norm_off(x, xbf, r * sx_row), *gr = norm_off(dy, dybf, r * sdy_row);
        /* a bfloat16 d(x) row is formed in float32 in `row` (one row of scratch per
         * item), then rounded once into place */
        float *CSA_RESTRICT dr = dxbf ? row : (float *)dx + r * sdx_row;
        const float ss = CSA_V(nb_dot)(xr, xbf, NULL, xr, xbf, d);
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        const float dot = CSA_V(nb_dot)(gr, dybf, w, xr, xbf, d);
#ifdef CSA_MUTANT_RMS_GRAD_MEAN
        const float k = inv * inv * inv * (dot / (float)(d + 1));   /* mutant: mean over d+1 */
#else
        const float k = inv * inv * inv * (dot / (float)d);
#endif
        if (w) {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++)
                dr[i] = CSA_V(nb_dx)(inv, norm_ld(gr, dybf, i) * w[i], norm_ld(xr, xbf, i), k);
        } else {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++)
                dr[i] = CSA_V(nb_dx)(inv, norm_ld(gr, dybf, i), norm_ld(xr, xbf, i), k);
        }
        if (dxbf) {
            csa_bf16 *CSA_RESTRICT o = (csa_bf16 *)dx + r * sdx_row;
#pragma omp simd
            for (csa_idx i = 0; i < d; i++) o[i] = csa_f32_to_bf16(dr[i]);
        }
        if (pr) {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++)
                pr[i] += norm_ld(gr, dybf, i) * (norm_ld(xr, xbf, i) * inv);
        }
    }
}

static int CSA_V(rms_norm_backward_tuned)(const void *dy, int dy_bf16, csa_idx sdy_row,
                                          const void *x, int x_bf16, csa_idx sx_row,
                                          csa_idx rows, csa_idx d, const float *w, float eps,
                                          void *dx, int dx_bf16, csa_idx sdx_row, float *dw)
{
    const csa_idx nb = (rows + CSA_NORM_GRAD_ROWS - 1) / CSA_NORM_GRAD_ROWS;
    const int nt = csa_threads(nb, 1 + 16384 / (CSA_NORM_GRAD_ROWS * (d + 1)));
    /* d(w)'s partials (one per block), then a bfloat16 d(x)'s row scratch (one per thread) */
    const size_t np = dw ? (size_t)(nb > 0 ? nb : 1) * (size_t)(d > 0 ? d : 1) : 0;
    const size_t nr = dx_bf16 ? (size_t)nt * (size_t)(d > 0 ? d : 1) : 0;
    float *part = NULL;
    if (np + nr) {
        part = malloc((np + nr) * sizeof(float));
        if (!part) return CSA_ENOMEM;
    }
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        float *row = dx_bf16 ? part + np + (size_t)omp_get_thread_num() * (size_t)d : NULL;
#else
        float *row = dx_bf16 ? part + np : NULL;
#endif
#pragma omp for schedule(static)
        for (csa_idx bk = 0; bk < nb; bk++) {
            const csa_idx r0 = bk * CSA_NORM_GRAD_ROWS;
            const csa_idx r1 = rows - r0 < CSA_NORM_GRAD_ROWS ? rows : r0 + CSA_NORM_GRAD_ROWS;
            float *pr = dw ? part + bk * d : NULL;
            if (x_bf16 && dy_bf16 && dx_bf16)
                CSA_V(nb_rows)(dy, 1, sdy_row, x, 1, sx_row, r0, r1, d, w, eps, dx, 1, sdx_row,
                               pr, row);
            else if (!x_bf16 && !dy_bf16 && !dx_bf16)
                CSA_V(nb_rows)(dy, 0, sdy_row, x, 0, sx_row, r0, r1, d, w, eps, dx, 0, sdx_row,
                               pr, row);
            else
                CSA_V(nb_rows)(dy, dy_bf16 != 0, sdy_row, x, x_bf16 != 0, sx_row, r0, r1, d, w,
                               eps, dx, dx_bf16 != 0, sdx_row, pr, row);
        }
    }
    if (!dw) {
        free(part);
        return CSA_OK;
    }
    const csa_idx nf = (d + 255) / 256;
    const int ntf = csa_threads(nf, 1 + 16384 / (256 * (nb + 1)));
#pragma omp parallel for num_threads(ntf) schedule(static)
    for (csa_idx c = 0; c < nf; c++) {
        const csa_idx f0 = c * 256, f1 = d - f0 < 256 ? d : f0 + 256;
        for (csa_idx i = f0; i < f1; i++) dw[i] = 0.0f;
        for (csa_idx bk = 0; bk < nb; bk++) {
            const float *CSA_RESTRICT pr = part + bk * d;
#pragma omp simd
            for (csa_idx i = f0; i < f1; i++) dw[i] += pr[i];
        }
#ifdef CSA_MUTANT_RMS_GRAD_WEIGHT
        for (csa_idx i = f0; i < f1; i++) dw[i] *= 1.0f + 1e-4f;   /* mutant: d(w) off 1e-4 */
#endif
    }
    free(part);
    return CSA_OK;
}
