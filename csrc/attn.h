/* Top-k sparse attention with an attention sink (SPEC section 5). */
#ifndef CSA_ATTN_H
#define CSA_ATTN_H
#include "csa.h"

/* For every batch b, query s and head h, over the valid entries j of idx[b, s, :]
 * (an entry of -1 is skipped):
 *
 *     l_j = scale * q[b, s, h, :] . kv[b, idx_j, :]
 *     out[b, s, h, :] = sum_j e^(l_j - m) kv[b, idx_j, :]
 *                       / (sum_j e^(l_j - m) + e^(sink[h] - m))
 *
 * K = V: one KV head shared by all H query heads (MQA).  The sink adds to the
 * denominator only.  m is the running maximum over the logits AND the sink: the
 * same quotient as with m = max_j l_j, but no exponent is ever positive, so nothing
 * overflows (a sink far above every logit gives a tiny output, not 0 * inf).  A
 * query with no valid index gets zeros.  Duplicate indices count once per
 * occurrence.  NaN in q, kv or sink propagates to the affected outputs.
 *
 * q:    [B, S, H, D], strides (sq_b, sq_s, sq_h, 1)
 * kv:   [B, N, D],    strides (skv_b, skv_n, 1)
 * sink: [H], contiguous
 * idx:  [B, S, K] int32, strides (si_b, si_s, 1); every entry in [-1, N)
 * out:  [B, S, H, D], strides (so_b, so_s, so_h, 1); must not overlap the inputs
 *
 * Returns CSA_EINDEX, before writing anything, if an index lies outside [-1, N);
 * CSA_ENOMEM if scratch space (a few hundred KB per thread) cannot be allocated.
 * Each (b, s, h) is computed by one thread in a fixed order, so the result is
 * bitwise the same at any thread count. */
int csa_sparse_attn(const float *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                    const float *kv, csa_idx skv_b, csa_idx skv_n,
                    const float *sink,
                    const int32_t *idx, csa_idx si_b, csa_idx si_s,
                    float *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                    csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                    float scale);

/* The same on bfloat16 q, kv and out (sink stays float32), the released model's
 * dtypes.  Logits, softmax and the accumulation of the output are float32; the
 * weights e^(l_j - m) are rounded to bfloat16 before they multiply kv (a bf16 GEMM,
 * as the released kernel runs it) while the denominator sums them unrounded; the
 * output is rounded to bfloat16 once.  At ISA level amx the two products run on
 * AMX-BF16 tiles, whose float32 summation order differs from the other levels' and
 * which treat bfloat16 subnormals as zero; every level is within bf16 rounding of the
 * others, and each is bitwise the same at any thread count. */
int csa_sparse_attn_bf16(const csa_bf16 *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                         const csa_bf16 *kv, csa_idx skv_b, csa_idx skv_n,
                         const float *sink,
                         const int32_t *idx, csa_idx si_b, csa_idx si_s,
                         csa_bf16 *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                         csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                         float scale);

/* The scalar oracles: the formula above, two passes per (b, s, h), no scratch. */
int csa_sparse_attn_ref(const float *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                        const float *kv, csa_idx skv_b, csa_idx skv_n,
                        const float *sink,
                        const int32_t *idx, csa_idx si_b, csa_idx si_s,
                        float *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                        csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                        float scale);
int csa_sparse_attn_bf16_ref(const csa_bf16 *q, csa_idx sq_b, csa_idx sq_s, csa_idx sq_h,
                             const csa_bf16 *kv, csa_idx skv_b, csa_idx skv_n,
                             const float *sink,
                             const int32_t *idx, csa_idx si_b, csa_idx si_s,
                             csa_bf16 *out, csa_idx so_b, csa_idx so_s, csa_idx so_h,
                             csa_idx B, csa_idx S, csa_idx H, csa_idx D, csa_idx N, csa_idx K,
                             float scale);
#endif
