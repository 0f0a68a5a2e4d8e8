/* Gradients of the indexer scores and the indexer's KL objective (index.h, "gradients";
 * docs/kernels.md, section 11.3): the scalar `_ref` oracles, the row statistics both
 * paths share, and the dispatch to the tuned body (index_grad_impl.h). */
#include "index.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline csa_idx ixg_visible(csa_idx pos, csa_idx ratio) { return (pos + 1) / ratio; }

static inline csa_idx ixg_min(csa_idx a, csa_idx b) { return a < b ? a : b; }

#define imin_g ixg_min

static int ixg_args_ok(const struct csa_index_problem *p)
{
    return !p->qk_bf16 && !p->w_bf16 && !p->k_fp4 && !p->q_fp4 && p->ratio >= 1;
}

/* Entries row s of the call can see (clamped to Tc). */
static inline csa_idx ixg_nv(const struct csa_index_problem *p, csa_idx s)
{
    return ixg_min(ixg_visible(p->start_pos + s, p->ratio), p->Tc);
}

/* Entries query (b, s) of a KL call can see: its position is start_pos + s, or the
 * caller's per-query position (floor division: a position below -1 sees nothing). */
static inline csa_idx ixg_kl_nv(const struct csa_index_problem *p, const struct csa_kl_target *x,
                                csa_idx b, csa_idx s)
{
    if (!x->pos) return ixg_nv(p, s);
    const csa_idx P = x->pos[b * x->spb + s * x->sps];
    return P + 1 <= 0 ? 0 : ixg_min((P + 1) / p->ratio, p->Tc);
}

/* Every index is -1 or an entry its row can see. */
static int ixg_check_idx(const struct csa_index_problem *p, const struct csa_kl_target *x)
{
    if (!x->idx) return CSA_OK;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            const csa_idx nv = ixg_kl_nv(p, x, b, s);
            const int32_t *ir = x->idx + b * x->sib + s * x->sis;
            for (csa_idx j = 0; j < x->K; j++) {
                const int32_t t = ir[j * x->sik];
                if (t < -1 || t >= nv) return CSA_EINDEX;
            }
        }
    return CSA_OK;
}

/* Number of slots of row (b, s) and their target sum Z (double, slot order). */
static csa_idx ixg_row_mass(const struct csa_index_problem *p, const struct csa_kl_target *x,
                            csa_idx b, csa_idx s, double *Z)
{
    const float *tr = x->t + b * x->stb + s * x->sts;
    double z = 0.0;
    csa_idx n = 0;
    if (x->idx) {
        const int32_t *ir = x->idx + b * x->sib + s * x->sis;
        for (csa_idx j = 0; j < x->K; j++)
            if (ir[j * x->sik] >= 0) {
                z += (double)tr[j * x->stk];
                n++;
            }
    } else {
        n = ixg_kl_nv(p, x, b, s);
        for (csa_idx t = 0; t < n; t++) z += (double)tr[t * x->stk];
    }
    *Z = z;
    return n;
}

static inline int ixg_row_takes_part(csa_idx n, double Z) { return n > 0 && Z != 0.0; }

/* Rows taking part in the loss. */
static csa_idx ixg_count_rows(const struct csa_index_problem *p, const struct csa_kl_target *x)
{
    csa_idx n_rows = 0;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            double Z;
            const csa_idx n = ixg_row_mass(p, x, b, s, &Z);
            n_rows += ixg_row_takes_part(n, Z);
        }
    return n_rows;
}

/* Valid slots of row (b, s): entry positions pos[0..n) and targets y[0..n), slot order. */
static csa_idx ixg_row_slots(const struct csa_index_problem *p, const struct csa_kl_target *x,
                             csa_idx b, csa_idx s, csa_idx *pos, float *y)
{
    const float *tr = x->t + b * x->stb + s * x->sts;
    csa_idx n = 0;
    if (x->idx) {
        const int32_t *ir = x->idx + b * x->sib + s * x->sis;
        for (csa_idx j = 0; j < x->K; j++) {
            const int32_t t = ir[j * x->sik];
            if (t < 0) continue;
            pos[n] = t;
            y[n++] = tr[j * x->stk];
        }
    } else {
        n = ixg_kl_nv(p, x, b, s);
        for (csa_idx t = 0; t < n; t++) {
            pos[t] = t;
            y[t] = tr[t * x->stk];
        }
    }
    return n;
}

