#include "gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "fpgrid_impl.h"
#include "amx.h"

/* ------------------------------------------------------------ decoding */

/* e4m3fn: the 7 magnitude bits placed at the top of a float32's exponent/mantissa
 * fields give 2^-120 times the value (a float32 subnormal for the e4m3 subnormals),
 * so one exact multiply by 2^120 decodes every code; 0x7f / 0xff are NaN. */
static inline float g_e4m3(uint32_t v)
{
    const uint32_t em = v & 0x7fu;
    const uint32_t mag = em == 0x7fu ? 0x7fc00000u : q_bits(q_float(em << 20) * 0x1p120f);
    return q_float(mag | ((v & 0x80u) << 24));
}

static inline float g_e2m1(uint32_t nib)
{
    static const float t[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float f = t[nib & 7u];
    return (nib & 8u) ? -f : f;
}

/* e8m0: 2^(v - 127); 0 is 2^-127 (a float32 subnormal), 0xff NaN. */
static inline float g_e8m0(uint32_t v)
{
    return v == 0xffu ? NAN : (v == 0 ? 0x1p-127f : q_float(v << 23));
}

float csa_e4m3_to_f32(uint8_t v) { return g_e4m3(v); }
float csa_e2m1_to_f32(uint8_t nibble) { return g_e2m1(nibble); }
float csa_e8m0_to_f32(uint8_t v) { return g_e8m0(v); }

static inline float g_scale(const void *s, int fmt, csa_idx i)
{
    return fmt == CSA_S_E8M0 ? g_e8m0(((const uint8_t *)s)[i]) : ((const float *)s)[i];
}

/* The weight-side scale factor sbx of block kb (in the weight's blocks) for row n. */
static inline float g_bscale(const struct csa_gemm_args *g, csa_idx n, csa_idx kb)
{
    if (g->b_fmt == CSA_W_E4M3)
        return g_scale(g->bs, g->bs_fmt, (n / 128) * g->sbs_row + kb * g->sbs_col) * 256.0f;
    return g_scale(g->bs, g->bs_fmt, n * g->sbs_row + kb * g->sbs_col);
}

static inline float g_tree(const float *l)
{
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static inline void g_store(const struct csa_gemm_args *g, csa_idx m, csa_idx n, float v)
{
    if (g->out_bf16)
        ((csa_bf16 *)g->out)[m * g->so_row + n] = csa_f32_to_bf16(v);
    else
        ((float *)g->out)[m * g->so_row + n] = v;
}

/* ------------------------------------------------------------ scalar oracle */

int csa_gemm_ref(const struct csa_gemm_args *g)
{
    const int fp8 = g->b_fmt == CSA_W_E4M3;
    const csa_idx BK = fp8 ? 128 : 32;
    for (csa_idx m = 0; m < g->M; m++)
        for (csa_idx n = 0; n < g->N; n++) {
            const uint8_t *ar = g->a + m * g->sa_row, *br = g->b + n * g->sb_row;
            float acc = 0.0f;
            for (csa_idx k0 = 0; k0 < g->K; k0 += BK) {
                float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const csa_idx k1 = k0 + BK < g->K ? k0 + BK : g->K;
                for (csa_idx k = k0; k < k1; k++) {
                    const float bv = fp8 ? g_e4m3(br[k]) * (1.0f / 256.0f)
                                         : g_e2m1(k & 1 ? br[k / 2] >> 4 : br[k / 2] & 15u);
                    l[(k - k0) & 7] += g_e4m3(ar[k]) * bv;
                }
                const float s = g_scale(g->as, g->as_fmt, m * g->sas_row + (k0 / 128) * g->sas_col) *
                                g_bscale(g, n, k0 / BK);
                acc = fmaf(g_tree(l), s, acc);
            }
            g_store(g, m, n, acc);
        }
    return CSA_OK;
}

/* ------------------------------------------------------------ tuned entry */

/* Software prefetches of the one-row e4m3 paths (g_row1, gemm_row_vnni_impl.h's
 * gv_fp8_row8*): each row G_PF_L1 bytes ahead into L1, and the rows G_PF_TASKS tasks
 * (of 8 rows) on into L2.  The rows are 1-8 KiB, too short a stream for the hardware
 * prefetchers to train on: single thread, N = 32768, K = 1024, 13.1 -> 7.9 ms with
 * the next task's rows prefetched into L1 (AVX2; p20 of 40 calls, load average 6), and
 * 2.9 -> 1.46 ms with that and L2 three tasks on (AVX-512 VBMI, 2 threads).  But the
 * next task into L1 fills L1 once rows are 4 KiB (K = 4096); this scheme instead, AMD
 * EPYC (Zen 4), 2 threads, interleaved in one process, weights from memory:
 * - level avx2 (g_row1): N = 1024, K = 4096 0.24 -> 0.19 ms; N = 4096, K = 8192 1.71 ->
 *   1.33; N = 2048, K = 4096 0.45 -> 0.36; N = 32768, K = 1024 1.75 -> 1.44-1.61;
 * - avx512 with VBMI (gv_fp8_row8): 0.25 -> 0.21, 1.96 -> 1.52, 0.46 -> 0.38, within
 *   noise; with AVX512_BF16 too (gv_fp8_row8_dp): 0.19-0.21 -> 0.15-0.16, 1.24-1.55 ->
 *   1.05-1.12, 0.32-0.37 -> 0.28-0.30, within noise.
 * 128 to 384 bytes ahead and one to four tasks on were within noise of each other. */
#define G_PF_L1 256
#define G_PF_TASKS 2

/* Columns of the weight panel one task decodes (rows of b), and the K slice it
 * decodes at a time (prefill: a 64-row panel in L2 that every row pair of the
 * activation tile reuses; decode shapes take 4 whole rows, see gemm_impl.h). */
#define G_KC 256
#define G_KC_SMALL_MAX 8192   /* decode shapes: whole rows up to this K (4 x 128 KiB) */
#define G_NC_LARGE 64
#define G_MB 192     /* activation rows per output tile (float accumulators in L2) */
#define G_MS 32      /* activation rows swept per weight quad (their slice in L1/L2) */
/* Row stride of the decoded activations, in floats: K plus one cache line, so that the
 * rows a prefill microkernel reads together (K = 1024: 4 KiB apart) do not all fall
 * in the same L1 set. */
#define G_LDA(K) ((K) + 16)

#define CSA_IMPL "gemm_impl.h"
#include "csa_isa_variants.h"

static int g_batch_ref(const struct csa_gemm_args *gs, csa_idx count)
{
    for (csa_idx i = 0; i < count; i++) {
        const int st = csa_gemm_ref(gs + i);
        if (st) return st;
    }
    return CSA_OK;
}

/* One problem is a batch of one (gemm_impl.h: gemm_tuned_batch).  One call against a
 * call a problem, AMD EPYC (Zen 4), 2 threads, interleaved in one process, weights from
 * memory (three copies cycled), the decode GEMMs of the llama.cpp comparison's model:
 * the grouped output projection (8 FP8 problems N = 1024, K = 4096) 1.01 -> 0.76 ms at
 * the avx512 level, 1.45 -> 1.12 at avx2; six routed experts (12 FP4 problems N = 4096,
 * K = 4096 and 2048) 2.70 -> 2.54, 7.76 -> 7.55.  Each call had a thread start-up and,
 * at its end, one thread idle while the other finished the last rows. */
int csa_gemm_batch(const struct csa_gemm_args *gs, csa_idx count)
{
    if (count <= 0) return CSA_OK;
    CSA_DISPATCH(gemm_tuned_batch, (gs, count), g_batch_ref(gs, count));
}

int csa_gemm(const struct csa_gemm_args *g)
{
    return csa_gemm_batch(g, 1);
}

static int g_by_weight(const void *x, const void *y)
{
    const csa_idx *p = x, *q = y;   /* (weight, row) pairs */
    if (p[0] != q[0]) return p[0] < q[0] ? -1 : 1;
    return p[1] < q[1] ? -1 : p[1] > q[1];
}

/* b_index: row m of a (g's M rows) against weight ix[m] of the E stacked at b +
 * e * b_e bytes (scales at bs + e * bs_e bytes); ix[m] = -1: no weight (the caller
 * writes a zero row, g_zero_rows), in no problem, so the other rows' runs are what they
 * would be without it.  The rows of one weight, in increasing
 * order, split into runs of evenly spaced rows (a model's grouped projection, rows
 * t * G + g: one run a group; experts with their tokens sorted: one a weight), and each
 * run is one problem, so each weight is read once a run.  *subs: the problems (at most
 * M), *order scratch; returns their count, or -1 when an allocation failed. */
static csa_idx g_index_problems(const struct csa_gemm_args *g, const int32_t *ix,
                                csa_idx b_e, csa_idx bs_e, int as_size, int out_size,
                                struct csa_gemm_args **subs, csa_idx **order)
{
    const csa_idx M = g->M;
    *subs = malloc((size_t)(M > 0 ? M : 1) * sizeof **subs);
    *order = malloc((size_t)(M > 0 ? 2 * M : 1) * sizeof **order);
    if (!*subs || !*order) return -1;
    /* the rows sorted by weight, increasing within one (E never sizes a buffer: a
     * stack of empty weights may be as long as NumPy allows) */
    csa_idx *pair = *order;
    for (csa_idx m = 0; m < M; m++) {
        pair[2 * m] = ix[m];
        pair[2 * m + 1] = m;
    }
    qsort(pair, (size_t)M, 2 * sizeof *pair, g_by_weight);
    csa_idx n = 0, i0 = 0;
    while (i0 < M && pair[2 * i0] < 0)     /* the -1 rows sort first */
        i0++;
    for (csa_idx i = i0; i < M;) {
        const csa_idx e = pair[2 * i], r0 = pair[2 * i + 1];
        csa_idx len = 1, step = 1;
        if (i + 1 < M && pair[2 * (i + 1)] == e) {
            step = pair[2 * (i + 1) + 1] - r0;
            while (i + len < M && pair[2 * (i + len)] == e &&
                   pair[2 * (i + len) + 1] - pair[2 * (i + len - 1) + 1] == step)
                len++;
        }
        struct csa_gemm_args *p = *subs + n++;
        *p = *g;
        p->M = len;
        p->a = g->a + r0 * g->sa_row;
        p->sa_row = step * g->sa_row;
        p->as = (const char *)g->as + (size_t)(r0 * g->sas_row) * as_size;
        p->sas_row = step * g->sas_row;
        p->b = g->b + e * b_e;
        p->bs = (const char *)g->bs + e * bs_e;
        p->out = (char *)g->out + (size_t)(r0 * g->so_row) * out_size;
#ifndef CSA_MUTANT_GEMM_INDEX_STEP
        p->so_row = step * g->so_row;
#else /* planted (make mutants): a run's output rows written as if adjacent */
        p->so_row = g->so_row;
#endif
        i += len;
    }
    return n;
}

/* The b_index = -1 rows of g's output: +0.0 (all bits zero in float32 and bfloat16). */
static void g_zero_rows(const struct csa_gemm_args *g, const int32_t *ix, int out_size)
{
    for (csa_idx m = 0; m < g->M; m++)
        if (ix[m] < 0)
            memset((char *)g->out + (size_t)(m * g->so_row) * out_size, 0,
                   (size_t)g->N * out_size);
}

int csa_gemm_indexed(const struct csa_gemm_args *g, const int32_t *ix, csa_idx b_e,
                     csa_idx bs_e)
{
    if (g->M < 0) return CSA_EINVAL;
    const int as_size = g->as_fmt == CSA_S_F32 ? 4 : 1, out_size = g->out_bf16 ? 2 : 4;
    struct csa_gemm_args *subs = NULL;
    csa_idx *order = NULL;
    const csa_idx n = g_index_problems(g, ix, b_e, bs_e, as_size, out_size, &subs, &order);
    int st = CSA_ENOMEM;
    if (n >= 0) {
        st = csa_gemm_batch(subs, n);
        if (st == CSA_OK) g_zero_rows(g, ix, out_size);
    }
    free(subs);
    free(order);
    return st;
}
