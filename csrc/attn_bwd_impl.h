/* Tuned backward of sparse attention (docs/kernels.md, section 11.1), included by
 * attn_impl.h once per ISA level (CSA_V names); float32 outputs (attn.c rounds them for
 * bfloat16 ones), float32 or bfloat16 inputs, widened where they are read.
 *
 * Two kinds of work item, over chunks of ATTN_BWD_CH query rows:
 *
 * Row items (one query row (b, s) with all H heads, which share the K gathered kv
 * rows): per block of ATTN_BWD_KB gathered rows, small GEMMs with the forward's tiles,
 *
 *   L[k, h]  = R_k . q_h          attn_logits with Q^T          (recomputed logits)
 *   dP[k, h] = R_k . dO_h         attn_logits with dO^T
 *   P = e^(scale L - lse),  dS = scale P (dP - Dr),  Dr[h] = dO_h . O_h
 *   dqT[d, h] += sum_k R_k[d] dS[k, h]                       attn_pv (no alpha)
 *
 * and P, dS of every valid slot go to the chunk's buffer ([K + 6, H] each per row).
 *
 * Column items (a block of features of one chunk): for the chunk's rows in
 * order and their valid slots in order, the kv gradient of the slot
 *
 *   G[k, d] = sum_h P[k, h] dO[h, d] + sum_h dS[k, h] q[h, d]      (bwd_gkv tile)
 *
 * is formed in registers (6 slots x 64 features) and added straight onto
 * dkv[b, idx_k, d].  Each feature belongs to one column item, so every dkv element is a
 * sequential float32 sum in (b, s, slot) order at any thread count and any chunk size,
 * with no atomics and no [rows, K, D] buffer.  (The previous design wrote G for a chunk
 * of rows to a 32 MB buffer, inverted the chunk's index lists on one thread and summed
 * each kv row's G rows in list order: the same sum in the same order, so the same bits,
 * but G is 4x the bytes of P and dS -- 1.3 MB a row at V4-Flash -- and measured on the
 * 2-core Sapphire Rapids (shared host), G's stores, its page faults, the serial
 * inversion and the waits at its barriers were a quarter of the backward.)
 * The items are handed out in one list, the row items of chunk c followed by the column
 * items of chunk c - 1, and each waits (acquire / release counters) only for the items
 * whose results it reads: a column item for its chunk's rows and for the same column of
 * the previous chunk (so the dkv order stays fixed), a row item for the column items of
 * the chunk that last used its buffer (ATTN_BWD_NB buffers).  There is no barrier per
 * chunk; dsink sums the rows' -e^(sink - lse) Dr in row order at the end. */

/* Rows per chunk: ATTN_BWD_CH per thread (P and dS of the chunks in flight: 3 x 4 x
 * 330 KB at V4-Flash and 2 threads).  Features per column item: D split into
 * ceil(threads / 2) parts of 64-feature multiples -- one column item per chunk at 1 or 2
 * threads.  A chunk's P and dS then pass through L1 once per 64 features of its item,
 * and at 2 threads the column items (about 40% of the work) form one chain that runs
 * beside the row items of the next chunks instead of both threads doing d(kv) of the
 * same chunk at once; with more threads one chain would be the bottleneck, hence a
 * chain per 2 threads.  Measured, V4-Flash at S = 2048, 2 threads (bench_grad_ratio's
 * shape, old and new settings interleaved in one process, load 1.3-3.9): avx512
 * float32 2 rows a thread with one column item 2.47x / 2.48x the forward against 2.56x /
 * 2.67x with 8 rows a thread and two column items of 256 features (the previous
 * setting), bfloat16 2.41x against 2.62x, avx2 float32 2.26x against 2.30x; either change
 * alone moved nothing (2 rows: 2.65x against 2.64x; one column item: 2.57x against
 * 2.56x).  (Older, with a barrier per chunk: 1 thread, 4 rows 2.45x, 16 rows 2.51x;
 * 64 features per item 2.62x against 2.52x with all 512.)  Neither changes a bit: every
 * dkv element is the same chain whichever item computes it. */
#define ATTN_BWD_CH 2
/* gathered rows per block of a row item: a multiple of ATTN_MR, so no logits tile
 * computes padding rows but the last (the forward's 64 compute 66) */
#define ATTN_BWD_KB 66
/* chunks whose P and dS are held at once (at least 2: the row items of chunk c are
 * listed before the column items of chunk c - 1): the row items run up to
 * ATTN_BWD_NB - 1 chunks ahead of the column items */
#define ATTN_BWD_NB 3

#ifdef __AVX512F__
/* G[i, d0 .. d0 + 16 NV) for ATTN_MR slots i (sum_h P[i, h] dO[h, .] then + sum_h
 * dS[i, h] q[h, .], features beyond D masked off), added onto dkv row dst[i] for i < nr,
 * in slot order (a kv row listed twice in the tile gets both, one after the other). */
