#include "pool.h"

#include <math.h>
#include <string.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "norm.h"
#include "rope.h"

/* The candidates of one entry that come from one place: candidate j reads
 * kv + j*skv, sc + j*ssc and (unless ape is NULL) ape + j*sape, each at feature f
 * times its feature stride (always 1 in the tuned kernels).  `sc` holds scores, or
 * logits already including ape (the streaming state), in which case ape is NULL. */
typedef struct {
    const float *kv, *sc, *ape;
    csa_idx n, skv, ssc, sape;
    csa_idx fkv, fsc, fape;
    csa_idx pf;   /* tuned prefill only: the row's other half (elements away), which the
                   * next entry reads, is prefetched along with it; 0 = none */
} pool_cands;

/* The scalar oracle of one entry.  Per feature, in this order: m = max of the logits
 * (a NaN logit never becomes the max; it makes its own exp NaN, hence the entry NaN,
 * as torch's softmax does), e_j = exp(l_j - m), s = sum e_j, acc = sum e_j kv_j,
 * out = acc / s.  All -inf logits give NaN, as torch's softmax does. */
static int pool_entry_ref(const pool_cands *c, int nc, csa_idx d, float *out, csa_idx sof)
{
    for (csa_idx f = 0; f < d; f++) {
        float m = -INFINITY;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                float l = c[k].sc[j * c[k].ssc + f * c[k].fsc];
                if (c[k].ape) l += c[k].ape[j * c[k].sape + f * c[k].fape];
                m = l > m ? l : m;
            }
        float s = 0.0f, acc = 0.0f;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                float l = c[k].sc[j * c[k].ssc + f * c[k].fsc];
                if (c[k].ape) l += c[k].ape[j * c[k].sape + f * c[k].fape];
                const float e = expf(l - m);
                s += e;
                acc += e * c[k].kv[j * c[k].skv + f * c[k].fkv];
            }
        out[f * sof] = acc / s;
    }
    return CSA_OK;
}

/* The candidate sources of entry g of a [T, c*d] sequence (pointers at its row 0). */
static int entry_cands(pool_cands *c, const float *kv, csa_idx skt, csa_idx skf,
                       const float *score, csa_idx sst, csa_idx ssf, const float *ape,
                       csa_idx sar, csa_idx saf, csa_idx d, csa_idx r, int overlap, csa_idx g)
{
    const float *k0 = kv + g * r * skt, *s0 = score + g * r * sst;
    if (!overlap) {
        c[0] = (pool_cands){k0, s0, ape, r, skt, sst, sar, skf, ssf, saf};
        return 1;
    }
    /* group g-1 through the first d features, group g through the second d */
    c[0] = (pool_cands){k0 - r * skt, s0 - r * sst, ape, g > 0 ? r : 0, skt, sst, sar,
                        skf, ssf, saf};
    c[1] = (pool_cands){k0 + d * skf, s0 + d * ssf, ape ? ape + d * saf : NULL, r, skt, sst,
                        sar, skf, ssf, saf, -d * skf};
    return 2;
}

int csa_gated_pool_ref(const float *kv, csa_idx skb, csa_idx skt, csa_idx skf,
                       const float *score, csa_idx ssb, csa_idx sst, csa_idx ssf,
                       const float *ape, csa_idx sar, csa_idx saf,
                       csa_idx B, csa_idx T, csa_idx d, csa_idx ratio, int overlap,
                       float *out, csa_idx sob, csa_idx sog, csa_idx sof)
{
    if (ratio <= 0 || B < 0 || T < 0 || d < 0) return CSA_EINVAL;
    const csa_idx G = T / ratio;
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx g = 0; g < G; g++) {
            float *o = out + b * sob + g * sog;
            if (ratio == 1 && !overlap) {
                for (csa_idx f = 0; f < d; f++) o[f * sof] = kv[b * skb + g * skt + f * skf];
                continue;
            }
            pool_cands c[2];
            const int nc = entry_cands(c, kv + b * skb, skt, skf, score + b * ssb, sst, ssf,
                                       ape, sar, saf, d, ratio, overlap, g);
            pool_entry_ref(c, nc, d, o, sof);
        }
    return CSA_OK;
}

/* Feature chunk of one decode entry per parallel item. */
#define POOL_STEP_F 128

#define CSA_IMPL "pool_impl.h"
#include "csa_isa_variants.h"

