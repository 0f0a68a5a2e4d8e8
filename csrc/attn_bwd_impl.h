/* Tuned backward of sparse attention (docs/kernels.md, section 11.1), included by
 * attn_impl.h once per ISA level (CSA_V names), float32 only.
 *
 * One work item is one query row (b, s) with all H heads: its heads share the K
 * gathered kv rows, so per block of ATTN_KB gathered rows everything is a small GEMM
 * with the forward's tiles:
 *
 *   L[k, h]  = R_k . q_h          attn_logits with Q^T          (recomputed logits)
 *   dP[k, h] = R_k . dO_h         attn_logits with dO^T
 *   P = e^(scale L - lse),  dS = scale P (dP - Dr),  Dr[h] = dO_h . O_h
 *   dqT[d, h] += sum_k R_k[d] dS[k, h]                       attn_pv (alpha = 1)
 *   G[k, d]   = sum_h P[k, h] dO[h, d] + sum_h dS[k, h] q[h, d]   (bwd_gkv tile)
 *
 * G, the kv gradient of every valid slot of the row, goes to a shared buffer for a
 * chunk of rows; after the chunk its index lists are inverted (for each kv row, the
 * (row, slot) pairs that list it, in that order) and the threads take kv rows, each
 * adding its G rows onto the old value in list order, the sum kept in registers.  So every dkv
 * element is a sequential sum in the order (b, s, slot) at any thread count and any
 * chunk size; dsink sums the rows' -e^(sink - lse) Dr in row order at the end. */

#define ATTN_BWD_G_BYTES (32u << 20) /* most bytes of G per chunk of rows */

#ifdef __AVX512F__
/* G[i, d0 .. d0 + 16 NV) for ATTN_MR rows i: sum_h P[i, h] dO[h, .] then + sum_h
 * dS[i, h] q[h, .] (features beyond D are masked off on load; G has room for them). */