static inline __attribute__((always_inline)) void
CSA_V(gkv_tile)(const float *P, const float *DS, csa_idx hcp, csa_idx H, const float *dO,
                csa_idx sdo_h, const float *q, csa_idx sq_h, csa_idx d0, csa_idx D,
                float *const *dst, int nr, const int NV)
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
    /* constant indices only (a loop to nr would index acc at run time and keep it in
     * memory: measured 1.8x slower tiles) */
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) {
        if (i >= nr) break;
        float *o = dst[i] + d0;
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(o + 16 * j, mk[j],
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(mk[j], o + 16 * j), acc[i][j]));
    }
}

/* gkv_tile at hcp = 64 and 64 features (V4-Flash), out of line: the 6 weights of a head
 * and the dO / q rows are one base register + constant displacements, and the masks
 * constant (plain loads).  All ATTN_MR rows of dst are written (the caller points the
 * rows past nr at scratch): with a run-time nr, GCC kept the accumulators' home on the
 * stack and stored all 24 every head of the second loop. */
static __attribute__((noinline)) void
CSA_V(gkv_tile_64)(const float *P, const float *DS, csa_idx H, const float *dO, const float *q,
                   float *const *dst)
{
    CSA_V(gkv_tile)(P, DS, 64, H, dO, 64, q, 64, 0, 64, dst, ATTN_MR, 4);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The AVX2 tile: 6 slots x 16 features (12 accumulators of the 16 ymm registers), the
 * same per-element chains; added onto dst[i] + d0 for i < nr in slot order.  Called
 * with hcp = 64 as a constant where it is (V4-Flash), so the 6 weights of a head are
 * one base register + displacements; bwd_dkv_cols is kept out of line: inlined into the
 * backward's parallel region, GCC kept the 6 offsets i hcp on the stack and reloaded
 * them every head (6 loads beside the 6 broadcasts per 12 FMAs). */
static inline __attribute__((always_inline)) void
CSA_V(gkv_tile_v8)(const float *P, const float *DS, const csa_idx hcp, csa_idx H,
                                      const float *dO, csa_idx sdo_h, const float *q,
                                      csa_idx sq_h, csa_idx d0, float *const *dst, int nr)
{
    CSA_V(v8) acc[ATTN_MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) acc[i][0] = acc[i][1] = (CSA_V(v8)){0};
    for (csa_idx h = 0; h < H; h++) {
        const CSA_V(v8) x0 = *(const CSA_V(v8u) *)(dO + h * sdo_h + d0);
        const CSA_V(v8) x1 = *(const CSA_V(v8u) *)(dO + h * sdo_h + d0 + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ATTN_MR; i++) {
            const float w = P[i * hcp + h];
            acc[i][0] += w * x0;
            acc[i][1] += w * x1;
        }
    }
    for (csa_idx h = 0; h < H; h++) {
        const CSA_V(v8) x0 = *(const CSA_V(v8u) *)(q + h * sq_h + d0);
        const CSA_V(v8) x1 = *(const CSA_V(v8u) *)(q + h * sq_h + d0 + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ATTN_MR; i++) {
            const float w = DS[i * hcp + h];
            acc[i][0] += w * x0;
            acc[i][1] += w * x1;
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) {
        if (i >= nr) break;
        CSA_V(v8u) *o = (CSA_V(v8u) *)(dst[i] + d0);
        o[0] = o[0] + acc[i][0];
        o[1] = o[1] + acc[i][1];
    }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The row items' tiles at AVX2: the forward's qk_tile_v8 / pv_tile_v8 with the same
 * per-element chains (so the same bits), but reading the block's rows from the tile,
 * ts floats apart (bwd_item says why), instead of through a pointer per row.  The
 * forward's tiles, inlined into the backward's parallel region, reloaded row pointers
 * or offsets from the stack every step (5-9 loads per 12 FMAs); here a row is a
 * displacement from one base (constant for ts = 528, hcp = 64, D = 512, V4-Flash).
 * Measured with the padded tile, 2 threads, float32, S = 2048, load 2-4: backward /
 * forward 2.31x against 2.50x before, CPU time, interleaved. */

/* L[i, 0:16] = sum_d T[i ts + d] QT[d, 0:16] for ATTN_MR rows of the block tile T. */
static inline __attribute__((always_inline)) void
CSA_V(bwd_qk_v8)(const float *T, const csa_idx ts, const float *QT, const csa_idx hcp,
                 const csa_idx D, float *L)
{
    CSA_V(v8) acc[ATTN_MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) acc[i][0] = acc[i][1] = (CSA_V(v8)){0};
    const float *r = T, *qt = QT;
    for (csa_idx d = 0; d < D; d++, r++, qt += hcp) {
        const CSA_V(v8) q0 = *(const CSA_V(v8) *)qt, q1 = *(const CSA_V(v8) *)(qt + 8);
#pragma GCC unroll 8
        for (int i = 0; i < ATTN_MR; i++) {
            const float x = r[i * ts];
            acc[i][0] += x * q0;
            acc[i][1] += x * q1;
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_MR; i++) {
        *(CSA_V(v8) *)(L + i * hcp) = acc[i][0];
        *(CSA_V(v8) *)(L + i * hcp + 8) = acc[i][1];
    }
}

/* bwd_logits_v8's loops, inlined once with the shape's constants, once without */
static inline __attribute__((always_inline)) void
CSA_V(bwd_logits_v8_k)(const float *T, const csa_idx ts, csa_idx kbp, const float *QT,
                       const csa_idx hcp, const csa_idx D, float *L)
{
    for (csa_idx i0 = 0; i0 < kbp; i0 += ATTN_MR)
        for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
            CSA_V(bwd_qk_v8)(T + i0 * ts, ts, QT + h0, hcp, D, L + i0 * hcp + h0);
}

/* Logits of kbp (a multiple of ATTN_MR) tile rows for all hcp heads (attn_logits). */
static __attribute__((noinline)) void
CSA_V(bwd_logits_v8)(const float *T, csa_idx ts, csa_idx kbp, const float *QT, csa_idx hcp,
                     csa_idx D, float *L)
{
    if (ts == 528 && hcp == 64 && D == 512)
        CSA_V(bwd_logits_v8_k)(T, 528, kbp, QT, 64, 512, L);
    else
        CSA_V(bwd_logits_v8_k)(T, ts, kbp, QT, hcp, D, L);
}

/* OT[d0 + i, 0:16] (+)= sum_{k < kb} T[k ts + d0 + i] P[k, 0:16], i < 6. */
static inline __attribute__((always_inline)) void
CSA_V(bwd_pv_v8)(const float *T, csa_idx ts, csa_idx kb, const float *P, csa_idx hcp,
                 float *OT, csa_idx d0, int first)
{
    CSA_V(v8) acc[6][2];
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        acc[i][0] = first ? (CSA_V(v8)){0} : *(const CSA_V(v8) *)(OT + (d0 + i) * hcp);
        acc[i][1] = first ? (CSA_V(v8)){0} : *(const CSA_V(v8) *)(OT + (d0 + i) * hcp + 8);
    }
    const float *r = T + d0, *p = P;
    for (csa_idx k = 0; k < kb; k++, r += ts, p += hcp) {
        const CSA_V(v8) p0 = *(const CSA_V(v8) *)p, p1 = *(const CSA_V(v8) *)(p + 8);
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) {
            const float x = r[i];
            acc[i][0] += x * p0;
            acc[i][1] += x * p1;
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < 6; i++) {
        *(CSA_V(v8) *)(OT + (d0 + i) * hcp) = acc[i][0];
        *(CSA_V(v8) *)(OT + (d0 + i) * hcp + 8) = acc[i][1];
    }
}

/* OT[d, h] (+)= sum_{k < kb} T[k ts + d] P[k, h] for d < D, h < hcp (attn_pv without
 * alpha; the tail of D % 6 features by attn_pv_feature through R, the same rows). */
static __attribute__((noinline)) void
CSA_V(bwd_pv)(const float *T, csa_idx ts, const float *const *R, csa_idx kb, const float *P,
              csa_idx hcp, float *OT, csa_idx D, int first)
{
    const csa_idx d6 = D - D % 6;
    for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
        for (csa_idx d0 = 0; d0 < d6; d0 += 6)
            CSA_V(bwd_pv_v8)(T, ts, kb, P + h0, hcp, OT + h0, d0, first);
    for (csa_idx d = d6; d < D; d++) CSA_V(attn_pv_feature)(R, kb, P, hcp, NULL, OT, d, first);
}
#endif

/* The scalar form of the tile for features d0 .. d1 (at most 16): the same chains. */
static void CSA_V(gkv_tile_1)(const float *P, const float *DS, csa_idx hcp, csa_idx H,
                              const float *dO, csa_idx sdo_h, const float *q, csa_idx sq_h,
                              csa_idx d0, csa_idx d1, float *const *dst, int nr)
{
    float acc[ATTN_MR][16];
    const csa_idx nd = d1 - d0;
    for (int i = 0; i < ATTN_MR; i++)
        for (csa_idx c = 0; c < nd; c++) acc[i][c] = 0.0f;
    for (csa_idx h = 0; h < H; h++)
        for (int i = 0; i < ATTN_MR; i++) {
            const float w = P[i * hcp + h];
            for (csa_idx c = 0; c < nd; c++) acc[i][c] += w * dO[h * sdo_h + d0 + c];
        }
    for (csa_idx h = 0; h < H; h++)
        for (int i = 0; i < ATTN_MR; i++) {
            const float w = DS[i * hcp + h];
            for (csa_idx c = 0; c < nd; c++) acc[i][c] += w * q[h * sq_h + d0 + c];
        }
    for (int i = 0; i < nr; i++)
        for (csa_idx c = 0; c < nd; c++) dst[i][d0 + c] += acc[i][c];
}

/* t[i] = element o + i of a float32 (bf = 0) or bfloat16 (bf = 1) array, i < n. */
static inline void CSA_V(bwd_pack)(const void *x, int bf, csa_idx o, csa_idx n, float *CSA_RESTRICT t)
{
    if (bf)
        CSA_V(attn_widen_bf16)((const csa_bf16 *)x + o, n, t);
    else
        memcpy(t, (const float *)x + o, (size_t)n * sizeof(float));
}

/* A column item: dkv[b, idx, d0 .. d1) += G of every valid slot of rows r0 .. r1 (in
 * row order, then slot order).  Pb, Sb: the chunk's P and dS, rs floats a row apart;
 * vid, cnt: the rows' valid kv indices (slot order) and their counts; X: 2 H
 * (d1 - d0) floats of scratch.  Each row's dO and q slices are first packed into X,
 * one tile width of features (BW) at a time, each block H rows of its width, contiguous:
 * in place, their rows lie D floats apart, 2 KB at D = 512, so the 128 rows of a
 * 64-feature slice fall into 8 of L1's 64 sets and evict each other -- the tile read
 * them at half the logits tile's speed (perf, 2-core Sapphire Rapids, shared host).
 * (Packed H x (d1 - d0), rows 1 KB apart at 2 threads, the same happened to a lesser
 * degree, and a slot group walked all blocks, 128 KB, so every tile read from L2.)
 * The 64-feature blocks are the outer loop: a block's dO and q (2 H 64 floats, 32 KB)
 * stay in L1 for all the row's slot groups, and P and dS (6 x 2 lines a group) are
 * streamed from L2 instead, once per block.  Each dkv element still gets its slots in slot
 * order, the same chain. */
#if defined(__AVX2__) && !defined(__AVX512F__)
__attribute__((noinline))
#endif
static void CSA_V(bwd_dkv_cols)(const struct csa_attn_bwd_problem *g, csa_idx r0, csa_idx r1,
                                const float *Pb, const float *Sb, csa_idx rs, const int32_t *vid,
                                const csa_idx *cnt, csa_idx hcp, csa_idx d0, csa_idx d1, float *X)
{
    const struct csa_attn_problem *a = &g->f;
    const csa_idx S = a->S, H = a->H, K = a->K, nd = d1 - d0, cw = d1 - d0;
    const csa_idx BW = 64;
    float *xo = X, *xq = X + H * cw;
#ifdef __AVX512F__
    /* gkv_tile_64's rows past nr (zeroed: no read of indeterminate floats) */
    float junk[64] = {0};
#endif
#ifdef CSA_MUTANT_ATTN_BWD_CHUNK_LAST /* planted: a chunk's last row adds no d(kv) */
    if (r1 - r0 > 1) r1--;
#endif
    for (csa_idx r = r0; r < r1; r++) {
        const csa_idx b = r / S, s = r % S, n = cnt[r - r0];
        if (n == 0) continue;
        const csa_idx oo = b * g->sdo_b + s * g->sdo_s + d0, qo = b * a->sq_b + s * a->sq_s + d0;
        for (csa_idx c0 = 0; c0 < nd; c0 += BW) { /* bfloat16 rows widened on the way (exact) */
            const csa_idx bw = nd - c0 < BW ? nd - c0 : BW;
            float *bo = xo + c0 * H, *bq = xq + c0 * H;
            for (csa_idx h = 0; h < H; h++) {
                CSA_V(bwd_pack)(g->dout, g->dout_bf16, oo + h * g->sdo_h + c0, bw, bo + h * bw);
                CSA_V(bwd_pack)(a->q, a->bf16, qo + h * a->sq_h + c0, bw, bq + h * bw);
            }
        }
        const int32_t *v = vid + (r - r0) * K;
        const float *P = Pb + (r - r0) * rs, *DS = Sb + (r - r0) * rs;
        float *dkvb = (float *)g->dkv + b * g->sdkv_b + d0;
        for (csa_idx c0 = 0; c0 < nd; c0 += BW) {
            const csa_idx bw = nd - c0 < BW ? nd - c0 : BW;
            const float *bo = xo + c0 * H, *bq = xq + c0 * H;
            float *dkvc = dkvb + c0;
            for (csa_idx i0 = 0; i0 < n; i0 += ATTN_MR) {
                float *dst[ATTN_MR];
                int nr = 0;
                for (csa_idx i = i0; i < i0 + ATTN_MR && i < n; i++) {
#ifdef CSA_MUTANT_ATTN_BWD_DUP_ONCE
                    if (i > 0 && v[i] == v[i - 1]) continue;
#endif
                    dst[nr++] = dkvc + (csa_idx)v[i] * g->sdkv_n;
                }
                /* the next group's d(kv) lines, fetched while this tile runs (~1500
                 * cycles): d(kv) is 5 MB at S = 2048, beyond L2, and the adds onto it
                 * waited for their loads (7% of this function's samples, perf, avx512) */
                for (csa_idx i = i0 + ATTN_MR; i < i0 + 2 * ATTN_MR && i < n; i++)
                    for (csa_idx l = 0; l < bw; l += 16)
                        __builtin_prefetch(dkvc + (csa_idx)v[i] * g->sdkv_n + l, 1, 3);
                const float *Pi = P + i0 * hcp, *Si = DS + i0 * hcp;
#ifdef __AVX512F__
                const csa_idx nv = (bw + 15) / 16;
                if (hcp == 64 && bw == 64) {
                    for (int i = nr; i < ATTN_MR; i++) dst[i] = junk;
                    CSA_V(gkv_tile_64)(Pi, Si, H, bo, bq, dst);
                } else switch (nv) {
                case 4: CSA_V(gkv_tile)(Pi, Si, hcp, H, bo, bw, bq, bw, 0, bw, dst, nr, 4); break;
                case 3: CSA_V(gkv_tile)(Pi, Si, hcp, H, bo, bw, bq, bw, 0, bw, dst, nr, 3); break;
                case 2: CSA_V(gkv_tile)(Pi, Si, hcp, H, bo, bw, bq, bw, 0, bw, dst, nr, 2); break;
                default: CSA_V(gkv_tile)(Pi, Si, hcp, H, bo, bw, bq, bw, 0, bw, dst, nr, 1); break;
                }
#else
                csa_idx c = 0;
#if defined(__AVX2__)
                if (hcp == 64) /* constant P / dS row offsets (see gkv_tile_v8) */
                    for (; c + 16 <= bw; c += 16)
                        CSA_V(gkv_tile_v8)(Pi, Si, 64, H, bo, bw, bq, bw, c, dst, nr);
                else
                    for (; c + 16 <= bw; c += 16)
                        CSA_V(gkv_tile_v8)(Pi, Si, hcp, H, bo, bw, bq, bw, c, dst, nr);
#endif
                for (; c < bw; c += 16)
                    CSA_V(gkv_tile_1)(Pi, Si, hcp, H, bo, bw, bq, bw, c, bw - c < 16 ? bw : c + 16,
                                      dst, nr);
#endif
            }
        }
    }
}

/* Floats between the rows of a block in the row items' tile (bwd_item says why AVX2
 * pads them). */
static inline csa_idx CSA_V(bwd_ts)(csa_idx dp)
{
#if defined(__AVX2__) && !defined(__AVX512F__)
    return dp + 16;
#else
    return dp;
#endif
}

/* Per-thread scratch of the backward, in floats (pieces multiples of 16). */
struct CSA_V(bwd_ws) {
    float *QT, *dOT, *dqT, *lse, *Dr, *ones /* the planted DQ_SCALE mutant's divisor */, *tile;
};

/* A row item: query row (b, s): dq[b, s]; P and dS of its valid slots (slot order,
 * rows hcp floats apart, zero rows after the last block's valid ones) into P, DS; their
 * kv indices into vid, their count into *cnt; the row's dsink terms into rs[H]. */
static void CSA_V(bwd_item)(const struct csa_attn_bwd_problem *g, csa_idx b, csa_idx s,
                            csa_idx hcp, csa_idx dp, const struct CSA_V(bwd_ws) *w,
                            const float **valid, const float **blk, float *P, float *DS,
                            int32_t *vid, csa_idx *cnt, float *rs)
{
    const struct csa_attn_problem *a = &g->f;
    const csa_idx D = a->D, H = a->H, K = a->K;
    const int bf = a->bf16, dbf = g->dout_bf16;
    const size_t es = bf ? sizeof(csa_bf16) : sizeof(float), des = dbf ? sizeof(csa_bf16) : sizeof(float);
    const int32_t *ir = a->idx + b * a->si_b + s * a->si_s;
    const char *kvb = (const char *)a->kv + (size_t)(b * a->skv_b) * es;
    const char *q = (const char *)a->q + (size_t)(b * a->sq_b + s * a->sq_s) * es;
    const char *o = (const char *)a->out + (size_t)(b * a->so_b + s * a->so_s) * es;
    const char *dO = (const char *)g->dout + (size_t)(b * g->sdo_b + s * g->sdo_s) * des;
    /* d(q) belongs to this row: a bfloat16 d(q) is rounded once from the row's float32
     * tile as it is stored (no float32 copy of d(q)) */
    const int qbf = g->dq_bf16;
    char *dq = (char *)g->dq + (size_t)(b * g->sdq_b + s * g->sdq_s) *
                                   (qbf ? sizeof(csa_bf16) : sizeof(float));
    const float *lse = a->lse + b * a->sl_b + s * a->sl_s;

    csa_idx n = 0;
    for (csa_idx k = 0; k < K; k++)
        if (ir[k] >= 0) {
            vid[n] = ir[k];
            valid[n++] = (const float *)(kvb + (size_t)((csa_idx)ir[k] * a->skv_n) * es);
        }
    *cnt = n;
    if (n == 0) { /* the output is the constant 0: no gradient anywhere */
        for (csa_idx h = 0; h < H; h++) {
            memset(dq + (size_t)(h * g->sdq_h) * (qbf ? sizeof(csa_bf16) : sizeof(float)), 0,
                   (size_t)D * (qbf ? sizeof(csa_bf16) : sizeof(float)));
            rs[h] = 0.0f;
        }
        return;
    }
    CSA_V(attn_transpose_q)(q, bf, a->sq_h, H, hcp, D, w->QT);
    CSA_V(attn_transpose_q)(dO, dbf, g->sdo_h, H, hcp, D, w->dOT);
    for (csa_idx h = 0; h < hcp; h++) {
        float dr = 0.0f;
        if (h < H) {
            /* 16 interleaved partial sums (vector lanes), then added in lane order: a
             * fixed order that vectorizes without reassociation; bfloat16 rows are
             * widened into the tile first */
            const float *CSA_RESTRICT x = (const float *)(dO + (size_t)(h * g->sdo_h) * des);
            const float *CSA_RESTRICT y = (const float *)(o + (size_t)(h * a->so_h) * es);
            if (dbf) {
                CSA_V(attn_widen_bf16)((const csa_bf16 *)x, D, w->tile);
                x = w->tile;
            }
            if (bf) {
                CSA_V(attn_widen_bf16)((const csa_bf16 *)y, D, w->tile + dp);
                y = w->tile + dp;
            }
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
    }
    for (csa_idx h = 0; h < H; h++) {
        rs[h] = -expf(a->sink[h] - w->lse[h]) * w->Dr[h];
#ifdef CSA_MUTANT_ATTN_BWD_SINK_SIGN
        rs[h] = -rs[h];
#endif
    }
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* AVX2: every block's rows are copied into the tile, ts = dp + 16 floats apart, and
     * read from there by the backward's own tiles (bwd_logits_v8, bwd_pv).  In place (or
     * dp floats apart, 2 KB at D = 512) the rows' lines for one feature fall into 2 of
     * L1's 64 sets, so d(q)'s tile, which reads 6 features of all 66 rows per pass, read
     * them from L2: 27% of the backward's samples for 20% of its flops, where the logits
     * tile took 34% for 40% (perf, 2 threads, float32, S = 2048).  At 2112 bytes apart
     * the 66 rows fall into 66 different sets. */
    const int direct = 0;
#else
    const int direct = !bf && (uintptr_t)kvb % sizeof(float) == 0;
#endif
    const csa_idx ts = CSA_V(bwd_ts)(dp);
    const float scale = a->scale;
    for (csa_idx k0 = 0; k0 < n; k0 += ATTN_BWD_KB) {
        const csa_idx kb = n - k0 < ATTN_BWD_KB ? n - k0 : ATTN_BWD_KB;
        const csa_idx kbp = ((kb + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
        float *L = P + k0 * hcp, *dP = DS + k0 * hcp;
        for (csa_idx i = 0; i < kbp; i++) {
            float *t = w->tile + i * ts;
            if (i < kb && direct) {
                blk[i] = valid[k0 + i];
            } else {
                if (i < kb && bf)
                    CSA_V(attn_widen_bf16)((const csa_bf16 *)valid[k0 + i], D, t);
                else if (i < kb)
                    memcpy(t, valid[k0 + i], (size_t)D * sizeof(float));
                else
                    memset(t, 0, (size_t)D * sizeof(float));
                blk[i] = t;
            }
        }
#if defined(__AVX2__) && !defined(__AVX512F__)
        CSA_V(bwd_logits_v8)(w->tile, ts, kbp, w->QT, hcp, D, L);
        CSA_V(bwd_logits_v8)(w->tile, ts, kbp, w->dOT, hcp, D, dP);
#else
        CSA_V(attn_logits)(blk, kbp, w->QT, hcp, D, L);
        CSA_V(attn_logits)(blk, kbp, w->dOT, hcp, D, dP);
#endif
        CSA_V(attn_probs)(L, kb, hcp, scale, w->lse, H, NULL);
        for (csa_idx i = 0; i < kb; i++) {
            float *CSA_RESTRICT Pi = L + i * hcp, *CSA_RESTRICT dS = dP + i * hcp;
            const float *CSA_RESTRICT dr = w->Dr;
#ifdef CSA_MUTANT_ATTN_BWD_NO_DR
#pragma omp simd
            for (csa_idx h = 0; h < hcp; h++) dS[h] = scale * (Pi[h] * dS[h]);
            continue;
#endif
#pragma omp simd
            for (csa_idx h = 0; h < hcp; h++) dS[h] = scale * (Pi[h] * (dS[h] - dr[h]));
        }
        /* the padding rows weigh nothing */
        memset(L + kb * hcp, 0, (size_t)((kbp - kb) * hcp) * sizeof(float));
        memset(dP + kb * hcp, 0, (size_t)((kbp - kb) * hcp) * sizeof(float));
#if defined(__AVX2__) && !defined(__AVX512F__)
        CSA_V(bwd_pv)(w->tile, ts, blk, kb, dP, hcp, w->dqT, D, k0 == 0);
#else
        CSA_V(attn_pv)(blk, kb, dP, hcp, NULL, w->dqT, D, k0 == 0);
#endif
    }
#ifdef CSA_MUTANT_ATTN_BWD_DQ_SCALE /* planted: d(q) divided by 1 - 1e-4 */
    for (csa_idx h = 0; h < hcp; h++) w->ones[h] = 1.0f - 1e-4f;
    CSA_V(attn_store)(w->dqT, hcp, w->ones, H, D, dq, g->sdq_h, qbf);
#else
    /* d(q) is the sum itself: no divisor (dividing by 1 changed no bit but cost the
     * vdivps of every element) */
    CSA_V(attn_store)(w->dqT, hcp, NULL, H, D, dq, g->sdq_h, qbf);
#endif
#ifdef CSA_MUTANT_ATTN_BWD_BF16_TRUNC /* planted: the bf16 d(q) truncated, not rounded */
    if (qbf)
        for (csa_idx h = 0; h < H; h++)
            for (csa_idx d = 0; d < D; d++) {
                union { float f; uint32_t u; } v = {w->dqT[d * hcp + h]};
                ((csa_bf16 *)dq)[h * g->sdq_h + d] = (csa_bf16)(v.u >> 16);
            }
#endif
}

/* Waits until *p >= v (acquire: what the writer stored before its release is seen). */
static void CSA_V(bwd_wait)(const csa_idx *p, csa_idx v)
{
    for (unsigned spin = 1; __atomic_load_n(p, __ATOMIC_ACQUIRE) < v; spin++) {
#if defined(__x86_64__) && defined(__GNUC__)
        _mm_pause();
#endif
        if (spin % 256 == 0) sched_yield(); /* a preempted peer gets the core back */
    }
}

static int CSA_V(sparse_attn_backward_tuned)(const struct csa_attn_bwd_problem *g)
{
    const struct csa_attn_problem *a = &g->f;
    const csa_idx B = a->B, S = a->S, H = a->H, D = a->D, K = a->K, N = a->N, nq = B * S;
    const csa_idx hcp = ((H + 15) / 16) * 16, dp = ((D + 15) / 16) * 16;
    const csa_idx kbp_max = ((ATTN_BWD_KB + ATTN_MR - 1) / ATTN_MR) * ATTN_MR;
    const int nt = csa_threads(nq, 1);
    const csa_idx ncol0 = (nt + 1) / 2; /* column chains (see ATTN_BWD_CH) */
    const csa_idx CW = ((D + ncol0 - 1) / ncol0 + 63) / 64 * 64, ncol = (D + CW - 1) / CW;
    const csa_idx per_thread = 3 * D * hcp + 3 * hcp + kbp_max * CSA_V(bwd_ts)(dp) + 2 * H * CW;
    const csa_idx per_ptr = K + kbp_max;
    /* P or dS of one row: K valid slots at most, + the last tile's padding */
    const csa_idx rsz = (K + ATTN_MR) * hcp;
    const csa_idx ch = ATTN_BWD_CH * nt < nq ? ATTN_BWD_CH * nt : nq;
    const csa_idx nch = (nq + ch - 1) / ch, buf = 2 * ch * rsz;
    const csa_idx nb = nch < ATTN_BWD_NB ? nch : ATTN_BWD_NB; /* chunks in flight */
    const csa_idx items = nq + nch * ncol;
    float *ws = aligned_alloc(64, (size_t)(nt * per_thread) * sizeof(float));
    const float **ptrs = malloc((size_t)(nt * per_ptr) * sizeof(*ptrs));
    float *PS = aligned_alloc(64, (size_t)(nb * buf) * sizeof(float));
    int32_t *vid = malloc((size_t)(nb * ch * K) * sizeof(int32_t));
    csa_idx *cnt = malloc((size_t)(nb * ch) * sizeof(csa_idx));
    float *rs = malloc((size_t)(nq * H) * sizeof(float));
    /* progress: row items done per chunk, column items done per chunk, chunks done per
     * column; then the item list */
    csa_idx *prog = calloc((size_t)(2 * nch + ncol + 1 + 2 * items), sizeof(csa_idx));
    if (!ws || !ptrs || !PS || !vid || !cnt || !rs || !prog) {
        free(ws);
        free(ptrs);
        free(PS);
        free(vid);
        free(cnt);
        free(rs);
        free(prog);
        return CSA_ENOMEM;
    }
    csa_idx *rows_done = prog, *cols_done = prog + nch, *col_chunks = prog + 2 * nch;
    csa_idx *next = col_chunks + ncol, *list = next + 1;
    /* The items in the order they are handed out: the row items of chunk c, then the
     * column items of chunk c - 1.  Every item waits only for items listed before it
     * (a column item: its chunk's row items and the same column of the previous chunk;
     * a row item: the column items of the chunk that used its buffer last), which were
     * handed out earlier and finish without waiting for a later one, so the pipeline
     * cannot deadlock, at any thread count. */
    {
        csa_idx n = 0;
        for (csa_idx c = 0; c <= nch; c++) {
            for (csa_idx r = c * ch; c < nch && r < nq && r < (c + 1) * ch; r++)
                list[2 * n] = -1, list[2 * n + 1] = r, n++;
            for (csa_idx j = 0; c > 0 && j < ncol; j++) list[2 * n] = c - 1, list[2 * n + 1] = j, n++;
        }
    }

#pragma omp parallel num_threads(nt)
    {
        const int t = omp_tid();
        float *p = ws + t * per_thread;
        struct CSA_V(bwd_ws) w;
        w.QT = p, p += D * hcp;
        w.dOT = p, p += D * hcp;
        w.dqT = p, p += D * hcp;
        w.lse = p, p += hcp;
        w.Dr = p, p += hcp;
        w.ones = p, p += hcp;
        w.tile = p, p += kbp_max * CSA_V(bwd_ts)(dp);
        float *X = p;
        const float **valid = ptrs + t * per_ptr, **blk = valid + K;
#pragma omp for schedule(static)
        for (csa_idx bn = 0; bn < B * N; bn++)
            memset((float *)g->dkv + (bn / N) * g->sdkv_b + (bn % N) * g->sdkv_n, 0, (size_t)D * sizeof(float));
        /* no barrier per chunk: each item waits for what it reads (counters with
         * acquire / release), so a thread that the shared host preempts holds up only
         * the items that need its results, not a whole step (the previous design, one
         * barrier per chunk of rows: 2.61x the forward at 2 threads, avx512, S = 512) */
        for (;;) {
            const csa_idx it = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
            if (it >= items) break;
            const csa_idx c = list[2 * it], x = list[2 * it + 1];
            if (c < 0) { /* row item x of chunk x / ch */
                const csa_idx cc = x / ch, i = x - cc * ch, bi = cc % nb;
                float *cur = PS + bi * buf;
                if (cc >= nb) CSA_V(bwd_wait)(cols_done + cc - nb, ncol);
                CSA_V(bwd_item)(g, x / S, x % S, hcp, dp, &w, valid, blk, cur + i * rsz,
                                cur + ch * rsz + i * rsz, vid + bi * ch * K + i * K,
                                cnt + bi * ch + i, rs + x * H);
                __atomic_fetch_add(rows_done + cc, 1, __ATOMIC_RELEASE);
            } else { /* column item x of chunk c */
                const csa_idx p0 = c * ch, p1 = p0 + ch < nq ? p0 + ch : nq, bi = c % nb;
                const csa_idx d0 = x * CW;
                float *prev = PS + bi * buf;
                CSA_V(bwd_wait)(rows_done + c, p1 - p0);
                CSA_V(bwd_wait)(col_chunks + x, c);
                CSA_V(bwd_dkv_cols)(g, p0, p1, prev, prev + ch * rsz, rsz, vid + bi * ch * K,
                                    cnt + bi * ch, hcp, d0, d0 + CW < D ? d0 + CW : D, X);
                __atomic_store_n(col_chunks + x, c + 1, __ATOMIC_RELEASE);
                __atomic_fetch_add(cols_done + c, 1, __ATOMIC_RELEASE);
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
    free(PS);
    free(vid);
    free(cnt);
    free(rs);
    free(prog);
    return CSA_OK;
}
