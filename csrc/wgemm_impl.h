/* Tuned csa_wfp8_gemm bodies (gemm.h), compiled once per ISA level by
 * csa_isa_variants.h.  A task is 4 consecutive weight rows (1 where a group boundary of
 * ng_rows falls inside them); for each activation row it walks K once, each 16 or 32
 * activations (widened once) multiplied into the 4 rows' sixteen lanes, so every weight
 * byte is read once for M = 1 and each output is computed by one thread in the
 * oracle's order: the bits depend on neither the level nor the thread count.  Tasks
 * are handed out dynamically (a descheduled thread on a shared host does not hold the
 * others' rows) in guided chunks, as gemm_impl.h's row groups: each thread's rows
 * mostly one run, so the prefetch W_PF_TASKS tasks on seldom lands in the other
 * thread's rows.  Sapphire Rapids, amx level, 2 threads, weights from memory (400 MiB
 * of copies cycled), one process alternating the builds, load 1.8, median call against
 * chunks of 8 tasks: wo_a's shape 1.81 -> 1.59 ms and 2.12 -> 1.82; wbf16 K = 4096,
 * N = 1024 408 -> 364 us, N = 256 112 -> 97 us; wfp8 N = 1024 247 -> 220 us.  Built
 * for decode (M of a few rows); larger M re-reads the weights
 * from cache for each activation row.  Software prefetches (W_PF_L1, W_PF_TASKS): wo_a's
 * shape, weights from memory (12 copies cycled), one thread, 3.1-3.5 -> 2.8-3.1 CPU-ms a
 * call (interleaved runs, a host at load 6: wall times meaningless).
 *
 * Decoding: e4m3 byte v sign-extended to 16 bits and shifted left by 7, bit 14 cleared
 * (& 0xBF80), is the half (binary16) of value e4m3(v) / 256, subnormals included; the
 * F16C / AVX-512 conversion widens 16 of them at a time.  Two integer operations per
 * 32 codes (on 512-bit registers) and the conversion: wo_a's shape (8 x [1024, 4096]),
 * one thread, weights in the L3, 5.4 ms with a per-code decode through float32 bit
 * fields (and 150 ms when that decode made float32 subnormals of the e4m3 subnormals:
 * microcode assists on the multiply that restored them).  NaN codes (0x7f / 0xff)
 * would convert to finite halves: each 128-block of a task's rows is tested for them
 * first (at avx512 a running byte maximum of the codes' low seven bits, one compare
 * at the end) and a block that has one takes the scalar path, the oracle's arithmetic. */

/* Software prefetches (as gemm.c's one-row paths, whose comment has the measurement:
 * rows of a few KiB are too short a stream for the hardware prefetchers): each row
 * W_PF_L1 bytes ahead into L1, and the rows W_PF_TASKS tasks on into L2. */
#ifndef W_PF_L1
#define W_PF_L1 256
#define W_PF_L1_BF 512
#define W_PF_TASKS 2
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define W_LANES 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define W_LANES 2
#else
#define W_LANES 0
#endif

static inline const void *CSA_V(w_arow)(const struct csa_wgemm_args *g, csa_idx m, csa_idx n)
{
    const csa_idx off = m * g->sa_row + (g->ng_rows > 0 ? (n / g->ng_rows) * g->sa_grp : 0);
    return g->a_bf16 ? (const void *)((const csa_bf16 *)g->a + off)
                     : (const void *)((const float *)g->a + off);
}

static inline float CSA_V(w_ascalar)(const void *a, int bf16, csa_idx k)
{
    return bf16 ? csa_bf16_to_f32(((const csa_bf16 *)a)[k]) : ((const float *)a)[k];
}

/* e4m3 / 256 (exact), the oracle's decode */
static inline float CSA_V(w_bscalar)(uint8_t v)
{
    return csa_e4m3_to_f32(v) * (1.0f / 256.0f);
}

static inline float CSA_V(w_tree)(float *t)
{
    for (int w = 1; w < 16; w *= 2)
        for (int i = 0; i < 16; i += 2 * w) t[i] = t[i] + t[i + w];
    return t[0];
}

/* One block [k0, k0 + len) of one weight row into the sixteen lanes t (which hold the
 * block's earlier k), the oracle's way. */
static inline void CSA_V(w_block_scalar)(const void *a, int bf, const uint8_t *br, int wbf,
                                         csa_idx k0, csa_idx kfrom, csa_idx kto, float *t)
{
    for (csa_idx k = kfrom; k < kto; k++) {
        const float w = wbf ? csa_bf16_to_f32(((const csa_bf16 *)br)[k]) : CSA_V(w_bscalar)(br[k]);
        t[(k - k0) & 15] = fmaf(CSA_V(w_ascalar)(a, bf, k), w, t[(k - k0) & 15]);
    }
}

