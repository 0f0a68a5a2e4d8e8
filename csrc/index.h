/* Indexer scoring and top-k selection (docs/kernels.md, section 4), window and HCA index lists
 * (docs/kernels.md, sections 4 and 6). */
#ifndef CSA_INDEX_H
#define CSA_INDEX_H
#include "csa.h"

/* Scoring problem shared by the kernels below.  All strides in elements; the
 * innermost (Di) strides of q and k are 1.
 *   q : [B, S, Hi, Di]  strides (sqb, sqs, sqh, 1)
 *   k : [B, Tc, Di]     strides (skb, skt, 1)
 *   w : [B, S, Hi]      strides (swb, sws, swh)
 * q and k are both float32 or both bfloat16 (qk_bf16); w is float32 or bfloat16
 * (w_bf16), independently.  bfloat16 values are widened to float32 exactly and
 * everything is computed in float32; the scores are float32 whatever the input dtype
 * (the released scorer accumulates q.k in float32 and returns float32 scores).
 * score[b, s, t] = sum_h relu(q[b,s,h,:] . k[b,t,:]) * w[b,s,h] for the entries the
 * query at absolute position P = start_pos + s can see, t < (P + 1) / ratio; the
 * caller guarantees Tc >= (start_pos + S) / ratio, so every visible t < Tc.
 *
 * Summation order: each dot product runs over d = 0 .. Di-1 in order; the head sum
 * follows a fixed order that depends on the ISA level only, never on the thread
 * count or on which other queries or keys are in the call, so the same (q row,
 * k row, w row) always gives the same bits at a given ISA level, in every function
 * of this file.  relu keeps NaN (relu(NaN) = NaN, as torch).
 *
 * bfloat16 inputs at every level but 'amx' go through the float32 code on widened
 * copies, so they give exactly the bits of float32 inputs holding the same values.
 * At level 'amx' (CSA_ISA_AMX) bfloat16 q . k run on AMX-BF16 tiles: products of
 * bfloat16 values are exact in float32, so only the order of the float32 additions
 * of a dot product differs (the tile unit's, in chunks of 32 features from d = 0),
 * and the tile unit treats bfloat16 subnormals (|x| < 2^-126) as zero and flushes
 * subnormal results.  The head sum keeps the fixed order of the float32 code. */
struct csa_index_problem {
    const void *q, *k, *w; /* float32, or csa_bf16 where qk_bf16 / w_bf16 say so */
    int qk_bf16, w_bf16;
    csa_idx B, S, Hi, Di, Tc;
    csa_idx sqb, sqs, sqh;
    csa_idx skb, skt;
    csa_idx swb, sws, swh;
    csa_idx ratio, start_pos;
    /* FP4 operands (docs/kernels.md, section 4, "FP4 key rows"): k_fp4 = k holds
     * uint8 rows of Di / 2 + Di / 32 bytes (e2m1 codes two a byte, element 2i in the
     * low nibble, then one ue8m0 exponent byte per 32 features), skb / skt in bytes;
     * q_fp4 = q holds such rows too (sqb, sqs, sqh in bytes), else q (float32 or
     * bfloat16 per qk_bf16) is rounded to FP4 per 32 features with ue8m0 scales
     * first.  q_fp4 needs k_fp4; Di % 32 == 0.  Each block of 32 features is scored
     * as an exact integer sum of (2 q)(2 k) codes times 2^(eq + ek - 256) (the
     * product of the two scales, then the integer sum converted and scaled), the
     * blocks added in float32 in order; relu as above, then relu(dot) * w (rounded)
     * added in head order h = 0 .. Hi-1: unlike float keys, the same bits at every
     * ISA level (docs/kernels.md, section 4, "The integer path"). */
    int k_fp4, q_fp4;
    /* bf16_steps (FP4 keys only; CSA_EINVAL otherwise): the roundings of the released
     * indexer's bfloat16 torch expression, einsum -> relu -> times w -> sum over heads,
     * so that its top-k can be reproduced bit for bit.  Each head's dot (exact, as
     * above) is rounded to bfloat16 (nearest even; NaN -> 0x7fc0 as torch), relu,
     * times w (a bfloat16 value) rounded to bfloat16 again; the terms are added in
     * float32 the way torch (2.x, CPU) sums a bfloat16 [.., Hi, Tc] tensor over Hi,
     * which depends on the entry's column t:
     *   t < 32 floor(Tc / 32) (its vectorized columns, 4 vectors of 8): a cascade of 4
     *     accumulators, heads added one by one into the first, after every 16 heads
     *     the first added into the second (the second into the third after every
     *     256, the third into the fourth after every 4096), and at the end
     *     ((first + second) + third) + fourth;
     *   the other columns: 4 lanes, head h into lane h % 4 (h < 4 floor(Hi / 4)),
     *     each lane such a cascade over its own heads, then the last Hi % 4 heads
     *     added one by one into lane 0's total, then ((l0 + l1) + l2) + l3;
     * the total rounded to bfloat16.  So Tc must be the released tensor's entry
     * count (the keys the released code scores, not a longer cache).  Scores are
     * float32 holding bfloat16 values.  Hi <= 65536. */
    int bf16_steps;
};

