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
 * than their visible entries: the causal half of a prefill is never computed.
 *
 * bfloat16 q and k (ix_mode): at level 'amx' the AMX-BF16 path below scores them
 * natively; elsewhere (IX_WIDEN) each packed q row is widened first and each chunk of
 * keys is widened once into a per-thread float32 scratch shared by the rows that
 * read it, so the float32 code above runs unchanged and gives its own bits.  Neither
 * path ever holds a float32 copy of the whole of q or k. */

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
#define IX_AMX_TILE 512 /* bf16 elements of a 16-row x 64-byte AMX tile */

typedef float CSA_V(vf) __attribute__((vector_size(IX_VL * 4)));
typedef int32_t CSA_V(vi) __attribute__((vector_size(IX_VL * 4)));

/* Constant lane shuffles: __builtin_shufflevector (clang, GCC >= 12) takes the lane
 * indices as constants (0 .. VL-1: a, VL .. 2VL-1: b); GCC's older __builtin_shuffle
 * takes them as a vector of the same meaning.  Same lanes, same bits. */
#ifndef IX_SHUF1
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define IX_SHUF1(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define IX_SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef IX_SHUF1
#define IX_SHUF1(v, ...) __builtin_shuffle(v, (CSA_V(vi)){__VA_ARGS__})
#define IX_SHUF2(a, b, ...) __builtin_shuffle(a, b, (CSA_V(vi)){__VA_ARGS__})
#endif
#endif

/* Lane sum of v by a fixed tree. */
static inline float CSA_V(ix_hsum)(CSA_V(vf) v)
{
    /* only lane 0 of the result is read: the other lanes take lane 0 */
#if IX_VL == 16
    v += IX_SHUF1(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    v += IX_SHUF1(v, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    v += IX_SHUF1(v, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    v += IX_SHUF1(v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#elif IX_VL == 8
    v += IX_SHUF1(v, 4, 5, 6, 7, 0, 0, 0, 0);
    v += IX_SHUF1(v, 2, 3, 0, 0, 0, 0, 0, 0);
    v += IX_SHUF1(v, 1, 0, 0, 0, 0, 0, 0, 0);
#else
    v += IX_SHUF1(v, 2, 3, 0, 0);
    v += IX_SHUF1(v, 1, 0, 0, 0);
#endif
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

/* Scores of one query row (packed in buf) against keys [t0, t1), into o[t]; kb points
 * at key kt0 <= t0 (the cache itself, or a widened chunk of it); tiles whose keys all
 * lie in unkept candidate blocks are skipped. */
static void CSA_V(ix_score_row)(const float *buf, csa_idx HP, csa_idx Di, const float *kb,
                                csa_idx skt, csa_idx kt0, csa_idx t0, csa_idx t1,
                                const uint8_t *cm, csa_idx scn, csa_idx bs, float *o)
{
    typedef CSA_V(vf) vf;
    typedef CSA_V(vi) vi;
    const float *qt = buf;
    const vf *wv = (const vf *)(buf + Di * HP);
    const vi *lm = (const vi *)(buf + (Di + 1) * HP);
    const csa_idx nvec = HP / IX_VL;
    for (csa_idx t = t0; t < t1; t += IX_NK) {
        const csa_idx nk = imin(IX_NK, t1 - t);
        if (cand_tile_skipped(cm, scn, bs, t, nk)) continue;
        const float *kr[IX_NK];
        for (int j = 0; j < IX_NK; j++) kr[j] = kb + (imin(t + j, t1 - 1) - kt0) * skt;
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

/* Widens keys [t0, t1) of batch entry b (bfloat16) into dst[(t - t0) * Di + d]. */
static void CSA_V(ix_widen_keys)(const struct csa_index_problem *p, csa_idx b, csa_idx t0,
                                 csa_idx t1, float *CSA_RESTRICT dst)
{
    const csa_bf16 *kb = (const csa_bf16 *)p->k + b * p->skb;
    const csa_idx Di = p->Di;
    for (csa_idx t = t0; t < t1; t++) {
        const csa_bf16 *CSA_RESTRICT kr = kb + t * p->skt;
        float *CSA_RESTRICT o = dst + (t - t0) * Di;
        csa_idx d = 0;
#if defined(__AVX2__)
        /* in registers: zero-extend 8 halves to 32 bits, shift into the high half */
        for (; d + 8 <= Di; d += 8)
            _mm256_storeu_si256((__m256i *)(o + d),
                                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(kr + d))), 16));
#endif
        for (; d < Di; d++) o[d] = csa_bf16_to_f32(kr[d]);
    }
}

/* In-register transpose of a VL x VL block r[i][l] -> r[l][i]: at each scale w the
 * off-diagonal w x w blocks of every 2w x 2w diagonal block swap places. */
#define IX_MA(l, w) (((l) & (w)) ? IX_VL + (l) - (w) : (l))
#define IX_MB(l, w) (((l) & (w)) ? IX_VL + (l) : (l) + (w))
#if IX_VL == 16
#define IX_LANES(M, w)                                                                      \
    M(0, w), M(1, w), M(2, w), M(3, w), M(4, w), M(5, w), M(6, w), M(7, w), M(8, w),        \
    M(9, w), M(10, w), M(11, w), M(12, w), M(13, w), M(14, w), M(15, w)
#elif IX_VL == 8
#define IX_LANES(M, w) M(0, w), M(1, w), M(2, w), M(3, w), M(4, w), M(5, w), M(6, w), M(7, w)
#else
#define IX_LANES(M, w) M(0, w), M(1, w), M(2, w), M(3, w)
#endif
#define IX_TSTEP(w)                                                                         \
    for (int i = 0; i < IX_VL; i++)                                                         \
        if (!(i & (w))) {                                                                   \
            const vf a = r[i], b = r[i + (w)];                                              \
            r[i] = IX_SHUF2(a, b, IX_LANES(IX_MA, w));                                      \
            r[i + (w)] = IX_SHUF2(a, b, IX_LANES(IX_MB, w));                                \
        }

static inline void CSA_V(ix_transpose)(CSA_V(vf) *r)
{
    typedef CSA_V(vf) vf;
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
 * blocks of q are transposed in registers, the edges element by element.  A
 * bfloat16 q row is first widened into qf [Hi x Di]. */
static void CSA_V(ix_pack_row)(const struct csa_index_problem *p, csa_idx b, csa_idx s,
                               csa_idx HP, float *buf, float *qf)
{
    typedef CSA_V(vf) vf;
    typedef float vfu __attribute__((vector_size(IX_VL * 4), aligned(4)));
    const csa_idx Hi = p->Hi, Di = p->Di;
    const float *qr;
    csa_idx sqh;
    if (p->qk_bf16) {
        const csa_bf16 *q16 = (const csa_bf16 *)p->q + b * p->sqb + s * p->sqs;
        for (csa_idx h = 0; h < Hi; h++)
#pragma omp simd
            for (csa_idx d = 0; d < Di; d++) qf[h * Di + d] = csa_bf16_to_f32(q16[h * p->sqh + d]);
        qr = qf;
        sqh = Di;
    } else {
        qr = (const float *)p->q + b * p->sqb + s * p->sqs;
        sqh = p->sqh;
    }
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
    const csa_idx w0 = b * p->swb + s * p->sws;
    for (csa_idx h = 0; h < HP; h++) {
        wv[h] = h < Hi ? ld(p->w, p->w_bf16, w0 + h * p->swh) : 0.0f;
        lm[h] = h < Hi ? -1 : 0;
    }
}

/* ------------------------------------------------------------------ AMX-BF16 */
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
/* Level 'amx', bfloat16 q and k (only the AVX-512 variant has this; the functions are
 * compiled for the tile ISA but only reached when csa_isa_get() >= CSA_ISA_AMX).
 *
 * One TDPBF16PS does C[16 x 16 f32] += A[16 x 32 bf16] . B[32 x 16 bf16], B in "VNNI"
 * layout: row i of the B tile holds the feature pair (2i, 2i+1) of each of its 16
 * columns.  A = 16 keys x 32 features, loaded straight from the cache (k's own
 * layout: no packing pass over k, so decode streams the cache once); B = 32 features
 * x 16 heads of the query row, packed once per row.  C = 16 keys x 16 heads: row n is
 * the head vector of key n, exactly the `part` vector of the float32 code (lane =
 * head mod 16, head vectors summed in order), and ix_amx_hsum16 applies ix_hsum's
 * tree to 16 of them at once.  A key's score depends only on its own row of A, so
 * the bits do not depend on the chunking, the thread count or the other keys and
 * rows of the call.
 *
 * Tiles: tmm0-3 = C for up to 4 head groups (64 heads a pass; more heads take more
 * passes), tmm4 = A, tmm5-7 = B (groups 0-3 use 5, 6, 5, 7, so a load seldom waits
 * for the product still reading its tile). */
#define IX_HAVE_AMX 1
#define IX_AMX_FN                                                                          \
    static __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,"  \
                                 "f16c,amx-tile,amx-bf16"),                                 \
                          noinline))

/* Each thread that uses tiles configures them (csrc/amx.h) and releases them after. */
IX_AMX_FN void CSA_V(ix_amx_begin)(void) { csa_amx_tiles_16x64(); }

IX_AMX_FN void CSA_V(ix_amx_end)(void) { _tile_release(); }

/* Packed query row: B tile (g, c) at buf + (g * DC + c) * IX_AMX_TILE holds, in row i,
 * the features (32c + 2i, 32c + 2i + 1) of heads 16g .. 16g+15 (zero past Hi and Di);
 * then the float32 weights [HG * 16] (zero past Hi). */
IX_AMX_FN void CSA_V(ix_amx_pack_row)(const struct csa_index_problem *p, csa_idx b, csa_idx s,
                                      csa_bf16 *buf)
{
    typedef CSA_V(vf) vf;
    const csa_idx Hi = p->Hi, Di = p->Di, HG = (Hi + 15) / 16, DC = (Di + 31) / 32;
    const csa_bf16 *qr = (const csa_bf16 *)p->q + b * p->sqb + s * p->sqs;
    for (csa_idx g = 0; g < HG; g++)
        for (csa_idx c = 0; c < DC; c++) {
            const csa_idx nd = imin(32, Di - 32 * c);
            const __mmask32 dm = nd == 32 ? 0xFFFFFFFFu : (1u << nd) - 1u;
            vf r[16];
            for (int j = 0; j < 16; j++) {
                const csa_idx h = 16 * g + j;
                const __m512i v = h < Hi ? _mm512_maskz_loadu_epi16(dm, qr + h * p->sqh + 32 * c)
                                         : _mm512_setzero_si512();
                r[j] = (vf)_mm512_castsi512_ps(v);
            }
            /* a 16 x 16 transpose of 32-bit feature pairs: row i = pair i of every head
             * (shuffles move bits, never round them) */
            CSA_V(ix_transpose)(r);
            csa_bf16 *o = buf + (g * DC + c) * IX_AMX_TILE;
            for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(o + 32 * i), (__m512)r[i]);
        }
    float *wv = (float *)(buf + HG * DC * IX_AMX_TILE);
    const csa_idx w0 = b * p->swb + s * p->sws;
    for (csa_idx h = 0; h < 16 * HG; h++) wv[h] = h < Hi ? ld(p->w, p->w_bf16, w0 + h * p->swh) : 0.0f;
}

/* out[n] = ix_hsum(v[n]) for 16 vectors, as one vector over n: the same additions
 * (lane l + lane l+8, then + l+4, + l+2, + l+1) done for several vectors at a time by
 * moving their halves, quarters, ... side by side.  The pairing makes lane n of the
 * result the sum of v[n]. */
static inline __attribute__((always_inline)) __m512 CSA_V(ix_amx_hsum16)(const __m512 *v)
{
    __m512 P[8], R[4], U[2];
    for (int i = 0; i < 4; i++) {
        /* [a0..7 | b0..7] + [a8..15 | b8..15]: keys (i, 4+i) and (8+i, 12+i) */
        P[2 * i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[4 + i], 0x44),
                                 _mm512_shuffle_f32x4(v[i], v[4 + i], 0xEE));
        P[2 * i + 1] = _mm512_add_ps(_mm512_shuffle_f32x4(v[8 + i], v[12 + i], 0x44),
                                     _mm512_shuffle_f32x4(v[8 + i], v[12 + i], 0xEE));
    }
    for (int i = 0; i < 4; i++) /* 128-bit blocks (0, 2) + (1, 3): lanes l + l+4 */
        R[i] = _mm512_add_ps(_mm512_shuffle_f32x4(P[2 * i], P[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(P[2 * i], P[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* within blocks, (0, 1) + (2, 3): lanes l + l+2 */
        U[i] = _mm512_add_ps(_mm512_shuffle_ps(R[2 * i], R[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(R[2 * i], R[2 * i + 1], 0xEE));
    /* within blocks, 0 + 1 and 2 + 3: block m = keys 4m .. 4m+3 */
    return _mm512_add_ps(_mm512_shuffle_ps(U[0], U[1], 0x88), _mm512_shuffle_ps(U[0], U[1], 0xDD));
}

/* C tiles 0 .. NG-1 = sum over the DC feature chunks of A(keys) . B(head group g0+g),
 * stored to cbuf[g][16 keys][16 heads]. */
#define IX_AMX_GROUPS(NG)                                                                  \
    do {                                                                                   \
        _tile_zero(0);                                                                     \
        if (NG > 1) _tile_zero(1);                                                         \
        if (NG > 2) _tile_zero(2);                                                         \
        if (NG > 3) _tile_zero(3);                                                         \
        for (csa_idx c = 0; c < DC; c++) {                                                 \
            const csa_bf16 *bq = qb + c * IX_AMX_TILE;                                     \
            _tile_loadd(4, ka + 32 * c, kstride);                                          \
            _tile_loadd(5, bq, 64);                                                        \
            _tile_dpbf16ps(0, 4, 5);                                                       \
            if (NG > 1) {                                                                  \
                _tile_loadd(6, bq + DC * IX_AMX_TILE, 64);                                 \
                _tile_dpbf16ps(1, 4, 6);                                                   \
            }                                                                              \
            if (NG > 2) {                                                                  \
                _tile_loadd(5, bq + 2 * DC * IX_AMX_TILE, 64);                             \
                _tile_dpbf16ps(2, 4, 5);                                                   \
            }                                                                              \
            if (NG > 3) {                                                                  \
                _tile_loadd(7, bq + 3 * DC * IX_AMX_TILE, 64);                             \
                _tile_dpbf16ps(3, 4, 7);                                                   \
            }                                                                              \
        }                                                                                  \
        _tile_stored(0, cbuf, 64);                                                         \
        if (NG > 1) _tile_stored(1, cbuf + 256, 64);                                       \
        if (NG > 2) _tile_stored(2, cbuf + 512, 64);                                       \
        if (NG > 3) _tile_stored(3, cbuf + 768, 64);                                       \
    } while (0)

/* Scores of one packed query row against keys [t0, t1) of batch entry b, into o[t].
 * Whole key blocks are read in place when Di is a multiple of 32 and the 16 rows
 * exist in the cache (rows past t1 are computed and dropped: a key's result depends
 * only on its own row); otherwise the block is copied, zero padded, into kpad
 * [16][DC * 32].  cbuf: 1024 floats; both 64-byte aligned. */
IX_AMX_FN void CSA_V(ix_amx_score_row)(const struct csa_index_problem *p, csa_idx b,
                                       const csa_bf16 *buf, csa_idx t0, csa_idx t1,
                                       const uint8_t *cm, csa_idx scn, csa_idx bs, float *o,
                                       float *cbuf, csa_bf16 *kpad)
{
    const csa_idx Hi = p->Hi, Di = p->Di, Tc = p->Tc, skt = p->skt;
    const csa_idx HG = (Hi + 15) / 16, DC = (Di + 31) / 32;
    const csa_bf16 *kb = (const csa_bf16 *)p->k + b * p->skb;
    const float *wv = (const float *)(buf + HG * DC * IX_AMX_TILE);
    const int inplace = Di % 32 == 0;
    const __m512 zero = _mm512_setzero_ps();
    __asm__ volatile("" ::: "memory"); /* the tile loads read the packed row */
    for (csa_idx t = t0; t < t1; t += 16) {
        const csa_idx nk = imin(16, t1 - t);
        if (cand_tile_skipped(cm, scn, bs, t, nk)) continue;
        const csa_bf16 *ka;
        long kstride;
        if (inplace && t + 16 <= Tc) {
            ka = kb + t * skt;
            kstride = (long)skt * 2;
        } else {
            const csa_idx nr = imin(16, Tc - t);
            for (csa_idx n = 0; n < 16; n++)
                for (csa_idx c = 0; c < DC; c++) {
                    const csa_idx nd = imin(32, Di - 32 * c);
                    const __mmask32 dm = nd == 32 ? 0xFFFFFFFFu : (1u << nd) - 1u;
                    const __m512i v = n < nr ? _mm512_maskz_loadu_epi16(dm, kb + (t + n) * skt + 32 * c)
                                             : _mm512_setzero_si512();
                    _mm512_store_si512((void *)(kpad + n * DC * 32 + 32 * c), v);
                }
            __asm__ volatile("" ::: "memory");
            ka = kpad;
            kstride = (long)DC * 64;
        }
        __m512 part[16];
        for (int n = 0; n < 16; n++) part[n] = zero;
        for (csa_idx g0 = 0; g0 < HG; g0 += 4) {
            const csa_bf16 *qb = buf + g0 * DC * IX_AMX_TILE;
            const csa_idx ng = imin(4, HG - g0);
            switch (ng) {
            case 4: IX_AMX_GROUPS(4); break;
            case 3: IX_AMX_GROUPS(3); break;
            case 2: IX_AMX_GROUPS(2); break;
            default: IX_AMX_GROUPS(1); break;
            }
            for (csa_idx g = 0; g < ng; g++) {
                const csa_idx h0 = 16 * (g0 + g);
                const __m512 w = _mm512_load_ps(wv + h0);
                /* padded heads: their lanes may hold 0 * inf, masked out as in ix_chunk */
                const __mmask16 lm = Hi - h0 >= 16 ? 0xFFFF : (__mmask16)((1u << (Hi - h0)) - 1u);
#pragma GCC unroll 16
                for (int n = 0; n < 16; n++) {
                    const __m512 x = _mm512_load_ps(cbuf + (g * 16 + n) * 16);
                    /* relu keeps NaN: zero exactly where x < 0 (ordered) */
                    const __mmask16 keep = _mm512_mask_cmp_ps_mask(lm, x, zero, _CMP_NLT_UQ);
                    part[n] = _mm512_fmadd_ps(_mm512_maskz_mov_ps(keep, x), w, part[n]);
                }
            }
        }
        _mm512_mask_storeu_ps(o + t, (__mmask16)((1u << nk) - 1u), CSA_V(ix_amx_hsum16)(part));
    }
}
#undef IX_AMX_GROUPS
#undef IX_AMX_FN
#endif

#include "index_fp4_impl.h"

/* The q . k path of a call at the current level. */
static int CSA_V(ix_mode)(const struct csa_index_problem *p)
{
    if (p->k_fp4) return IX_FP4;
    if (!p->qk_bf16) return IX_F32;
#ifdef IX_HAVE_AMX
    if (csa_isa_get() >= CSA_ISA_AMX) return IX_AMX;
#endif
    return IX_WIDEN;
}

/* Finishes the S rows of batch b once all their scores exist: -inf fill or selection. */
static void CSA_V(ix_finish_batch)(const struct ix_call *x, const float *scr, csa_idx b,
                                   struct sel_ws *ws)
{
    const struct csa_index_problem *p = x->p;
    for (csa_idx s = 0; s < p->S; s++) {
        const csa_idx r = b * p->S + s, nv = visible(p->start_pos + s, p->ratio);
        if (!x->idx) {
            float *o = x->sc + b * x->sob + s * x->sos;
            for (csa_idx t = nv; t < p->Tc; t++) o[t] = -INFINITY;
        } else {
            select_row(scr + r * p->Tc, 1, nv, cand_row(x->c, b, s), x->c, x->K, x->offset,
                       x->order, x->idx + r * x->K, ws);
        }
    }
}

/* Row geometry of a call: bytes of a packed query row, and the padded head count HP
 * of the float32 layout. */
static size_t CSA_V(ix_row_bytes)(const struct csa_index_problem *p, int mode, csa_idx *HP)
{
    *HP = (p->Hi + IX_VL - 1) / IX_VL * IX_VL;
    if (mode == IX_FP4) {
        struct CSA_V(ix4_geo) g;
        CSA_V(ix4_row_geo)(p, &g);
        return g.bytes;
    }
#ifdef IX_HAVE_AMX
    if (mode == IX_AMX) {
        const csa_idx HG = (p->Hi + 15) / 16, DC = (p->Di + 31) / 32;
        return ((size_t)HG * DC * IX_AMX_TILE * 2 + (size_t)HG * 64 + 63) / 64 * 64;
    }
#endif
    (void)mode;
    return ((size_t)(p->Di + 2) * *HP * sizeof(float) + 64) / 64 * 64;
}

/* Bytes of the per-thread key scratch for a chunk of kc keys: widened float32 keys,
 * or packed B tiles. */
static size_t CSA_V(ix_key_scratch)(const struct csa_index_problem *p, int mode, csa_idx kc)
{
    if (mode == IX_WIDEN) return (size_t)(kc > 0 ? kc : 1) * (size_t)(p->Di > 0 ? p->Di : 1) * 4;
    if (mode == IX_AMX) return (size_t)((p->Di + 31) / 32) * 1024; /* one padded key block */
    if (mode == IX_FP4)
        return (size_t)((kc + IX4_NK - 1) / IX4_NK + 1) * CSA_V(ix4_tile_bytes)(p->Di, IX4_NK);
    (void)kc;
    return 0;
}

/* Per-thread product scratch: the AMX tiles' C, or the FP4 tile's dots. */
static float *CSA_V(ix_cbuf)(const struct csa_index_problem *p, int mode)
{
    if (mode == IX_AMX) return aligned_alloc(64, 1024 * sizeof(float));
    (void)p;
    if (mode == IX_FP4) return aligned_alloc(64, 64); /* unused */
    return NULL;
}

/* Packs query row (b, s) for the mode; qf: float32 [Hi x Di] scratch for IX_WIDEN. */
static void CSA_V(ix_pack)(const struct ix_call *x, int mode, csa_idx b, csa_idx s,
                           csa_idx HP, float *buf, float *qf)
{
    const struct csa_index_problem *p = x->p;
    if (mode == IX_FP4) {
        CSA_V(ix4_pack_row)(x, b, s, (uint8_t *)buf);
        return;
    }
#ifdef IX_HAVE_AMX
    if (mode == IX_AMX) {
        CSA_V(ix_amx_pack_row)(p, b, s, (csa_bf16 *)buf);
        return;
    }
#endif
    CSA_V(ix_pack_row)(p, b, s, HP, buf, qf);
}

/* Scores the packed row buf against keys [t0, t1) of batch entry b.  kc: the key
 * scratch, holding the widened keys from kt0 on (IX_WIDEN) or room for one padded
 * key block (IX_AMX); unused for float32 keys. */
static void CSA_V(ix_score)(const struct ix_call *x, int mode, const float *buf, csa_idx HP,
                            csa_idx b, csa_idx s, void *kc, csa_idx kt0, csa_idx t0,
                            csa_idx t1, float *o, float *cbuf)
{
    const struct csa_index_problem *p = x->p;
    const struct csa_index_cand *c = x->c;
    const csa_idx bs = c && c->mask ? c->block_size : 1, scn = c && c->mask ? c->scn : 0;
    const uint8_t *cm = cand_row(c, b, s);
#ifdef IX_HAVE_AMX
    if (mode == IX_AMX) {
        CSA_V(ix_amx_score_row)(p, b, (const csa_bf16 *)buf, t0, t1, cm, scn, bs, o, cbuf,
                                (csa_bf16 *)kc);
        return;
    }
#endif
    if (mode == IX_FP4) {
        CSA_V(ix4_score_row)(x, (const uint8_t *)buf, b, s, (const uint8_t *)kc, kt0, t0, t1, cm,
                             scn, bs, o);
        return;
    }
    (void)cbuf;
    if (mode == IX_WIDEN)
        CSA_V(ix_score_row)(buf, HP, p->Di, (const float *)kc, p->Di, kt0, t0, t1, cm, scn, bs, o);
    else
        CSA_V(ix_score_row)(buf, HP, p->Di, (const float *)p->k + b * p->skb, p->skt, 0, t0, t1,
                            cm, scn, bs, o);
}

/* Widens keys [t0, t1) of batch entry b into the key scratch kc (IX_WIDEN; the other
 * modes read k in place). */
static void CSA_V(ix_prep_keys)(const struct csa_index_problem *p, int mode, csa_idx b,
                                csa_idx t0, csa_idx t1, void *kc)
{
    if (mode == IX_WIDEN && t1 > t0) CSA_V(ix_widen_keys)(p, b, t0, t1, (float *)kc);
    if (mode == IX_FP4 && t1 > t0) CSA_V(ix4_pack_keys)(p, b, t0, t1, (uint8_t *)kc);
}

static void CSA_V(ix_tiles_begin)(int mode)
{
#ifdef IX_HAVE_AMX
    if (mode == IX_AMX) CSA_V(ix_amx_begin)();
#endif
#ifdef IX4_HAVE_AMX
    if (mode == IX_FP4 && CSA_V(ix4_amx)()) CSA_V(ix4_amx_begin)();
#endif
    (void)mode;
}

static void CSA_V(ix_tiles_end)(int mode)
{
#ifdef IX_HAVE_AMX
    if (mode == IX_AMX) CSA_V(ix_amx_end)();
#endif
#ifdef IX4_HAVE_AMX
    if (mode == IX_FP4 && CSA_V(ix4_amx)()) CSA_V(ix4_amx_end)();
#endif
    (void)mode;
}

/* ix_run for calls with few rows (decode): the keys of each batch entry are split
 * into chunks taken dynamically by the threads (a descheduled thread holds up one
 * chunk, not half the keys), and the thread that completes a batch entry's last
 * chunk finishes its rows, so no barrier waits inside the region.  Scratch: the
 * packed rows, for top-k their [Tc] score rows, and per thread one chunk of keys
 * (widened or packed for the tiles) that all the batch entry's rows share. */
static int CSA_V(ix_run_keysplit)(const struct ix_call *x, int mode)
{
    const struct csa_index_problem *p = x->p;
    const csa_idx rows = p->B * p->S, Tc = p->Tc, S = p->S;
    csa_idx HP;
    const size_t row_bytes = CSA_V(ix_row_bytes)(p, mode, &HP);
    const csa_idx KC = mode == IX_AMX ? 256 : mode == IX_FP4 ? IX_FK * 32 : IX_NK * 64; /* AMX: a multiple of 16 */
    const csa_idx nvmax = visible(p->start_pos + S - 1, p->ratio);
    const csa_idx nch = nvmax > 0 ? (nvmax + KC - 1) / KC : 1, items = p->B * nch;
    const size_t kbytes = CSA_V(ix_key_scratch)(p, mode, KC);
    float *bufs = aligned_alloc(64, row_bytes * (size_t)rows);
    float *qf = mode == IX_WIDEN ? malloc((size_t)(p->Hi * p->Di > 0 ? p->Hi * p->Di : 1) * 4) : NULL;
    float *scr = x->idx ? malloc((size_t)rows * (size_t)(Tc > 0 ? Tc : 1) * sizeof(float)) : NULL;
    csa_idx *done = calloc((size_t)p->B, sizeof(csa_idx));
    if (!bufs || (mode == IX_WIDEN && !qf) || (x->idx && !scr) || !done) {
        free(bufs);
        free(qf);
        free(scr);
        free(done);
        return CSA_ENOMEM;
    }
    const csa_idx rf = (csa_idx)(row_bytes / sizeof(float));
    for (csa_idx r = 0; r < rows; r++) CSA_V(ix_pack)(x, mode, r / S, r % S, HP, bufs + r * rf, qf);
    free(qf);
    int err = CSA_OK;
#pragma omp parallel num_threads(csa_threads(items, 1))
    {
        struct sel_ws ws = {0};
        void *kc = kbytes ? aligned_alloc(64, (kbytes + 63) / 64 * 64) : NULL;
        float *cbuf = CSA_V(ix_cbuf)(p, mode);
        int st = ((kbytes && !kc) || (mode >= IX_AMX && !cbuf)) ? CSA_ENOMEM : CSA_OK;
        if (!st && x->idx) st = sel_ws_alloc(&ws, Tc, x->K);
        if (st) {
#pragma omp atomic write
            err = st;
        }
        CSA_V(ix_tiles_begin)(mode);
#pragma omp for schedule(dynamic, 1) nowait
        for (csa_idx it = 0; it < items; it++) {
            if (st) continue; /* err is set: the call fails, nothing to finish */
            const csa_idx b = it / nch, t0 = (it % nch) * KC;
            CSA_V(ix_prep_keys)(p, mode, b, t0, imin(nvmax, t0 + KC), kc);
            for (csa_idx s = 0; s < S; s++) {
                const csa_idx r = b * S + s;
                const csa_idx t1 = imin(visible(p->start_pos + s, p->ratio), t0 + KC);
                if (t1 <= t0) continue;
                float *o = x->idx ? scr + r * Tc : x->sc + b * x->sob + s * x->sos;
                CSA_V(ix_score)(x, mode, bufs + r * rf, HP, b, s, kc, t0, t0, t1, o, cbuf);
            }
            /* acq_rel: the last chunk's thread sees every other chunk's scores */
            if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == nch)
                CSA_V(ix_finish_batch)(x, scr, b, &ws);
        }
        CSA_V(ix_tiles_end)(mode);
        sel_ws_free(&ws);
        free(kc);
        free(cbuf);
    }
    free(bufs);
    free(scr);
    free(done);
    return err;
}

/* Fused top-k of FP4 keys for calls with few rows (decode, speculative verification):
 * as ix_run_keysplit, but no [S, Tc] score rows.  Each thread scores a chunk of keys
 * into a chunk-sized row and keeps, per query row, its own candidates (key, position)
 * in ascending position (a thread's chunks come in increasing order): those whose key
 * passes the thread's threshold; once more than 2K are kept, select_keys cuts them to
 * the K best and the K-th key becomes the threshold (strictly above: an entry equal to
 * it comes later than the K kept, so it ranks below all of them).  Nothing cut can be
 * among the row's top K, so the thread that completes a batch entry merges every
 * thread's candidates by position and selects from them exactly what select_row would
 * from the whole row.  Memory O(threads * rows * (2K + chunk)), independent of Tc. */
#define IX_STREAM_KMAX 4096
static int CSA_V(ix_run_stream)(const struct ix_call *x)
{
    const struct csa_index_problem *p = x->p;
    const int mode = IX_FP4;
    const csa_idx rows = p->B * p->S, S = p->S, K = x->K;
    csa_idx HP;
    const size_t row_bytes = CSA_V(ix_row_bytes)(p, mode, &HP);
    const csa_idx KC = IX_FK * 32;
    const csa_idx nvmax = visible(p->start_pos + S - 1, p->ratio);
    const csa_idx nch = nvmax > 0 ? (nvmax + KC - 1) / KC : 1, items = p->B * nch;
    const size_t kbytes = CSA_V(ix_key_scratch)(p, mode, KC);
    const int nt = csa_threads(items, 1);
    const csa_idx cap = 2 * K + KC, ns = (csa_idx)nt * rows;
    float *bufs = aligned_alloc(64, row_bytes * (size_t)rows);
    uint32_t *ck = malloc((size_t)(ns * cap) * sizeof(uint32_t));
    int32_t *cp = malloc((size_t)(ns * cap) * sizeof(int32_t));
    csa_idx *cn = calloc((size_t)ns, sizeof(csa_idx));
    uint32_t *cthr = calloc((size_t)ns, sizeof(uint32_t));
    uint8_t *cfull = calloc((size_t)ns, 1);
    csa_idx *done = calloc((size_t)p->B, sizeof(csa_idx));
    if (!bufs || !ck || !cp || !cn || !cthr || !cfull || !done) {
        free(bufs);
        free(ck);
        free(cp);
        free(cn);
        free(cthr);
        free(cfull);
        free(done);
        return CSA_ENOMEM;
    }
    const csa_idx rf = (csa_idx)(row_bytes / sizeof(float));
    for (csa_idx r = 0; r < rows; r++) CSA_V(ix_pack)(x, mode, r / S, r % S, HP, bufs + r * rf, NULL);
    int err = CSA_OK;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int me = omp_get_thread_num();
#else
        const int me = 0;
#endif
        void *kc = aligned_alloc(64, (kbytes + 63) / 64 * 64);
        float *sc = malloc((size_t)KC * sizeof(float));
        uint32_t *cb = malloc((size_t)(ns * cap > cap ? ns * cap : cap) * sizeof(uint32_t));
        uint32_t *mk = malloc((size_t)(ns * cap) * sizeof(uint32_t));
        int32_t *mp = malloc((size_t)(ns * cap) * sizeof(int32_t));
        uint32_t *tk = malloc((size_t)K * sizeof(uint32_t));
        int32_t *tp = malloc((size_t)K * sizeof(int32_t));
        const int st = (!kc || !sc || !cb || !mk || !mp || !tk || !tp) ? CSA_ENOMEM : CSA_OK;
        if (st) {
#pragma omp atomic write
            err = st;
        }
        const struct csa_index_cand *c = x->c;
        const csa_idx bs = c && c->mask ? c->block_size : 1, scn = c && c->mask ? c->scn : 0;
        CSA_V(ix_tiles_begin)(mode);
#pragma omp for schedule(dynamic, 1) nowait
        for (csa_idx it = 0; it < items; it++) {
            if (st) continue; /* err is set: the call fails, nothing to finish */
            const csa_idx b = it / nch, t0 = (it % nch) * KC;
            CSA_V(ix_prep_keys)(p, mode, b, t0, imin(nvmax, t0 + KC), kc);
            for (csa_idx s = 0; s < S; s++) {
                const csa_idx r = b * S + s, slot = me * rows + r;
                const csa_idx t1 = imin(visible(p->start_pos + s, p->ratio), t0 + KC);
                if (t1 <= t0) continue;
                const uint8_t *cm = cand_row(c, b, s);
                /* the chunk's scores land in sc[0 .. t1 - t0): sc - t0 indexed by t */
                CSA_V(ix4_score_row)(x, (const uint8_t *)(bufs + r * rf), b, s, (const uint8_t *)kc,
                                     t0, t0, t1, cm, scn, bs, sc - t0);
                uint32_t *key = ck + slot * cap;
                int32_t *pos = cp + slot * cap;
                csa_idx n = cn[slot];
                const uint32_t thr = cthr[slot];
                const int full = cfull[slot];
                csa_idx t = t0;
#if defined(__AVX512F__)
                if (!cm)
                    /* 16 keys at a time: score_key in the lanes, the kept ones packed
                     * by VPCOMPRESSD, what the scalar loop below keeps in its order (5%
                     * of a decode call's samples at avx512, Tc = 64K, before) */
                    for (; t + 16 <= t1; t += 16) {
                        const __m512 f = _mm512_loadu_ps(sc + (t - t0));
                        const __m512i u = _mm512_castps_si512(f);
                        __m512i k = _mm512_xor_si512(
                            u, _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32((int)0x80000000u)));
                        k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                                  _mm512_set1_epi32((int)0x80000000u));
                        k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
                        const __mmask16 m = full ? _mm512_cmpgt_epu32_mask(k, _mm512_set1_epi32((int)thr)) : 0xffff;
#ifndef CSA_MUTANT_FP4_TOPK_POS
                        const __m512i ps = _mm512_add_epi32(_mm512_set1_epi32((int32_t)t),
#else /* planted (make mutants): positions counted in the chunk, as sc is indexed */
                        const __m512i ps = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(t - t0)),
#endif
                                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
                        /* compressed in registers, stored whole (n + 16 <= cap = 2K + KC):
                         * the masked compressing store is microcoded on Intel */
                        _mm512_storeu_si512((void *)(key + n), _mm512_maskz_compress_epi32(m, k));
                        _mm512_storeu_si512((void *)(pos + n), _mm512_maskz_compress_epi32(m, ps));
                        n += __builtin_popcount((unsigned)m);
                    }
#endif
                for (; t < t1; t++) {
                    if (cm && !cm[(t / bs) * scn]) continue;
                    const uint32_t u = score_key(sc[t - t0]);
                    key[n] = u;
                    pos[n] = (int32_t)t;
                    n += !full || u > thr;
                }
                if (n > 2 * K) {
                    n = select_keys(key, pos, n, K, cb);
                    uint32_t m = 0xFFFFFFFFu;
                    for (csa_idx j = 0; j < n; j++) m = key[j] < m ? key[j] : m;
                    cthr[slot] = m;
                    cfull[slot] = 1;
                }
                cn[slot] = n;
            }
            /* acq_rel: the last chunk's thread sees every other thread's candidates */
            if (__atomic_add_fetch(&done[b], 1, __ATOMIC_ACQ_REL) == nch) {
                for (csa_idx s = 0; s < S; s++) {
                    const csa_idx r = b * S + s;
                    csa_idx hd[64], m = 0; /* merge by position: each list ascends */
                    for (int u = 0; u < nt; u++) hd[u] = 0;
                    for (;;) {
                        int best = -1;
                        for (int u = 0; u < nt; u++) {
                            const csa_idx sl = u * rows + r;
                            if (hd[u] < cn[sl] &&
                                (best < 0 || cp[sl * cap + hd[u]] < cp[(best * rows + r) * cap + hd[best]]))
                                best = u;
                        }
                        if (best < 0) break;
                        const csa_idx sl = best * rows + r;
                        mk[m] = ck[sl * cap + hd[best]];
                        mp[m++] = cp[sl * cap + hd[best]++];
                    }
                    uint32_t *kk = mk;
                    int32_t *pp = mp;
                    const csa_idx k = select_keys(kk, pp, m, K, cb);
                    if (x->order == CSA_ORDER_SCORE) sort_desc(&kk, &pp, k, tk, tp);
                    int32_t *out = x->idx + r * K;
                    for (csa_idx j = 0; j < k; j++) out[j] = (int32_t)(pp[j] + x->offset);
                    for (csa_idx j = k; j < K; j++) out[j] = -1;
                }
            }
        }
        CSA_V(ix_tiles_end)(mode);
        free(kc);
        free(sc);
        free(cb);
        free(mk);
        free(mp);
        free(tk);
        free(tp);
    }
    free(bufs);
    free(ck);
    free(cp);
    free(cn);
    free(cthr);
    free(cfull);
    free(done);
    return err;
}

/* Scores (x->idx == NULL: into x->sc, -inf past the visible entries) or fused top-k
 * (into x->idx [B, S, K]). */
static int CSA_V(ix_run)(const struct ix_call *x)
{
    const struct csa_index_problem *p = x->p;
    const csa_idx rows = p->B * p->S, Tc = p->Tc, Di = p->Di;
    if (rows == 0 || (x->idx && x->K == 0)) return CSA_OK;
    const int mode = CSA_V(ix_mode)(p);
    csa_idx HP;
    const size_t row_bytes = CSA_V(ix_row_bytes)(p, mode, &HP);
    const int nt_max = csa_threads(rows * 4096, 1);

    if (mode == IX_FP4 && x->idx && x->K <= IX_STREAM_KMAX && nt_max <= 64 && rows < 4 * nt_max)
        return CSA_V(ix_run_stream)(x);
    if (nt_max > 1 && rows < 4 * nt_max) return CSA_V(ix_run_keysplit)(x, mode);

    /* Blocks of qb rows share each chunk of keys while it sits in L2 (512 KB: 1026
     * float32 keys, or 2048 bfloat16 ones for the tiles, at Di = 128); qb shrinks so
     * that every thread gets a few blocks. */
    const csa_idx qb = imin(IX_QB, rows / (4 * nt_max) > 1 ? rows / (4 * nt_max) : 1);
    const csa_idx nbs = (p->S + qb - 1) / qb, nblk = p->B * nbs;
    const csa_idx dd = Di > 0 ? Di : 1;
    const csa_idx KC = mode == IX_AMX ? 16 * imin(1 << 12, (csa_idx)(512 * 1024) / (2 * 16 * dd) + 1)
                     : mode == IX_FP4 ? IX_FK * imin(1 << 16, (csa_idx)(256 * 1024) / (dd + dd / 8 + 8) / IX_FK + 1)
                                      : IX_NK * imin(1 << 16, (csa_idx)(512 * 1024) / (4 * dd) / IX_NK + 1);
    const csa_idx rf = (csa_idx)(row_bytes / sizeof(float));
    int err = CSA_OK;
#pragma omp parallel num_threads(csa_threads(nblk, 1))
    {
        float *bufs = aligned_alloc(64, row_bytes * IX_QB);
        float *scr = x->idx ? malloc((size_t)IX_QB * (size_t)(Tc > 0 ? Tc : 1) * sizeof(float)) : NULL;
        float *qf = mode == IX_WIDEN ? malloc((size_t)(p->Hi * Di > 0 ? p->Hi * Di : 1) * 4) : NULL;
        const size_t kbytes = CSA_V(ix_key_scratch)(p, mode, KC);
        void *kc = kbytes ? aligned_alloc(64, (kbytes + 63) / 64 * 64) : NULL;
        float *cbuf = CSA_V(ix_cbuf)(p, mode);
        struct sel_ws ws = {0};
        int st = (!bufs || (x->idx && !scr) || (mode == IX_WIDEN && !qf) || (kbytes && !kc) ||
                  (mode >= IX_AMX && !cbuf)) ? CSA_ENOMEM : CSA_OK;
        if (!st && x->idx) st = sel_ws_alloc(&ws, Tc, x->K);
        if (st) {
#pragma omp atomic write
            err = st;
        }
        CSA_V(ix_tiles_begin)(mode);
#pragma omp for schedule(dynamic, 1)
        for (csa_idx bb = 0; bb < nblk; bb++) {
            if (st) continue;
            const csa_idx blk = nblk - 1 - bb, b = blk / nbs, s0 = (blk % nbs) * qb;
            const csa_idx ns = imin(qb, p->S - s0);
            csa_idx nv[IX_QB], nvb = 0;
            float *o[IX_QB];
            for (csa_idx i = 0; i < ns; i++) {
                nv[i] = visible(p->start_pos + s0 + i, p->ratio);
                nvb = nv[i] > nvb ? nv[i] : nvb;
                o[i] = x->idx ? scr + i * Tc : x->sc + b * x->sob + (s0 + i) * x->sos;
                if (nv[i] > 0) CSA_V(ix_pack)(x, mode, b, s0 + i, HP, bufs + i * rf, qf);
            }
            for (csa_idx t0 = 0; t0 < nvb; t0 += KC) {
                CSA_V(ix_prep_keys)(p, mode, b, t0, imin(nvb, t0 + KC), kc);
                for (csa_idx i = 0; i < ns; i++) {
                    const csa_idx t1 = imin(nv[i], t0 + KC);
                    if (t1 > t0)
                        CSA_V(ix_score)(x, mode, bufs + i * rf, HP, b, s0 + i, kc, t0, t0, t1,
                                        o[i], cbuf);
                }
            }
            for (csa_idx i = 0; i < ns; i++) {
                if (x->idx)
                    select_row(o[i], 1, nv[i], cand_row(x->c, b, s0 + i), x->c, x->K, x->offset,
                               x->order, x->idx + (b * p->S + s0 + i) * x->K, &ws);
                else
                    for (csa_idx t = nv[i]; t < Tc; t++) o[i][t] = -INFINITY;
            }
        }
        CSA_V(ix_tiles_end)(mode);
        free(bufs);
        free(scr);
        free(qf);
        free(kc);
        free(cbuf);
        sel_ws_free(&ws);
    }
    return err;
}

/* ix_run with FP4 keys' query rows in place: q itself (q_fp4), or q rounded and
 * packed once, before any parallel region (csa_quant_pack threads its rows). */
static int CSA_V(ix_run_entry)(struct ix_call *x)
{
    const struct csa_index_problem *p = x->p;
    if (!fp4_args_ok(p)) return CSA_EINVAL;
    if (!p->k_fp4) return CSA_V(ix_run)(x);
    static const uint8_t none[64];
    if (p->q_fp4) {
        x->qp = p->B * p->S * p->Hi > 0 ? (const uint8_t *)p->q : none;
        x->qpb = p->sqb;
        x->qps = p->sqs;
        x->qph = p->sqh;
        return CSA_V(ix_run)(x);
    }
    const csa_idx W = p->Di / 2 + p->Di / 32, n = p->B * p->S * p->Hi;
    if (n == 0) {
        x->qp = none;
        return CSA_V(ix_run)(x);
    }
    uint8_t *qp = malloc((size_t)n * (size_t)W);
    if (!qp) return CSA_ENOMEM;
    int st = CSA_OK;
    if (p->sqs == p->Hi * p->sqh && p->sqb == p->S * p->sqs) {
        st = csa_quant_pack(p->q, p->qk_bf16, n, p->Di, p->sqh, 1, 32, CSA_Q_E2M1, CSA_QS_UE8M0,
                            qp, W, qp + p->Di / 2, 1, W, 1);
    } else {
        for (csa_idx r = 0; r < p->B * p->S && !st; r++)
            st = fp4_pack_q(p, r / p->S, r % p->S, qp + r * p->Hi * W, 0);
    }
    x->qp = qp;
    x->qph = W;
    x->qps = p->Hi * W;
    x->qpb = p->S * p->Hi * W;
    if (!st) st = CSA_V(ix_run)(x);
    free(qp);
    return st;
}

static int CSA_V(index_scores_tuned)(const struct csa_index_problem *p, float *out, csa_idx sob,
                                     csa_idx sos)
{
    struct ix_call x = {.p = p, .sc = out, .sob = sob, .sos = sos};
#ifdef CSA_MUTANT_INDEX_SCORES /* planted (make mutants): scores off by a relative 1e-4 */
    const int st = CSA_V(ix_run_entry)(&x);
    if (st == CSA_OK)
        for (csa_idx b = 0; b < p->B; b++)
            for (csa_idx s = 0; s < p->S; s++)
                for (csa_idx t = 0; t < p->Tc; t++) out[b * sob + s * sos + t] *= 1.0f + 1e-4f;
    return st;
#else
    return CSA_V(ix_run_entry)(&x);
#endif
}

static int CSA_V(index_topk_tuned)(const struct csa_index_problem *p,
                                   const struct csa_index_cand *c, csa_idx K, csa_idx offset,
                                   int order, int32_t *out)
{
    struct ix_call x = {.p = p, .c = c, .K = K, .offset = offset, .order = order, .idx = out};
#ifdef CSA_MUTANT_TOPK_SLOT /* planted (make mutants): each row's last top-k slot lost */
    const int st = CSA_V(ix_run_entry)(&x);
    if (st == CSA_OK && K > 0)
        for (csa_idx i = 0; i < p->B * p->S; i++) out[i * K + K - 1] = -1;
    return st;
#else
    return CSA_V(ix_run_entry)(&x);
#endif
}

#undef IX_VL
#undef IX_NK
#undef IX_HC
#undef IX_QB
#undef IX_AMX_TILE
#undef IX_FK
#undef IX_STREAM_KMAX
#undef IX4_NK
#ifdef IX4_HAVE_VNNI
#undef IX4_HAVE_VNNI
#endif
#ifdef IX4_HAVE_AMX
#undef IX4_HAVE_AMX
#endif
#ifdef IX_HAVE_AMX
#undef IX_HAVE_AMX
#endif
