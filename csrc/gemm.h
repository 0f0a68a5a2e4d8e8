/* FP8 x FP8 and FP8 x FP4 block-scaled GEMMs (docs/kernels.md section 9: the released
 * `fp8_gemm` / `fp4_gemm`).
 *
 * C[m, n] = sum over K blocks kb of  P(m, n, kb) * (sa[m, k0 / 128] * sbx(n, kb)),
 * each block's partial sum P in float32, scaled and added into a float32 accumulator
 * (starting at +0) by one fused multiply-add, blocks in increasing k; the result is
 * stored as float32 or rounded once to bfloat16 (nearest-even).
 *
 *   FP8 weights (CSA_W_E4M3): b [N, K] e4m3fn bytes, blocks of 128 along K, one scale
 *       per 128 x 128 block: sb[n / 128, kb].  Decoded b values enter P divided by 256
 *       (exact: they are fp16 halves of the e4m3 values) and sbx = sb * 256.
 *   FP4 weights (CSA_W_E2M1): b [N, K / 2] bytes, two e2m1 values a byte (element 2i in
 *       the low nibble, as torch's float4_e2m1fn_x2), blocks of 32 along K with one
 *       scale each: sb[n, k0 / 32]; sbx = sb.
 * Activations a [M, K] are e4m3fn bytes with one scale per row and 128 columns.
 * The block partial sum P has a fixed order: eight lanes, lane j adding the products
 * of the block's elements j, j + 8, j + 16, ... in increasing k (every product of two
 * of these formats is exact in float32), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
 * (l6 + l7)).  Every ISA level and thread count computes exactly this, so the bits
 * never depend on them; it equals the same sum over the true values except when
 * sa * sb * 256 overflows float32 (scales beyond 2^120).  One exception, by design:
 * at the amx level, more than 16 activation rows with power-of-two scales run on AMX
 * tiles (gemm_amx_impl.h), whose float32 additions take the tiles'
 * order -- the same products, bits within float32 rounding of the oracle's, still
 * independent of the thread count. 
 *
 * Decoding: e4m3 0x7f / 0xff are NaN, e8m0 0xff is NaN and 0x00 is 2^-127; scales may
 * also be float32.  A trailing partial block (K not a multiple of the block) is
 * summed the same way over the elements it has. */
#ifndef CSA_GEMM_H
#define CSA_GEMM_H
#include "csa.h"

enum csa_gemm_wfmt { CSA_W_E4M3 = 0, CSA_W_E2M1 = 1 };
enum csa_gemm_sfmt { CSA_S_F32 = 0, CSA_S_E8M0 = 1 };

struct csa_gemm_args {
    const uint8_t *a;          /* [M, K] e4m3 bytes, unit column stride */
    csa_idx M, K, sa_row;
    const void *as;            /* [M, ceil(K / 128)] float32 or e8m0 bytes */
    int as_fmt;
    csa_idx sas_row, sas_col;
    const uint8_t *b;          /* [N, K] e4m3 or [N, K / 2] packed e2m1, unit column stride */
    int b_fmt;
    csa_idx N, sb_row;         /* row stride in bytes */
    const void *bs;            /* [ceil(N / 128), ceil(K / 128)] or [N, ceil(K / 32)] */
    int bs_fmt;
    csa_idx sbs_row, sbs_col;
    void *out;                 /* [M, N] float32 or bfloat16, unit column stride */
    int out_bf16;
    csa_idx so_row;
};

int csa_gemm(const struct csa_gemm_args *g);
int csa_gemm_ref(const struct csa_gemm_args *g);

/* count independent GEMMs (a model's grouped output projection, or its routed experts
 * at decode: a few weights with one activation row each), each output element the
 * bits csa_gemm gives for its own problem.  The one-activation-row problems share one
 * parallel region, their row groups handed out together: one thread start-up instead
 * of one a problem, and no thread waiting at a problem's end while work is left
 * (gemm.c has the measurement).  The others run one after another. */
int csa_gemm_batch(const struct csa_gemm_args *gs, csa_idx count);