/* V4.1 candidate blocks: mask [B, S, n_blocks] (nonzero = kept) with strides
 * (scb, scs, scn); entry t belongs to block t / block_size.  NULL mask = all kept. */
struct csa_index_cand {
    const uint8_t *mask;
    csa_idx n_blocks, block_size;
    csa_idx scb, scs, scn;
};

/* Selection and ordering of the top-k.
 *   Ranking: a higher score ranks first; NaN ranks above +inf (as torch.topk);
 *   -0.0 equals +0.0; equal scores (and NaNs among themselves) rank by LOWER
 *   position first.  The selected set is therefore unique.
 *   Only visible entries (t < (P+1)/ratio) of kept blocks take part; a row whose
 *   candidates are fewer than K fills its last slots with -1.
 *   order CSA_ORDER_SCORE: by rank (V4); CSA_ORDER_POSITION: ascending position
 *   (V4.1).  Visible entries are written as t + offset, the -1 padding comes last. */
enum { CSA_ORDER_SCORE = 0, CSA_ORDER_POSITION = 1 };

/* out: float32 [B, S, Tc], strides (sob, sos, 1); invisible entries get -inf. */
int csa_index_scores(const struct csa_index_problem *p, float *out, csa_idx sob, csa_idx sos);
int csa_index_scores_ref(const struct csa_index_problem *p, float *out, csa_idx sob,
                         csa_idx sos);

/* Fused scoring + selection; out: int32 [B, S, K] contiguous.  Extra memory is
 * O(threads * Tc) (O(B*S*Tc) when B*S is small enough to split keys across
 * threads), never [S, Tc, Hi]. */
int csa_index_topk(const struct csa_index_problem *p, const struct csa_index_cand *c,
                   csa_idx K, csa_idx offset, int order, int32_t *out);
int csa_index_topk_ref(const struct csa_index_problem *p, const struct csa_index_cand *c,
                       csa_idx K, csa_idx offset, int order, int32_t *out);

/* Selection over precomputed scores [B, S, Tc] (strides ssb, sss, sst); only the
 * visible entries are read.  Same ranking as csa_index_topk, so the two agree
 * exactly on the scores of csa_index_scores. out: int32 [B, S, K] contiguous. */
int csa_topk_indices(const float *scores, csa_idx B, csa_idx S, csa_idx Tc, csa_idx ssb,
                     csa_idx sss, csa_idx sst, csa_idx ratio, csa_idx start_pos,
                     const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                     int32_t *out);
int csa_topk_indices_ref(const float *scores, csa_idx B, csa_idx S, csa_idx Tc, csa_idx ssb,
                         csa_idx sss, csa_idx sst, csa_idx ratio, csa_idx start_pos,
                         const struct csa_index_cand *c, csa_idx K, csa_idx offset, int order,
                         int32_t *out);

/* V4.1 level one.  Block j of a row covers entries [j*bs, (j+1)*bs); its score is
 * the max over its VISIBLE entries (NaN ranks highest, as above); a block with no
 * visible entry is unreachable and never kept.  The block holding the newest visible
 * entry is always kept and counts among `topk_blocks`; the others are the best
 * reachable blocks, ties by lower block index.  out: uint8 [B, S, n_blocks]
 * contiguous, n_blocks = ceil(Tc / bs), 1 = kept. */
int csa_select_candidate_blocks(const float *scores, csa_idx B, csa_idx S, csa_idx Tc,
                                csa_idx ssb, csa_idx sss, csa_idx sst, csa_idx ratio,
                                csa_idx start_pos, csa_idx topk_blocks, csa_idx bs,
                                uint8_t *out);

/* kernels.md section 6.  Prefill (start_pos == 0): out [B, S, min(S, window)], row s lists
 * max(0, s-window+1) .. s in ascending order, then -1.  Decode (start_pos > 0, S == 1):
 * out [B, 1, window]: while the ring fills (start_pos < window-1) slots 0 .. start_pos
 * then -1; afterwards the ring slots (start_pos+1+j) mod window, oldest first. */
int csa_window_topk_idxs(int32_t *out, csa_idx window, csa_idx B, csa_idx S, csa_idx start_pos);

/* kernels.md section 4, HCA.  Prefill: out [B, S, S/ratio], row s lists t + offset for
 * t < (s+1)/ratio, then -1.  Decode (S == 1): out [B, 1, (start_pos+1)/ratio],
 * t + offset for every t. */
int csa_compress_topk_idxs(int32_t *out, csa_idx ratio, csa_idx B, csa_idx S,
                           csa_idx start_pos, csa_idx offset);
