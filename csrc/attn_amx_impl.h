/* Sparse attention on bfloat16 inputs with AMX-BF16 tiles (ISA level amx).
 *
 * Included by attn_impl.h into its AVX-512 variant only, and reached only when the
 * run-time level is amx (the CPU has the tiles and the OS let us use them).  One work
 * item is (b, s, a chunk of heads), as in the float32 body, and its two products run
 * as tile GEMMs over chunks of AMX_KC gathered rows:
 *
 *   L[k, h] = KV_k . Q_h      A = the chunk's rows copied contiguous (16 rows x 32
 *                             features), B = Q^T packed once per item in pair layout
 *   P = e^(scale L - m)       the float32 online softmax of the other levels
 *   O[h, :] = alpha_h O[h, :] + sum_k P[k, h] KV_k
 *                             A = P^T rounded to bf16 (16 heads x 32 rows),
 *                             B = the rows interleaved in pairs (16 row pairs x 16 features)
 *
 * TDPBF16PS multiplies exactly and accumulates in float32, so only the summation order
 * differs from the other levels.  All tiles are 16 rows x 64 bytes; shapes are padded
 * with zeros to 32 heads / 32 rows / 32 features, so every tile is whole.  Per-thread
 * scratch for V4-Flash (64 heads, D = 512): about 0.9 MB, which stays in L2. */

/* clang gives a function the first target of nested `clang attribute` regions:
 * leave the AVX-512 variant's region for the AMX one (GCC nests its pragmas). */
#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")

#define AMX_KC 256 /* gathered rows per chunk (a multiple of 32) */

/* Lanes of a 32 x bf16 vector starting at element d0 that lie inside a row of D. */
static inline __mmask32 CSA_V(amx_mask32)(csa_idx d0, csa_idx D)
{
    const csa_idx left = D - d0;
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : left > 0 ? (__mmask32)((1u << left) - 1) : 0;
}

/* QTv[c, h] = the bf16 pair (q_h[2c], q_h[2c+1]) as one 32-bit word, for c < Dp/2 and
 * h < hcp (zero past D and for the padding heads hc <= h): Q^T in the pair layout of
 * a B operand. */
