/* Tuned indexer gradients, compiled once per ISA level by csa_isa_variants.h.
 *
 * One query row at a time (its slots: the visible entries for the scores backward
 * and the dense warm-up, the valid topk slots for the sparse KL loss), three small
 * GEMMs of the row's [Hi, Di] query block against its n gathered key rows:
 *   a[j][h]  = q[h] . k[pos_j]       tiles of IXG_HC head vectors x IXG_NK keys, q packed
 *                                    transposed (qt[d][h]), k[pos_j][d] broadcast
 *   gate[j][h] = G_j w[h] relu'(a)   in place of a; dw[h] = sum_j G_j relu(a[j][h])
 *   dq[h]    = sum_j gate[j][h] k[pos_j]   tiles of IXG_HB heads x IXG_DV d-vectors
 *   dk[pos_j] += sum_h gate[j][h] q[h]     tiles of IXG_KB keys x IXG_DV d-vectors
 * Each element's sum runs in a fixed order (d, j or h ascending), so a row's results
 * depend only on its own data.  dk: the rows of one chunk (CSA_IXG_CHUNK consecutive
 * rows of a batch entry, fixed by the problem) add into the chunk's own [Tc, Di]
 * partial in row order; chunks run a wave at a time (a few per thread) and the wave's
 * partials are added into dk in chunk order, so dk is the same left fold over chunks
 * whatever the number of threads or waves. */

/* Register tiles: 32 vector registers with AVX-512 (24 accumulators + the loads), 16
 * below it (12). */
#if defined(__AVX512F__)
#define IXG_VL 16
#define IXG_NK 6 /* keys per dot tile */
#define IXG_DV 4 /* d-vectors per dq / dk tile */
#else
#if defined(__AVX2__)
#define IXG_VL 8
#else
#define IXG_VL 4
#endif
#define IXG_NK 3
#define IXG_DV 2
#endif
#define IXG_HC 4 /* head vectors per dot tile */
#define IXG_HB 6 /* heads per dq tile */
#define IXG_KB 6 /* keys per dk tile */

typedef float CSA_V(gvf) __attribute__((vector_size(IXG_VL * 4)));
typedef int32_t CSA_V(gvi) __attribute__((vector_size(IXG_VL * 4)));
typedef float CSA_V(gvu) __attribute__((vector_size(IXG_VL * 4), aligned(4)));

static inline float CSA_V(ixg_hsum)(CSA_V(gvf) v)
{
    float s = 0.0f;
    for (int l = 0; l < IXG_VL; l++) s += v[l];
    return s;
}

/* Per-thread scratch. */
struct CSA_V(ixg_ws) {
    float *qt, *wv, *dwa, *a, *y, *I, *G;
    int32_t *lm;
    csa_idx *pos;
    unsigned char *seen; /* KL: the degenerate-row check */
};

static void CSA_V(ixg_ws_free)(struct CSA_V(ixg_ws) *w)
{
    free(w->qt);
    free(w->a);
    free(w->y);
    free(w->I);
    free(w->G);
    free(w->pos);
    free(w->seen);
    memset(w, 0, sizeof *w);
}

static size_t CSA_V(ixg_al)(size_t bytes) { return (bytes + 63) / 64 * 64; }

static int CSA_V(ixg_ws_alloc)(struct CSA_V(ixg_ws) *w, csa_idx HP, csa_idx Di, csa_idx nmax)
{
    memset(w, 0, sizeof *w);
    const size_t n = (size_t)(nmax > 0 ? nmax : 1);
    /* qt [Di][HP], then w [HP], lane mask [HP], dw accumulators [HP] */
    w->qt = aligned_alloc(64, CSA_V(ixg_al)((size_t)(Di + 3) * (size_t)HP * 4));
    /* + IXG_HB: the last dq tile of a row may read (and drop) heads past HP */
    w->a = aligned_alloc(64, CSA_V(ixg_al)((n * (size_t)HP + IXG_HB) * 4));
    w->y = malloc(n * sizeof(float));
    w->I = malloc(n * sizeof(float));
    w->G = malloc(n * sizeof(float));
    w->pos = malloc(n * sizeof(csa_idx));
    w->seen = malloc(n);
    if (!w->qt || !w->a || !w->y || !w->I || !w->G || !w->pos || !w->seen) {
        CSA_V(ixg_ws_free)(w);
        return CSA_ENOMEM;
    }
    w->wv = w->qt + Di * HP;
    w->lm = (int32_t *)(w->wv + HP);
    w->dwa = w->wv + 2 * HP;
    return CSA_OK;
}

