#include "pool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif

#include "norm.h"
#include "qpack.h"
#include "quant.h"
#include "rope.h"

/* Element access for arrays that are float32 (bf = 0) or bfloat16 (bf = 1). */
static inline const void *pool_off(const void *p, int bf, csa_idx i)
{
    return bf ? (const void *)((const csa_bf16 *)p + i) : (const void *)((const float *)p + i);
}

static inline float pool_ld(const void *p, int bf, csa_idx i)
{
    return bf ? csa_bf16_to_f32(((const csa_bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void pool_st(void *p, int bf, csa_idx i, float v)
{
    if (bf)
        ((csa_bf16 *)p)[i] = csa_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* n contiguous values of src (float32 or bfloat16) as float32 into dst: exact. */
static void pool_to_f32(float *dst, const void *src, int bf, csa_idx n)
{
    if (!bf) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const csa_bf16 *h = src;
    for (csa_idx i = 0; i < n; i++) dst[i] = csa_bf16_to_f32(h[i]);
}

/* n contiguous values from src to dst, each float32 or bfloat16 (rounded if narrowed). */
static void pool_copy(void *dst, int dbf, const void *src, int sbf, csa_idx n)
{
    if (dbf == sbf) {
        memcpy(dst, src, (size_t)n * (dbf ? sizeof(csa_bf16) : sizeof(float)));
        return;
    }
    for (csa_idx i = 0; i < n; i++) pool_st(dst, dbf, i, pool_ld(src, sbf, i));
}

/* The candidates of one entry that come from one place: candidate j reads
 * kv + j*skv, sc + j*ssc and (unless ape is NULL) ape + j*sape, each at feature f
 * times its feature stride (always 1 in the tuned kernels), all in elements of their
 * own type (kvbf, scbf: bfloat16).  `sc` holds scores, or logits already including
 * ape (the streaming state, float32), in which case ape is NULL. */
typedef struct {
    const void *kv, *sc;
    const float *ape;
    csa_idx n, skv, ssc, sape;
    csa_idx fkv, fsc, fape;
    csa_idx pf;   /* tuned prefill only: the row's other half (elements away), which the
                   * next entry reads, is prefetched along with it; 0 = none */
    int next;     /* tuned prefill only: an entry follows whose candidate j is this one's
                   * j + n rows on: its rows are prefetched while this one computes */
    int kvbf, scbf;
} pool_cands;

/* The scalar oracle of one entry.  Per feature, in this order: m = max of the logits
 * (a NaN logit never becomes the max; it makes its own exp NaN, hence the entry NaN,
 * as torch's softmax does), e_j = exp(l_j - m), s = sum e_j, acc = sum e_j kv_j,
 * out = acc / s (rounded once if out is bfloat16).  All -inf logits give NaN, as
 * torch's softmax does. */
static int pool_entry_ref(const pool_cands *c, int nc, csa_idx d, void *out, int obf,
                          csa_idx sof)
{
    for (csa_idx f = 0; f < d; f++) {
        float m = -INFINITY;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                float l = pool_ld(c[k].sc, c[k].scbf, j * c[k].ssc + f * c[k].fsc);
                if (c[k].ape) l += c[k].ape[j * c[k].sape + f * c[k].fape];
                m = l > m ? l : m;
            }
        float s = 0.0f, acc = 0.0f;
        for (int k = 0; k < nc; k++)
            for (csa_idx j = 0; j < c[k].n; j++) {
                float l = pool_ld(c[k].sc, c[k].scbf, j * c[k].ssc + f * c[k].fsc);
                if (c[k].ape) l += c[k].ape[j * c[k].sape + f * c[k].fape];
                const float e = expf(l - m);
                s += e;
                acc += e * pool_ld(c[k].kv, c[k].kvbf, j * c[k].skv + f * c[k].fkv);
            }
        pool_st(out, obf, f * sof, acc / s);
    }
    return CSA_OK;
}

/* The candidate sources of entry g of a [T, c*d] sequence (pointers at its row 0). */
static int entry_cands(pool_cands *c, const void *kv, int kvbf, csa_idx skt, csa_idx skf,
                       const void *score, int scbf, csa_idx sst, csa_idx ssf, const float *ape,
                       csa_idx sar, csa_idx saf, csa_idx d, csa_idx r, int overlap, csa_idx g)
{
    const void *k0 = pool_off(kv, kvbf, g * r * skt), *s0 = pool_off(score, scbf, g * r * sst);
    if (!overlap) {
        c[0] = (pool_cands){.kv = k0, .sc = s0, .ape = ape, .n = r, .skv = skt, .ssc = sst,
                            .sape = sar, .fkv = skf, .fsc = ssf, .fape = saf, .kvbf = kvbf,
                            .scbf = scbf};
        return 1;
    }
    /* group g-1 through the first d features, group g through the second d; the
     * pointers of group -1 are never formed (no candidates there) */
    c[0] = (pool_cands){.kv = g > 0 ? pool_off(k0, kvbf, -r * skt) : k0,
                        .sc = g > 0 ? pool_off(s0, scbf, -r * sst) : s0, .ape = ape,
                        .n = g > 0 ? r : 0, .skv = skt, .ssc = sst, .sape = sar, .fkv = skf,
                        .fsc = ssf, .fape = saf, .kvbf = kvbf, .scbf = scbf};
    c[1] = (pool_cands){.kv = pool_off(k0, kvbf, d * skf), .sc = pool_off(s0, scbf, d * ssf),
                        .ape = ape ? ape + d * saf : NULL, .n = r, .skv = skt, .ssc = sst,
                        .sape = sar, .fkv = skf, .fsc = ssf, .fape = saf, .pf = -d * skf,
                        .kvbf = kvbf, .scbf = scbf};
    return 2;
}

int csa_gated_pool_ref(const struct csa_pool_problem *p)
{
    const void *kv = p->kv, *score = p->score;
    const float *ape = p->ape;
    void *out = p->out;
    const int kv_bf16 = p->kv_bf16, sc_bf16 = p->sc_bf16, out_bf16 = p->out_bf16;
    const int overlap = p->overlap;
    const csa_idx skb = p->skb, skt = p->skt, skf = p->skf, ssb = p->ssb, sst = p->sst,
                  ssf = p->ssf, sar = p->sar, saf = p->saf, sob = p->sob, sog = p->sog,
                  sof = p->sof, B = p->B, T = p->T, d = p->d, ratio = p->ratio;
    if (ratio <= 0 || B < 0 || T < 0 || d < 0) return CSA_EINVAL;
    const csa_idx G = T / ratio;
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx g = 0; g < G; g++) {
            const csa_idx o = b * sob + g * sog;
            if (ratio == 1 && !overlap) {
                for (csa_idx f = 0; f < d; f++)
                    pool_st(out, out_bf16, o + f * sof,
                            pool_ld(kv, kv_bf16, b * skb + g * skt + f * skf));
                continue;
            }
            pool_cands c[2];
            const int nc = entry_cands(c, pool_off(kv, kv_bf16, b * skb), kv_bf16, skt, skf,
                                       pool_off(score, sc_bf16, b * ssb), sc_bf16, sst, ssf, ape,
                                       sar, saf, d, ratio, overlap, g);
            pool_entry_ref(c, nc, d, (void *)pool_off(out, out_bf16, o), out_bf16, sof);
        }
    return CSA_OK;
}


/* ---------------------------------------------------------------- backward
 * The candidate sources of entry g as token ranges: part k is tokens t0 .. t0+n-1
 * read at features foff .. foff+d-1 (ape row j of the part at the same features). */
typedef struct {
    csa_idx t0, n, foff;
} pool_part;

static int grad_parts(pool_part *pt, csa_idx g, csa_idx r, csa_idx d, int overlap)
{
    if (!overlap) {
        pt[0] = (pool_part){g * r, r, 0};
        return 1;
    }
    pt[0] = (pool_part){g > 0 ? (g - 1) * r : 0, g > 0 ? r : 0, 0};
    pt[1] = (pool_part){g * r, r, d};
    return 2;
}

/* The tuned backward's parallel items: the entries (b, g) in order, cut into chunks
 * whose number depends on the shape alone -- never on the thread count -- so each chunk
 * sums its own partial d(ape) over its entries in order and the partials are then added
 * in chunk order: the bits are the same at any thread count (they differ from the
 * `_ref`'s one running sum by rounding only; a problem of one chunk adds exactly as the
 * `_ref` does).  A chunk has at least POOL_GRAD_CHUNK_WORK candidate elements (the
 * parallel region's start is a few microseconds; 32K elements are ~30 us), and there are
 * at most POOL_GRAD_CHUNKS: each chunk after the first holds a float32 partial of
 * d(ape) [ratio, c*d] (ratio 128, d 512: 256 KiB, 1.75 MiB for the 7). */
#ifndef POOL_GRAD_CHUNKS
#define POOL_GRAD_CHUNKS 8
#endif
#ifndef POOL_GRAD_CHUNK_WORK
#define POOL_GRAD_CHUNK_WORK 32768
#endif
static csa_idx grad_chunks(const struct csa_pool_grad_problem *p)
{
    const csa_idx E = p->B * (p->T / p->ratio);
    csa_idx n = E * (p->overlap ? 2 : 1) * p->ratio * p->d / POOL_GRAD_CHUNK_WORK;
    if (n > POOL_GRAD_CHUNKS) n = POOL_GRAD_CHUNKS;
    if (n > E) n = E;
    return n < 1 ? 1 : n;
}

static int grad_check(const struct csa_pool_grad_problem *p)
{
    if (p->ratio <= 0 || p->B < 0 || p->T < 0 || p->d < 0 || !p->dkv) return CSA_EINVAL;
    if ((p->ratio > 1 || p->overlap) && (!p->score || !p->dsc)) return CSA_EINVAL;
    return CSA_OK;
}

/* Zeroes d(kv), d(score) where no entry reads (pool.h): tokens t >= G*r, and with
 * overlap the first halves of group G-1 (all of them when G = 0).  Row i = b*T + t. */
static void grad_zero_row(const struct csa_pool_grad_problem *p, csa_idx i)
{
    const csa_idx T = p->T, r = p->ratio, G = T / r, d = p->d;
    const csa_idx cd = (p->overlap ? 2 : 1) * d, b = i / T, t = i % T;
    csa_idx n = 0;
    if (t >= G * r) n = cd;
    else if (p->overlap && t >= (G - 1) * r) n = d;
    if (!n) return;
    /* zero bits are 0.0 in float32 and in bfloat16 */
    memset((char *)p->dkv + (size_t)(b * p->sgkb + t * p->sgkt) * (p->dkv_bf16 ? 2 : 4), 0,
           (size_t)n * (p->dkv_bf16 ? 2 : 4));
    if (p->dsc)
        memset((char *)p->dsc + (size_t)(b * p->sgsb + t * p->sgst) * (p->dsc_bf16 ? 2 : 4), 0,
               (size_t)n * (p->dsc_bf16 ? 2 : 4));
}

static int pool_bwd_ref_f32(const struct csa_pool_grad_problem *p);

/* The oracle with bfloat16 d(kv) / d(score): into float32 scratch, rounded once after
 * (d(ape) summed from the float32 d(score), as the tuned bodies do). */
int csa_gated_pool_backward_ref(const struct csa_pool_grad_problem *p)
{
    int st = grad_check(p);
    if (st != CSA_OK) return st;
    if (!p->dkv_bf16 && !p->dsc_bf16) return pool_bwd_ref_f32(p);
    const csa_idx B = p->B, T = p->T, cd = (p->overlap ? 2 : 1) * p->d;
    const size_t n = (size_t)(B * T * cd > 0 ? B * T * cd : 1);
    struct csa_pool_grad_problem h = *p;
    float *tk = malloc(n * sizeof(float)), *ts = p->dsc ? malloc(n * sizeof(float)) : NULL;
    if (!tk || (p->dsc && !ts)) {
        free(tk);
        free(ts);
        return CSA_ENOMEM;
    }
    h.dkv = tk, h.sgkb = T * cd, h.sgkt = cd, h.dkv_bf16 = 0;
    if (ts) h.dsc = ts, h.sgsb = T * cd, h.sgst = cd, h.dsc_bf16 = 0;
    st = pool_bwd_ref_f32(&h);
    for (csa_idx b = 0; st == CSA_OK && b < B; b++)
        for (csa_idx t = 0; t < T; t++)
            for (csa_idx f = 0; f < cd; f++) {
                const csa_idx i = (b * T + t) * cd + f;
                pool_st(p->dkv, p->dkv_bf16, b * p->sgkb + t * p->sgkt + f, tk[i]);
                if (ts) pool_st(p->dsc, p->dsc_bf16, b * p->sgsb + t * p->sgst + f, ts[i]);
            }
    free(tk);
    free(ts);
    return st;
}

static int pool_bwd_ref_f32(const struct csa_pool_grad_problem *p)
{
    const csa_idx B = p->B, T = p->T, d = p->d, r = p->ratio, G = T / r;
    const csa_idx cd = (p->overlap ? 2 : 1) * d;
    for (csa_idx i = 0; i < B * T; i++) grad_zero_row(p, i);
    if (p->dape)
        for (csa_idx j = 0; j < r; j++)
            for (csa_idx f = 0; f < cd; f++) p->dape[j * p->sgar + f] = 0.0f;
    if (r == 1 && !p->overlap) {   /* ungated: out = kv */
        for (csa_idx b = 0; b < B; b++)
            for (csa_idx t = 0; t < T; t++) {
                float *k = (float *)p->dkv + b * p->sgkb + t * p->sgkt;
                float *s = p->dsc ? (float *)p->dsc + b * p->sgsb + t * p->sgst : NULL;
                for (csa_idx f = 0; f < d; f++) {
                    k[f] = pool_ld(p->dy, p->dy_bf16, b * p->sdb + t * p->sdg + f);
                    if (s) s[f] = 0.0f;
                }
            }
        return CSA_OK;
    }
    for (csa_idx b = 0; b < B; b++)
        for (csa_idx g = 0; g < G; g++) {
            pool_part pt[2];
            const int np = grad_parts(pt, g, r, d, p->overlap);
            for (csa_idx f = 0; f < d; f++) {
                const float dy = pool_ld(p->dy, p->dy_bf16, b * p->sdb + g * p->sdg + f);
#define GP_L(k, j)                                                                          \
    (pool_ld(p->score, p->sc_bf16, b * p->ssb + (pt[k].t0 + (j)) * p->sst + pt[k].foff + f) + \
     (p->ape ? p->ape[(j) * p->sar + pt[k].foff + f] : 0.0f))
#define GP_KV(k, j) pool_ld(p->kv, p->kv_bf16, b * p->skb + (pt[k].t0 + (j)) * p->skt + pt[k].foff + f)
                float m = -INFINITY;
                for (int k = 0; k < np; k++)
                    for (csa_idx j = 0; j < pt[k].n; j++) {
                        const float l = GP_L(k, j);
                        m = l > m ? l : m;
                    }
                float s = 0.0f, acc = 0.0f;
                for (int k = 0; k < np; k++)
                    for (csa_idx j = 0; j < pt[k].n; j++) {
                        const float e = expf(GP_L(k, j) - m);
                        s += e;
                        acc += e * GP_KV(k, j);
                    }
                const float y = acc / s;
                for (int k = 0; k < np; k++)
                    for (csa_idx j = 0; j < pt[k].n; j++) {
                        const float w = expf(GP_L(k, j) - m) / s;
                        const float dk = w * dy;
                        const csa_idx t = pt[k].t0 + j, ff = pt[k].foff + f;
                        ((float *)p->dkv)[b * p->sgkb + t * p->sgkt + ff] = dk;
                        ((float *)p->dsc)[b * p->sgsb + t * p->sgst + ff] = dk * (GP_KV(k, j) - y);
                    }
#undef GP_L
#undef GP_KV
            }
        }
    if (p->dape)   /* every element: rows b, then groups g, in order */
        for (csa_idx b = 0; b < B; b++)
            for (csa_idx g = 0; g < G; g++)
                for (csa_idx j = 0; j < r; j++)
                    for (csa_idx f = 0; f < cd; f++)
                        p->dape[j * p->sgar + f] += ((const float *)p->dsc)[b * p->sgsb + (g * r + j) * p->sgst + f];
    return CSA_OK;
}

/* Feature chunk of one decode entry per parallel item. */
#define POOL_STEP_F 128

#define CSA_IMPL "pool_impl.h"
#include "csa_isa_variants.h"

int csa_gated_pool(const struct csa_pool_problem *p)
{
    if (p->skf != 1 || (p->score && p->ssf != 1) || (p->ape && p->saf != 1) || p->sof != 1)
        return csa_gated_pool_ref(p);
    CSA_DISPATCH(gated_pool_tuned, (p), csa_gated_pool_ref(p));
}


int csa_gated_pool_backward(const struct csa_pool_grad_problem *p)
{
    int st = grad_check(p);
    if (st != CSA_OK) return st;
    /* the tuned body keeps every candidate's logits of a 16-feature chunk in its buffer */
    if ((p->overlap ? 2 : 1) * p->ratio > POOL_GRAD_LB / 16) return csa_gated_pool_backward_ref(p);
    CSA_DISPATCH(gated_pool_backward_tuned, (p), csa_gated_pool_backward_ref(p));
}

/* One entry at the current ISA level: the decode step pools with exactly the code
 * the prefill pools with, so both give the same bits. */
static int pool_entry_any(const pool_cands *c, int nc, csa_idx d, void *out, int obf)
{
    CSA_DISPATCH(pool_entry_tuned, (c, nc, d, out, obf), pool_entry_ref(c, nc, d, out, obf, 1));
}

void csa_round_bf16(float *x, csa_idx n, csa_idx s)
{
    for (csa_idx i = 0; i < n; i++) x[i * s] = csa_bf16_to_f32(csa_f32_to_bf16(x[i * s]));
}

static void round_rows(float *out, csa_idx B, csa_idx G, csa_idx d, csa_idx sob, csa_idx sog)
{
    const csa_idx rows = B * G;
    const int nt = csa_threads(rows, 1 + 16384 / (d + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx i = 0; i < rows; i++) csa_round_bf16(out + (i / G) * sob + (i % G) * sog, d, 1);
}

/* The QAT rounding of the epilogue (pool.h, `quant`) on out [B, G, d] (unit feature
 * stride), in place, by the kernels fp8_round / fp4_round / hadamard run: the same
 * calls on the same values, so the same bits. */
static int pool_round(float *of, csa_bf16 *oh, csa_idx G, csa_idx d, csa_idx sog,
                      csa_idx block, int fmt, int scale)
{
    return oh ? csa_quant_round_bf16(oh, G, d, sog, 1, block, fmt, scale, oh, sog, 1)
              : csa_quant_round(of, G, d, sog, 1, block, fmt, scale, of, sog, 1);
}

static int pool_quant(const csa_pool_epilogue *ep, void *out, int obf, csa_idx B, csa_idx G,
                      csa_idx d, csa_idx sob, csa_idx sog)
{
    const int q = ep->quant;
    if (q < CSA_POOL_Q_NONE || q > CSA_POOL_Q_FP4_E4M3) return CSA_EINVAL;
    if (q == CSA_POOL_Q_FP8 && (ep->quant_d < 0 || ep->quant_d > d)) return CSA_EINVAL;
    const float hscale = (float)(1.0 / sqrt((double)d));
    int st = CSA_OK;
    for (csa_idx b = 0; b < B && st == CSA_OK; b++) {
        float *of = obf ? NULL : (float *)out + b * sob;
        csa_bf16 *oh = obf ? (csa_bf16 *)out + b * sob : NULL;
        switch (q) {
        case CSA_POOL_Q_FP8:
            st = pool_round(of, oh, G, ep->quant_d, sog, 64, CSA_Q_E4M3, CSA_QS_UE8M0);
            break;
        case CSA_POOL_Q_FP4:
            st = pool_round(of, oh, G, d, sog, 32, CSA_Q_E2M1, CSA_QS_UE8M0);
            break;
        case CSA_POOL_Q_HADAMARD_FP4:
#ifdef CSA_MUTANT_POOL_QAT_HADAMARD /* planted (make mutants): the QAT epilogue's Hadamard
                                     * dropped at the tuned levels (the epilogue is shared) */
            if (csa_isa_get() != CSA_ISA_REF) {
                st = pool_round(of, oh, G, d, sog, 32, CSA_Q_E2M1, CSA_QS_UE8M0);
                break;
            }
#endif
            st = oh ? csa_hadamard_bf16(oh, G, d, sog, 1, hscale, oh, sog, 1)
                    : csa_hadamard(of, G, d, sog, 1, hscale, of, sog, 1);
            if (st == CSA_OK && ep->bf16 && of)
                for (csa_idx g = 0; g < G; g++) csa_round_bf16(of + g * sog, d, 1);
            if (st == CSA_OK) st = pool_round(of, oh, G, d, sog, 32, CSA_Q_E2M1, CSA_QS_UE8M0);
            break;
        case CSA_POOL_Q_FP4_E4M3:
            st = pool_round(of, oh, G, d, sog, 16, CSA_Q_E2M1, CSA_QS_E4M3);
            if (st == CSA_OK && ep->bf16 && of)
                for (csa_idx g = 0; g < G; g++) csa_round_bf16(of + g * sog, d, 1);
            break;
        default:
            break;
        }
    }
    return st;
}

/* The epilogue of entries g0 .. g0+G-1 of rows 0..B-1 (out [B, G, d], unit feature
 * stride).  A bfloat16 out is already rounded (the cast to the model dtype happened on
 * the pooling store); the bf16 norm and RoPE kernels round on their stores. */
static int pool_epilogue(const csa_pool_epilogue *ep, void *out, int obf, csa_idx B,
                         csa_idx G, csa_idx d, csa_idx sob, csa_idx sog, csa_idx ratio,
                         csa_idx g0)
{
    if (!ep || B * G == 0) return CSA_OK;
    int st = CSA_OK;
    float *of = obf ? NULL : out;
    csa_bf16 *oh = obf ? out : NULL;
    if (ep->bf16 && !obf) round_rows(of, B, G, d, sob, sog);
    if (ep->norm_w) {
        for (csa_idx b = 0; b < B && st == CSA_OK; b++)
            st = obf ? csa_rms_norm_bf16(oh + b * sob, G, d, sog, 1, ep->norm_w, 1, ep->eps,
                                         oh + b * sob, sog, 1)
                     : csa_rms_norm(of + b * sob, G, d, sog, 1, ep->norm_w, 1, ep->eps,
                                    of + b * sob, sog, 1);
        if (ep->bf16 && !obf) round_rows(of, B, G, d, sob, sog);
    }
    if (ep->cos && st == CSA_OK) {
        if (ep->half * 2 > d || (g0 + G - 1) * ratio >= ep->rows) return CSA_EINVAL;
        const csa_idx row0 = g0 * ratio * ep->srow, sr = ratio * ep->srow;
        const csa_idx tail = d - 2 * ep->half;
        st = obf ? csa_apply_rope_bf16(oh + tail, B, G, 1, ep->half, sob, sog, 0, 1,
                                       ep->cos + row0, sr, 1, ep->sin + row0, sr, 1, 0)
                 : csa_apply_rope(of + tail, B, G, 1, ep->half, sob, sog, 0, 1, ep->cos + row0,
                                  sr, 1, ep->sin + row0, sr, 1, 0);
        if (ep->bf16 && !obf) round_rows(of, B, G, d, sob, sog);
    }
    if (ep->quant && st == CSA_OK) st = pool_quant(ep, out, obf, B, G, d, sob, sog);
    return st;
}

/* Row j of the open group (or of the previous group) from a token's kv and scores:
 * n features of kv, and the logits score + ape (ape row `ap`, or none), as float32. */
static void state_row(float *dk, float *ds, const void *k, int kbf, const void *sc, int sbf,
                      const float *ap, csa_idx n)
{
    pool_to_f32(dk, k, kbf, n);
    pool_to_f32(ds, sc, sbf, n);
    if (ap)
        for (csa_idx f = 0; f < n; f++) ds[f] += ap[f];
}

static int pool_prefill_values(csa_pool_state *st, const struct csa_pool_problem *p,
                               const csa_pool_epilogue *ep)
{
    const void *kv = p->kv, *score = p->score;
    const float *ape = p->ape;
    void *out = p->out;
    const int kv_bf16 = p->kv_bf16, sc_bf16 = p->sc_bf16, out_bf16 = p->out_bf16;
    const csa_idx skb = p->skb, skt = p->skt, ssb = p->ssb, sst = p->sst, sob = p->sob,
                  sog = p->sog, B = p->B, T = p->T;
    const csa_idx r = st->ratio, d = st->d, cd = (st->overlap ? 2 : 1) * d;
    if (r <= 0 || B < 0 || B > st->batch || T < 0) return CSA_EINVAL;
    if (p->ratio != r || p->d != d || p->overlap != st->overlap || p->skf != 1 ||
        (score && p->ssf != 1) || p->sof != 1 || (ape && (p->sar != cd || p->saf != 1)))
        return CSA_EINVAL;
    const int gate = r > 1 || st->overlap;
    if (gate && !score) return CSA_EINVAL;
    const csa_idx G = T / r, rem = T % r;
    int s = csa_gated_pool(p);
    if (s == CSA_OK) s = pool_epilogue(ep, out, out_bf16, B, G, d, sob, sog, r, 0);
    if (s != CSA_OK) return s;
    for (csa_idx b = 0; b < B; b++) {
        if (gate) {
            /* the open group: kv and logits of the trailing tokens (score + ape added in
             * float32, as the entry adds them) */
            for (csa_idx j = 0; j < rem; j++)
                state_row(st->kv + (b * r + j) * cd, st->score + (b * r + j) * cd,
                          pool_off(kv, kv_bf16, b * skb + (G * r + j) * skt), kv_bf16,
                          pool_off(score, sc_bf16, b * ssb + (G * r + j) * sst), sc_bf16,
                          ape ? ape + j * cd : NULL, cd);
            /* the last complete group's first halves become the previous group */
            if (st->overlap && G > 0)
                for (csa_idx j = 0; j < r; j++)
                    state_row(st->prev_kv + (b * r + j) * d, st->prev_score + (b * r + j) * d,
                              pool_off(kv, kv_bf16, b * skb + ((G - 1) * r + j) * skt), kv_bf16,
                              pool_off(score, sc_bf16, b * ssb + ((G - 1) * r + j) * sst),
                              sc_bf16, ape ? ape + j * cd : NULL, d);
        }
        st->pos[b] = T;
    }
    return CSA_OK;
}

static int pool_step_values(csa_pool_state *st, const struct csa_pool_problem *pp, int64_t p,
                            const csa_pool_epilogue *ep, int *emitted)
{
    const void *kv = pp->kv, *score = pp->score;
    const float *ape = pp->ape;
    void *out = pp->out;
    const int kv_bf16 = pp->kv_bf16, sc_bf16 = pp->sc_bf16, out_bf16 = pp->out_bf16;
    const csa_idx skb = pp->skb, ssb = pp->ssb, sob = pp->sob, B = pp->B;
    const csa_idx r = st->ratio, d = st->d, cd = (st->overlap ? 2 : 1) * d;
    if (r <= 0 || B < 0 || B > st->batch || p < 0) return CSA_EINVAL;
    for (csa_idx b = 0; b < B; b++)
        if (st->pos[b] != p) return CSA_EINVAL;
    const csa_idx slot = (csa_idx)(p % r), g = (csa_idx)(p / r);
    const int done = slot == r - 1;
    *emitted = done;
    if (r == 1 && !st->overlap) {         /* ratio 1: the token's own kv, no gate */
        for (csa_idx b = 0; b < B; b++) {
            pool_copy((void *)pool_off(out, out_bf16, b * sob), out_bf16,
                      pool_off(kv, kv_bf16, b * skb), kv_bf16, d);
            st->pos[b] = p + 1;
        }
        return pool_epilogue(ep, out, out_bf16, B, 1, d, sob, 0, r, g);
    }
    if (!score) return CSA_EINVAL;
    for (csa_idx b = 0; b < B; b++)
        state_row(st->kv + (b * r + slot) * cd, st->score + (b * r + slot) * cd,
                  pool_off(kv, kv_bf16, b * skb), kv_bf16, pool_off(score, sc_bf16, b * ssb),
                  sc_bf16, ape ? ape + slot * cd : NULL, cd);
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
                c[nc++] = (pool_cands){.kv = pk, .sc = ps, .n = g > 0 ? r : 0, .skv = d,
                                       .ssc = d, .fkv = 1, .fsc = 1, .fape = 1};
                c[nc++] = (pool_cands){.kv = sk + d, .sc = ss + d, .n = r, .skv = cd, .ssc = cd,
                                       .fkv = 1, .fsc = 1, .fape = 1};
            } else {
                c[nc++] = (pool_cands){.kv = sk, .sc = ss, .n = r, .skv = cd, .ssc = cd,
                                       .fkv = 1, .fsc = 1, .fape = 1};
            }
            pool_entry_any(c, nc, fc, (void *)pool_off(out, out_bf16, b * sob + f0), out_bf16);
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
        s = pool_epilogue(ep, out, out_bf16, B, 1, d, sob, 0, r, g);
    }
    for (csa_idx b = 0; b < B; b++) st->pos[b] = p + 1;
    return s;
}

/* A packed call (pool.h, `pack`): the entries are made as values in a scratch
 * [B, G, d] (G = 1 for a step) of the problem's out type, by exactly the unpacked path,
 * then encoded into the caller's uint8 rows by csa_quant_pack, whose rounding is the
 * FP4 rounding the values got: the codes times the scales are those values. */
static int pool_packed(csa_pool_state *st, const struct csa_pool_problem *p,
                       const csa_pool_epilogue *ep, int64_t pos, int *emitted)
{
    const csa_idx d = st->d, r = st->ratio, B = p->B;
    if ((ep->quant != CSA_POOL_Q_FP4 && ep->quant != CSA_POOL_Q_HADAMARD_FP4) || d % 32 ||
        r <= 0 || B < 0 || p->T < 0 || p->sof != 1)
        return CSA_EINVAL;
    const csa_idx G = emitted ? 1 : p->T / r;
    const size_t esz = p->out_bf16 ? sizeof(csa_bf16) : sizeof(float);
    void *vals = malloc((size_t)(B * G * d) * esz + 1);
    if (!vals) return CSA_ENOMEM;
    struct csa_pool_problem q = *p;
    q.out = vals;
    q.sob = G * d;
    q.sog = emitted ? 0 : d;
    csa_pool_epilogue e = *ep;
    e.pack = 0;
    int made = 0;
    int s = emitted ? pool_step_values(st, &q, pos, &e, &made)
                    : pool_prefill_values(st, &q, &e);
    if (emitted) *emitted = made;
    else made = G > 0;
    uint8_t *o = p->out;
    for (csa_idx b = 0; b < B && s == CSA_OK && made; b++) {
        const void *x = p->out_bf16 ? (const void *)((csa_bf16 *)vals + b * G * d)
                                    : (const void *)((float *)vals + b * G * d);
        s = csa_quant_pack(x, p->out_bf16, G, d, d, 1, 32, CSA_Q_E2M1, CSA_QS_UE8M0,
                           o + b * p->sob, p->sog, o + b * p->sob + d / 2, 1, p->sog, 1);
    }
    free(vals);
    return s;
}

int csa_pool_prefill(csa_pool_state *st, const struct csa_pool_problem *p,
                     const csa_pool_epilogue *ep)
{
    if (ep && ep->pack) return pool_packed(st, p, ep, 0, NULL);
    return pool_prefill_values(st, p, ep);
}

int csa_pool_step(csa_pool_state *st, const struct csa_pool_problem *pp, int64_t p,
                  const csa_pool_epilogue *ep, int *emitted)
{
    if (ep && ep->pack) return pool_packed(st, pp, ep, p, emitted);
    return pool_step_values(st, pp, p, ep, emitted);
}
