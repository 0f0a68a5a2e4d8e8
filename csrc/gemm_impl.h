/* Tuned fp8_gemm / fp4_gemm bodies, compiled once per ISA level by
 * csa_isa_variants.h.  Every output element is computed by one thread in the
 * oracle's order (gemm.h), so the bits depend on neither the level nor the threads.
 *
 * Structure: the activations are decoded once to float32 rows (they are small next
 * to the weights); the weights are never expanded as a whole: each task takes a
 * panel of NC rows of b and, G_KC columns at a time, decodes that slice into a
 * thread-private float buffer (16 KiB for decode shapes, L1; 64 KiB for prefill, L2)
 * which every activation row then reuses, so the weight bytes stream from memory
 * once.  Small M (<= 16, and every M at the base level): the microkernel multiplies 1
 * or 2 activation rows by 4 weight rows, eight k a vector (8 accumulators, FMA on
 * AVX2), reduces each block's lanes by the fixed tree and adds partial * scale into
 * the float32 output tile.  Prefill (M > 16, AVX2 and up): the panel is decoded
 * transposed, 16 columns a strip, and g_pk multiplies 6 broadcast activation rows by
 * 2 vectors of 8 columns, one residue of the block at a time (g_panel_t).
 *
 * One activation row (decode) takes a path of its own: g_row1 (e4m3, 8 weight rows
 * at a time: weights decoded straight into registers by shifts, masks and byte
 * shuffles, no conversion instructions, no buffer) or gemm_row_i8_impl.h (e2m1: exact
 * 8-bit dot products, VPMADDUBSW), each weight byte read once, the row groups handed
 * out dynamically so a descheduled thread on a shared host does not hold the others
 * (g_rows_run, which also runs the one-row problems of a csa_gemm_batch together).
 *
 * The AVX-512 variant first offers the call to the paths of CPU features beyond the
 * level's own (csa_cpu_features()): one row on VNNI + VBMI (gemm_row_vnni_impl.h, the
 * oracle's bits; FP8 by bf16 dot products in the oracle's order where AVX512_BF16 is
 * there too), more rows as one bf16 GEMM (gemm_amx_impl.h: AMX tiles, or AVX512_BF16
 * dot products; float32 additions in its own order, docs/kernels.md section 9). */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define G_SIMD 1
#else
#define G_SIMD 0
#endif

/* One activation row to float32 (true values). */
static void CSA_V(g_dec_a)(const uint8_t *CSA_RESTRICT a, float *CSA_RESTRICT f, csa_idx K)
{
#pragma omp simd
    for (csa_idx k = 0; k < K; k++) f[k] = g_e4m3(a[k]);
}

/* ---- one activation row: the row-group driver ----
 *
 * A one-row problem, prepared (g_prepare_row): its weight rows in groups of R (R <= 16),
 * each group computed by fn from the prepared activation act and its per-128 scales as
 * into its R results; sbt is each thread's scratch for R rows' scales ([K / 32][R]
 * floats).  act and as belong to the job (g_jobs_free). */
typedef void (*CSA_V(g_rows_fn))(const struct csa_gemm_args *, const void *, const float *,
                                 csa_idx, csa_idx, float *, float *);
struct CSA_V(g_job) {
    const struct csa_gemm_args *g;
    CSA_V(g_rows_fn) fn;
    int R;
    void *act;
    float *as;
};

static void CSA_V(g_jobs_free)(struct CSA_V(g_job) *jobs, csa_idx nj)
{
    for (csa_idx i = 0; i < nj; i++) {
        free(jobs[i].act);
        free(jobs[i].as);
    }
}

/* The row groups of every job, one parallel region (used by this level's float32 paths
 * and gemm_row_vnni_impl.h's).  The groups are handed out dynamically (a descheduled
 * thread on a shared host does not hold the others) in guided chunks, long runs of rows
 * first: AMD EPYC (Zen 4), fp8_gemm N = 32768, K = 1024, 2 threads, interleaved: chunks
 * of 64 / R groups 1.12-1.32 ms, guided 0.86-0.95, static halves 0.92-0.98 (each
 * thread's rows one stream, and the prefetch of the next group seldom into the other
 * thread's rows); FP4, N = 2048, K = 4096: no change.  The AVX2 level's FP8 path
 * (g_row1) had chunks of 64 / R until it came here: N = 32768, K = 1024 1.37-1.40 ->
 * 0.96-0.99 ms, N = 4096, K = 4096 0.61 -> 0.54, N = 2048, K = 4096 0.31 -> 0.28 (same
 * CPU, DEEPSEEK_CSA_ISA=avx2, the two builds in alternating processes, three rounds).
 * Several jobs (csa_gemm_batch) are one sequence of groups, job after job: a thread
 * that finishes its share of one problem goes on to the next instead of waiting for
 * the others to finish this one. */