static inline float CSA_V(w_bscale)(const struct csa_wgemm_args *g, csa_idx n, csa_idx kb)
{
    const csa_idx i = (n / 128) * g->sbs_row + kb * g->sbs_col;
    return (g->bs_fmt == CSA_S_E8M0 ? csa_e8m0_to_f32(((const uint8_t *)g->bs)[i])
                                    : ((const float *)g->bs)[i]) * 256.0f;
}

#if W_LANES == 1
/* a whole 128-block of row p has no NaN code */
static inline int CSA_V(w_finite128)(const uint8_t *p)
{
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    const __mmask64 x = _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(p), m7), m7);
    const __mmask64 y = _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(p + 64), m7), m7);
    return (x | y) == 0;
}

/* the 128-blocks at k0 of rows br[0 .. R-1] have no NaN code: the largest low seven
 * bits (a byte max in registers, one compare at the end) is below 0x7f.  Against a
 * compare and a mask move per 64 codes: the check was 15% of wo_a's time with the
 * weights in L2 (one thread, 14.3 -> 16.5 GB/s without it). */
static inline int CSA_V(w_finiteR)(const uint8_t *const *br, int R, csa_idx k0)
{
    const __m512i m7 = _mm512_set1_epi8(0x7f);
    __m512i m = _mm512_setzero_si512();
    for (int r = 0; r < R; r++) {
        m = _mm512_max_epu8(m, _mm512_and_si512(_mm512_loadu_si512(br[r] + k0), m7));
        m = _mm512_max_epu8(m, _mm512_and_si512(_mm512_loadu_si512(br[r] + k0 + 64), m7));
    }
    return _mm512_cmpeq_epi8_mask(m, m7) == 0;
}

static inline __m512 CSA_V(w_act16)(const void *a, int bf16, csa_idx k)
{
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const csa_bf16 *)a + k))), 16));
    return _mm512_loadu_ps((const float *)a + k);
}

/* gemm.h's pairwise reduction of the sixteen lanes: adjacent lanes, then pairs, quads,
 * halves (x + y and y + x are the same float). */
static inline float CSA_V(w_red16)(__m512 v)
{
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    return _mm512_cvtss_f32(v);
}

/* 16 halves from memory widened to float32 (w_block4 says why from memory) */
static inline __m512 CSA_V(w_cvtph_mem)(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)p));
}

/* w_red16 of four rows at once, into lanes 0-3: each sum pairs the same two values
 * as w_red16 does (pairs, pairs of pairs, then the 128-bit quarters), the quarters of
 * two rows packed into one register by shuffles, so 13 vector operations instead of
 * 4 x 8. */
static inline __m128 CSA_V(w_red4x16)(const __m512 *l)
{
    /* per quarter: rows 0 and 1's (or 2 and 3's) sums of lane pairs */
    const __m512 a = _mm512_add_ps(_mm512_shuffle_ps(l[0], l[1], 0x88),
                                   _mm512_shuffle_ps(l[0], l[1], 0xDD));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_ps(l[2], l[3], 0x88),
                                   _mm512_shuffle_ps(l[2], l[3], 0xDD));
    /* per quarter: rows 0-3's sums of lanes 0+1+2+3 of that quarter */
    __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
    c = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0xB1));
    return _mm_add_ps(_mm512_castps512_ps128(c), _mm512_extractf32x4_ps(c, 2));
}

/* Rows n0 .. n0 + R - 1 against activation row a, one full finite-checked 128-block:
 * the block sums into P[r].  R is a compile-time constant at each call (GCC clones the
 * function per R).  The decoded halves go through h, 1 KiB in L1, so that vcvtph2ps
 * reads memory: from a register its upper half needs an extract, one more port-5 uop
 * per 32 codes in a loop bound by ports 0 and 5 (K = 4096, N = 128, weights in L2, one
 * thread: 14.5 -> 15.7 GB/s).  Out of line: inlined into the task loop it ran ~8%
 * slower (register pressure; same measurement). */
