/* Tuned indexer scoring, compiled once per ISA level by csa_isa_variants.h.
 *
 * One query row at a time: its q is packed transposed, qt[d][h] (heads padded to a
 * whole number of vectors, padded lanes masked out), so that a register tile holds
 * IX_HC head vectors x IX_NK keys: per d, IX_HC vector loads of qt and IX_NK
 * broadcasts of k[t][d] feed IX_HC*IX_NK FMAs.  After the Di loop the tile applies
 * relu and the weights lane-wise and sums the head vectors of a key, in head-vector
 * order, into one vector per key; a fixed shuffle tree then sums its lanes.  Every
 * key's score therefore depends only on (q row, k row, w row), never on the tiling,
 * the thread count or the other rows and keys of the call.
 *
 * Work split: prefill-like calls give each thread whole query rows, longest
 * (latest) first under a dynamic schedule since causal rows differ in length, and a
 * [Tc] scratch row that the selection consumes right away; calls with few rows
 * (decode) split the keys across threads (ix_run_keysplit).  Rows never see more
 * than their visible entries: the causal half of a prefill is never computed. */

#if defined(__AVX512F__)
#define IX_VL 16
#define IX_NK 6
#elif defined(__AVX2__)
#define IX_VL 8
#define IX_NK 3
#else
#define IX_VL 4
#define IX_NK 3
#endif
#define IX_HC 4 /* head vectors per register tile */
#define IX_QB 8 /* query rows sharing a chunk of keys */

typedef float CSA_V(vf) __attribute__((vector_size(IX_VL * 4)));
typedef int32_t CSA_V(vi) __attribute__((vector_size(IX_VL * 4)));

/* Lane sum of v by a fixed tree. */
static inline float CSA_V(ix_hsum)(CSA_V(vf) v)
{
    typedef CSA_V(vi) vi;
#if IX_VL == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15});
#endif
#if IX_VL >= 8
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7});
#endif
    v += __builtin_shuffle(v, (vi){2, 3});
    v += __builtin_shuffle(v, (vi){1});
    return v[0];
}

