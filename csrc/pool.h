/* Gated pooling, the Compressor (docs/kernels.md, section 3): prefill of complete groups and the
 * explicit per-sequence streaming state of decode. */
#ifndef CSA_POOL_H
#define CSA_POOL_H
#include "csa.h"

/* One pooling call; the glue fills it, the kernels take it as const.
 * out[b, g, f] for g < T / ratio, f < d (c = 2 with overlap, else 1):
 *   non-overlap: softmax over j < ratio of  score[b, g*r+j, f] + ape[j, f]  weighting
 *                kv[b, g*r+j, f];
 *   overlap:     softmax over the r tokens of group g-1 through features f (logit
 *                score + ape[j, f]) and the r tokens of group g through features d+f
 *                (logit score + ape[j, d+f]); group -1 does not exist (weight 0);
 *   ratio 1 without overlap: out = kv (no gate; score may be NULL).
 * Float32 throughout: logits, max, exp(l - max), sum, then sum(e*kv) / sum(e).
 * kv, score: [B, T, c*d] with strides (skb, skt, skf), (ssb, sst, ssf); ape: [ratio,
 * c*d] with strides (sar, saf), or NULL for zeros; out: [B, T/ratio, d] with strides
 * (sob, sog, sof).  The tuned kernels need unit feature strides (else the `_ref` runs).
 * Element types: kv, score and out are each float32 (flag 0) or bfloat16 (flag 1,
 * csa_bf16): bfloat16 inputs are widened exactly as they are read, and a bfloat16 out
 * is rounded once, nearest-even, on store; ape is float32. */
struct csa_pool_problem {
    const void *kv;
    csa_idx skb, skt, skf;
    const void *score;
    csa_idx ssb, sst, ssf;
    const float *ape;
    csa_idx sar, saf;
    void *out;
    csa_idx sob, sog, sof;
    csa_idx B, T, d, ratio;
    int overlap;
    int kv_bf16, sc_bf16, out_bf16;
};

int csa_gated_pool(const struct csa_pool_problem *p);
int csa_gated_pool_ref(const struct csa_pool_problem *p);

/* Backward of csa_gated_pool (docs/kernels.md, section 11.2).  Per entry and feature,
 * with the candidates, logits l_j = score_j + ape_j and w = softmax(l) of the forward
 * (recomputed: nothing is saved but the inputs) and y = sum_j w_j kv_j:
 *   d(kv_j) = w_j dy,   d(score_j) = w_j dy (kv_j - y),
 *   d(ape)[j, f] = the sum of d(score) over every complete group and row: the `_ref`
 *   adds the entries (b, g) in the order b = 0.., g = 0.. into one sum; the tuned
 *   kernels cut the entries, in that order, into chunks fixed by the shape alone (at
 *   most 8; one while the problem has fewer than 64K candidate elements, pool.c
 *   grad_chunks), sum each chunk in order and add the chunk sums in chunk order -- the
 *   `_ref`'s bits for a problem of one chunk, else the same sum rounded differently.
 * Every (token, feature) of kv / score feeds at most one entry (with overlap, group g's
 * first halves feed entry g+1, its second halves entry g), so d(kv) and d(score) have
 * one writer each; what feeds no entry (the T % ratio trailing tokens, with overlap the
 * last complete group's first halves) gets 0.  Ratio 1 without overlap: d(kv) = dy,
 * d(score) = 0 (score may be NULL) and d(ape) = 0.
 * dy: [B, T/ratio, d] (strides sdb, sdg); kv, score: [B, T, c*d]; ape [ratio, c*d] or
 * NULL; dkv, dsc: [B, T, c*d] float32 (dsc may be NULL only at ratio 1 without
 * overlap); dape [ratio, c*d] float32 or NULL (not wanted).  Every feature stride is 1.
 * kv, score, dy: float32 or bfloat16 by their flags (widened exactly); arithmetic
 * float32.  dkv / dsc are float32, or bfloat16 by dkv_bf16 / dsc_bf16: the float32 result
 * rounded once (csa_f32_to_bf16) as the tuned bodies store it (the oracle goes through
 * float32 scratch); d(ape) is summed from the float32 d(score) either way.  Bits do not
 * depend on the thread count. */
struct csa_pool_grad_problem {
    const void *dy;
    csa_idx sdb, sdg;
    const void *kv;
    csa_idx skb, skt;
    const void *score;
    csa_idx ssb, sst;
    const float *ape;
    csa_idx sar;
    void *dkv;
    csa_idx sgkb, sgkt;
    void *dsc;
    csa_idx sgsb, sgst;
    float *dape;
    csa_idx sgar;
    csa_idx B, T, d, ratio;
    int overlap;
    int dy_bf16, kv_bf16, sc_bf16, dkv_bf16, dsc_bf16;
};

int csa_gated_pool_backward(const struct csa_pool_grad_problem *p);
int csa_gated_pool_backward_ref(const struct csa_pool_grad_problem *p);