/* a[j][i*VL ..] = q . k[pos_j] for hc head vectors and keys kr[0..nk) (nk <= IXG_NK; the
 * missing ones repeat the last key and are not stored). */
static inline __attribute__((always_inline)) void
CSA_V(ixg_dot_tile)(const int hc, const float *CSA_RESTRICT qt, csa_idx HP, csa_idx Di,
                    const float *const *kr, float *a0, csa_idx nk)
{
    typedef CSA_V(gvf) vf;
    vf acc[IXG_HC][IXG_NK];
#pragma GCC unroll 8
    for (int i = 0; i < hc; i++)
#pragma GCC unroll 8
        for (int j = 0; j < IXG_NK; j++) acc[i][j] = (vf){0};
    for (csa_idx d = 0; d < Di; d++) {
        const float *qd = qt + d * HP;
        vf qv[IXG_HC];
#pragma GCC unroll 8
        for (int i = 0; i < hc; i++) qv[i] = *(const vf *)(qd + i * IXG_VL);
#pragma GCC unroll 8
        for (int j = 0; j < IXG_NK; j++) {
            const float kv = kr[j][d];
#pragma GCC unroll 8
            for (int i = 0; i < hc; i++) acc[i][j] += qv[i] * kv;
        }
    }
    for (csa_idx j = 0; j < nk; j++)
#pragma GCC unroll 8
        for (int i = 0; i < hc; i++) *(vf *)(a0 + j * HP + i * IXG_VL) = acc[i][j];
}

/* dq[h0 + hb][d0 ..] for IXG_HB heads (gates of padded heads are 0) and nd d-vectors:
 * sum over the n slots in order of gate[j][h] * k[pos_j][d]; heads >= nh not stored. */
static inline __attribute__((always_inline)) void
CSA_V(ixg_dq_tile)(const int nd, const float *CSA_RESTRICT a, csa_idx HP, const float *kb,
                   csa_idx skt, const csa_idx *pos, csa_idx n, csa_idx h0, csa_idx nh,
                   csa_idx d0, float *dqr, csa_idx Di)
{
    typedef CSA_V(gvf) vf;
    typedef CSA_V(gvu) vu;
    vf acc[IXG_HB][IXG_DV];
#pragma GCC unroll 8
    for (int i = 0; i < IXG_HB; i++)
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) acc[i][v] = (vf){0};
    for (csa_idx j = 0; j < n; j++) {
        const float *kr = kb + pos[j] * skt + d0;
        const float *gr = a + j * HP + h0;
        vf kv[IXG_DV];
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) kv[v] = (vf) * (const vu *)(kr + v * IXG_VL);
#pragma GCC unroll 8
        for (int i = 0; i < IXG_HB; i++) {
            const float g = gr[i];
#pragma GCC unroll 8
            for (int v = 0; v < nd; v++) acc[i][v] += g * kv[v];
        }
    }
    for (csa_idx i = 0; i < IXG_HB && i < nh; i++)
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) *(vu *)(dqr + (h0 + i) * Di + d0 + v * IXG_VL) = acc[i][v];
}

/* part[pos_j][d0 ..] += sum over heads in order of gate[j][h] * q[h][d] for the slots
 * j0 .. j0+nk-1 (nk <= IXG_KB; missing ones repeat the last and are not added), nd
 * d-vectors.  The slots are added one after the other (duplicates add twice). */