/* part[j] += sum over the hc head vectors i of relu(qt_i . k_j) * w_i (masked). */
static inline __attribute__((always_inline)) void
CSA_V(ix_chunk)(const int hc, const float *CSA_RESTRICT qt, csa_idx HP, csa_idx Di,
                const float *const *kr, const CSA_V(vf) *wv, const CSA_V(vi) *lm,
                CSA_V(vf) *part)
{
    typedef CSA_V(vf) vf;
    typedef CSA_V(vi) vi;
    vf acc[IX_HC][IX_NK];
#pragma GCC unroll 8
    for (int i = 0; i < hc; i++)
#pragma GCC unroll 8
        for (int j = 0; j < IX_NK; j++) acc[i][j] = (vf){0};
    for (csa_idx d = 0; d < Di; d++) {
        const float *qd = qt + d * HP;
        vf qv[IX_HC];
#pragma GCC unroll 8
        for (int i = 0; i < hc; i++) qv[i] = *(const vf *)(qd + i * IX_VL);
#pragma GCC unroll 8
        for (int j = 0; j < IX_NK; j++) {
            const float kv = kr[j][d];
#pragma GCC unroll 8
            for (int i = 0; i < hc; i++) acc[i][j] += qv[i] * kv;
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < IX_NK; j++)
#pragma GCC unroll 8
        for (int i = 0; i < hc; i++) {
            const vf a = acc[i][j];
            const vi keep = ~(a < (vf){0}) & lm[i]; /* relu keeps NaN; padded heads -> 0 */
            part[j] += (vf)((vi)a & keep) * wv[i];
        }
}

/* Scores of one query row (packed in buf) against keys [t0, t1) of kb, into o[t];
 * tiles whose keys all lie in unkept candidate blocks are skipped. */
static void CSA_V(ix_score_row)(const float *buf, csa_idx HP, csa_idx Di, const float *kb,
                                csa_idx skt, csa_idx t0, csa_idx t1, const uint8_t *cm,
                                csa_idx scn, csa_idx bs, float *o)
{
    typedef CSA_V(vf) vf;
    typedef CSA_V(vi) vi;
    const float *qt = buf;
    const vf *wv = (const vf *)(buf + Di * HP);
    const vi *lm = (const vi *)(buf + (Di + 1) * HP);
    const csa_idx nvec = HP / IX_VL;
    for (csa_idx t = t0; t < t1; t += IX_NK) {
        const csa_idx nk = imin(IX_NK, t1 - t);
        if (cm) {
            int any = 0;
            for (csa_idx j = t / bs; j <= (t + nk - 1) / bs; j++) any |= cm[j * scn] != 0;
            if (!any) continue;
        }
        const float *kr[IX_NK];
        for (int j = 0; j < IX_NK; j++) kr[j] = kb + imin(t + j, t1 - 1) * skt;
        vf part[IX_NK];
        for (int j = 0; j < IX_NK; j++) part[j] = (vf){0};
        for (csa_idx c = 0; c < nvec; c += IX_HC) {
            const float *qc = qt + c * IX_VL;
            switch (nvec - c < IX_HC ? nvec - c : IX_HC) {
            case 4: CSA_V(ix_chunk)(4, qc, HP, Di, kr, wv + c, lm + c, part); break;
            case 3: CSA_V(ix_chunk)(3, qc, HP, Di, kr, wv + c, lm + c, part); break;
            case 2: CSA_V(ix_chunk)(2, qc, HP, Di, kr, wv + c, lm + c, part); break;
            default: CSA_V(ix_chunk)(1, qc, HP, Di, kr, wv + c, lm + c, part); break;
            }
        }
        for (csa_idx j = 0; j < nk; j++) o[t + j] = CSA_V(ix_hsum)(part[j]);
    }
}

/* In-register transpose of a VL x VL block r[i][l] -> r[l][i]: at each scale w the
 * off-diagonal w x w blocks of every 2w x 2w diagonal block swap places. */
#define IX_MA(l, w) (((l) & (w)) ? IX_VL + (l) - (w) : (l))
#define IX_MB(l, w) (((l) & (w)) ? IX_VL + (l) : (l) + (w))
#if IX_VL == 16
#define IX_LANES(M, w)                                                                      \
    {M(0, w), M(1, w), M(2, w), M(3, w), M(4, w), M(5, w), M(6, w), M(7, w), M(8, w),       \
     M(9, w), M(10, w), M(11, w), M(12, w), M(13, w), M(14, w), M(15, w)}
#elif IX_VL == 8
#define IX_LANES(M, w) {M(0, w), M(1, w), M(2, w), M(3, w), M(4, w), M(5, w), M(6, w), M(7, w)}
#else
#define IX_LANES(M, w) {M(0, w), M(1, w), M(2, w), M(3, w)}
#endif
#define IX_TSTEP(w)                                                                         \
    for (int i = 0; i < IX_VL; i++)                                                         \
        if (!(i & (w))) {                                                                   \
            const vf a = r[i], b = r[i + (w)];                                              \
            r[i] = __builtin_shuffle(a, b, (vi)IX_LANES(IX_MA, w));                         \
            r[i + (w)] = __builtin_shuffle(a, b, (vi)IX_LANES(IX_MB, w));                   \
        }

static inline void CSA_V(ix_transpose)(CSA_V(vf) *r)
{
    typedef CSA_V(vf) vf;
    typedef CSA_V(vi) vi;
#if IX_VL == 16
    IX_TSTEP(8)
#endif
#if IX_VL >= 8
    IX_TSTEP(4)
#endif
    IX_TSTEP(2)
    IX_TSTEP(1)
}
#undef IX_TSTEP
#undef IX_LANES
#undef IX_MA
#undef IX_MB

/* buf = [qt: Di x HP][w: HP][lane mask: HP] for query row (b, s); whole VL x VL
 * blocks of q are transposed in registers, the edges element by element. */
static void CSA_V(ix_pack_row)(const struct csa_index_problem *p, csa_idx b, csa_idx s,
                               csa_idx HP, float *buf)
{
    typedef CSA_V(vf) vf;
    typedef float vfu __attribute__((vector_size(IX_VL * 4), aligned(4)));
    const float *qr = p->q + b * p->sqb + s * p->sqs;
    const float *wr = p->w + b * p->swb + s * p->sws;
    const csa_idx Hi = p->Hi, Di = p->Di, sqh = p->sqh;
    const csa_idx Hf = Hi / IX_VL * IX_VL, Df = Di / IX_VL * IX_VL;
    for (csa_idx h0 = 0; h0 < Hf; h0 += IX_VL)
        for (csa_idx d0 = 0; d0 < Df; d0 += IX_VL) {
            vf r[IX_VL];
            for (int i = 0; i < IX_VL; i++) r[i] = (vf) * (const vfu *)(qr + (h0 + i) * sqh + d0);
            CSA_V(ix_transpose)(r);
            for (int i = 0; i < IX_VL; i++) *(vf *)(buf + (d0 + i) * HP + h0) = r[i];
        }
    for (csa_idx h = 0; h < Hf; h++)
        for (csa_idx d = Df; d < Di; d++) buf[d * HP + h] = qr[h * sqh + d];
    for (csa_idx d = 0; d < Di; d++) {
        float *row = buf + d * HP;
        for (csa_idx h = Hf; h < Hi; h++) row[h] = qr[h * sqh + d];
        for (csa_idx h = Hi; h < HP; h++) row[h] = 0.0f;
    }
    float *wv = buf + Di * HP;
    int32_t *lm = (int32_t *)(buf + (Di + 1) * HP);
    for (csa_idx h = 0; h < HP; h++) {
        wv[h] = h < Hi ? wr[h * p->swh] : 0.0f;
        lm[h] = h < Hi ? -1 : 0;
    }
}

/* Finishes the S rows of batch b once all their scores exist: -inf fill or selection. */
static void CSA_V(ix_finish_batch)(const struct csa_index_problem *p,
                                   const struct csa_index_cand *c, csa_idx K, csa_idx offset,
                                   int order, int32_t *idx, float *sc, csa_idx sob, csa_idx sos,
                                   const float *scr, csa_idx b, struct sel_ws *ws)
{
    for (csa_idx s = 0; s < p->S; s++) {
        const csa_idx r = b * p->S + s, nv = visible(p->start_pos + s, p->ratio);
        if (!idx) {
            float *o = sc + b * sob + s * sos;
            for (csa_idx t = nv; t < p->Tc; t++) o[t] = -INFINITY;
        } else {
            select_row(scr + r * p->Tc, 1, nv, cand_row(c, b, s), c, K, offset, order,
                       idx + r * K, ws);
        }
    }
}

/* ix_run for calls with few rows (decode): the keys of each batch entry are split
 * into chunks taken dynamically by the threads (a descheduled thread holds up one
 * chunk, not half the keys), and the thread that completes a batch entry's last
 * chunk finishes its rows, so no barrier waits inside the region.  Scratch: the
 * packed rows and, for top-k, their [Tc] score rows. */
static int CSA_V(ix_run_keysplit)(const struct csa_index_problem *p,
                                  const struct csa_index_cand *c, csa_idx K, csa_idx offset,
                                  int order, int32_t *idx, float *sc, csa_idx sob, csa_idx sos,
                                  csa_idx HP, size_t row_bytes)
{
    const csa_idx rows = p->B * p->S, Tc = p->Tc, S = p->S;
    const csa_idx bs = c && c->mask ? c->block_size : 1, scn = c && c->mask ? c->scn : 0;
    const csa_idx KC = IX_NK * 64;
    const csa_idx nvmax = visible(p->start_pos + S - 1, p->ratio);
    const csa_idx nch = nvmax > 0 ? (nvmax + KC - 1) / KC : 1, items = p->B * nch;
    float *bufs = aligned_alloc(64, row_bytes * (size_t)rows);
    float *scr = idx ? malloc((size_t)rows * (size_t)(Tc > 0 ? Tc : 1) * sizeof(float)) : NULL;
    csa_idx *done = calloc((size_t)p->B, sizeof(csa_idx));
    if (!bufs || (idx && !scr) || !done) {
        free(bufs);
        free(scr);
        free(done);
        return CSA_ENOMEM;
    }
    const csa_idx rf = (csa_idx)(row_bytes / sizeof(float));
    for (csa_idx r = 0; r < rows; r++) CSA_V(ix_pack_row)(p, r / S, r % S, HP, bufs + r * rf);
    int err = CSA_OK;
#pragma omp parallel num_threads(csa_threads(items, 1))
    {
        struct sel_ws ws = {0};
        const int st = idx ? sel_ws_alloc(&ws, Tc, K) : CSA_OK;
        if (st) {
#pragma omp atomic write
            err = st;
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (csa_idx it = 0; it < items; it++) {
            const csa_idx b = it / nch, t0 = (it % nch) * KC;
            for (csa_idx s = 0; s < S; s++) {
                const csa_idx r = b * S + s;
                const csa_idx t1 = imin(visible(p->start_pos + s, p->ratio), t0 + KC);
                if (t1 <= t0) continue;
                float *o = idx ? scr + r * Tc : sc + b * sob + s * sos;
                CSA_V(ix_score_row)(bufs + r * rf, HP, p->Di, p->k + b * p->skb, p->skt, t0, t1,
                                    cand_row(c, b, s), scn, bs, o);
            }
            /* acq_rel: the last chunk's thread sees every other chunk's scores */
            if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == nch) {
                if (st) continue; /* no workspace: err is set, nothing to select with */
                CSA_V(ix_finish_batch)(p, c, K, offset, order, idx, sc, sob, sos, scr, b, &ws);
            }
        }
        sel_ws_free(&ws);
    }
    free(bufs);
    free(scr);
    free(done);
    return err;
}

/* Scores (idx == NULL: into sc[b*sob + s*sos + t], -inf past the visible entries) or
 * fused top-k (into idx [B, S, K]). */
static int CSA_V(ix_run)(const struct csa_index_problem *p, const struct csa_index_cand *c,
                         csa_idx K, csa_idx offset, int order, int32_t *idx, float *sc,
                         csa_idx sob, csa_idx sos)
{
    const csa_idx rows = p->B * p->S, Tc = p->Tc, Di = p->Di;
    if (rows == 0 || (idx && K == 0)) return CSA_OK;
    const csa_idx HP = (p->Hi + IX_VL - 1) / IX_VL * IX_VL;
    const size_t row_bytes = ((size_t)(Di + 2) * HP * sizeof(float) + 64) / 64 * 64;
    const csa_idx bs = c && c->mask ? c->block_size : 1, scn = c && c->mask ? c->scn : 0;
    const int nt_max = csa_threads(rows * 4096, 1);
    int err = CSA_OK;

    if (nt_max > 1 && rows < 4 * nt_max) {
        return CSA_V(ix_run_keysplit)(p, c, K, offset, order, idx, sc, sob, sos, HP,
                                      row_bytes);
    }

    /* Blocks of qb rows share each chunk of keys while it sits in L2; qb shrinks so
     * that every thread gets a few blocks. */
    const csa_idx qb = imin(IX_QB, rows / (4 * nt_max) > 1 ? rows / (4 * nt_max) : 1);
    const csa_idx nbs = (p->S + qb - 1) / qb, nblk = p->B * nbs;
    const csa_idx KC = IX_NK * imin(1 << 16, (csa_idx)(512 * 1024) / (4 * (Di > 0 ? Di : 1)) / IX_NK + 1);
    const csa_idx rf = (csa_idx)(row_bytes / sizeof(float));
#pragma omp parallel num_threads(csa_threads(nblk, 1))
    {
        float *bufs = aligned_alloc(64, row_bytes * IX_QB);
        float *scr = idx ? malloc((size_t)IX_QB * (size_t)(Tc > 0 ? Tc : 1) * sizeof(float)) : NULL;
        struct sel_ws ws = {0};
        int st = (!bufs || (idx && !scr)) ? CSA_ENOMEM : CSA_OK;
        if (!st && idx) st = sel_ws_alloc(&ws, Tc, K);
        if (st) {
#pragma omp atomic write
            err = st;
        }
#pragma omp for schedule(dynamic, 1)
        for (csa_idx bb = 0; bb < nblk; bb++) {
            if (st) continue;
            const csa_idx blk = nblk - 1 - bb, b = blk / nbs, s0 = (blk % nbs) * qb;
            const csa_idx ns = imin(qb, p->S - s0);
            csa_idx nv[IX_QB], nvmax = 0;
            float *o[IX_QB];
            for (csa_idx i = 0; i < ns; i++) {
                nv[i] = visible(p->start_pos + s0 + i, p->ratio);
                nvmax = nv[i] > nvmax ? nv[i] : nvmax;
                o[i] = idx ? scr + i * Tc : sc + b * sob + (s0 + i) * sos;
                if (nv[i] > 0) CSA_V(ix_pack_row)(p, b, s0 + i, HP, bufs + i * rf);
            }
            for (csa_idx t0 = 0; t0 < nvmax; t0 += KC)
                for (csa_idx i = 0; i < ns; i++) {
                    const csa_idx t1 = imin(nv[i], t0 + KC);
                    if (t1 > t0)
                        CSA_V(ix_score_row)(bufs + i * rf, HP, Di, p->k + b * p->skb, p->skt, t0,
                                            t1, cand_row(c, b, s0 + i), scn, bs, o[i]);
                }
            for (csa_idx i = 0; i < ns; i++) {
                if (idx)
                    select_row(o[i], 1, nv[i], cand_row(c, b, s0 + i), c, K, offset, order,
                               idx + (b * p->S + s0 + i) * K, &ws);
                else
                    for (csa_idx t = nv[i]; t < Tc; t++) o[i][t] = -INFINITY;
            }
        }
        free(bufs);
        free(scr);
        sel_ws_free(&ws);
    }
    return err;
}

static int CSA_V(index_scores_tuned)(const struct csa_index_problem *p, float *out, csa_idx sob,
                                     csa_idx sos)
{
    return CSA_V(ix_run)(p, NULL, 0, 0, 0, NULL, out, sob, sos);
}

static int CSA_V(index_topk_tuned)(const struct csa_index_problem *p,
                                   const struct csa_index_cand *c, csa_idx K, csa_idx offset,
                                   int order, int32_t *out)
{
    return CSA_V(ix_run)(p, c, K, offset, order, out, NULL, 0, 0);
}

#undef IX_VL
#undef IX_NK
#undef IX_HC
#undef IX_QB