static void CSA_V(amx_pack_q)(const csa_bf16 *q, csa_idx sq_h, csa_idx hc, csa_idx hcp,
                              csa_idx D, csa_idx Dp, uint32_t *QTv)
{
    for (csa_idx h0 = 0; h0 < hcp; h0 += 16)
        for (csa_idx c0 = 0; c0 < Dp / 2; c0 += 16) {
            __m512i r[16];
            const __mmask32 mk = CSA_V(amx_mask32)(2 * c0, D);
            for (int i = 0; i < 16; i++)
                r[i] = h0 + i < hc ? _mm512_maskz_loadu_epi16(mk, q + (h0 + i) * sq_h + 2 * c0)
                                   : _mm512_setzero_si512();
            CSA_V(transpose16)(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(QTv + (c0 + i) * hcp + h0, r[i]);
        }
}

/* KVc[i] = the i-th gathered row, zero-padded to Dp (zero rows from kc to kcp), and
 * Vv[r, d] = the pair (KVc[2r, d], KVc[2r+1, d]): the rows in the B layout of O. */
static void CSA_V(amx_pack_rows)(const csa_bf16 *const *rows, csa_idx kc, csa_idx kcp,
                                 csa_idx D, csa_idx Dp, csa_bf16 *KVc, uint32_t *Vv)
{
    static const int16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const int16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
    for (csa_idx i = 0; i < kcp; i += 2) {
        csa_bf16 *e = KVc + i * Dp, *o = e + Dp;
        for (csa_idx d0 = 0; d0 < Dp; d0 += 32) {
            const __mmask32 mk = CSA_V(amx_mask32)(d0, D);
            const __m512i a = i < kc ? _mm512_maskz_loadu_epi16(mk, rows[i] + d0)
                                     : _mm512_setzero_si512();
            const __m512i b = i + 1 < kc ? _mm512_maskz_loadu_epi16(mk, rows[i + 1] + d0)
                                         : _mm512_setzero_si512();
            _mm512_storeu_si512(e + d0, a);
            _mm512_storeu_si512(o + d0, b);
            uint32_t *v = Vv + (i / 2) * Dp + d0;
            _mm512_storeu_si512(v, _mm512_permutex2var_epi16(a, ilo, b));
            _mm512_storeu_si512(v + 16, _mm512_permutex2var_epi16(a, ihi, b));
        }
    }
}

/* L[k, h] = KVc_k . Q_h for k < kcp, h < hcp (float32, rows of hcp). */
static void CSA_V(amx_logits)(const csa_bf16 *KVc, csa_idx kcp, const uint32_t *QTv,
                              csa_idx hcp, csa_idx Dp, float *L)
{
    const size_t sa = (size_t)Dp * 2, sb = (size_t)hcp * 4, sl = (size_t)hcp * 4;
    for (csa_idx i0 = 0; i0 < kcp; i0 += 32)
        for (csa_idx j0 = 0; j0 < hcp; j0 += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (csa_idx d0 = 0; d0 < Dp; d0 += 32) {
                _tile_loadd(4, KVc + i0 * Dp + d0, sa);
                _tile_loadd(5, KVc + (i0 + 16) * Dp + d0, sa);
                _tile_loadd(6, QTv + (d0 / 2) * hcp + j0, sb);
                _tile_loadd(7, QTv + (d0 / 2) * hcp + j0 + 16, sb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, L + i0 * hcp + j0, sl);
            _tile_stored(1, L + i0 * hcp + j0 + 16, sl);
            _tile_stored(2, L + (i0 + 16) * hcp + j0, sl);
            _tile_stored(3, L + (i0 + 16) * hcp + j0 + 16, sl);
        }
}

/* PT[h, r] = the pair (bf16 P[2r, h], bf16 P[2r+1, h]) for r < kcp/2, zero for rows
 * kc <= k: the weights transposed into the A layout of O, rounded to nearest even. */
static void CSA_V(amx_pack_p)(const float *P, csa_idx kc, csa_idx kcp, csa_idx hcp, uint32_t *PT)
{
    static const int16_t il[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i inter = _mm512_loadu_si512(il);
    const csa_idx np = kcp / 2;
    for (csa_idx r0 = 0; r0 < np; r0 += 16)
        for (csa_idx h0 = 0; h0 < hcp; h0 += 16) {
            __m512i x[16];
            for (int j = 0; j < 16; j++) {
                const csa_idx k = 2 * (r0 + j);
                const __m512 e = k < kc ? _mm512_loadu_ps(P + k * hcp + h0) : _mm512_setzero_ps();
                const __m512 o = k + 1 < kc ? _mm512_loadu_ps(P + (k + 1) * hcp + h0)
                                            : _mm512_setzero_ps();
                /* 16 bf16 of row k, then 16 of row k+1; interleaved into pairs per head */
                x[j] = _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(o, e));
            }
            CSA_V(transpose16)(x);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(PT + (h0 + i) * np + r0, x[i]);
        }
}

/* O[h, :] (=|+=) sum_{k < kcp} P[k, h] KV_k for h < hcp, Dp features (rows of Dp). */
static void CSA_V(amx_pv)(const uint32_t *PT, csa_idx kcp, csa_idx hcp, const uint32_t *Vv,
                          csa_idx Dp, float *O, int first)
{
    const csa_idx np = kcp / 2;
    const size_t sa = (size_t)np * 4, sb = (size_t)Dp * 4, so = (size_t)Dp * 4;
    for (csa_idx h0 = 0; h0 < hcp; h0 += 32)
        for (csa_idx d0 = 0; d0 < Dp; d0 += 32) {
            float *o = O + h0 * Dp + d0;
            if (first) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, o, so);
                _tile_loadd(1, o + 16, so);
                _tile_loadd(2, o + 16 * Dp, so);
                _tile_loadd(3, o + 16 * Dp + 16, so);
            }
            for (csa_idx r0 = 0; r0 < np; r0 += 16) {
                _tile_loadd(4, PT + h0 * np + r0, sa);
                _tile_loadd(5, PT + (h0 + 16) * np + r0, sa);
                _tile_loadd(6, Vv + r0 * Dp + d0, sb);
                _tile_loadd(7, Vv + r0 * Dp + d0 + 16, sb);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, so);
            _tile_stored(1, o + 16, so);
            _tile_stored(2, o + 16 * Dp, so);
            _tile_stored(3, o + 16 * Dp + 16, so);
        }
}