int csa_gated_pool(const float *kv, csa_idx skb, csa_idx skt, csa_idx skf,
                   const float *score, csa_idx ssb, csa_idx sst, csa_idx ssf,
                   const float *ape, csa_idx sar, csa_idx saf,
                   csa_idx B, csa_idx T, csa_idx d, csa_idx ratio, int overlap,
                   float *out, csa_idx sob, csa_idx sog, csa_idx sof)
{
    if (skf != 1 || (score && ssf != 1) || (ape && saf != 1) || sof != 1)
        return csa_gated_pool_ref(kv, skb, skt, skf, score, ssb, sst, ssf, ape, sar, saf, B,
                                  T, d, ratio, overlap, out, sob, sog, sof);
    CSA_DISPATCH(gated_pool_tuned,
                 (kv, skb, skt, score, ssb, sst, ape, sar, B, T, d, ratio, overlap, out, sob, sog),
                 csa_gated_pool_ref(kv, skb, skt, skf, score, ssb, sst, ssf, ape, sar, saf, B, T,
                                    d, ratio, overlap, out, sob, sog, sof));
}

/* One entry at the current ISA level: the decode step pools with exactly the code
 * the prefill pools with, so both give the same bits. */
static int pool_entry_any(const pool_cands *c, int nc, csa_idx d, float *out)
{
    CSA_DISPATCH(pool_entry_tuned, (c, nc, d, out), pool_entry_ref(c, nc, d, out, 1));
}

void csa_round_bf16(float *x, csa_idx n, csa_idx s)
{
    for (csa_idx i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i * s], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) u = 0x7fc00000u;      /* NaN stays NaN */
        else u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;  /* nearest-even */
        memcpy(&x[i * s], &u, 4);
    }
}