static int CSA_V(g_rows_run)(const struct CSA_V(g_job) *jobs, csa_idx nj)
{
    csa_idx first_small[17];
    csa_idx *first = nj < 17 ? first_small : malloc((size_t)(nj + 1) * sizeof *first);
    if (!first) return CSA_ENOMEM;
    csa_idx total = 0, sbt_n = 1;
    int rmax = 1;
    for (csa_idx i = 0; i < nj; i++) {
        first[i] = total;
        total += (jobs[i].g->N + jobs[i].R - 1) / jobs[i].R;
        if (jobs[i].g->K / 32 * jobs[i].R > sbt_n) sbt_n = jobs[i].g->K / 32 * jobs[i].R;
        if (jobs[i].R > rmax) rmax = jobs[i].R;
    }
    first[nj] = total;
    const int nt = csa_threads(total, 256 / rmax);
    int fail = 0;
#pragma omp parallel num_threads(nt)
    {
        float *sbt = malloc((size_t)sbt_n * sizeof *sbt);
        if (!sbt) {
#pragma omp atomic write
            fail = 1;
        }
        csa_idx p = 0; /* this thread's job: its chunks come in increasing order */
#pragma omp for schedule(guided, 64 / rmax)
        for (csa_idx q = 0; q < total; q++) {
            if (!sbt) continue;
            if (q < first[p]) p = 0;
            while (q >= first[p + 1]) p++;
            const struct CSA_V(g_job) *jb = jobs + p;
            float res[16];
            const csa_idx n0 = jb->R * (q - first[p]), left = jb->g->N - n0;
            const csa_idx nr = left < jb->R ? left : jb->R;
#ifndef CSA_MUTANT_GEMM_BATCH
            jb->fn(jb->g, jb->act, jb->as, n0, nr, sbt, res);
#else /* planted (make mutants): every job takes the first job's activation scales */
            jb->fn(jb->g, jb->act, jobs[0].as, n0, nr, sbt, res);
#endif
            for (csa_idx r = 0; r < nr; r++) g_store(jb->g, 0, n0 + r, res[r]);
        }
        free(sbt);
    }
    if (first != first_small) free(first);
    return fail ? CSA_ENOMEM : CSA_OK;
}

#if G_SIMD
/* 16 e4m3 bytes -> 16 floats, each 1/256 of its value: the byte moved to the top of a
 * 16-bit lane and shifted right once (arithmetic, then the sign copy cleared) is the
 * fp16 encoding of value / 256, subnormals included, which F16C widens exactly.
 * NaN codes (x & 0x7f == 0x7f) would come out finite: such chunks take the scalar path. */
static inline void CSA_V(g_dec16_e4m3)(const uint8_t *p, float *dst)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m128i s7 = _mm_set1_epi8(0x7f);
    if (__builtin_expect(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(x, s7), s7)), 0)) {
        for (int i = 0; i < 16; i++) dst[i] = g_e4m3(p[i]) * (1.0f / 256.0f);
        return;
    }
    const __m128i z = _mm_setzero_si128(), keep = _mm_set1_epi16((short)0xBFFF);
    const __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(z, x), 1), keep);
    const __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(z, x), 1), keep);
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(lo));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(hi));
}

#endif

#if G_SIMD
/* 16 bytes of packed e2m1 (32 values, element 2i in the low nibble of byte i) ->
 * 32 floats: each nibble indexes an in-register table of the high bytes of the fp16
 * values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; the low bytes are zero). */
static inline __attribute__((always_inline)) void CSA_V(g_reg32_e2m1)(const uint8_t *p,
                                                                     __m256 v[4])
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i tbl = _mm_setr_epi8(0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46,
                                      (char)0x80, (char)0xb8, (char)0xbc, (char)0xbe,
                                      (char)0xc0, (char)0xc2, (char)0xc4, (char)0xc6);
    const __m128i lv = _mm_shuffle_epi8(tbl, _mm_and_si128(x, m4));
    const __m128i hv = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(x, 4), m4));
    const __m128i e0 = _mm_unpacklo_epi8(lv, hv), e1 = _mm_unpackhi_epi8(lv, hv);
    const __m128i z = _mm_setzero_si128();
    v[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, e0));
    v[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, e0));
    v[2] = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, e1));
    v[3] = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, e1));
}

/* 32 e2m1 codes (16 bytes) into a float32 buffer: the register decoder, stored. */
static inline void CSA_V(g_dec32_e2m1)(const uint8_t *p, float *dst)
{
    __m256 v[4];
    CSA_V(g_reg32_e2m1)(p, v);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, v[i]);
}

/* e4m3 codes -> float32 by shift and mask alone: ((b & 0x80) << 24) | ((b & 0x7f) << 20)
 * is 2^-120 times the value, exactly, e4m3 subnormals (m * 2^-9) included (they land on
 * the float32 subnormals m * 2^-129).  16 codes (broadcast to both halves) a call: one
 * byte shuffle puts code j at the top of lane j and code 8 + j at the top of its low
 * 16-bit half, one 16-bit arithmetic shift by 4 copies the sign into bits 27-31 (and
 * 11-15) of both; the lanes masked to sign + the 7 bits are codes 0-7, the low halves
 * shifted up and masked codes 8-15.  Five instructions for 16 codes (the 32-bit
 * version, one shuffle, shift and mask per 8 codes, took six), no conversion unit.
 * NaN codes come out finite: the callers note them apart. */
static inline __attribute__((always_inline)) void CSA_V(g_w16)(__m256i bb, __m256i ctlp,
                                                              __m256 w[2])
{
    const __m256i m = _mm256_set1_epi32((int)0x87f00000u);
    const __m256i x = _mm256_srai_epi16(_mm256_shuffle_epi8(bb, ctlp), 4);
    w[0] = _mm256_castsi256_ps(_mm256_and_si256(x, m));
    w[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 16), m));
}

/* The oracle's sum of one block [k0, k1) of an e4m3 weight row against the activation
 * af (held times 2^112): the scalar path of the one-row kernels for blocks with a NaN
 * code. */
