/* Top-k sparse attention with an attention sink (docs/kernels.md, section 5). */
#ifndef CSA_ATTN_H
#define CSA_ATTN_H
#include "csa.h"

/* One sparse attention call; the glue fills it, csa_sparse_attn and the `_ref` oracle
 * take it as const.  For every batch b, query s and head h, over the valid entries j
 * of idx[b, s, :] (an entry of -1 is skipped):
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
 * q, kv and out are float32, or bfloat16 (csa_bf16) when `bf16` (the released
 * model's dtypes; sink stays float32).  bfloat16: logits, softmax and the
 * accumulation of the output are float32; the weights e^(l_j - m) are rounded to
 * bfloat16 before they multiply kv (a bf16 GEMM, as the released kernel runs it)
 * while the denominator sums them unrounded; the output is rounded to bfloat16 once.
 * At ISA level amx the two products run on AMX-BF16 tiles, whose float32 summation
 * order differs from the other levels' and which treat bfloat16 subnormals as zero;
 * every level is within bf16 rounding of the others. */
struct csa_attn_problem {
    const void *q;     /* float32, or bfloat16 when bf16 */
    csa_idx sq_b, sq_s, sq_h;
    const void *kv;    /* same dtype as q */
    csa_idx skv_b, skv_n;
    const float *sink;
    const int32_t *idx;
    csa_idx si_b, si_s;
    void *out;         /* same dtype as q */
    csa_idx so_b, so_s, so_h;
    csa_idx B, S, H, D, N, K;
    float scale;
    int bf16;
    /* Optional results of the same pass (NULL: not wanted).  lse: float32 [B, S, H],
     * strides (sl_b, sl_s, 1), the row log-sum-exp of the full denominator,
     * log(sum_j e^(l_j) + e^(sink[h])) (a query with no valid index: sink[h]).
     * weights: float32 [B, S, K], strides (sw_b, sw_s, 1), per slot the probability
     * e^(l_j - lse) summed over the heads (0 for a -1 slot; a duplicated index gives
     * each of its slots the same value).  out may be NULL when only weights (and lse)
     * are wanted; weights are computed at float32 precision from float32 logits. */
    float *lse;
    csa_idx sl_b, sl_s;
    float *weights;
    csa_idx sw_b, sw_s;
};

/* The backward of one sparse attention call (docs/kernels.md, section 11.1).  f holds
 * the forward's inputs (f.out: the forward's output O, f.lse: its row log-sum-exp,
 * both as the forward returned them; f.weights unused).  With p_j = e^(l_j - lse) and
 * Dr = dO . O per (b, s, h):
 *
 *     dl_j            = p_j (dO . kv_j - Dr)
 *     dq              = scale sum_j dl_j kv_j
 *     dkv[b, idx_j]  += p_j dO + scale dl_j q      (summed over s, slots and heads)
 *     dsink[h]        = -sum_{b,s} e^(sink[h] - lse) Dr
 *
 * -1 slots are skipped, a query with no valid index contributes nothing, a
 * duplicated index contributes once per slot.  dkv rows no slot references get 0.
 * Every dkv element is summed in the order (b, s, slot) whatever the thread count;
 * dsink in the order (b, s).  All results are fully written (no accumulation into
 * the caller's arrays).  dout/dq: [B, S, H, D] (unit inner stride), dkv: [B, N, D],
 * dsink: [H] contiguous; none may overlap another array.
 *
 * dtypes: q, kv, out are float32, or bfloat16 when f.bf16; dout is float32 or bfloat16
 * by dout_bf16: bfloat16 inputs are widened exactly where they are read (no copy), and
 * all arithmetic is float32, so the results are bitwise those of the float32 call on
 * the widened values.  dq and dkv are float32, or bfloat16 by dq_bf16 / dkv_bf16: the
 * float32 result rounded once (csa_f32_to_bf16).  The tuned bodies round each row's d(q)
 * as they store it; d(kv) (and the oracle's d(q)) go through float32 scratch of the
 * result's size; dsink is float32. */
struct csa_attn_bwd_problem {
    struct csa_attn_problem f;
    const void *dout;
    csa_idx sdo_b, sdo_s, sdo_h;
    void *dq;
    csa_idx sdq_b, sdq_s, sdq_h;
    void *dkv;
    csa_idx sdkv_b, sdkv_n;
    float *dsink;
    int dout_bf16, dq_bf16, dkv_bf16;
};

/* Returns CSA_EINDEX, before writing anything, if an index lies outside [-1, N);
 * CSA_ENOMEM if scratch space (a few hundred KB per thread) cannot be allocated.
 * Each (b, s, h) is computed by one thread in a fixed order, so the result is
 * bitwise the same at any thread count. */
int csa_sparse_attn(const struct csa_attn_problem *p);

/* The scalar oracle: the formula above, two passes per (b, s, h), no scratch. */
int csa_sparse_attn_ref(const struct csa_attn_problem *p);

/* f.out (may be NULL), f.lse (may be NULL) and f.weights (must be set) in one pass
 * (the ISA levels' non-AMX bodies, float32 arithmetic for bf16 inputs too). */
int csa_sparse_attn_weights(const struct csa_attn_problem *p);
int csa_sparse_attn_weights_ref(const struct csa_attn_problem *p);

/* The backward above; CSA_EINDEX (nothing written) for an index outside [-1, N),
 * CSA_ENOMEM if scratch cannot be had.  _ref: the scalar oracle, one (b, s, h) after
 * another. */
int csa_sparse_attn_backward(const struct csa_attn_bwd_problem *g);
int csa_sparse_attn_backward_ref(const struct csa_attn_bwd_problem *g);

/* The first entry of p->idx outside [-1, N), in (b, s, k) order: returns 1 and sets
 * *b, *s, *k, or 0 if every entry is valid.  Both entries above run it (once) before
 * reading a row; the glue runs it again only to name the entry of a CSA_EINDEX. */
int csa_attn_bad_index(const struct csa_attn_problem *p, csa_idx *b, csa_idx *s, csa_idx *k);
#endif