/* dst[d] = bf16(src[d] / den) for d < D: csa_f32_to_bf16 sixteen lanes at a time
 * (nearest-even, NaN kept quiet, subnormals kept; VCVTNEPS2BF16 would flush them).
 * The same rule as bf16_impl.h's bf16_narrow16, in its own instruction sequence (an
 * integer NaN test); left as it is because AMX code is only changed mechanically. */
static void CSA_V(amx_store_bf16)(csa_bf16 *dst, const float *src, float den, csa_idx D)
{
    const __m512 dv = _mm512_set1_ps(den);
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff),
                  absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                  quiet = _mm512_set1_epi32(0x40);
    for (csa_idx d = 0; d < D; d += 16) {
        const __mmask16 mk = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1);
        const __m512i u = _mm512_castps_si512(_mm512_div_ps(_mm512_maskz_loadu_ps(mk, src + d), dv));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, absm), inf);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), quiet);
        _mm256_mask_storeu_epi16(dst + d, mk, _mm512_cvtepi32_epi16(r));
    }
}

/* Asks for the n gathered rows into L2 (every 4th line; the streamer follows). */
static void CSA_V(amx_prefetch)(const csa_bf16 *const *rows, csa_idx n, csa_idx D)
{
    for (csa_idx i = 0; i < n; i++)
        for (csa_idx d = 0; d < D; d += 128) __builtin_prefetch(rows[i] + d, 0, 2);
}

struct CSA_V(amx_scratch) {
    uint32_t *QTv, *Vv, *PT;
    csa_bf16 *KVc;
    float *L, *O, *m, *sum, *alpha;
};

/* One work item: query (b, s), heads h0 .. h0+hc-1 (hcp: hc rounded up to 32). */
static void CSA_V(amx_item)(const struct csa_attn_problem *a, csa_idx b, csa_idx s, csa_idx h0,
                            csa_idx hc, csa_idx hcp, csa_idx Dp,
                            const struct CSA_V(amx_scratch) *w, const csa_bf16 **rows,
                            uint32_t *keys)
{
    const csa_idx D = a->D;
    const int32_t *ir = a->idx + b * a->si_b + s * a->si_s;
    const csa_bf16 *kvb = (const csa_bf16 *)a->kv + b * a->skv_b;
    const csa_bf16 *q = (const csa_bf16 *)a->q + b * a->sq_b + s * a->sq_s + h0 * a->sq_h;
    csa_bf16 *out = (csa_bf16 *)a->out + b * a->so_b + s * a->so_s + h0 * a->so_h;

    const csa_idx n = attn_sorted_valid(ir, a->K, keys, keys + a->K);
    for (csa_idx k = 0; k < n; k++) rows[k] = kvb + (csa_idx)keys[k] * a->skv_n;
    float *lse = a->lse ? a->lse + b * a->sl_b + s * a->sl_s + h0 : NULL;
    if (n == 0) {
        for (csa_idx h = 0; h < hc; h++) memset(out + h * a->so_h, 0, (size_t)D * sizeof(csa_bf16));
        if (lse)
            for (csa_idx h = 0; h < hc; h++) lse[h] = a->sink[h0 + h];
        return;
    }
    CSA_V(amx_prefetch)(rows, n < AMX_KC ? n : AMX_KC, D);
    CSA_V(amx_pack_q)(q, a->sq_h, hc, hcp, D, Dp, w->QTv);
    for (csa_idx h = 0; h < hcp; h++) {
        w->m[h] = h < hc ? a->sink[h0 + h] : 0.0f;
        w->sum[h] = 1.0f; /* e^(sink - m) with m = sink */
    }
    for (csa_idx k0 = 0; k0 < n; k0 += AMX_KC) {
        const csa_idx kc = n - k0 < AMX_KC ? n - k0 : AMX_KC, kcp = (kc + 31) / 32 * 32;
        if (k0 + kc < n) /* the next chunk's rows into L2 while this one computes */
            CSA_V(amx_prefetch)(rows + k0 + kc, n - k0 - kc < AMX_KC ? n - k0 - kc : AMX_KC, D);
        CSA_V(amx_pack_rows)(rows + k0, kc, kcp, D, Dp, w->KVc, w->Vv);
        CSA_V(amx_logits)(w->KVc, kcp, w->QTv, hcp, Dp, w->L);
        CSA_V(attn_softmax)(w->L, kc, hcp, a->scale, w->m, w->sum, w->alpha);
        CSA_V(amx_pack_p)(w->L, kc, kcp, hcp, w->PT);
        if (k0 > 0)
            for (csa_idx h = 0; h < hcp; h++) {
                float *CSA_RESTRICT o = w->O + h * Dp;
                const float al = w->alpha[h];
#pragma omp simd
                for (csa_idx d = 0; d < Dp; d++) o[d] *= al;
            }
        CSA_V(amx_pv)(w->PT, kcp, hcp, w->Vv, Dp, w->O, k0 == 0);
    }
    for (csa_idx h = 0; h < hc; h++)
        CSA_V(amx_store_bf16)(out + h * a->so_h, w->O + h * Dp, w->sum[h], D);
    if (lse) /* the row's log-sum-exp (sum includes the sink's term) */
        for (csa_idx h = 0; h < hc; h++) lse[h] = w->m[h] + logf(w->sum[h]);
}