static float CSA_V(g_e4m3_block)(const float *af, const uint8_t *row, csa_idx k0, csa_idx k1)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (csa_idx k = k0; k < k1; k++)
        l[(k - k0) & 7] += (af[k] * 0x1p-112f) * (g_e4m3(row[k]) * (1.0f / 256.0f));
    return g_tree(l);
}

/* One activation row against G_R1 rows of e4m3 weights (rows past nr repeat the last
 * one, their results dropped), decoding straight into registers as the bytes stream in:
 * no buffer, each weight byte read once.  af holds the activation times 2^112 (exact),
 * so af * g_w16(b) = a * b / 256 exactly: the very products of the oracle, summed in its
 * order (lanes = k mod 8 within a block, the tree), then one FMA per block into the
 * float32 accumulators.  Eight rows, not four: each row's block is one chain of 16
 * dependent FMAs, and eight chains keep both FMA pipes fed where four left them
 * waiting (register-only loop, one thread, AMD EPYC Zen 3: 4 -> 8 rows 1.05-1.10x). */
#define G_R1 8
static void CSA_V(g_row1)(const struct csa_gemm_args *g, const float *af, const float *as,
                          csa_idx n0, csa_idx nr, float *res)
{
    const csa_idx K = g->K;
    const uint8_t *rp[G_R1];
    for (int r = 0; r < G_R1; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    __m128 c0 = _mm_setzero_ps(), c1 = _mm_setzero_ps();
    /* code j at the top of lane j, code 8 + j at the top of its low half (g_w16) */
    const __m256i ctlp = _mm256_setr_epi8(-128, 8, -128, 0, -128, 9, -128, 1, -128, 10, -128, 2,
                                          -128, 11, -128, 3, -128, 12, -128, 4, -128, 13, -128,
                                          5, -128, 14, -128, 6, -128, 15, -128, 7);
    const __m256i s7 = _mm256_set1_epi8(0x7f);
    const csa_idx pfd2 = G_PF_TASKS * G_R1 * g->sb_row;
    for (csa_idx k0 = 0, j = 0; k0 < K; k0 += 128, j++) {
        const csa_idx k1 = K - k0 < 128 ? K : k0 + 128;
        __m256 acc[G_R1];
        __m256i mx = _mm256_setzero_si256();
        for (int r = 0; r < G_R1; r++) acc[r] = _mm256_setzero_ps();
        /* 32 codes of a row a step.  NaN codes (b & 0x7f == 0x7f, the largest
         * magnitude) are only noted here, by a running byte maximum: a block that has
         * one is redone by the scalar path. */
        for (csa_idx k = k0; k < k1; k += 32) {
            const __m256 x0 = _mm256_loadu_ps(af + k), x1 = _mm256_loadu_ps(af + k + 8);
            const __m256 x2 = _mm256_loadu_ps(af + k + 16), x3 = _mm256_loadu_ps(af + k + 24);
            for (int r = 0; r < G_R1; r++) {
                const uint8_t *p = rp[r] + k;
                if (!(k & 32)) {
                    _mm_prefetch((const char *)(p + G_PF_L1), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p + pfd2), _MM_HINT_T1);
                }
                mx = _mm256_max_epu8(mx, _mm256_and_si256(
                                             _mm256_loadu_si256((const __m256i *)p), s7));
                const __m256i b0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
                const __m256i b1 =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 16)));
                __m256 a = acc[r];
                __m256 w[4];
                CSA_V(g_w16)(b0, ctlp, w);
                CSA_V(g_w16)(b1, ctlp, w + 2);
                a = _mm256_fmadd_ps(x0, w[0], a);
                a = _mm256_fmadd_ps(x1, w[1], a);
                a = _mm256_fmadd_ps(x2, w[2], a);
                a = _mm256_fmadd_ps(x3, w[3], a);
                acc[r] = a;
            }
        }
        __m128 p0, p1;
        if (__builtin_expect(_mm256_movemask_epi8(_mm256_cmpeq_epi8(mx, s7)) != 0, 0)) {
            float pr[G_R1];
            for (int r = 0; r < G_R1; r++) pr[r] = CSA_V(g_e4m3_block)(af, rp[r], k0, k1);
            p0 = _mm_loadu_ps(pr);
            p1 = _mm_loadu_ps(pr + 4);
        } else {
            /* lanes of 4 rows at a time: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)),
             * g_tree's order */
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                             _mm256_hadd_ps(acc[2], acc[3]));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]),
                                             _mm256_hadd_ps(acc[6], acc[7]));
            p0 = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
            p1 = _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1));
        }
        /* one weight scale per 128 rows: n0 is a multiple of G_R1, which divides 128 */
        const __m128 s = _mm_set1_ps(as[j] * g_bscale(g, n0, j));
        c0 = _mm_fmadd_ps(p0, s, c0);
        c1 = _mm_fmadd_ps(p1, s, c1);
    }
    _mm_storeu_ps(res, c0);
    _mm_storeu_ps(res + 4, c1);
}
#endif

#if G_SIMD
/* The scales of weight rows n0 .. n0 + R - 1 (rows past nr repeat the last one),
 * transposed to sbt [K / 32][R]: e8m0 as bytes (decoded R at a time in the loops: the
 * scalar decode of each was a fifth of the time), float32 as they are. */