static inline __attribute__((always_inline)) void
CSA_V(gkv_tile)(const float *P, const float *DS, csa_idx hcp, csa_idx H, const float *dO,
                csa_idx sdo_h, const float *q, csa_idx sq_h, csa_idx d0, csa_idx D, float *G,
                csa_idx dg, const int NV)
{
    __m512 acc[ATTN_MR][4];
    __mmask16 mk[4];
    for (int j = 0; j < NV; j++) {
        const csa_idx left = D - d0 - 16 * j;
        mk[j] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    }
    for (int i = 0; i < ATTN_MR; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = _mm512_setzero_ps();
    for (csa_idx h = 0; h < H; h++) {
        const float *x = dO + h * sdo_h + d0;
        __m512 v[4];
        for (int j = 0; j < NV; j++) v[j] = _mm512_maskz_loadu_ps(mk[j], x + 16 * j);
        for (int i = 0; i < ATTN_MR; i++) {
            const __m512 w = _mm512_set1_ps(P[i * hcp + h]);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(w, v[j], acc[i][j]);
        }
    }
    for (csa_idx h = 0; h < H; h++) {
        const float *x = q + h * sq_h + d0;
        __m512 v[4];
        for (int j = 0; j < NV; j++) v[j] = _mm512_maskz_loadu_ps(mk[j], x + 16 * j);
        for (int i = 0; i < ATTN_MR; i++) {
            const __m512 w = _mm512_set1_ps(DS[i * hcp + h]);
            for (int j = 0; j < NV; j++) acc[i][j] = _mm512_fmadd_ps(w, v[j], acc[i][j]);
        }
    }
    for (int i = 0; i < ATTN_MR; i++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(G + i * dg + d0 + 16 * j, acc[i][j]);
}
#endif

/* G[i, :] for i < kbp (a multiple of ATTN_MR; G rows dg floats apart, dg >= D rounded
 * up to 16). */
static void CSA_V(bwd_gkv)(const float *P, const float *DS, csa_idx kbp, csa_idx hcp, csa_idx H,
                           const float *dO, csa_idx sdo_h, const float *q, csa_idx sq_h,
                           csa_idx D, float *G, csa_idx dg)
{
#ifdef __AVX512F__
    /* features outer: the 64-feature slices of q and dO (32 KB for 64 heads) stay in L1
     * while the block's slots pass; P and dS are read by broadcasts, in order */
    for (csa_idx d0 = 0; d0 < D; d0 += 64)
        for (csa_idx i0 = 0; i0 < kbp; i0 += ATTN_MR) {
            const csa_idx nv = (D - d0 + 15) / 16;
            const float *Pi = P + i0 * hcp, *Si = DS + i0 * hcp;
            float *Gi = G + i0 * dg;
            switch (nv >= 4 ? 4 : nv) {
            case 4: CSA_V(gkv_tile)(Pi, Si, hcp, H, dO, sdo_h, q, sq_h, d0, D, Gi, dg, 4); break;
            case 3: CSA_V(gkv_tile)(Pi, Si, hcp, H, dO, sdo_h, q, sq_h, d0, D, Gi, dg, 3); break;
            case 2: CSA_V(gkv_tile)(Pi, Si, hcp, H, dO, sdo_h, q, sq_h, d0, D, Gi, dg, 2); break;
            default: CSA_V(gkv_tile)(Pi, Si, hcp, H, dO, sdo_h, q, sq_h, d0, D, Gi, dg, 1); break;
            }
        }
#else
    for (csa_idx i = 0; i < kbp; i++) {
        float *CSA_RESTRICT g = G + i * dg;
        for (csa_idx d = 0; d < D; d++) g[d] = 0.0f;
        for (csa_idx h = 0; h < H; h++) {
            const float w = P[i * hcp + h];
            const float *CSA_RESTRICT x = dO + h * sdo_h;
#pragma omp simd
            for (csa_idx d = 0; d < D; d++) g[d] += w * x[d];
        }
        for (csa_idx h = 0; h < H; h++) {
            const float w = DS[i * hcp + h];
            const float *CSA_RESTRICT x = q + h * sq_h;
#pragma omp simd
            for (csa_idx d = 0; d < D; d++) g[d] += w * x[d];
        }
    }
#endif
}

/* dst[d] += G[ref_0 + d] + G[ref_1 + d] + ... in list order (one sequential float32
 * chain per feature), d < D; the partial sum stays in registers per block of features. */
static void CSA_V(bwd_gather_add)(float *CSA_RESTRICT dst, const float *G, const csa_idx *ref,
                                  csa_idx n, csa_idx D)
{
    csa_idx d0 = 0;
#ifdef __AVX512F__
    for (; d0 + 128 <= D; d0 += 128) {
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_loadu_ps(dst + d0 + 16 * j);
        for (csa_idx i = 0; i < n; i++) {
            const float *src = G + ref[i] + d0;
            for (int j = 0; j < 8; j++) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(src + 16 * j));
        }
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(dst + d0 + 16 * j, acc[j]);
    }
#endif
    for (; d0 < D; d0 += 64) {
        const csa_idx nd = D - d0 < 64 ? D - d0 : 64;
        float acc[64];
        for (csa_idx d = 0; d < nd; d++) acc[d] = dst[d0 + d];
        for (csa_idx i = 0; i < n; i++) {
            const float *CSA_RESTRICT src = G + ref[i] + d0;
#pragma omp simd
            for (csa_idx d = 0; d < nd; d++) acc[d] += src[d];
        }
        for (csa_idx d = 0; d < nd; d++) dst[d0 + d] = acc[d];
    }
}

/* Per-thread scratch of the backward, in floats (pieces multiples of 16). */
struct CSA_V(bwd_ws) {
    float *QT, *dOT, *dqT, *L, *dP, *lse, *Dr, *ones, *tile;
};

/* One query row (b, s): dq[b, s], the row's G (slot order of the valid entries) and
 * their kv indices in vid, their count in *cnt, the row's dsink terms in rs[H]. */
static void CSA_V(bwd_item)(const struct csa_attn_bwd_problem *g, csa_idx b, csa_idx s,
                            csa_idx hcp, csa_idx dp, const struct CSA_V(bwd_ws) *w,
                            const float **valid, const float **blk, float *G, int32_t *vid,
                            csa_idx *cnt, float *rs)
{
    const struct csa_attn_problem *a = &g->f;
    const csa_idx D = a->D, H = a->H, K = a->K;
    const int32_t *ir = a->idx + b * a->si_b + s * a->si_s;
    const float *kvb = (const float *)a->kv + b * a->skv_b;
    const float *q = (const float *)a->q + b * a->sq_b + s * a->sq_s;
    const float *o = (const float *)a->out + b * a->so_b + s * a->so_s;
    const float *dO = g->dout + b * g->sdo_b + s * g->sdo_s;
    float *dq = g->dq + b * g->sdq_b + s * g->sdq_s;
    const float *lse = a->lse + b * a->sl_b + s * a->sl_s;

    csa_idx n = 0;
    for (csa_idx k = 0; k < K; k++)
        if (ir[k] >= 0) {
            vid[n] = ir[k];
            valid[n++] = kvb + (csa_idx)ir[k] * a->skv_n;
        }
    *cnt = n;
    if (n == 0) { /* the output is the constant 0: no gradient anywhere */
        for (csa_idx h = 0; h < H; h++) {
            memset(dq + h * g->sdq_h, 0, (size_t)D * sizeof(float));
            rs[h] = 0.0f;
        }
        return;
    }
    CSA_V(attn_transpose_q)(q, 0, a->sq_h, H, hcp, D, w->QT);
    CSA_V(attn_transpose_q)(dO, 0, g->sdo_h, H, hcp, D, w->dOT);
    for (csa_idx h = 0; h < hcp; h++) {
        float dr = 0.0f;
        if (h < H) {
            /* 16 interleaved partial sums (vector lanes), then added in lane order: a
             * fixed order that vectorizes without reassociation */
            const float *CSA_RESTRICT x = dO + h * g->sdo_h, *CSA_RESTRICT y = o + h * a->so_h;
            float part[16] = {0};
            csa_idx d = 0;
            for (; d + 16 <= D; d += 16)
#pragma omp simd
                for (int l = 0; l < 16; l++) part[l] += x[d + l] * y[d + l];
            for (; d < D; d++) part[d % 16] += x[d] * y[d];
            for (int l = 0; l < 16; l++) dr += part[l];
        }
        w->Dr[h] = dr;
        w->lse[h] = h < H ? lse[h] : INFINITY;
        w->ones[h] = 1.0f;
    }
    for (csa_idx h = 0; h < H; h++) {
        rs[h] = -expf(a->sink[h] - w->lse[h]) * w->Dr[h];
#ifdef CSA_MUTANT_ATTN_BWD_SINK_SIGN
        rs[h] = -rs[h];
#endif
    }
    const int direct = (uintptr_t)kvb % sizeof(float) == 0;
    const float scale = a->scale;
    for (csa_idx k0 = 0; k0 < n; k0 += ATTN_KB) {
        const csa_idx kb = n - k0 < ATTN_KB ? n - k0 : ATTN_KB;
        const csa_idx kbp = ((kb + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
        for (csa_idx i = 0; i < kbp; i++) {
            float *t = w->tile + i * dp;
            if (i < kb && direct) {
                blk[i] = valid[k0 + i];
            } else {
                if (i < kb)
                    memcpy(t, valid[k0 + i], (size_t)D * sizeof(float));
                else
                    memset(t, 0, (size_t)D * sizeof(float));
                blk[i] = t;
            }
        }
        CSA_V(attn_logits)(blk, kbp, w->QT, hcp, D, w->L);
        CSA_V(attn_logits)(blk, kbp, w->dOT, hcp, D, w->dP);
        CSA_V(attn_probs)(w->L, kb, hcp, scale, w->lse, H, NULL);
        for (csa_idx i = 0; i < kb; i++) {
            float *CSA_RESTRICT P = w->L + i * hcp, *CSA_RESTRICT dS = w->dP + i * hcp;
            const float *CSA_RESTRICT dr = w->Dr;
#ifdef CSA_MUTANT_ATTN_BWD_NO_DR
#pragma omp simd
            for (csa_idx h = 0; h < hcp; h++) dS[h] = scale * (P[h] * dS[h]);
            continue;
#endif
#pragma omp simd
            for (csa_idx h = 0; h < hcp; h++) dS[h] = scale * (P[h] * (dS[h] - dr[h]));
        }
        /* the padding rows weigh nothing */
        memset(w->L + kb * hcp, 0, (size_t)((kbp - kb) * hcp) * sizeof(float));
        memset(w->dP + kb * hcp, 0, (size_t)((kbp - kb) * hcp) * sizeof(float));
        CSA_V(attn_pv)(blk, kb, w->dP, hcp, w->ones, w->dqT, D, k0 == 0);
        CSA_V(bwd_gkv)(w->L, w->dP, kbp, hcp, H, dO, g->sdo_h, q, a->sq_h, D, G + k0 * dp, dp);
    }
#ifdef CSA_MUTANT_ATTN_BWD_DQ_SCALE
    for (csa_idx h = 0; h < hcp; h++) w->ones[h] = 1.0f - 1e-4f;
#endif
    CSA_V(attn_store)(w->dqT, hcp, w->ones, H, D, dq, g->sdq_h, 0);
}

static int CSA_V(sparse_attn_backward_tuned)(const struct csa_attn_bwd_problem *g)
{
    const struct csa_attn_problem *a = &g->f;
    const csa_idx B = a->B, S = a->S, H = a->H, D = a->D, K = a->K, N = a->N, nq = B * S;
    const csa_idx hcp = ((H + 15) / 16) * 16, dp = ((D + 15) / 16) * 16;
    const csa_idx kbp_max = ((ATTN_KB + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
    const csa_idx per_thread = 3 * D * hcp + 2 * kbp_max * hcp + 3 * hcp + kbp_max * dp;
    const csa_idx per_ptr = K + kbp_max;
    const csa_idx g_row = (K + ATTN_MR) * dp; /* slack: the last block's padding rows */
    const int nt = csa_threads(nq, 1);
    /* rows per chunk: as many as ATTN_BWD_G_BYTES of G hold (24 at V4-Flash): each chunk
     * costs two barriers, which a loaded machine makes expensive (measured: 1 or 4 rows
     * per thread 15-40% slower than 12 or 32 at 2 threads); the results do not depend on it */
    const csa_idx ch_mem = (csa_idx)(ATTN_BWD_G_BYTES / ((size_t)g_row * sizeof(float)));
    csa_idx ch = ch_mem;
    if (ch < 1) ch = 1;
    if (ch > nq) ch = nq;
    float *ws = aligned_alloc(64, (size_t)(nt * per_thread) * sizeof(float));
    const float **ptrs = malloc((size_t)(nt * per_ptr) * sizeof(*ptrs));
    float *G = aligned_alloc(64, (size_t)(ch * g_row) * sizeof(float));
    int32_t *vid = malloc((size_t)(ch * K) * sizeof(int32_t));
    csa_idx *cnt = malloc((size_t)ch * sizeof(csa_idx));
    float *rs = malloc((size_t)(nq * H) * sizeof(float));
    /* the inverted lists: head/fill [B*N + 1], gref [ch*K] (offsets of G rows) */
    csa_idx *head = malloc((size_t)(B * N + 1) * sizeof(csa_idx));
    csa_idx *fill = malloc((size_t)(B * N + 1) * sizeof(csa_idx));
    csa_idx *gref = malloc((size_t)(ch * K) * sizeof(csa_idx));
    if (!ws || !ptrs || !G || !vid || !cnt || !rs || !head || !fill || !gref) {
        free(head);
        free(fill);
        free(gref);
        free(ws);
        free(ptrs);
        free(G);
        free(vid);
        free(cnt);
        free(rs);
        return CSA_ENOMEM;
    }

#pragma omp parallel num_threads(nt)
    {
        const int t = omp_tid();
        float *p = ws + t * per_thread;
        struct CSA_V(bwd_ws) w;
        w.QT = p, p += D * hcp;
        w.dOT = p, p += D * hcp;
        w.dqT = p, p += D * hcp;
        w.L = p, p += kbp_max * hcp;
        w.dP = p, p += kbp_max * hcp;
        w.lse = p, p += hcp;
        w.Dr = p, p += hcp;
        w.ones = p, p += hcp;
        w.tile = p;
        const float **valid = ptrs + t * per_ptr, **blk = valid + K;
#pragma omp for schedule(static)
        for (csa_idx bn = 0; bn < B * N; bn++)
            memset(g->dkv + (bn / N) * g->sdkv_b + (bn % N) * g->sdkv_n, 0, (size_t)D * sizeof(float));
        for (csa_idx c0 = 0; c0 < nq; c0 += ch) {
            const csa_idx c1 = c0 + ch < nq ? c0 + ch : nq;
#pragma omp for schedule(dynamic, 1)
            for (csa_idx r = c0; r < c1; r++)
                CSA_V(bwd_item)(g, r / S, r % S, hcp, dp, &w, valid, blk, G + (r - c0) * g_row,
                                vid + (r - c0) * K, cnt + (r - c0), rs + r * H);
            /* the chunk's G into dkv: the index lists inverted (one thread, a stable
             * counting sort by (b, n), so each kv row's list is in (row, slot) order),
             * then the kv rows in parallel, each a sequential sum onto its old value */
#pragma omp single
            {
                memset(head, 0, (size_t)(B * N + 1) * sizeof(csa_idx));
                for (csa_idx r = c0; r < c1; r++)
                    for (csa_idx i = 0; i < cnt[r - c0]; i++)
                        head[(r / S) * N + vid[(r - c0) * K + i] + 1]++;
                for (csa_idx k = 0; k < B * N; k++) head[k + 1] += head[k];
                for (csa_idx k = 0; k <= B * N; k++) fill[k] = head[k];
                for (csa_idx r = c0; r < c1; r++)
                    for (csa_idx i = 0; i < cnt[r - c0]; i++) {
#ifdef CSA_MUTANT_ATTN_BWD_DUP_ONCE
                        if (i > 0 && vid[(r - c0) * K + i] == vid[(r - c0) * K + i - 1]) continue;
#endif
                        gref[fill[(r / S) * N + vid[(r - c0) * K + i]]++] = (r - c0) * g_row + i * dp;
                    }
            }
#pragma omp for schedule(dynamic, 16)
            for (csa_idx key = 0; key < B * N; key++) {
                const csa_idx lo = head[key], hi = fill[key]; /* fill: the end of the list */
                if (lo == hi) continue;
                float *dst = g->dkv + (key / N) * g->sdkv_b + (key % N) * g->sdkv_n;
                CSA_V(bwd_gather_add)(dst, G, gref + lo, hi - lo, D);
            }
        }
    }
    for (csa_idx h = 0; h < H; h++) {
        float t = 0.0f;
        for (csa_idx r = 0; r < nq; r++) t += rs[r * H + h];
        g->dsink[h] = t;
    }
    free(ws);
    free(ptrs);
    free(G);
    free(vid);
    free(cnt);
    free(rs);
    free(head);
    free(fill);
    free(gref);
    return CSA_OK;
}