/* 1 when the n slots pos[0..n) of row (b, s) are every entry it can see (the sparse
 * loss is the dense one there); seen: scratch of n bytes.  Only rows with n >= nv
 * can be, so the check costs O(n) for those and nothing for the others. */
static int ixg_row_degenerate(const struct csa_index_problem *p, const struct csa_kl_target *x,
                              csa_idx b, csa_idx s, const csa_idx *pos, csa_idx n,
                              unsigned char *seen)
{
    if (!x->idx) return 1;
    const csa_idx nv = ixg_kl_nv(p, x, b, s);
    if (n < nv) return 0;
    memset(seen, 0, (size_t)nv);
    csa_idx distinct = 0;
    for (csa_idx j = 0; j < n; j++)
        if (!seen[pos[j]]) {
            seen[pos[j]] = 1;
            distinct++;
        }
    return distinct == nv;
}

/* The KL row statistics, shared by both paths: from the scores I[0..n) and targets
 * y[0..n) with sum Z, the row's loss (returned), its kl_uniform term (*klu) and, when
 * G is not NULL, the score gradients G[j] (index.h: rho, clipping).  Everything in
 * double, in slot order.  The default (selected target, no clipping) is the
 * arithmetic of the first version of this function, bit for bit: rho = 1 multiplies
 * exactly, and a row where clipping changes nothing takes the unclipped formula. */
static double ixg_kl_row(const struct csa_kl_target *x, const float *I, const float *y,
                         csa_idx n, double Z, csa_idx n_rows, float *G, double *klu)
{
    double m = -INFINITY;
    int nan = 0;
    for (csa_idx j = 0; j < n; j++) {
        const double v = I[j];
        nan |= v != v;
        m = v > m ? v : m;
    }
    if (nan) m = NAN;
    double se = 0.0;
    for (csa_idx j = 0; j < n; j++) se += exp((double)I[j] - m);
    const double lse = m + log(se);
    const double rho = x->target == CSA_KL_JOINT ? Z : 1.0;
    /* clipping: which slots (with p_j != 0) have l_j below the clip, and U */
    int clipped = 0;
    double U = 0.0;
    if (x->clip_on) {
        for (csa_idx j = 0; j < n; j++) {
            const double pj = (double)y[j] / Z, ls = (double)I[j] - lse;
            if (pj == 0.0) continue;
            if (ls < x->clip) clipped = 1;
            else U += pj;
        }
    }
    double loss = 0.0, plogp = 0.0;
    for (csa_idx j = 0; j < n; j++) {
        const double pj = (double)y[j] / Z, ls = (double)I[j] - lse;
        const int cut = clipped && ls < x->clip;
        if (pj != 0.0) { /* 0 log 0 = 0 */
            const double lp = log(pj);
            loss += pj * (lp - (cut ? x->clip : ls));
            plogp += pj * lp;
        }
        if (G) {
            const double g = clipped ? exp(ls) * U - (cut ? 0.0 : pj) : exp(ls) - pj;
            G[j] = (float)(rho * g / (double)n_rows);
        }
    }
    *klu = rho * (log((double)n) + plogp);
    return rho * loss;
}

/* ------------------------------------------------------------------ oracle */