static __attribute__((noinline)) void CSA_V(w_block4)(const void *a, int bf,
                                                      const uint8_t *const *br, int R,
                                                      csa_idx k0, float *P, csa_idx pf2)
{
    __m512 l[4];
    for (int r = 0; r < R; r++) l[r] = _mm512_setzero_ps();
    const __m512i mk = _mm512_set1_epi16((short)0xBF80);
    uint16_t h[4][128] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++) {
        _mm_prefetch((const char *)(br[r] + k0 + W_PF_L1), _MM_HINT_T0);
        _mm_prefetch((const char *)(br[r] + k0 + 64 + W_PF_L1), _MM_HINT_T0);
        if (pf2) {
            _mm_prefetch((const char *)(br[r] + k0 + pf2), _MM_HINT_T1);
            _mm_prefetch((const char *)(br[r] + k0 + 64 + pf2), _MM_HINT_T1);
        }
        for (int k = 0; k < 128; k += 32)
            _mm512_store_si512((__m512i *)(h[r] + k), _mm512_and_si512(_mm512_slli_epi16(
                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(br[r] + k0 + k))), 7), mk));
    }
    for (int k = 0; k < 128; k += 16) {
        const __m512 x = CSA_V(w_act16)(a, bf, k0 + k);
        for (int r = 0; r < R; r++)
            l[r] = _mm512_fmadd_ps(x, CSA_V(w_cvtph_mem)(h[r] + k), l[r]);
    }
    if (R == 4)
        _mm_storeu_ps(P, CSA_V(w_red4x16)(l));
    else
        for (int r = 0; r < R; r++) P[r] = CSA_V(w_red16)(l[r]);
}

/* The same for bf16 weights (widened by a shift), prefetched as the e4m3 rows are:
 * without, K = 4096 from memory ran 13.3 (1 thread) / 25.8 (2 threads) GB/s at N = 1024
 * against 17.3 / 28.9 with. */
static inline __attribute__((always_inline)) void CSA_V(w_block4_bf)(const void *a, int bf,
                                                                     const uint8_t *const *br,
                                                                     int R, csa_idx k0, float *P,
                                                                     csa_idx pf2)
{
    __m512 l[4];
    for (int r = 0; r < R; r++) {
        l[r] = _mm512_setzero_ps();
        for (int j = 0; j < 256; j += 64) {
            _mm_prefetch((const char *)(br[r] + 2 * k0 + j + W_PF_L1_BF), _MM_HINT_T0);
            if (pf2) _mm_prefetch((const char *)(br[r] + 2 * k0 + j + pf2), _MM_HINT_T1);
        }
    }
    for (csa_idx k = k0; k < k0 + 128; k += 16) {
        const __m512 x = CSA_V(w_act16)(a, bf, k);
        for (int r = 0; r < R; r++)
            l[r] = _mm512_fmadd_ps(x, CSA_V(w_act16)(br[r], 1, k), l[r]);
    }
    if (R == 4)
        _mm_storeu_ps(P, CSA_V(w_red4x16)(l));
    else
        for (int r = 0; r < R; r++) P[r] = CSA_V(w_red16)(l[r]);
}
#elif W_LANES == 2
static inline int CSA_V(w_finite128)(const uint8_t *p)
{
    const __m256i m7 = _mm256_set1_epi8(0x7f);
    __m256i any = _mm256_setzero_si256();
    for (int i = 0; i < 128; i += 32)
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(
            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), m7), m7));
    return _mm256_testz_si256(any, any);
}

static inline int CSA_V(w_finiteR)(const uint8_t *const *br, int R, csa_idx k0)
{
    int ok = 1;
    for (int r = 0; r < R; r++) ok &= CSA_V(w_finite128)(br[r] + k0);
    return ok;
}

static inline __m256 CSA_V(w_act8)(const void *a, int bf16, csa_idx k)
{
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const csa_bf16 *)a + k))), 16));
    return _mm256_loadu_ps((const float *)a + k);
}

/* one half's tree (lanes 0-7 or 8-15) */
static inline float CSA_V(w_red8)(__m256 v)
{
    v = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));
    v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E));
    v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
    return _mm256_cvtss_f32(v);
}

static inline __attribute__((always_inline)) void CSA_V(w_block4)(const void *a, int bf,
                                                                  const uint8_t *const *br, int R,
                                                                  csa_idx k0, float *P, csa_idx pf2)
{
    __m256 lo[4], hi[4];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i mk = _mm256_set1_epi16((short)0xBF80);
    for (csa_idx k = k0; k < k0 + 128; k += 16) {
        const __m256 x0 = CSA_V(w_act8)(a, bf, k), x1 = CSA_V(w_act8)(a, bf, k + 8);
        if (!(k & 63))
            for (int r = 0; r < R; r++) {
                _mm_prefetch((const char *)(br[r] + k + W_PF_L1), _MM_HINT_T0);
                if (pf2) _mm_prefetch((const char *)(br[r] + k + pf2), _MM_HINT_T1);
            }
        for (int r = 0; r < R; r++) {
            const __m256i h = _mm256_and_si256(_mm256_slli_epi16(
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(br[r] + k))), 7), mk);
            lo[r] = _mm256_fmadd_ps(x0, _mm256_cvtph_ps(_mm256_castsi256_si128(h)), lo[r]);
            hi[r] = _mm256_fmadd_ps(x1, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), hi[r]);
        }
    }
    for (int r = 0; r < R; r++) P[r] = CSA_V(w_red8)(lo[r]) + CSA_V(w_red8)(hi[r]);
}