/* g's M activation rows against a stack of E weights: row m times weight ix[m] (at
 * g->b + ix[m] * b_e bytes, its scales at g->bs + ix[m] * bs_e bytes), or, for
 * ix[m] = -1, no weight: output row m is +0.0.  ix has M entries, each in [-1, E)
 * (the caller checks).  The rows of one weight, in increasing order, split into runs
 * of evenly spaced rows (a model's grouped projection, rows t * G + g: one run a group;
 * experts with their tokens sorted: one a weight); each run is one problem of
 * csa_gemm_batch, so a weight is read once a run, and each output element has the
 * bits csa_gemm gives for its own run.  CSA_ENOMEM when the run list cannot be
 * allocated. */
int csa_gemm_indexed(const struct csa_gemm_args *g, const int32_t *ix, csa_idx b_e,
                     csa_idx bs_e);

/* Weight-only FP8: float activations (float32 or bfloat16, as they are) times e4m3
 * weights with one scale per 128 x 128 block (the layout fp8_gemm reads), for a
 * product the released model.py computes in bf16 from a widened FP8 weight (its
 * attention's grouped output projection wo_a, an einsum over weights DeepSeek's
 * convert.py dequantizes): reading the FP8 codes halves the bytes.
 *
 * C[m, n] = sum over K blocks kb of P(m, n, kb) * (sb[n / 128, kb] * 256), each block's
 * partial sum P in float32 over sixteen lanes, lane j adding a[m, k] * (e4m3(b[n, k]) /
 * 256) by a fused multiply-add for the block's k = k0 + j, k0 + j + 16, ... in increasing
 * k (the weights enter divided by 256, exact: they are binary16 halves, which the tuned
 * code converts), the lanes reduced pairwise (lanes 0+1, 2+3, ..., then those pairs,
 * ..., one sum), P added into a float32 accumulator (from +0) by one fused multiply-add;
 * stored as float32 or rounded once to bfloat16.  bf16 activations give exact products
 * (8 x 4 significant bits), so the result is the exact-product sum in this order
 * (scaled by powers of two: exact away from float32's subnormal range); every level and thread
 * count computes exactly this (one thread an output row).  e4m3 0x7f / 0xff and e8m0
 * 0xff decode to NaN, e8m0 0x00 to 2^-127.
 *
 * bfloat16 weights (b_bf16): the same with lane j adding a[m, k] * b[n, k] and P added
 * into the accumulator as it is -- the released model.py's float32 weights that its
 * checkpoint stores in bf16 (the compressors' wkv / wgate, the head), read at half the
 * bytes of their float32 copies.
 *
 * Groups (ng_rows > 0): weight row n reads the activations a + (n / ng_rows) * sa_grp,
 * so one call runs G independent products [M, K] x [ng_rows, K]^T side by side, output
 * row m holding them one after another (the einsum "bsgd,grd->bsgr"). */
struct csa_wgemm_args {
    const void *a;             /* [M, (G,) K] float32 or bfloat16, unit column stride */
    int a_bf16;
    csa_idx M, K, sa_row, sa_grp, ng_rows;
    const uint8_t *b;          /* [N, K] e4m3 bytes (or bfloat16), unit column stride */
    int b_bf16;                /* bf16 weights: no scales (bs unused), P added as it is */
    csa_idx N, sb_row;         /* row stride in bytes */
    const void *bs;            /* [ceil(N / 128), ceil(K / 128)] float32 or e8m0 */
    int bs_fmt;
    csa_idx sbs_row, sbs_col;
    void *out;                 /* [M, N] float32 or bfloat16, unit column stride */
    int out_bf16;
    csa_idx so_row;
};

int csa_wfp8_gemm(const struct csa_wgemm_args *g);
int csa_wfp8_gemm_ref(const struct csa_wgemm_args *g);

/* Scalar decoders (the oracle's), for the tests and other kernels. */
float csa_e4m3_to_f32(uint8_t v);
float csa_e2m1_to_f32(uint8_t nibble);
float csa_e8m0_to_f32(uint8_t v);
#endif