static int CSA_V(sparse_attn_amx)(const struct csa_attn_problem *a)
{
    const csa_idx nq = a->B * a->S, H = a->H;
    csa_idx hc_max = nq >= ATTN_FEW_QUERIES ? ATTN_HC : ATTN_HC_FEW;
    if (hc_max > H) hc_max = H;
    const csa_idx nchunks = (H + hc_max - 1) / hc_max, items = nq * nchunks;
    const csa_idx hcp = (hc_max + 31) / 32 * 32, Dp = (a->D + 31) / 32 * 32;
    /* per-thread scratch in bytes, each piece a multiple of 64 */
    const size_t qtv = (size_t)(Dp / 2 * hcp) * 4, kvc = (size_t)(AMX_KC * Dp) * 2,
                 vv = (size_t)(AMX_KC / 2 * Dp) * 4, l = (size_t)(AMX_KC * hcp) * 4,
                 pt = (size_t)(hcp * AMX_KC / 2) * 4, o = (size_t)(hcp * Dp) * 4,
                 vec = (size_t)hcp * 4;
    const size_t per_thread = qtv + kvc + vv + l + pt + o + 3 * vec;
    const int nt = csa_threads(items, 1);
    char *ws = aligned_alloc(64, (size_t)nt * per_thread);
    /* per thread: K row pointers, then 2K uint32 of sort keys */
    const csa_bf16 **rows = malloc((size_t)(nt * 2 * (a->K > 0 ? a->K : 1)) * sizeof(*rows));
    if (!ws || !rows) {
        free(ws);
        free(rows);
        return CSA_ENOMEM;
    }

#pragma omp parallel num_threads(nt)
    {
        const int t = omp_tid();
        char *p = ws + (size_t)t * per_thread;
        struct CSA_V(amx_scratch) w;
        w.QTv = (uint32_t *)p, p += qtv;
        w.KVc = (csa_bf16 *)p, p += kvc;
        w.Vv = (uint32_t *)p, p += vv;
        w.L = (float *)p, p += l;
        w.PT = (uint32_t *)p, p += pt;
        w.O = (float *)p, p += o;
        w.m = (float *)p, p += vec;
        w.sum = (float *)p, p += vec;
        w.alpha = (float *)p;
        csa_amx_tiles_16x64(); /* tiles 0-3: a 2 x 2 block of results, 4-5: A, 6-7: B */
#pragma omp for schedule(dynamic, 1)
        for (csa_idx it = 0; it < items; it++) {
            const csa_idx qi = it / nchunks, c = it % nchunks;
            const csa_idx h0 = c * hc_max, hc = H - h0 < hc_max ? H - h0 : hc_max;
            CSA_V(amx_item)(a, qi / a->S, qi % a->S, h0, hc, hcp, Dp, &w, rows + t * 2 * a->K,
                            (uint32_t *)(rows + t * 2 * a->K + a->K));
        }
        _tile_release();
    }
    free(ws);
    free(rows);
    return CSA_OK;
}

CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