static void CSA_V(g_rows_scales)(const struct csa_gemm_args *g, csa_idx n0, csa_idx nr, int R,
                                 float *sbt)
{
    const csa_idx nb = g->K / 32;
    uint8_t *sb8 = (uint8_t *)sbt;
    for (int r = 0; r < R; r++) {
        const csa_idx n = n0 + (r < nr ? r : nr - 1);
        if (g->bs_fmt == CSA_S_E8M0) {
            const uint8_t *q = (const uint8_t *)g->bs + n * g->sbs_row;
            for (csa_idx j = 0; j < nb; j++) sb8[R * j + r] = q[j * g->sbs_col];
        } else {
            for (csa_idx j = 0; j < nb; j++) sbt[R * j + r] = g_bscale(g, n, j);
        }
    }
}

#include "gemm_row_i8_impl.h"
#endif

/* Weight row slice [k0, k0 + kl) of row n into dst (floats; e4m3 as value / 256). */
static void CSA_V(g_dec_b)(const struct csa_gemm_args *g, csa_idx n, csa_idx k0, csa_idx kl,
                           float *CSA_RESTRICT dst)
{
    const uint8_t *br = g->b + n * g->sb_row;
    if (g->b_fmt == CSA_W_E4M3) {
        csa_idx k = 0;
#if G_SIMD
        for (; k + 16 <= kl; k += 16) CSA_V(g_dec16_e4m3)(br + k0 + k, dst + k);
#endif
        for (; k < kl; k++) dst[k] = g_e4m3(br[k0 + k]) * (1.0f / 256.0f);
    } else {
        const uint8_t *p = br + k0 / 2;   /* k0 even */
        csa_idx k = 0;
#if G_SIMD
        for (; k + 32 <= kl; k += 32) CSA_V(g_dec32_e2m1)(p + k / 2, dst + k);
#endif
        for (; k < kl; k++) dst[k] = g_e2m1(k & 1 ? p[k / 2] >> 4 : p[k / 2] & 15u);
    }
}

/* MR activation rows (a0, a1: float rows at the slice) times 4 weight rows (b, row
 * stride G_KC) over kl columns in blocks of bk; after each block, the 4 x MR partial
 * sums are scaled by sa[i][block] * sbx and added into c (row stride ldc).
 * fp8: sbx[j] is the weight scale of block j (one for the 4 rows); fp4: sbq + j * ldq
 * holds the 4 rows' scales of block j.  as_i[j]: the activation scale of the 128-block
 * holding block j. */
static inline __attribute__((always_inline)) void CSA_V(g_micro)(
    const int MR, const float *a0, const float *a1, const float *b, csa_idx ldb, csa_idx kl,
    csa_idx bk,
    const float *sbx, const float *sbq, csa_idx ldq, const float *sa0, const float *sa1,
    float *c, csa_idx ldc)
{
    const int fp4 = bk == 32;
    for (csa_idx k0 = 0, j = 0; k0 < kl; k0 += bk, j++) {
        const csa_idx len = kl - k0 < bk ? kl - k0 : bk;
        const csa_idx jb = fp4 ? j / 4 : j;   /* 128-block of the activation scale */
#if G_SIMD
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
        __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
        const float *r0 = b, *r1 = b + ldb, *r2 = b + 2 * ldb, *r3 = b + 3 * ldb;
        for (csa_idx k = k0; k < k0 + len; k += 8) {
            __m256 b0 = _mm256_loadu_ps(r0 + k), b1 = _mm256_loadu_ps(r1 + k);
            __m256 b2 = _mm256_loadu_ps(r2 + k), b3 = _mm256_loadu_ps(r3 + k);
            /* keep the four weight vectors in registers: GCC would otherwise fold each
             * load into the FMAs of both activation rows (two loads per vector) */
            if (MR == 2) __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3));
            const __m256 x0 = _mm256_loadu_ps(a0 + k);
            c00 = _mm256_fmadd_ps(x0, b0, c00);
            c01 = _mm256_fmadd_ps(x0, b1, c01);
            c02 = _mm256_fmadd_ps(x0, b2, c02);
            c03 = _mm256_fmadd_ps(x0, b3, c03);
            if (MR == 2) {
                const __m256 x1 = _mm256_loadu_ps(a1 + k);
                c10 = _mm256_fmadd_ps(x1, b0, c10);
                c11 = _mm256_fmadd_ps(x1, b1, c11);
                c12 = _mm256_fmadd_ps(x1, b2, c12);
                c13 = _mm256_fmadd_ps(x1, b3, c13);
            }
        }
        /* the tree: hadd pairs, then the two 128-bit halves */
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(c00, c01), _mm256_hadd_ps(c02, c03));
        const __m128 p0 = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
        const __m128 sb = fp4 ? _mm_loadu_ps(sbq + j * ldq) : _mm_set1_ps(sbx[j]);
        _mm_storeu_ps(c, _mm_fmadd_ps(p0, _mm_mul_ps(_mm_set1_ps(sa0[jb]), sb),
                                      _mm_loadu_ps(c)));
        if (MR == 2) {
            const __m256 u1 =
                _mm256_hadd_ps(_mm256_hadd_ps(c10, c11), _mm256_hadd_ps(c12, c13));
            const __m128 p1 =
                _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1));
            _mm_storeu_ps(c + ldc, _mm_fmadd_ps(p1, _mm_mul_ps(_mm_set1_ps(sa1[jb]), sb),
                                                _mm_loadu_ps(c + ldc)));
        }