static inline __attribute__((always_inline)) void
CSA_V(ixg_dk_tile)(const int nd, const float *CSA_RESTRICT a, csa_idx HP, const float *qb,
                   csa_idx sqh, csa_idx Hi, const csa_idx *pos, csa_idx j0, csa_idx nk,
                   csa_idx d0, float *part, csa_idx Di)
{
    typedef CSA_V(gvf) vf;
    typedef CSA_V(gvu) vu;
    vf acc[IXG_KB][IXG_DV];
    const float *gr[IXG_KB];
#pragma GCC unroll 8
    for (int i = 0; i < IXG_KB; i++) {
        gr[i] = a + (j0 + (i < nk ? i : nk - 1)) * HP;
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) acc[i][v] = (vf){0};
    }
    for (csa_idx h = 0; h < Hi; h++) {
        const float *qr = qb + h * sqh + d0;
        vf qv[IXG_DV];
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) qv[v] = (vf) * (const vu *)(qr + v * IXG_VL);
#pragma GCC unroll 8
        for (int i = 0; i < IXG_KB; i++) {
            const float g = gr[i][h];
#pragma GCC unroll 8
            for (int v = 0; v < nd; v++) acc[i][v] += g * qv[v];
        }
    }
    for (csa_idx i = 0; i < nk; i++) {
        float *pr = part + pos[j0 + i] * Di + d0;
#pragma GCC unroll 8
        for (int v = 0; v < nd; v++) {
            vu *o = (vu *)(pr + v * IXG_VL);
#ifdef CSA_MUTANT_IXG_DK_SKIP_DUP
            if (i > 0 && pos[j0 + i] == pos[j0 + i - 1]) continue;
#endif
            *o = *o + acc[i][v];
        }
    }
}

/* The slots and score gradients of row (b, s), its dq / dw rows, and its dk
 * contributions into part (when grads are asked). */
