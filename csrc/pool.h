/* Gated pooling, the Compressor (SPEC section 3): prefill of complete groups and the
 * explicit per-sequence streaming state of decode. */
#ifndef CSA_POOL_H
#define CSA_POOL_H
#include "csa.h"

/* out[b, g, f] for g < T / ratio, f < d (c = 2 with overlap, else 1):
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
int csa_gated_pool(const void *kv, int kv_bf16, csa_idx skb, csa_idx skt, csa_idx skf,
                   const void *score, int sc_bf16, csa_idx ssb, csa_idx sst, csa_idx ssf,
                   const float *ape, csa_idx sar, csa_idx saf,
                   csa_idx B, csa_idx T, csa_idx d, csa_idx ratio, int overlap,
                   void *out, int out_bf16, csa_idx sob, csa_idx sog, csa_idx sof);
int csa_gated_pool_ref(const void *kv, int kv_bf16, csa_idx skb, csa_idx skt, csa_idx skf,
                       const void *score, int sc_bf16, csa_idx ssb, csa_idx sst, csa_idx ssf,
                       const float *ape, csa_idx sar, csa_idx saf,
                       csa_idx B, csa_idx T, csa_idx d, csa_idx ratio, int overlap,
                       void *out, int out_bf16, csa_idx sob, csa_idx sog, csa_idx sof);

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

/* What happens to an emitted entry (SPEC 3, "After pooling"), in this order:
 *   bf16:   round to bfloat16 (nearest-even), as the cast to the model dtype, and again
 *           after the norm and after RoPE (each writes back in the model dtype); a
 *           bfloat16 `out` implies it (the entries are then bfloat16 themselves:
 *           rounded on the pooling store, normed and rotated by the bf16 kernels);
 *   norm_w: [d] RMSNorm weight (unit stride), eps; NULL: no norm;
 *   cos, sin: [rows, half] tables (row stride srow, unit inner stride); entry g is
 *           rotated on its last 2*half features by row g*ratio; NULL: no RoPE.
 * The FP8 / FP4 rounding is applied by the caller. */
typedef struct {
    int bf16;
    const float *norm_w;
    float eps;
    const float *cos, *sin;
    csa_idx half, rows, srow;
} csa_pool_epilogue;

/* Prefill (start_pos 0) of rows 0..B-1 of the state, B <= st->batch: pools the T/ratio
 * complete groups into out [B, T/ratio, d] (strides sob, sog, unit feature stride),
 * applies the epilogue `ep` (may be NULL), and keeps the T % ratio trailing tokens (and,
 * with overlap, the last complete group) in the state; pos[b] = T.  kv, score: [B, T,
 * c*d] with unit feature strides; ape: [ratio, c*d] contiguous or NULL.  Bitwise equal
 * to pooling the same tokens through csa_pool_step.  kv, score, out: float32 or
 * bfloat16 by their flags (as csa_gated_pool); the state is float32 whatever they are
 * (bfloat16 -> float32 is exact). */
int csa_pool_prefill(csa_pool_state *st, const void *kv, int kv_bf16, csa_idx skb,
                     csa_idx skt, const void *score, int sc_bf16, csa_idx ssb, csa_idx sst,
                     const float *ape, csa_idx B, csa_idx T, const csa_pool_epilogue *ep,
                     void *out, int out_bf16, csa_idx sob, csa_idx sog);

/* One decode token at position p for rows 0..B-1 (every pos[b] must equal p): kv,
 * score [B, c*d] (row strides skb, ssb; unit feature stride), ape as above.  Fills
 * slot p % ratio; when (p + 1) % ratio == 0 pools the group into out [B, d] (row
 * stride sob), applies `ep`, sets *emitted = 1 and, with overlap, makes the group the
 * previous one.  pos[b] = p + 1.  Element types as csa_pool_prefill. */
int csa_pool_step(csa_pool_state *st, const void *kv, int kv_bf16, csa_idx skb,
                  const void *score, int sc_bf16, csa_idx ssb, const float *ape, csa_idx B,
                  int64_t p, const csa_pool_epilogue *ep, void *out, int out_bf16,
                  csa_idx sob, int *emitted);

/* Rounds n float32 values (stride s) to bfloat16 precision in place, nearest-even,
 * NaN stays NaN. */
void csa_round_bf16(float *x, csa_idx n, csa_idx s);
#endif