#else
        for (int i = 0; i < MR; i++) {
            const float *ar = i ? a1 : a0;
            const float sa = (i ? sa1 : sa0)[jb];
            for (int q = 0; q < 4; q++) {
                float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const float *br = b + q * ldb;
                for (csa_idx k = k0; k < k0 + len; k += 8)
                    for (int t = 0; t < 8; t++) l[t] += ar[k + t] * br[k + t];
                const float sb = fp4 ? sbq[j * ldq + q] : sbx[j];
                c[i * ldc + q] = fmaf(g_tree(l), sa * sb, c[i * ldc + q]);
            }
        }
#endif
    }
}

/* The two row counts as separate out-of-line functions: inlined into the panel loop
 * the compiler ran out of registers and spilled the accumulators. */
static __attribute__((noinline)) void CSA_V(g_micro2)(
    const float *a0, const float *a1, const float *b, csa_idx ldb, csa_idx kl, csa_idx bk,
    const float *sbx, const float *sbq, csa_idx ldq, const float *sa0, const float *sa1,
    float *c, csa_idx ldc)
{
    CSA_V(g_micro)(2, a0, a1, b, ldb, kl, bk, sbx, sbq, ldq, sa0, sa1, c, ldc);
}

static __attribute__((noinline)) void CSA_V(g_micro1)(
    const float *a0, const float *b, csa_idx ldb, csa_idx kl, csa_idx bk, const float *sbx,
    const float *sbq, csa_idx ldq, const float *sa0, float *c)
{
    CSA_V(g_micro)(1, a0, NULL, b, ldb, kl, bk, sbx, sbq, ldq, sa0, NULL, c, 0);
}

/* One panel: weight rows [n0, n0 + nr) against every activation row, KC columns of
 * the panel decoded at a time into Bf (row stride KC). */
static void CSA_V(g_panel)(const struct csa_gemm_args *g, const float *Af, const float *AS,
                           csa_idx KB128, csa_idx n0, csa_idx nr, csa_idx NC, csa_idx KC,
                           float *Bf, float *BS, float *C)
{
    const csa_idx M = g->M, K = g->K, LDA = G_LDA(K);
    const int fp8 = g->b_fmt == CSA_W_E4M3;
    const csa_idx bk = fp8 ? 128 : 32;
    const csa_idx nq = (nr + 3) / 4 * 4;    /* rows rounded up to whole quads */
    for (csa_idx m0 = 0; m0 < M; m0 += G_MB) {
        const csa_idx mb = M - m0 < G_MB ? M - m0 : G_MB;
        memset(C, 0, (size_t)(mb * NC) * sizeof *C);
        for (csa_idx kc = 0; kc < K; kc += KC) {
            const csa_idx kl = K - kc < KC ? K - kc : KC;
            const csa_idx nblk = (kl + bk - 1) / bk;
            for (csa_idx r = 0; r < nq; r++) {
                if (r < nr)
                    CSA_V(g_dec_b)(g, n0 + r, kc, kl, Bf + r * KC);
                else
                    memset(Bf + r * KC, 0, (size_t)kl * sizeof *Bf);
            }
            if (fp8) {
                for (csa_idx j = 0; j < nblk; j++) BS[j] = g_bscale(g, n0, kc / 128 + j);
            } else {
                for (csa_idx j = 0; j < nblk; j++)
                    for (csa_idx r = 0; r < nq; r++)
                        BS[j * NC + r] = r < nr ? g_bscale(g, n0 + r, kc / 32 + j) : 0.0f;
            }
            for (csa_idx ms = 0; ms < mb; ms += G_MS) {
                const csa_idx me = mb - ms < G_MS ? mb : ms + G_MS;
                for (csa_idx q = 0; q < nq; q += 4) {
                    const float *bq = Bf + q * KC;
                    csa_idx m = ms;
                    for (; m + 2 <= me; m += 2) {
                        const csa_idx ga = m0 + m;
                        CSA_V(g_micro2)(Af + ga * LDA + kc, Af + (ga + 1) * LDA + kc, bq, KC, kl, bk,
                                        BS, BS + q, NC, AS + ga * KB128 + kc / 128,
                                        AS + (ga + 1) * KB128 + kc / 128, C + m * NC + q, NC);
                    }
                    if (m < me) {
                        const csa_idx ga = m0 + m;
                        CSA_V(g_micro1)(Af + ga * LDA + kc, bq, KC, kl, bk, BS, BS + q, NC,
                                        AS + ga * KB128 + kc / 128, C + m * NC + q);
                    }
                }
            }
        }
        for (csa_idx m = 0; m < mb; m++)
            for (csa_idx r = 0; r < nr; r++) g_store(g, m0 + m, n0 + r, C[m * NC + r]);
    }
}

#if G_SIMD
/* Residue j of one block for g_pk: the MR x 2 lane sums in named registers (an array
 * of accumulators was kept in memory by GCC), stored to out once. */