static void CSA_V(ixg_row)(const struct ixg_call *c, struct CSA_V(ixg_ws) *ws, csa_idx HP,
                           csa_idx b, csa_idx s, float *part)
{
    typedef CSA_V(gvf) vf;
    typedef CSA_V(gvi) vi;
    typedef CSA_V(gvu) vu;
    const struct csa_index_problem *p = c->p;
    const csa_idx Hi = p->Hi, Di = p->Di, r = b * p->S + s, nvec = HP / IXG_VL;
    float *dqr = c->dq ? c->dq + r * Hi * Di : NULL, *dwr = c->dq ? c->dw + r * Hi : NULL;
    csa_idx n;
    double Z = 0.0;
    if (c->x) {
        n = ixg_row_mass(p, c->x, b, s, &Z);
        if (ixg_row_takes_part(n, Z)) n = ixg_row_slots(p, c->x, b, s, ws->pos, ws->y);
        else n = 0;
        c->rowloss[r] = c->rowklu[r] = 0.0;
        c->rowdeg[r] = n ? (unsigned char)ixg_row_degenerate(p, c->x, b, s, ws->pos, n, ws->seen)
                         : 0;
    } else {
        n = ixg_nv(p, s);
        for (csa_idx t = 0; t < n; t++) ws->pos[t] = t;
    }
    if (n == 0) {
        if (dqr) {
            memset(dqr, 0, (size_t)(Hi * Di) * sizeof(float));
            memset(dwr, 0, (size_t)Hi * sizeof(float));
        }
        return;
    }
    /* pack q transposed, w and the lane mask */
    const float *qb = (const float *)p->q + b * p->sqb + s * p->sqs;
    const float *wr = (const float *)p->w + b * p->swb + s * p->sws;
    float *qt = ws->qt;
    for (csa_idx d = 0; d < Di; d++) {
        float *row = qt + d * HP;
        for (csa_idx h = 0; h < Hi; h++) row[h] = qb[h * p->sqh + d];
        for (csa_idx h = Hi; h < HP; h++) row[h] = 0.0f;
    }
    for (csa_idx h = 0; h < HP; h++) {
        ws->wv[h] = h < Hi ? wr[h * p->swh] : 0.0f;
        ws->lm[h] = h < Hi ? -1 : 0;
        ws->dwa[h] = 0.0f;
    }
    const vf *wv = (const vf *)ws->wv;
    const vi *lm = (const vi *)ws->lm;
    /* a[j][h] */
    const float *kb = (const float *)p->k + b * p->skb;
    float *a = ws->a;
    for (csa_idx j = 0; j < n; j += IXG_NK) {
        const csa_idx nk = imin_g(IXG_NK, n - j);
        const float *kr[IXG_NK];
        for (int i = 0; i < IXG_NK; i++) kr[i] = kb + ws->pos[j + (i < nk ? i : nk - 1)] * p->skt;
        for (csa_idx v = 0; v < nvec; v += IXG_HC) {
            float *a0 = a + j * HP + v * IXG_VL;
            const float *q0 = qt + v * IXG_VL;
            switch (nvec - v < IXG_HC ? nvec - v : IXG_HC) {
            case 4: CSA_V(ixg_dot_tile)(4, q0, HP, Di, kr, a0, nk); break;
            case 3: CSA_V(ixg_dot_tile)(3, q0, HP, Di, kr, a0, nk); break;
            case 2: CSA_V(ixg_dot_tile)(2, q0, HP, Di, kr, a0, nk); break;
            default: CSA_V(ixg_dot_tile)(1, q0, HP, Di, kr, a0, nk); break;
            }
        }
    }
    float *G = ws->G;
    if (c->x) {
        for (csa_idx j = 0; j < n; j++) {
            vf acc = (vf){0};
            for (csa_idx v = 0; v < nvec; v++) {
                const vf av = *(const vf *)(a + j * HP + v * IXG_VL);
                const vi keep = ~(av < (vf){0}) & lm[v]; /* relu keeps NaN */
                acc += (vf)((vi)av & keep) * wv[v];
            }
            ws->I[j] = CSA_V(ixg_hsum)(acc);
        }
#if defined(CSA_MUTANT_IXG_JOINT_AS_SELECTED) || defined(CSA_MUTANT_IXG_CLIP_DROPPED)
        struct csa_kl_target xm = *c->x;
#ifdef CSA_MUTANT_IXG_JOINT_AS_SELECTED
        xm.target = CSA_KL_SELECTED;
#else
        xm.clip_on = 0;
#endif
        c->rowloss[r] = ixg_kl_row(&xm, ws->I, ws->y, n, Z, c->n_rows, dqr ? G : NULL,
                                   &c->rowklu[r]);
#else
        c->rowloss[r] = ixg_kl_row(c->x, ws->I, ws->y, n, Z, c->n_rows, dqr ? G : NULL,
                                   &c->rowklu[r]);
#endif
        if (!dqr) return;
    } else {
        const float *gr = c->g + b * c->sgb + s * c->sgs;
        for (csa_idx j = 0; j < n; j++) G[j] = gr[ws->pos[j] * c->sgt];
    }
    /* gates (in place of a) and dw */
    vf *dwa = (vf *)ws->dwa;
    for (csa_idx j = 0; j < n; j++) {
        const float g = G[j];
        for (csa_idx v = 0; v < nvec; v++) {
            vf *ap = (vf *)(a + j * HP + v * IXG_VL);
            const vf av = *ap;
            const vf rl = (vf)((vi)av & (~(av < (vf){0}) & lm[v]));
            dwa[v] += g * rl;
            const vi pass = ~(av <= (vf){0}) & lm[v]; /* relu' = 1 unless a <= 0 */
#ifdef CSA_MUTANT_IXG_GATE_GE
            *ap = (vf)((vi)(g * wv[v]) & (~(av < (vf){0}) & lm[v]));
#else
            *ap = (vf)((vi)(g * wv[v]) & pass);
#endif
        }
    }
    for (csa_idx h = 0; h < Hi; h++) dwr[h] = ws->dwa[h];
    /* dq */
    const csa_idx DF = Di / IXG_VL * IXG_VL, CH = IXG_DV * IXG_VL;
    for (csa_idx h0 = 0; h0 < Hi; h0 += IXG_HB) {
        csa_idx d0 = 0;
        for (; d0 + CH <= DF; d0 += CH)
            CSA_V(ixg_dq_tile)(IXG_DV, a, HP, kb, p->skt, ws->pos, n, h0, Hi - h0, d0, dqr, Di);
        for (; d0 < DF; d0 += IXG_VL)
            CSA_V(ixg_dq_tile)(1, a, HP, kb, p->skt, ws->pos, n, h0, Hi - h0, d0, dqr, Di);
    }
    for (csa_idx h = 0; h < Hi; h++)
        for (csa_idx d = DF; d < Di; d++) {
            float acc = 0.0f;
            for (csa_idx j = 0; j < n; j++) acc += a[j * HP + h] * kb[ws->pos[j] * p->skt + d];
            dqr[h * Di + d] = acc;
        }
#ifdef CSA_MUTANT_IXG_DQ_SCALE
    for (csa_idx i = 0; i < Hi * Di; i++) dqr[i] *= 1.0001f;
#endif
    /* dk contributions */
    for (csa_idx j0 = 0; j0 < n; j0 += IXG_KB) {
        const csa_idx nk = imin_g(IXG_KB, n - j0);
        csa_idx d0 = 0;
        for (; d0 + CH <= DF; d0 += CH)
            CSA_V(ixg_dk_tile)(IXG_DV, a, HP, qb, p->sqh, Hi, ws->pos, j0, nk, d0, part, Di);
        for (; d0 < DF; d0 += IXG_VL)
            CSA_V(ixg_dk_tile)(1, a, HP, qb, p->sqh, Hi, ws->pos, j0, nk, d0, part, Di);
        for (csa_idx j = j0; j < j0 + nk; j++)
            for (csa_idx d = DF; d < Di; d++) {
                float acc = 0.0f;
                for (csa_idx h = 0; h < Hi; h++) acc += a[j * HP + h] * qb[h * p->sqh + d];
                part[ws->pos[j] * Di + d] += acc;
            }
    }
    (void)sizeof(vu);
}