/* ------------------------------------------------------------------ gradients
 * docs/kernels.md, section 11.3.  float32 q, k, w only (qk_bf16, w_bf16, k_fp4, q_fp4
 * all 0, else CSA_EINVAL).  The results dq [B,S,Hi,Di], dk [B,Tc,Di] and dw [B,S,Hi]
 * are C-contiguous float32 and every element is written.  With a[s,h,t] = q[s,h].k[t]
 * and G[s,t] the gradient of the scores:
 *   dw[s,h] = sum_t G[s,t] relu(a[s,h,t])
 *   dq[s,h] = sum_t G[s,t] w[s,h] relu'(a) k[t],   dk[t] = sum_s sum_h (same) q[s,h]
 * over the entries row s can see; relu'(a) = 0 where a <= 0, 1 elsewhere (NaN
 * included, as torch's relu backward).  dk, which every row scatters into, is summed
 * per fixed chunk of CSA_IXG_CHUNK consecutive query rows of one batch entry into a
 * chunk partial, the partials then added in chunk order: the bits do not depend on
 * the thread count. */
#define CSA_IXG_CHUNK 32

/* g: float32 scores gradient [B, S, Tc], strides (sgb, sgs, sgt); only the visible
 * entries are read (the others are -inf in the forward and get no gradient). */
int csa_index_scores_backward(const struct csa_index_problem *p, const float *g, csa_idx sgb,
                              csa_idx sgs, csa_idx sgt, float *dq, float *dk, float *dw);
int csa_index_scores_backward_ref(const struct csa_index_problem *p, const float *g,
                                  csa_idx sgb, csa_idx sgs, csa_idx sgt, float *dq, float *dk,
                                  float *dw);

/* The indexer's KL objective (docs/kernels.md, section 11.3).  idx: int32 [B, S, K]
 * (strides sib, sis, sik), -1 = no entry, every other value a compressed entry row s
 * can see (else CSA_EINDEX, checked before anything is written); idx NULL = the dense
 * warm-up: the slots of row s are its visible entries, with K = Tc.  Row (b, s) sees
 * the entries t < nv(b, s) = clamp((P + 1) / ratio, 0, Tc) (floor division) of its
 * position P: start_pos + s, or pos[b * spb + s * sps] when pos (int32, per query:
 * padded batches, per-row positions) is not NULL.  target: float32 [B, S, K] (strides
 * stb, sts, stk), the slot's attention target (>= 0).
 * Per row with valid slots j (idx >= 0) and Z = sum_j target_j != 0 (rows with no valid
 * slot or Z == 0 take no part): p_j = target_j / Z, l_j = log_softmax_j(I),
 * L_j = l_j, or max(l_j, clip) when clip_on; the row weight rho = 1 (CSA_KL_SELECTED)
 * or Z (CSA_KL_JOINT: target_j is a probability of the joint attention distribution,
 * Z the mass that distribution puts on the row's slots); loss_row =
 * rho * sum_{p_j != 0} p_j (log p_j - L_j); *loss = mean of loss_row over the n_rows
 * rows taking part (0 when none).  Duplicate slots count as often as they appear.
 * With dq (then dk and dw) non-NULL the gradients of *loss are written too:
 * G_j = rho (softmax_j(I) - p_j) / n_rows, through the scores as above; when clipping
 * is on and some slot with p_j != 0 has l_j < clip, the clipped slots pass no gradient
 * (u_j = [l_j >= clip], U = sum_j p_j u_j): G_j = rho (softmax_j(I) U - p_j u_j) / n_rows.
 * stats (may be NULL): kl_uniform = mean over the rows taking part of
 * rho (log n + sum_{p_j != 0} p_j log p_j) (KL of p to the uniform distribution over the
 * row's n slots, weighted as the loss), rows = n_rows, degenerate = rows taking part
 * whose slots are every entry they can see (all rows of the dense warm-up).  Row sums
 * run in double; memory O(B*S + threads*K*Hi + chunks in flight*Tc*Di), never [S, Tc]. */
enum { CSA_KL_SELECTED = 0, CSA_KL_JOINT = 1 };
struct csa_kl_target {
    const int32_t *idx; /* NULL: dense warm-up */
    csa_idx K, sib, sis, sik;
    const float *t;
    csa_idx stb, sts, stk;
    const int32_t *pos; /* NULL: row s at start_pos + s */
    csa_idx spb, sps;
    int target;  /* CSA_KL_SELECTED (0) or CSA_KL_JOINT */
    int clip_on; /* 0: no clipping */
    double clip;
};
struct csa_kl_stats {
    double kl_uniform;
    csa_idx rows, degenerate;
};
int csa_indexer_kl(const struct csa_index_problem *p, const struct csa_kl_target *x,
                   double *loss, struct csa_kl_stats *stats, float *dq, float *dk, float *dw);
int csa_indexer_kl_ref(const struct csa_index_problem *p, const struct csa_kl_target *x,
                       double *loss, struct csa_kl_stats *stats, float *dq, float *dk,
                       float *dw);
#endif