static inline __attribute__((always_inline)) void CSA_V(g_pkj)(
    const int MR, const float *const *a, const float *b, csa_idx ldb, csa_idx len, csa_idx j,
    __m256 *out)
{
    const __m256 z = _mm256_setzero_ps();
    __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, c8 = z, c9 = z,
           c10 = z, c11 = z;
    const float *a0 = a[0], *a1 = a[MR > 1 ? 1 : 0], *a2 = a[MR > 2 ? 2 : 0];
    const float *a3 = a[MR > 3 ? 3 : 0], *a4 = a[MR > 4 ? 4 : 0], *a5 = a[MR > 5 ? 5 : 0];
    /* row i of the tile: its activation broadcast against the 16 columns */
#define G_PKROW(i, ai, ca, cb)                                                             \
    if (MR > i) {                                                                          \
        const __m256 x = _mm256_broadcast_ss(ai + k);                                      \
        ca = _mm256_fmadd_ps(x, b0, ca);                                                   \
        cb = _mm256_fmadd_ps(x, b1, cb);                                                   \
    }
    for (csa_idx k = j; k < len; k += 8) {
        const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
        G_PKROW(0, a0, c0, c1)
        G_PKROW(1, a1, c2, c3)
        G_PKROW(2, a2, c4, c5)
        G_PKROW(3, a3, c6, c7)
        G_PKROW(4, a4, c8, c9)
        G_PKROW(5, a5, c10, c11)
    }
#undef G_PKROW
    out[0] = c0, out[1] = c1;
    if (MR > 1) out[2] = c2, out[3] = c3;
    if (MR > 2) out[4] = c4, out[5] = c5;
    if (MR > 3) out[6] = c6, out[7] = c7;
    if (MR > 4) out[8] = c8, out[9] = c9;
    if (MR > 5) out[10] = c10, out[11] = c11;
}

/* Prefill microkernel: MR (<= 6) activation rows times 16 weight columns over one
 * K block (len, a multiple of 8), FMA on broadcast activations and vectors of 8
 * columns.  The contract's block sum is per (row, column): lane j of the oracle (its
 * elements j, j + 8, ... in increasing k) is here one accumulator per (row, 8
 * columns) fed k = j, j + 8, ... in turn, residue after residue, and the tree
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) is built as the residues finish
 * (its partial sums in S, L1); then c = fma(P, sa * sb, c) as the oracle's.
 * a[i]: row i's floats at the block's first k; b: the transposed weight panel (row
 * stride ldb floats) at the block's first k and the 16 columns; sa[i]: row i's
 * activation scale; sb0 / sb1: the 16 columns' weight scales; c: the output tile
 * (row stride ldc). */
static inline __attribute__((always_inline)) void CSA_V(g_pk)(
    const int MR, const float *const *a, const float *b, csa_idx ldb, csa_idx len,
    const float *sa, __m256 sb0, __m256 sb1, float *c, csa_idx ldc)
{
    __m256 S[4][12];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256 acc[12];
        CSA_V(g_pkj)(MR, a, b, ldb, len, j, acc);
        for (int i = 0; i < 2 * MR; i++) {
            const __m256 v = acc[i];
            switch (j) {
            case 0: S[0][i] = v; break;
            case 1: S[0][i] = _mm256_add_ps(S[0][i], v); break;
            case 2: S[1][i] = v; break;
            case 3: S[0][i] = _mm256_add_ps(S[0][i], _mm256_add_ps(S[1][i], v)); break;
            case 4: S[2][i] = v; break;
            case 5: S[2][i] = _mm256_add_ps(S[2][i], v); break;
            case 6: S[3][i] = v; break;
            default: S[0][i] = _mm256_add_ps(S[0][i], _mm256_add_ps(S[2][i], _mm256_add_ps(S[3][i], v)));
            }
        }
    }
    for (int i = 0; i < MR; i++) {
        const __m256 x = _mm256_set1_ps(sa[i]);
        float *ci = c + i * ldc;
        _mm256_storeu_ps(ci, _mm256_fmadd_ps(S[0][2 * i], _mm256_mul_ps(x, sb0), _mm256_loadu_ps(ci)));
        _mm256_storeu_ps(ci + 8, _mm256_fmadd_ps(S[0][2 * i + 1], _mm256_mul_ps(x, sb1),
                                                 _mm256_loadu_ps(ci + 8)));
    }
}

#define G_PK(R)                                                                            \
    static __attribute__((noinline)) void CSA_V(g_pk##R)(                                  \
        const float *const *a, const float *b, csa_idx ldb, csa_idx len, const float *sa,  \
        __m256 sb0, __m256 sb1, float *c, csa_idx ldc)                                     \
    {                                                                                      \
        CSA_V(g_pk)(R, a, b, ldb, len, sa, sb0, sb1, c, ldc);                              \
    }
G_PK(1) G_PK(2) G_PK(3) G_PK(4) G_PK(5) G_PK(6)
#undef G_PK

/* One prefill panel: weight rows [n0, n0 + nr) (nr <= NC, NC a multiple of 16) against
 * every activation row, G_KC columns of the panel decoded at a time into Bt transposed
 * in strips of 16 columns ([strip][k][16], padding columns zero: their results are
 * dropped; a strip's rows 64 bytes apart, not NC * 4: at 256 bytes a 128-row block
 * filled 16 of L1's 64 sets and evicted itself), each strip then swept by all the rows
 * of an output tile of G_MB rows, 6 at a time (the strip, 16 KiB, stays in L1).  The blocks reach each output element in increasing k,
 * as in the oracle. */