/* One past the highest entry the rows [s0, s1) of batch entry b may touch. */
static csa_idx CSA_V(ixg_chunk_tmax)(const struct ixg_call *c, csa_idx b, csa_idx s0, csa_idx s1)
{
    const struct csa_index_problem *p = c->p;
    if (s1 <= s0) return 0;
    if (!c->x) return ixg_nv(p, s1 - 1);
    const struct csa_kl_target *x = c->x;
    csa_idx m = 0;
    if (!x->idx) { /* the dense warm-up: per-query positions need not grow with s */
        for (csa_idx s = s0; s < s1; s++) {
            const csa_idx nv = ixg_kl_nv(p, x, b, s);
            m = nv > m ? nv : m;
        }
        return m;
    }
    for (csa_idx s = s0; s < s1; s++) {
        const int32_t *ir = x->idx + b * x->sib + s * x->sis;
        for (csa_idx j = 0; j < x->K; j++) {
            const csa_idx t = ir[j * x->sik];
            m = t + 1 > m ? t + 1 : m;
        }
    }
    return m;
}

static int CSA_V(ixg_run)(const struct ixg_call *c)
{
    const struct csa_index_problem *p = c->p;
    const csa_idx B = p->B, S = p->S, Tc = p->Tc, Di = p->Di;
    const csa_idx HP = (p->Hi + IXG_VL - 1) / IXG_VL * IXG_VL > 0
                           ? (p->Hi + IXG_VL - 1) / IXG_VL * IXG_VL : IXG_VL;
    const csa_idx nmax = c->x && c->x->idx ? c->x->K : Tc;
    int err = CSA_OK;
    if (!c->dq) { /* loss only: rows are independent */
        const csa_idx rows = B * S;
#pragma omp parallel num_threads(csa_threads(rows, 4))
        {
            struct CSA_V(ixg_ws) ws;
            const int st = CSA_V(ixg_ws_alloc)(&ws, HP, Di, nmax);
            if (st) {
#pragma omp atomic write
                err = st;
            }
#pragma omp for schedule(dynamic, 4)
            for (csa_idx r = 0; r < rows; r++)
                if (!st) CSA_V(ixg_row)(c, &ws, HP, r / S, r % S, NULL);
            CSA_V(ixg_ws_free)(&ws);
        }
        return err;
    }
    memset(c->dk, 0, (size_t)(B * Tc * Di) * sizeof(float));
    const csa_idx CHK = CSA_IXG_CHUNK, ncb = (S + CHK - 1) / CHK, NC = B * ncb;
    if (NC == 0) return CSA_OK;
    const size_t pstride = CSA_V(ixg_al)((size_t)(Tc > 0 ? Tc : 1) * (size_t)(Di > 0 ? Di : 1) * 4) / 4;
    /* chunks in flight: two per thread, at most ~256 MiB of partials (the wave width
     * changes when the partials are added, never in what order) */
    csa_idx W = imin_g(NC, 2 * (csa_idx)csa_threads(NC, 1));
    const csa_idx wmem = (csa_idx)(((size_t)256 << 20) / (pstride * 4));
    W = imin_g(W, wmem > 1 ? wmem : 1);
    float *parts = aligned_alloc(64, (size_t)W * pstride * 4);
    csa_idx *tmax = malloc((size_t)W * sizeof(csa_idx));
    if (!parts || !tmax) {
        free(parts);
        free(tmax);
        return CSA_ENOMEM;
    }
    for (csa_idx c0 = 0; c0 < NC && !err; c0 += W) {
        const csa_idx nw = imin_g(W, NC - c0);
#pragma omp parallel num_threads(csa_threads(nw, 1))
        {
            struct CSA_V(ixg_ws) ws;
            const int st = CSA_V(ixg_ws_alloc)(&ws, HP, Di, nmax);
            if (st) {
#pragma omp atomic write
                err = st;
            }
#pragma omp for schedule(dynamic, 1)
            for (csa_idx i = 0; i < nw; i++) {
                const csa_idx ch = c0 + i, b = ch / ncb, s0 = (ch % ncb) * CHK,
                              s1 = imin_g(S, s0 + CHK);
                float *part = parts + (size_t)i * pstride;
                tmax[i] = CSA_V(ixg_chunk_tmax)(c, b, s0, s1);
                if (st) continue;
                memset(part, 0, (size_t)(tmax[i] * Di) * sizeof(float));
                for (csa_idx s = s0; s < s1; s++) CSA_V(ixg_row)(c, &ws, HP, b, s, part);
            }
            CSA_V(ixg_ws_free)(&ws);
        }
        if (err) break;
        csa_idx tm = 0;
        for (csa_idx i = 0; i < nw; i++) tm = tmax[i] > tm ? tmax[i] : tm;
        /* dk += the wave's partials, in chunk order */
#pragma omp parallel for num_threads(csa_threads(tm, 64)) schedule(static)
        for (csa_idx t = 0; t < tm; t++)
            for (csa_idx i = 0; i < nw; i++) {
                if (t >= tmax[i]) continue;
                const csa_idx b = (c0 + i) / ncb;
                float *CSA_RESTRICT dst = c->dk + (b * Tc + t) * Di;
                const float *CSA_RESTRICT src = parts + (size_t)i * pstride + t * Di;
                for (csa_idx d = 0; d < Di; d++) dst[d] += src[d];
            }
    }
    free(parts);
    free(tmax);
    return err;
}

#undef IXG_VL
#undef IXG_NK
#undef IXG_HC
#undef IXG_HB
#undef IXG_KB
#undef IXG_DV