/* Streaming state of `batch` sequences (all arrays C-contiguous, owned by the caller):
 *   kv, score:           [batch, ratio, c*d]  the open group: slot p % ratio holds the kv
 *                        of position p and its LOGIT (score + ape[p % ratio]);
 *   prev_kv, prev_score: [batch, ratio, d]    (overlap only, else unused) the first
 *                        halves of the last complete group, kv and logits;
 *   pos:                 [batch]              tokens seen = the next start_pos.
 * A row is fresh at pos 0; nothing but pos decides what is valid. */
typedef struct {
    csa_idx batch, ratio, d;
    int overlap;
    float *kv, *score, *prev_kv, *prev_score;
    int64_t *pos;
} csa_pool_state;

/* What happens to an emitted entry (kernels.md section 3, "Epilogue"), in this order:
 *   bf16:   round to bfloat16 (nearest-even), as the cast to the model dtype, and again
 *           after the norm and after RoPE (each writes back in the model dtype); a
 *           bfloat16 `out` implies it (the entries are then bfloat16 themselves:
 *           rounded on the pooling store, normed and rotated by the bf16 kernels);
 *   norm_w: [d] RMSNorm weight (unit stride), eps; NULL: no norm;
 *   cos, sin: [rows, half] tables (row stride srow, unit inner stride); entry g is
 *           rotated on its last 2*half features by row g*ratio; NULL: no RoPE;
 *   quant:  the released QAT rounding (enum csa_pool_quant), applied last, in place,
 *           by the rounding kernels of quant.h (the bits of csa_quant_round /
 *           csa_hadamard on the stored entries):
 *             FP8           e4m3, ue8m0 scales, blocks of 64, on the first quant_d
 *                           features (d minus the rope dimension);
 *             FP4           e2m1, ue8m0 scales, blocks of 32;
 *             HADAMARD_FP4  the normalized Hadamard rotation (scale float32(d^-1/2)),
 *                           back to bfloat16 under `bf16`, then FP4 as above;
 *             FP4_E4M3      e2m1 in blocks of 16 with e4m3 scales, then back to
 *                           bfloat16 under `bf16` (the scales are not powers of two);
 *           a bfloat16 `out` is rounded by the bfloat16 kernels (widen, round in
 *           float32, narrow once);
 *   pack:   (FP4 or HADAMARD_FP4 only, d % 32 == 0) the entries are not stored as
 *           values: `out` of the problem is uint8 [B, G, d/2 + d/32] (strides sob, sog
 *           in bytes, unit inner stride) and each entry row holds the e2m1 codes of
 *           its rounded values, two a byte, element 2i in the low nibble, then one
 *           ue8m0 exponent byte per block of 32 (csa_quant_pack's layout, qpack.h;
 *           docs/kernels.md, "Packed FP4 entries").  The value rows live in a scratch
 *           buffer only (CSA_ENOMEM if it cannot be allocated). */
enum csa_pool_quant {
    CSA_POOL_Q_NONE = 0,
    CSA_POOL_Q_FP8 = 1,
    CSA_POOL_Q_FP4 = 2,
    CSA_POOL_Q_HADAMARD_FP4 = 3,
    CSA_POOL_Q_FP4_E4M3 = 4,
};

typedef struct {
    int bf16;
    const float *norm_w;
    float eps;
    const float *cos, *sin;
    csa_idx half, rows, srow;
    int quant;
    csa_idx quant_d;
    int pack;
} csa_pool_epilogue;

/* Bytes of one packed FP4 entry row of width d (pack above): d/2 codes + d/32 scales. */
#define CSA_POOL_PACKED_ROW(d) ((d) / 2 + (d) / 32)

/* Prefill (start_pos 0) of rows 0..B-1 of the state, B = p->B <= st->batch: pools the
 * T/ratio complete groups of p (p->ratio, d, overlap: the state's; unit feature
 * strides; ape [ratio, c*d] contiguous or NULL; out [B, T/ratio, d] with unit feature
 * stride), applies the epilogue `ep` (may be NULL), and keeps the T % ratio trailing
 * tokens (and, with overlap, the last complete group) in the state; pos[b] = T.
 * Bitwise equal to pooling the same tokens through csa_pool_step.  kv, score, out:
 * float32 or bfloat16 by their flags; the state is float32 whatever they are
 * (bfloat16 -> float32 is exact). */
int csa_pool_prefill(csa_pool_state *st, const struct csa_pool_problem *p,
                     const csa_pool_epilogue *ep);

/* One decode token at position `pos` for rows 0..B-1 of p (T = 1; every st->pos[b]
 * must equal pos): kv, score [B, 1, c*d] (row strides skb, ssb; unit feature
 * stride), ape as above, out [B, 1, d] (row stride sob).  Fills slot pos % ratio;
 * when (pos + 1) % ratio == 0 pools the group into out, applies `ep`, sets
 * *emitted = 1 and, with overlap, makes the group the previous one.
 * st->pos[b] = pos + 1.  Element types as csa_pool_prefill. */
int csa_pool_step(csa_pool_state *st, const struct csa_pool_problem *p, int64_t pos,
                  const csa_pool_epilogue *ep, int *emitted);

/* Rounds n float32 values (stride s) to bfloat16 precision in place: the value of
 * csa_f32_to_bf16 (nearest-even; a NaN stays a NaN with its top payload bits, quieted),
 * widened back. */
void csa_round_bf16(float *x, csa_idx n, csa_idx s);
#endif