static void CSA_V(g_panel_t)(const struct csa_gemm_args *g, const float *Af, const float *AS,
                             csa_idx KB128, csa_idx n0, csa_idx nr, csa_idx NC, float *Bt,
                             float *BS, float *C)
{
    const csa_idx M = g->M, K = g->K, KC = G_KC, LDA = G_LDA(K);
    const int fp8 = g->b_fmt == CSA_W_E4M3;
    const csa_idx bk = fp8 ? 128 : 32;
    float row[G_KC];
    for (csa_idx m0 = 0; m0 < M; m0 += G_MB) {
        const csa_idx mb = M - m0 < G_MB ? M - m0 : G_MB;
        memset(C, 0, (size_t)(mb * NC) * sizeof *C);
        for (csa_idx kc = 0; kc < K; kc += KC) {
            const csa_idx kl = K - kc < KC ? K - kc : KC;
            const csa_idx nblk = (kl + bk - 1) / bk;
            for (csa_idx r = 0; r < NC; r++) {
                float *bt = Bt + (r / 16) * (KC * 16) + r % 16;
                if (r < nr) {
                    CSA_V(g_dec_b)(g, n0 + r, kc, kl, row);
                    for (csa_idx k = 0; k < kl; k++) bt[k * 16] = row[k];
                } else {
                    for (csa_idx k = 0; k < kl; k++) bt[k * 16] = 0.0f;
                }
            }
            for (csa_idx j = 0; j < nblk; j++)
                for (csa_idx r = 0; r < NC; r++)
                    BS[j * NC + r] = r < nr ? g_bscale(g, n0 + r, (fp8 ? kc / 128 : kc / 32) + j) : 0.0f;
            for (csa_idx q = 0; q < NC; q += 16) {
                if (q >= nr) break;
                for (csa_idx m = 0; m < mb; m += 6) {
                    const int mr = mb - m < 6 ? (int)(mb - m) : 6;
                    for (csa_idx j = 0; j < nblk; j++) {
                        const csa_idx k0 = j * bk, len = kl - k0 < bk ? kl - k0 : bk;
                        const csa_idx kb128 = (kc + k0) / 128;
                        const float *ar[6];
                        float sa[6];
                        for (int i = 0; i < mr; i++) {
                            ar[i] = Af + (m0 + m + i) * LDA + kc + k0;
                            sa[i] = AS[(m0 + m + i) * KB128 + kb128];
                        }
                        const __m256 sb0 = _mm256_loadu_ps(BS + j * NC + q);
                        const __m256 sb1 = _mm256_loadu_ps(BS + j * NC + q + 8);
                        const float *bq = Bt + q * KC + k0 * 16;
                        float *cq = C + m * NC + q;
                        switch (mr) {
                        case 6: CSA_V(g_pk6)(ar, bq, 16, len, sa, sb0, sb1, cq, NC); break;
                        case 5: CSA_V(g_pk5)(ar, bq, 16, len, sa, sb0, sb1, cq, NC); break;
                        case 4: CSA_V(g_pk4)(ar, bq, 16, len, sa, sb0, sb1, cq, NC); break;
                        case 3: CSA_V(g_pk3)(ar, bq, 16, len, sa, sb0, sb1, cq, NC); break;
                        case 2: CSA_V(g_pk2)(ar, bq, 16, len, sa, sb0, sb1, cq, NC); break;
                        default: CSA_V(g_pk1)(ar, bq, 16, len, sa, sb0, sb1, cq, NC);
                        }
                    }
                }
            }
        }
        for (csa_idx m = 0; m < mb; m++)
            for (csa_idx r = 0; r < nr; r++) g_store(g, m0 + m, n0 + r, C[m * NC + r]);
    }
}
#endif

#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
#include "gemm_row_vnni_impl.h"
#include "gemm_amx_impl.h"
#endif

/* The activation rows decoded to float32 (true values; row stride lda) and their
 * per-128 scales (KB128 a row). */
static void CSA_V(g_dec_rows)(const struct csa_gemm_args *g, float *Af, float *AS, csa_idx lda)
{
    const csa_idx M = g->M, K = g->K, KB128 = (K + 127) / 128;
    const int nt = csa_threads(M, 1 + 65536 / K);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx m = 0; m < M; m++) {
        CSA_V(g_dec_a)(g->a + m * g->sa_row, Af + m * lda, K);
        for (csa_idx j = 0; j < KB128; j++)
            AS[m * KB128 + j] = g_scale(g->as, g->as_fmt, m * g->sas_row + j * g->sas_col);
#ifdef CSA_MUTANT_GEMM_SCALE /* planted (make mutants): the last K block's activation scale
                              * taken from the block before */
        if (KB128 > 1)
            AS[m * KB128 + KB128 - 1] = AS[m * KB128 + KB128 - 2];
#endif
    }
}

#if G_SIMD
static void CSA_V(g_row1_rows)(const struct csa_gemm_args *g, const void *af, const float *as,
                               csa_idx n0, csa_idx nr, float *sbt, float *res)
{
    (void)sbt;
    CSA_V(g_row1)(g, af, as, n0, nr, res);
}
#endif

/* A one-row problem this level computes by g_rows_run: 1 with *jb prepared, 0 when the
 * call takes another path, -1 when an allocation failed. */