static inline __attribute__((always_inline)) void CSA_V(w_block4_bf)(const void *a, int bf,
                                                                     const uint8_t *const *br,
                                                                     int R, csa_idx k0, float *P,
                                                                     csa_idx pf2)
{
    __m256 lo[4], hi[4];
    for (int r = 0; r < R; r++) {
        lo[r] = hi[r] = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 64) {
            _mm_prefetch((const char *)(br[r] + 2 * k0 + j + W_PF_L1_BF), _MM_HINT_T0);
            if (pf2) _mm_prefetch((const char *)(br[r] + 2 * k0 + j + pf2), _MM_HINT_T1);
        }
    }
    for (csa_idx k = k0; k < k0 + 128; k += 16) {
        const __m256 x0 = CSA_V(w_act8)(a, bf, k), x1 = CSA_V(w_act8)(a, bf, k + 8);
        for (int r = 0; r < R; r++) {
            lo[r] = _mm256_fmadd_ps(x0, CSA_V(w_act8)(br[r], 1, k), lo[r]);
            hi[r] = _mm256_fmadd_ps(x1, CSA_V(w_act8)(br[r], 1, k + 8), hi[r]);
        }
    }
    for (int r = 0; r < R; r++) P[r] = CSA_V(w_red8)(lo[r]) + CSA_V(w_red8)(hi[r]);
}
#endif

/* Rows n0 .. n0 + R - 1 (R <= 4, one activation group) for every activation row. */
static inline void CSA_V(w_task)(const struct csa_wgemm_args *g, csa_idx n0, const int R)
{
    const csa_idx K = g->K;
    const int bf = g->a_bf16, wbf = g->b_bf16;
    const uint8_t *br[4];
    for (int r = 0; r < R; r++) br[r] = g->b + (n0 + r) * g->sb_row;
    /* the rows W_PF_TASKS tasks on, at the same k, into L2 (when they exist) */
    const csa_idx pf2 = n0 + (W_PF_TASKS + 1) * 4 <= g->N ? W_PF_TASKS * 4 * g->sb_row : 0;
    (void)pf2;
    for (csa_idx m = 0; m < g->M; m++) {
        const void *a = CSA_V(w_arow)(g, m, n0);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (csa_idx k0 = 0; k0 < K; k0 += 128) {
            const csa_idx len = K - k0 < 128 ? K - k0 : 128;
            float P[4];
            int fast = 0;
#if W_LANES
            if (len == 128 && wbf) {
                fast = 1;
                CSA_V(w_block4_bf)(a, bf, br, R, k0, P, pf2);
            } else if (len == 128) {
                fast = CSA_V(w_finiteR)(br, R, k0);
                if (fast) CSA_V(w_block4)(a, bf, br, R, k0, P, pf2);
            }
#endif
            if (!fast)
                for (int r = 0; r < R; r++) {
                    float t[16] = {0};
                    CSA_V(w_block_scalar)(a, bf, br[r], wbf, k0, k0, k0 + len, t);
                    P[r] = CSA_V(w_tree)(t);
                }
            if (wbf)
                for (int r = 0; r < R; r++) acc[r] = acc[r] + P[r];
            else if (R == 4) {
                /* n0 is a multiple of 4: the four rows share one 128-row scale (one
                 * decode of it, not four calls) */
                const float sc = CSA_V(w_bscale)(g, n0, k0 / 128);
                for (int r = 0; r < R; r++) acc[r] = fmaf(P[r], sc, acc[r]);
            } else
                for (int r = 0; r < R; r++) acc[r] = fmaf(P[r], CSA_V(w_bscale)(g, n0 + r, k0 / 128), acc[r]);
        }
        for (int r = 0; r < R; r++) {
            const csa_idx o = m * g->so_row + n0 + r;
            if (g->out_bf16)
                ((csa_bf16 *)g->out)[o] = csa_f32_to_bf16(acc[r]);
            else
                ((float *)g->out)[o] = acc[r];
        }
    }
}

static int CSA_V(wgemm_tuned)(const struct csa_wgemm_args *g)
{
    const csa_idx N = g->N, ntask = (N + 3) / 4;
    const int nt = csa_threads(ntask, 16);
#pragma omp parallel for num_threads(nt) schedule(guided)
    for (csa_idx t = 0; t < ntask; t++) {
        const csa_idx n0 = 4 * t;
        const int R = N - n0 < 4 ? (int)(N - n0) : 4;
        if (R == 4 && (g->ng_rows <= 0 || n0 / g->ng_rows == (n0 + 3) / g->ng_rows))
            CSA_V(w_task)(g, n0, 4);           /* constant R: the row loops unroll */
        else
            for (int r = 0; r < R; r++) CSA_V(w_task)(g, n0 + r, 1);
    }
    return CSA_OK;
}

#undef W_LANES