static float ixg_dot_ref(const float *a, const float *b, csa_idx n)
{
    float acc = 0.0f;
    for (csa_idx d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

/* Adds the gradient contributions of one (row, entry) pair with score gradient G. */
static void ixg_pair_ref(const struct csa_index_problem *p, csa_idx b, csa_idx s, csa_idx t,
                         float G, float *dq, float *dk, float *dw)
{
    const float *q = (const float *)p->q, *k = (const float *)p->k, *w = (const float *)p->w;
    const csa_idx Hi = p->Hi, Di = p->Di;
    const float *kr = k + b * p->skb + t * p->skt;
    float *dkr = dk + (b * p->Tc + t) * Di;
    for (csa_idx h = 0; h < Hi; h++) {
        const float *qr = q + b * p->sqb + s * p->sqs + h * p->sqh;
        const float a = ixg_dot_ref(qr, kr, Di);
        const float r = a < 0.0f ? 0.0f : a; /* keeps NaN */
        const csa_idx o = (b * p->S + s) * Hi + h;
        dw[o] += G * r;
        const float gate = a <= 0.0f ? 0.0f : G * w[b * p->swb + s * p->sws + h * p->swh];
        float *dqr = dq + o * Di;
        for (csa_idx d = 0; d < Di; d++) {
            dqr[d] += gate * kr[d];
            dkr[d] += gate * qr[d];
        }
    }
}

static float ixg_score_ref(const struct csa_index_problem *p, csa_idx b, csa_idx s, csa_idx t)
{
    const float *q = (const float *)p->q, *k = (const float *)p->k, *w = (const float *)p->w;
    float acc = 0.0f;
    for (csa_idx h = 0; h < p->Hi; h++) {
        const float a = ixg_dot_ref(q + b * p->sqb + s * p->sqs + h * p->sqh,
                                    k + b * p->skb + t * p->skt, p->Di);
        const float r = a < 0.0f ? 0.0f : a;
        acc += r * w[b * p->swb + s * p->sws + h * p->swh];
    }
    return acc;
}

static void ixg_zero(const struct csa_index_problem *p, float *dq, float *dk, float *dw)
{
    const size_t rows = (size_t)(p->B * p->S);
    memset(dq, 0, rows * (size_t)(p->Hi * p->Di) * sizeof(float));
    memset(dk, 0, (size_t)(p->B * p->Tc * p->Di) * sizeof(float));
    memset(dw, 0, rows * (size_t)p->Hi * sizeof(float));
}

int csa_index_scores_backward_ref(const struct csa_index_problem *p, const float *g,
                                  csa_idx sgb, csa_idx sgs, csa_idx sgt, float *dq, float *dk,
                                  float *dw)
{
    if (!ixg_args_ok(p)) return CSA_EINVAL;
    ixg_zero(p, dq, dk, dw);
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            const csa_idx nv = ixg_nv(p, s);
            for (csa_idx t = 0; t < nv; t++)
                ixg_pair_ref(p, b, s, t, g[b * sgb + s * sgs + t * sgt], dq, dk, dw);
        }
    return CSA_OK;
}

/* stats from the sums over the rows taking part (row order) */
static void ixg_stats(struct csa_kl_stats *stats, double klu, csa_idx n_rows, csa_idx degen)
{
    if (!stats) return;
    stats->kl_uniform = n_rows ? klu / (double)n_rows : 0.0;
    stats->rows = n_rows;
    stats->degenerate = degen;
}

int csa_indexer_kl_ref(const struct csa_index_problem *p, const struct csa_kl_target *x,
                       double *loss, struct csa_kl_stats *stats, float *dq, float *dk,
                       float *dw)
{
    if (!ixg_args_ok(p)) return CSA_EINVAL;
    int st = ixg_check_idx(p, x);
    if (st) return st;
    const csa_idx n_rows = ixg_count_rows(p, x);
    const csa_idx nmax = x->idx ? x->K : p->Tc;
    const size_t nm = (size_t)(nmax > 0 ? nmax : 1);
    csa_idx *pos = malloc(nm * sizeof(csa_idx));
    float *y = malloc(nm * sizeof(float));
    float *I = malloc(nm * sizeof(float));
    float *G = malloc(nm * sizeof(float));
    unsigned char *seen = malloc(nm);
    if (!pos || !y || !I || !G || !seen) {
        st = CSA_ENOMEM;
        goto done;
    }
    if (dq) ixg_zero(p, dq, dk, dw);
    double sum = 0.0, klu_sum = 0.0;
    csa_idx degen = 0;
    for (csa_idx b = 0; b < p->B; b++)
        for (csa_idx s = 0; s < p->S; s++) {
            double Z = 0.0, klu = 0.0;
            const csa_idx nz = ixg_row_mass(p, x, b, s, &Z);
            if (!ixg_row_takes_part(nz, Z)) continue;
            const csa_idx n = ixg_row_slots(p, x, b, s, pos, y);
            for (csa_idx j = 0; j < n; j++) I[j] = ixg_score_ref(p, b, s, pos[j]);
            sum += ixg_kl_row(x, I, y, n, Z, n_rows, dq ? G : NULL, &klu);
            klu_sum += klu;
            degen += ixg_row_degenerate(p, x, b, s, pos, n, seen);
            if (dq)
                for (csa_idx j = 0; j < n; j++) ixg_pair_ref(p, b, s, pos[j], G[j], dq, dk, dw);
        }
    *loss = n_rows ? sum / (double)n_rows : 0.0;
    ixg_stats(stats, klu_sum, n_rows, degen);
done:
    free(pos);
    free(y);
    free(I);
    free(G);
    free(seen);
    return st;
}

/* ------------------------------------------------------------------ tuned */

/* Where a tuned row takes its slots and score gradients from. */
struct ixg_call {
    const struct csa_index_problem *p;
    const float *g; /* scores backward: G[s, t] */
    csa_idx sgb, sgs, sgt;
    const struct csa_kl_target *x; /* KL: slots and targets */
    csa_idx n_rows;
    double *rowloss, *rowklu; /* KL: per row, [B * S]: loss, kl_uniform term */
    unsigned char *rowdeg;    /* KL: per row, 1 = degenerate */
    float *dq, *dk, *dw; /* NULL dq: loss only */
};

#define CSA_IMPL "index_grad_impl.h"
#include "csa_isa_variants.h"

int csa_index_scores_backward(const struct csa_index_problem *p, const float *g, csa_idx sgb,
                              csa_idx sgs, csa_idx sgt, float *dq, float *dk, float *dw)
{
    if (!ixg_args_ok(p)) return CSA_EINVAL;
    const struct ixg_call c = {.p = p, .g = g, .sgb = sgb, .sgs = sgs, .sgt = sgt,
                               .dq = dq, .dk = dk, .dw = dw};
    CSA_DISPATCH(ixg_run, (&c), csa_index_scores_backward_ref(p, g, sgb, sgs, sgt, dq, dk, dw));
}

int csa_indexer_kl(const struct csa_index_problem *p, const struct csa_kl_target *x,
                   double *loss, struct csa_kl_stats *stats, float *dq, float *dk, float *dw)
{
    if (!ixg_args_ok(p)) return CSA_EINVAL;
    if (csa_isa_get() == CSA_ISA_REF) return csa_indexer_kl_ref(p, x, loss, stats, dq, dk, dw);
    int st = ixg_check_idx(p, x);
    if (st) return st;
    const size_t rows = (size_t)(p->B * p->S), nr = rows > 0 ? rows : 1;
    double *rl = malloc(2 * nr * sizeof(double));
    unsigned char *rd = malloc(nr);
    if (!rl || !rd) {
        free(rl);
        free(rd);
        return CSA_ENOMEM;
    }
    const struct ixg_call c = {.p = p, .x = x, .n_rows = ixg_count_rows(p, x), .rowloss = rl,
                               .rowklu = rl + nr, .rowdeg = rd, .dq = dq, .dk = dk, .dw = dw};
    switch (csa_isa_get()) {
    case CSA_ISA_AMX:
    case CSA_ISA_AVX512: st = ixg_run_avx512(&c); break;
    case CSA_ISA_AVX2: st = ixg_run_avx2(&c); break;
    default: st = ixg_run_base(&c); break;
    }
    if (!st) {
        /* row order: the bits do not depend on the thread count */
        double sum = 0.0, klu = 0.0;
        csa_idx degen = 0;
        for (size_t r = 0; r < rows; r++) {
            sum += rl[r];
            klu += rl[nr + r];
            degen += rd[r];
        }
        *loss = c.n_rows ? sum / (double)c.n_rows : 0.0;
        ixg_stats(stats, klu, c.n_rows, degen);
    }
    free(rl);
    free(rd);
    return st;
}