static int CSA_V(g_prepare_row)(const struct csa_gemm_args *g, struct CSA_V(g_job) *jb)
{
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
    /* the avx512 and amx levels (docs/kernels.md section 9) */
    if (g->M == 1 && (csa_cpu_features() & CSA_CPU_VNNI_VBMI)) {
        const int path = CSA_V(gv_takes)(g);
        if (path)
            return (path == 1 ? CSA_V(gv_prepare_fp4)(g, jb) : CSA_V(gv_prepare_fp8)(g, jb))
                       ? -1 : 1;
    }
#endif
#if G_SIMD
    /* One activation row, K a multiple of 32: FP4 by exact 8-bit dot products
     * (gemm_row_i8_impl.h) unless a code of the row is NaN (then every output is NaN
     * and the general path takes it); e4m3 by the fused float32 path (g_row1). */
    if (g->M == 1 && g->K % 32 == 0 && g->b_fmt == CSA_W_E2M1) return CSA_V(gi_prepare_fp4)(g, jb);
    if (g->M == 1 && g->K % 32 == 0 && g->b_fmt == CSA_W_E4M3) {
        const csa_idx K = g->K;
        float *Af = malloc((size_t)K * sizeof *Af);
        float *AS = malloc((size_t)((K + 127) / 128) * sizeof *AS);
        if (!Af || !AS) {
            free(Af);
            free(AS);
            return -1;
        }
        CSA_V(g_dec_rows)(g, Af, AS, K);
        /* the exact power of two that meets the weight decoder's (g_w16: 2^-120 times
         * the value, so products a * b / 256) */
        for (csa_idx k = 0; k < K; k++) Af[k] *= 0x1p112f;
        *jb = (struct CSA_V(g_job)){g, CSA_V(g_row1_rows), G_R1, Af, AS};
        return 1;
    }
#endif
    (void)g;
    (void)jb;
    return 0;
}

/* Every path but the one-row ones. */
static int CSA_V(gemm_rows)(const struct csa_gemm_args *g)
{
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
    {
        const int tiles = csa_isa_get() >= CSA_ISA_AMX;
        if ((tiles || (csa_cpu_features() & CSA_CPU_BF16)) && CSA_V(ga_ok)(g))
            return CSA_V(gemm_bf16)(g, tiles);
    }
#endif
    const csa_idx M = g->M, N = g->N, K = g->K, LDA = G_LDA(K);
    const csa_idx KB128 = (K + 127) / 128;
    float *Af = malloc((size_t)(M * LDA) * sizeof *Af);
    float *AS = malloc((size_t)(M * KB128) * sizeof *AS);
    if (!Af || !AS) {
        free(Af);
        free(AS);
        return CSA_ENOMEM;
    }
    CSA_V(g_dec_rows)(g, Af, AS, LDA);
    /* Decode shapes: panels of one quad of whole rows (the weight bytes are read in
     * address order, 4 rows = one contiguous run); prefill: 64 rows x G_KC columns. */
    const int small = M <= 16;
    const csa_idx NC = small ? 4 : G_NC_LARGE;
    const csa_idx KC = small ? (K <= G_KC_SMALL_MAX ? K : G_KC_SMALL_MAX) : G_KC;
    const csa_idx npan = (N + NC - 1) / NC;
    const csa_idx mb = M < G_MB ? M : G_MB;
    int fail = 0;
    const int nt = csa_threads(npan, small ? 16 : 1);
#pragma omp parallel num_threads(nt)
    {
        float *Bf = malloc((size_t)(NC * KC) * sizeof *Bf);
        float *BS = malloc((size_t)(NC * ((KC + 31) / 32)) * sizeof *BS);
        float *C = malloc((size_t)(mb * NC) * sizeof *C);
        const int ok = Bf && BS && C;
        if (!ok) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(static)
        for (csa_idx p = 0; p < npan; p++) {
            if (!ok) continue;
            const csa_idx n0 = p * NC;
            const csa_idx nr = N - n0 < NC ? N - n0 : NC;
#if G_SIMD
            if (!small) {
                CSA_V(g_panel_t)(g, Af, AS, KB128, n0, nr, NC, Bf, BS, C);
                continue;
            }
#endif
            CSA_V(g_panel)(g, Af, AS, KB128, n0, nr, NC, KC, Bf, BS, C);
        }
        free(Bf);
        free(BS);
        free(C);
    }
    free(Af);
    free(AS);
    return fail ? CSA_ENOMEM : CSA_OK;
}

/* csa_gemm_batch at this level (csa_gemm is a batch of one): the one-row problems
 * prepared, then run together by g_rows_run; the others one by one. */
static int CSA_V(gemm_tuned_batch)(const struct csa_gemm_args *gs, csa_idx count)
{
    struct CSA_V(g_job) job1;
    struct CSA_V(g_job) *jobs = count == 1 ? &job1 : malloc((size_t)count * sizeof *jobs);
    if (!jobs) return CSA_ENOMEM;
    csa_idx nj = 0;
    int st = CSA_OK;
    for (csa_idx i = 0; i < count && st == CSA_OK; i++) {
        const struct csa_gemm_args *g = gs + i;
        if (g->M == 0 || g->N == 0) continue;
        if (g->K == 0 || g->K % (g->b_fmt == CSA_W_E4M3 ? 16 : 32)) {
            st = csa_gemm_ref(g);
            continue;
        }
        const int r = CSA_V(g_prepare_row)(g, jobs + nj);
        if (r > 0)
            nj++;
        else
            st = r < 0 ? CSA_ENOMEM : CSA_V(gemm_rows)(g);
    }
    if (st == CSA_OK && nj) st = CSA_V(g_rows_run)(jobs, nj);
    CSA_V(g_jobs_free)(jobs, nj);
    if (jobs != &job1) free(jobs);
    return st;
}

#undef G_R1
#undef G_SIMD