static void round_rows(float *out, csa_idx B, csa_idx G, csa_idx d, csa_idx sob, csa_idx sog)
{
    const csa_idx rows = B * G;
    const int nt = csa_threads(rows, 1 + 16384 / (d + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx i = 0; i < rows; i++) csa_round_bf16(out + (i / G) * sob + (i % G) * sog, d, 1);
}

/* The epilogue of entries g0 .. g0+G-1 of rows 0..B-1 (out [B, G, d], unit feature
 * stride). */
static int pool_epilogue(const csa_pool_epilogue *ep, float *out, csa_idx B, csa_idx G,
                         csa_idx d, csa_idx sob, csa_idx sog, csa_idx ratio, csa_idx g0)
{
    if (!ep || B * G == 0) return CSA_OK;
    int st = CSA_OK;
    if (ep->bf16) round_rows(out, B, G, d, sob, sog);
    if (ep->norm_w) {
        for (csa_idx b = 0; b < B && st == CSA_OK; b++)
            st = csa_rms_norm(out + b * sob, G, d, sog, 1, ep->norm_w, 1, ep->eps, out + b * sob,
                              sog, 1);
        if (ep->bf16) round_rows(out, B, G, d, sob, sog);
    }
    if (ep->cos && st == CSA_OK) {
        if (ep->half * 2 > d || (g0 + G - 1) * ratio >= ep->rows) return CSA_EINVAL;
        const csa_idx row0 = g0 * ratio * ep->srow, sr = ratio * ep->srow;
        st = csa_apply_rope(out + d - 2 * ep->half, B, G, 1, ep->half, sob, sog, 0, 1,
                            ep->cos + row0, sr, 1, ep->sin + row0, sr, 1, 0);
        if (ep->bf16) round_rows(out, B, G, d, sob, sog);
    }
    return st;
}

int csa_pool_prefill(csa_pool_state *st, const float *kv, csa_idx skb, csa_idx skt,
                     const float *score, csa_idx ssb, csa_idx sst, const float *ape,
                     csa_idx B, csa_idx T, const csa_pool_epilogue *ep,
                     float *out, csa_idx sob, csa_idx sog)
{
    const csa_idx r = st->ratio, d = st->d, cd = (st->overlap ? 2 : 1) * d;
    if (r <= 0 || B < 0 || B > st->batch || T < 0) return CSA_EINVAL;
    const int gate = r > 1 || st->overlap;
    if (gate && !score) return CSA_EINVAL;
    const csa_idx G = T / r, rem = T % r;
    int s = csa_gated_pool(kv, skb, skt, 1, score, ssb, sst, 1, ape, cd, 1, B, T, d, r,
                           st->overlap, out, sob, sog, 1);
    if (s == CSA_OK) s = pool_epilogue(ep, out, B, G, d, sob, sog, r, 0);
    if (s != CSA_OK) return s;
    for (csa_idx b = 0; b < B; b++) {
        if (gate) {
            /* the open group: kv and logits of the trailing tokens */
            for (csa_idx j = 0; j < rem; j++) {
                const float *k = kv + b * skb + (G * r + j) * skt;
                const float *sc = score + b * ssb + (G * r + j) * sst;
                float *dk = st->kv + (b * r + j) * cd, *ds = st->score + (b * r + j) * cd;
                memcpy(dk, k, (size_t)cd * sizeof(float));
                if (ape)
                    for (csa_idx f = 0; f < cd; f++) ds[f] = sc[f] + ape[j * cd + f];
                else
                    memcpy(ds, sc, (size_t)cd * sizeof(float));
            }
            /* the last complete group's first halves become the previous group */
            if (st->overlap && G > 0)
                for (csa_idx j = 0; j < r; j++) {
                    const float *k = kv + b * skb + ((G - 1) * r + j) * skt;
                    const float *sc = score + b * ssb + ((G - 1) * r + j) * sst;
                    float *dk = st->prev_kv + (b * r + j) * d;
                    float *ds = st->prev_score + (b * r + j) * d;
                    memcpy(dk, k, (size_t)d * sizeof(float));
                    if (ape)
                        for (csa_idx f = 0; f < d; f++) ds[f] = sc[f] + ape[j * cd + f];
                    else
                        memcpy(ds, sc, (size_t)d * sizeof(float));
                }
        }
        st->pos[b] = T;
    }
    return CSA_OK;
}

int csa_pool_step(csa_pool_state *st, const float *kv, csa_idx skb, const float *score,
                  csa_idx ssb, const float *ape, csa_idx B, int64_t p,
                  const csa_pool_epilogue *ep, float *out, csa_idx sob, int *emitted)
{
    const csa_idx r = st->ratio, d = st->d, cd = (st->overlap ? 2 : 1) * d;
    if (r <= 0 || B < 0 || B > st->batch || p < 0) return CSA_EINVAL;
    for (csa_idx b = 0; b < B; b++)
        if (st->pos[b] != p) return CSA_EINVAL;
    const csa_idx slot = (csa_idx)(p % r), g = (csa_idx)(p / r);
    const int done = slot == r - 1;
    *emitted = done;
    if (r == 1 && !st->overlap) {         /* ratio 1: the token's own kv, no gate */
        for (csa_idx b = 0; b < B; b++) {
            memcpy(out + b * sob, kv + b * skb, (size_t)d * sizeof(float));
            st->pos[b] = p + 1;
        }
        return pool_epilogue(ep, out, B, 1, d, sob, 0, r, g);
    }
    if (!score) return CSA_EINVAL;
    for (csa_idx b = 0; b < B; b++) {
        float *sk = st->kv + b * r * cd, *ss = st->score + b * r * cd;
        memcpy(sk + slot * cd, kv + b * skb, (size_t)cd * sizeof(float));
        float *dl = ss + slot * cd;
        const float *sc = score + b * ssb;
        if (ape)
            for (csa_idx f = 0; f < cd; f++) dl[f] = sc[f] + ape[slot * cd + f];
        else
            memcpy(dl, sc, (size_t)cd * sizeof(float));
    }
    int s = CSA_OK;
    if (done) {
        /* Rows and chunks of POOL_STEP_F features are independent outputs (a feature's
         * arithmetic does not depend on the split).  Waking a second thread costs
         * more than one entry (even ratio 128 at batch 1, measured), so threads start
         * only for a batch of large entries. */
        const csa_idx nf = (d + POOL_STEP_F - 1) / POOL_STEP_F, items = B * nf;
        const csa_idx work = (st->overlap ? 2 : 1) * r * POOL_STEP_F;
        const int nt = csa_threads(items, 1 + 262144 / work);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx i = 0; i < items; i++) {
            const csa_idx b = i / nf, f0 = (i % nf) * POOL_STEP_F;
            const csa_idx fc = d - f0 < POOL_STEP_F ? d - f0 : POOL_STEP_F;
            const float *sk = st->kv + b * r * cd + f0, *ss = st->score + b * r * cd + f0;
            pool_cands c[2];
            int nc = 0;
            if (st->overlap) {
                const float *pk = st->prev_kv + b * r * d + f0, *ps = st->prev_score + b * r * d + f0;
                c[nc++] = (pool_cands){pk, ps, NULL, g > 0 ? r : 0, d, d, 0, 1, 1, 1};
                c[nc++] = (pool_cands){sk + d, ss + d, NULL, r, cd, cd, 0, 1, 1, 1};
            } else {
                c[nc++] = (pool_cands){sk, ss, NULL, r, cd, cd, 0, 1, 1, 1};
            }
            pool_entry_any(c, nc, fc, out + b * sob + f0);
        }
        /* the completed group becomes the previous one */
        if (st->overlap)
            for (csa_idx b = 0; b < B; b++)
                for (csa_idx j = 0; j < r; j++) {
                    memcpy(st->prev_kv + (b * r + j) * d, st->kv + (b * r + j) * cd,
                           (size_t)d * sizeof(float));
                    memcpy(st->prev_score + (b * r + j) * d, st->score + (b * r + j) * cd,
                           (size_t)d * sizeof(float));
                }
        s = pool_epilogue(ep, out, B, 1, d, sob, 0, r, g);
    }
    for (csa_idx b = 0; b < B; b++) st->pos[b] = p + 1;
    return s;
}
