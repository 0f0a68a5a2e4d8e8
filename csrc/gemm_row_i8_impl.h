/* fp4_gemm of one activation row by exact 8-bit dot products on AVX2 (VPMADDUBSW), for
 * the CPUs that gemm_row_vnni_impl.h does not serve: AVX2 only (AMD Zen 2 / Zen 3, Intel
 * before Ice Lake) and AVX-512 without VNNI (Skylake-SP).  Included by gemm_impl.h into
 * its AVX2 and AVX-512 variants; the bits are the oracle's, as on every other path.
 *
 * The integers are the VNNI path's: a product of an e4m3 activation and an e2m1 weight
 * is a_int * w2 * 2^-10, with a_int = |a| 2^9 = M 2^s (M <= 15 the code's significand,
 * s <= 14) and w2 = +-2|w| (<= 12; the activation's sign flips the weight's).  A lane of
 * the oracle adds 4 products (exact in float32: at most 4 * 448 * 6 < 2^14), and the
 * first level of its tree, l[2t] + l[2t + 1], rounds their exact sum once, as the
 * conversion of the integer sum to float32 does.
 *
 * VPMADDUBSW multiplies unsigned by signed bytes and adds each pair into a saturating
 * int16; VPMADDWD adds int16 pairs into an int32 times a multiplier.  a_int needs up to
 * 18 bits, a byte holds 8: the activation goes in passes, each a byte of a_int (bits
 * [b, b + 8), counted 2^b in the VPMADDWD), chosen per 64-column chunk from the bit
 * length of its largest a_int (gi_act).  Int16 sums of 4 products are at most 4 * 255
 * * 12 = 12240 and never saturate.  Two passes cover 16 bits, every column within
 * 2^-12 of the chunk's largest; a third only where smaller nonzero codes occur: e4m3
 * activations scaled per 128 columns as the released act_quant does, Gaussian, one
 * chunk in 75; heavy-tailed ones (x e^(1.5 z)) one in 3.  (Passes by exponent, M 2^d
 * for d <= 4 in a byte, cover 5 exponents each: the third pass in 16 of 64 chunks of
 * a Gaussian row.  The VNNI path's two passes put 2^j on the weight byte through a
 * 64-entry table, VPERMB; AVX2's byte table, VPSHUFB, has 16 entries, the e2m1 code
 * and its sign, and no room for j.)
 *
 * A ymm holds 32 bytes of one weight row: 2 blocks of 32 codes (one 128-bit lane each).
 * As in the VNNI path, a byte shuffle puts bytes t, t + 4, t + 8, t + 12 of each block
 * into dword t, so that its low nibbles are the block's elements 2t + 8q (q < 4: the
 * oracle's lane 2t) and its high nibbles lane 2t + 1's; the activation's sign bits are
 * xor'ed onto the nibbles' (one instruction for both), and each nibble indexes the
 * table of signed w2.  One VPMADDUBSW per nibble half and pass, their int16 sums added,
 * and one VPMADDWD leave in dword t the integer l[2t] + l[2t + 1] of the pass, summed
 * over the passes in int32 (exact: < 2^25).  Eight rows a task; the tree's other two
 * levels are shuffles that also gather four rows into each block's lane, and the FMAs
 * into the 8 rows' accumulators run a block at a time down one vector. */

/* One 64-column chunk of the activation row, laid out for gi_fp4_row8: byte
 * b * 16 + t * 4 + q of a register is column 64 c + 32 b + 2 t + 8 q (+ 1 for the
 * high-nibble registers). */
struct CSA_V(gi_chunk) {
    uint8_t sign[32];    /* 0x08 where the low nibble's column is negative, | 0x80 the high's */
    uint8_t a[3][2][32]; /* the chunk's passes (np of them): low-nibble columns, high */
    int16_t mult[3];     /* each pass's 2^b */
    int np;
};

/* Lays the activation row out in chunks (columns past K are zero).  0, or -1 when a code
 * is NaN (0x7f / 0xff: the caller takes another path).
 *
 * A chunk's passes are bytes of a_int: with L the bit length of the chunk's largest
 * a_int, the top pass is bits [b, b + 8) for b = max(L - 8, 0), the next bits
 * [max(b - 8, 0), b), the last whatever is left below (L <= 18, so bits [0, 2) at
 * most).  A column whose 4 significant bits straddle two passes is in both.  The
 * third pass is needed only when a column of the chunk has a bit below L - 16: for
 * the released activation scaling, codes below 2^-4 (1/7168 of the largest). */
static int CSA_V(gi_act)(const struct csa_gemm_args *g, struct CSA_V(gi_chunk) *ch)
{
    const csa_idx K = g->K, nch = (K + 63) / 64;
    /* per 128-bit lane (16 columns, q = 2 L + ql): the even columns 2t + 8ql to bytes
     * 2t + ql, the odd ones to 8 + 2t + ql; then, after the lanes' even and odd halves
     * are paired, byte 4t + q from the two lanes' halves */
    uint8_t c1[16], c3[16];
    for (int t = 0; t < 4; t++)
        for (int q = 0; q < 4; q++) {
            if (q < 2) {
                c1[2 * t + q] = (uint8_t)(2 * t + 8 * q);
                c1[8 + 2 * t + q] = (uint8_t)(2 * t + 8 * q + 1);
            }
            c3[4 * t + q] = (uint8_t)(q < 2 ? 2 * t + q : 8 + 2 * t + q - 2);
        }
    const __m256i C1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c1));
    const __m256i C3 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)c3));
    const __m256i m7f = _mm256_set1_epi8(0x7f), m80 = _mm256_set1_epi8((char)0x80);
    const __m256i z = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
    const __m256i d7 = _mm256_set1_epi32(7), d8 = _mm256_set1_epi32(8), d15 = _mm256_set1_epi32(15);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* after the packs */
    for (csa_idx c = 0; c < nch; c++) {
        __m256i Y[2];
        for (int b = 0; b < 2; b++) {
            const csa_idx k0 = 64 * c + 32 * b;
            if (k0 >= K) { /* K is a multiple of 32: a block is all there or not at all */
                Y[b] = z;
                continue;
            }
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(g->a + k0));
            if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(raw, m7f), m7f))) return -1;
            const __m256i x = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, C1), _MM_SHUFFLE(3, 1, 2, 0));
            Y[b] = _mm256_shuffle_epi8(x, C3);
        }
        /* the low-nibble columns' codes, then the high-nibble columns' */
        const __m256i lo = _mm256_permute2x128_si256(Y[0], Y[1], 0x20);
        const __m256i hi = _mm256_permute2x128_si256(Y[0], Y[1], 0x31);
        uint8_t code[64];
        _mm256_storeu_si256((__m256i *)code, lo);
        _mm256_storeu_si256((__m256i *)(code + 32), hi);
#ifndef CSA_MUTANT_GEMM_I8_SIGN
        _mm256_storeu_si256((__m256i *)ch[c].sign,
                            _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(lo, m80), 4),
                                            _mm256_and_si256(hi, m80)));
#else /* planted (make mutants): the high-nibble columns' signs dropped */
        _mm256_storeu_si256((__m256i *)ch[c].sign, _mm256_srli_epi16(_mm256_and_si256(lo, m80), 4));
#endif
        /* a_int = M 2^s of the 64 columns, 8 a vector, and the OR of them all */
        __m256i ai[8], any = z;
        for (int i = 0; i < 8; i++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(code + 8 * i)));
            const __m256i e = _mm256_and_si256(_mm256_srli_epi32(v, 3), d15);
            const __m256i M = _mm256_or_si256(_mm256_and_si256(v, d7),
                                              _mm256_and_si256(_mm256_cmpgt_epi32(e, z), d8));
            ai[i] = _mm256_sllv_epi32(M, _mm256_max_epi32(_mm256_sub_epi32(e, one), z));
            any = _mm256_or_si256(any, ai[i]);
        }
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(any), _mm256_extracti128_si256(any, 1));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, _MM_SHUFFLE(1, 0, 3, 2)));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, _MM_SHUFFLE(2, 3, 0, 1)));
        const uint32_t all = (uint32_t)_mm_cvtsi128_si32(o);
        const int L = all ? 32 - __builtin_clz(all) : 0;
        int base[3], np = 0;
        if (L) {
            base[np++] = L > 8 ? L - 8 : 0;
            if (base[0] > 0) base[np++] = base[0] > 8 ? base[0] - 8 : 0;
#ifndef CSA_MUTANT_GEMM_I8_PASS3
            if (np == 2 && base[1] > 0) base[np++] = 0;
#endif /* planted (make mutants): a chunk's third pass (its lowest bits) left out */
        }
        int kept = 0;
        for (int p = 0; p < np; p++) {
            /* bits [base[p], top) of each a_int (at most 8), packed back to the layout's
             * bytes */
            const int top = p ? base[p - 1] : base[0] + 8;
            const __m128i sh = _mm_cvtsi32_si128(base[p]);
            const __m256i mask = _mm256_set1_epi32((1 << (top - base[p])) - 1);
            __m256i bytes[2];
            for (int h = 0; h < 2; h++) {
                __m256i w[4];
                for (int i = 0; i < 4; i++) w[i] = _mm256_and_si256(_mm256_srl_epi32(ai[4 * h + i], sh), mask);
                bytes[h] = _mm256_permutevar8x32_epi32(
                    _mm256_packus_epi16(_mm256_packus_epi32(w[0], w[1]), _mm256_packus_epi32(w[2], w[3])),
                    order);
            }
            const __m256i both = _mm256_or_si256(bytes[0], bytes[1]);
            if (_mm256_testz_si256(both, both)) continue;
            _mm256_storeu_si256((__m256i *)ch[c].a[kept][0], bytes[0]);
            _mm256_storeu_si256((__m256i *)ch[c].a[kept][1], bytes[1]);
            ch[c].mult[kept] = (int16_t)(1 << base[p]);
            kept++;
        }
        ch[c].np = kept;
    }
    return 0;
}

/* Four weight rows' chunk ci against the activation chunk A with its np passes (a
 * constant where inlined): lane (b, r) of the result is block b's partial sum of row r
 * times 2^10, the oracle's tree over its lanes. */
static inline __attribute__((always_inline)) __m256 CSA_V(gi_rows4)(
    const uint8_t *const *rp, csa_idx ci, int two, int pf, csa_idx pfr,
    const struct CSA_V(gi_chunk) *A, const int np)
{
    /* dword t of each block <- its bytes t, t + 4, t + 8, t + 12 */
    const __m256i gather = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    /* e2m1 code (sign << 3 | magnitude) -> +-2 |w| */
    const __m256i wtab = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i S = _mm256_loadu_si256((const __m256i *)A->sign);
    /* the activation in registers for up to 2 passes; 3 read it from L1 (register
     * pressure) */
    __m256i Al[2], Ah[2], mu[2];
    for (int p = 0; p < np && np < 3; p++) {
        Al[p] = _mm256_loadu_si256((const __m256i *)A->a[p][0]);
        Ah[p] = _mm256_loadu_si256((const __m256i *)A->a[p][1]);
        mu[p] = _mm256_set1_epi16(A->mult[p]);
    }
    __m256 X[4];
#pragma GCC unroll 4 /* AMD EPYC Zen 4 at level avx2, 8 rows x 4096 in L2, two passes:
                      * 2.44 -> 2.03 ns a row and 64 columns (a stand-alone loop) */
    for (int rr = 0; rr < 4; rr++) {
        const uint8_t *src = rp[rr] + 32 * ci;
        if (pf) {
            /* the line two ahead in the row into L1, the rows of the task two ahead into
             * L2: 24 weights of 2048 x 4096 cycled (from memory), 2 threads, AMD EPYC
             * Zen 4 at level avx2: 0.28 -> 0.21 ms (each alone: 0.28, 0.22); one
             * weight, in L3: 0.176 -> 0.181 */
            _mm_prefetch((const char *)(src + 128), _MM_HINT_T0);
            if (pfr) _mm_prefetch((const char *)(src + pfr), _MM_HINT_T1);
        }
        const __m256i raw = two ? _mm256_loadu_si256((const __m256i *)src)
                                : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                          _mm_loadu_si128((const __m128i *)src), 0);
        const __m256i x = _mm256_xor_si256(_mm256_shuffle_epi8(raw, gather), S);
        const __m256i wl = _mm256_shuffle_epi8(wtab, _mm256_and_si256(x, m0f));
        const __m256i wh = _mm256_shuffle_epi8(wtab, _mm256_and_si256(_mm256_srli_epi16(x, 4), m0f));
        __m256i d = _mm256_setzero_si256();
        if (np == 3) {
            for (int p = 0; p < 3; p++)
                d = _mm256_add_epi32(d, _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)A->a[p][0]), wl),
                                     _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)A->a[p][1]), wh)),
                    _mm256_set1_epi16(A->mult[p])));
        } else {
            for (int p = 0; p < np; p++)
                d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(Al[p], wl),
                                                                           _mm256_maddubs_epi16(Ah[p], wh)),
                                                          mu[p]));
        }
        X[rr] = _mm256_cvtepi32_ps(d);
    }
    /* per block: (X0 + X1, X2 + X3) of rows 0, 1 (and 2, 3), then their sum in lane rr --
     * the tree's second and third levels */
    const __m256 u01 = _mm256_add_ps(_mm256_shuffle_ps(X[0], X[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(X[0], X[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 u23 = _mm256_add_ps(_mm256_shuffle_ps(X[2], X[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(X[2], X[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Eight weight rows' chunk ci: P[b] lane r = block b's partial sum of row r times 2^10.
 * two: the chunk has both blocks; pf: prefetch (once a 64-byte line of the rows). */
static inline __attribute__((always_inline)) void CSA_V(gi_rows8)(
    const uint8_t *const *rp, csa_idx ci, const int two, const int pf, csa_idx pfr,
    const struct CSA_V(gi_chunk) *A, __m256 P[2])
{
    __m256 W0, W1;
    switch (A->np) { /* the passes a constant in each case: no branch per row */
    case 0: W0 = W1 = _mm256_setzero_ps(); break;
    case 1:
        W0 = CSA_V(gi_rows4)(rp, ci, two, pf, pfr, A, 1);
        W1 = CSA_V(gi_rows4)(rp + 4, ci, two, pf, pfr, A, 1);
        break;
    case 2:
        W0 = CSA_V(gi_rows4)(rp, ci, two, pf, pfr, A, 2);
        W1 = CSA_V(gi_rows4)(rp + 4, ci, two, pf, pfr, A, 2);
        break;
    default:
        W0 = CSA_V(gi_rows4)(rp, ci, two, pf, pfr, A, 3);
        W1 = CSA_V(gi_rows4)(rp + 4, ci, two, pf, pfr, A, 3);
    }
    /* block b of the 8 rows: W0's lane b (rows 0-3), then W1's (rows 4-7) */
    P[0] = _mm256_permute2f128_ps(W0, W1, 0x20);
    P[1] = _mm256_permute2f128_ps(W0, W1, 0x31);
}

/* The last chunk when it has one block (K / 32 odd): apart, so that the main loop's
 * loads and prefetches are not conditional. */
static __attribute__((noinline)) void CSA_V(gi_rows8_half)(const uint8_t *const *rp, csa_idx ci,
                                                           const struct CSA_V(gi_chunk) *A, __m256 P[2])
{
    CSA_V(gi_rows8)(rp, ci, 0, 0, 0, A, P);
}

/* The scales of weight rows n0 .. n0 + 7 (rows past nr repeat the last one) transposed
 * to sbt [K / 32][8], as g_rows_scales does; e8m0 scales with unit column stride by
 * 8 x 8 byte transposes (gathering them in the loop instead: 2048 x 4096, AMD EPYC
 * Zen 4 at level avx2, one thread, 0.3 ns more a row and 64 columns, 15%).  1 when the
 * e8m0 codes include no 0 or 0xff (a shift decodes them), else 0. */
static int CSA_V(gi_scales8)(const struct csa_gemm_args *g, csa_idx n0, csa_idx nr, float *sbt)
{
    const csa_idx nb = g->K / 32;
    if (g->bs_fmt != CSA_S_E8M0 || g->sbs_col != 1) {
        CSA_V(g_rows_scales)(g, n0, nr, 8, sbt);
        return 0;
    }
    uint8_t *sb8 = (uint8_t *)sbt;
    const uint8_t *q[8];
    for (int r = 0; r < 8; r++) q[r] = (const uint8_t *)g->bs + (n0 + (r < nr ? r : nr - 1)) * g->sbs_row;
    const __m128i z = _mm_setzero_si128(), ff = _mm_set1_epi8((char)0xff);
    __m128i odd = z;
    csa_idx j0 = 0;
    for (; j0 + 8 <= nb; j0 += 8) {
        __m128i x[8];
        for (int r = 0; r < 8; r++) x[r] = _mm_loadl_epi64((const __m128i *)(q[r] + j0));
        const __m128i a01 = _mm_unpacklo_epi8(x[0], x[1]), a23 = _mm_unpacklo_epi8(x[2], x[3]);
        const __m128i a45 = _mm_unpacklo_epi8(x[4], x[5]), a67 = _mm_unpacklo_epi8(x[6], x[7]);
        const __m128i b0 = _mm_unpacklo_epi16(a01, a23), b1 = _mm_unpackhi_epi16(a01, a23);
        const __m128i b2 = _mm_unpacklo_epi16(a45, a67), b3 = _mm_unpackhi_epi16(a45, a67);
        const __m128i c[4] = {_mm_unpacklo_epi32(b0, b2), _mm_unpackhi_epi32(b0, b2),
                              _mm_unpacklo_epi32(b1, b3), _mm_unpackhi_epi32(b1, b3)};
        for (int i = 0; i < 4; i++) {
            _mm_storeu_si128((__m128i *)(sb8 + 8 * j0 + 16 * i), c[i]);
#ifndef CSA_MUTANT_GEMM_I8_SCALE
            odd = _mm_or_si128(odd, _mm_or_si128(_mm_cmpeq_epi8(c[i], z), _mm_cmpeq_epi8(c[i], ff)));
#else /* planted (make mutants): code 0xff (NaN) not seen, so decoded by the shift (inf) */
            odd = _mm_or_si128(odd, _mm_cmpeq_epi8(c[i], z));
            (void)ff;
#endif
        }
    }
    int plain = _mm_testz_si128(odd, odd);
    for (; j0 < nb; j0++)
        for (int r = 0; r < 8; r++) {
            sb8[8 * j0 + r] = q[r][j0];
            if (q[r][j0] == 0 || q[r][j0] == 0xff) plain = 0;
        }
    return plain;
}

/* The 8 rows' scales of block j from sbt (gi_scales8) as float32. */
static inline __attribute__((always_inline)) __m256 CSA_V(gi_sb8)(const float *sbt, csa_idx j, int e8, int plain)
{
    if (!e8) return _mm256_loadu_ps(sbt + 8 * j);
    /* e8m0: v << 23, and 0x00400000 added for 0 (2^-127) and 0xff (NaN) */
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)sbt + 8 * j)));
    const __m256i v = _mm256_slli_epi32(x, 23);
    if (plain) return _mm256_castsi256_ps(v);
    const __m256i z = _mm256_setzero_si256(), ff = _mm256_set1_epi32(0xff);
    const __m256i fix = _mm256_or_si256(_mm256_cmpeq_epi32(x, z), _mm256_cmpeq_epi32(x, ff));
    return _mm256_castsi256_ps(_mm256_or_si256(v, _mm256_and_si256(fix, _mm256_set1_epi32(0x00400000))));
}

/* One activation row against 8 weight rows n0 .. n0 + 7 (rows past nr repeat the last
 * one, their results dropped): res[r] = the oracle's C[0, n0 + r].  sbt: scratch for
 * the 8 rows' scales, [K / 32][8]. */
static void CSA_V(gi_fp4_row8)(const struct csa_gemm_args *g, const void *actv, const float *as,
                               csa_idx n0, csa_idx nr, float *sbt, float *res)
{
    const struct CSA_V(gi_chunk) *act = actv;
    const csa_idx nb = g->K / 32;
    const uint8_t *rp[8];
    for (int r = 0; r < 8; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    const int e8 = g->bs_fmt == CSA_S_E8M0;
    const int plain = CSA_V(gi_scales8)(g, n0, nr, sbt);
    /* the rows of the task two ahead (this thread's, mostly: g_rows_run) into L2 */
    const csa_idx pfr = n0 + 16 < g->N ? 16 * g->sb_row : 0;
    __m256 c = _mm256_setzero_ps();
    /* the chunks with two blocks, then (K / 32 odd) the last one with one: the call to
     * gi_rows8_half kept out of the loop, where it put c in memory (the FMA chain
     * through stores and loads; N = 256, K = 4096, one pass, one thread, AMD EPYC
     * Zen 4 at level avx2: 2.74 -> 2.29 ns a row and 64 columns, call included) */
    const csa_idx nfull = nb / 2;
    for (csa_idx ci = 0; ci < nfull; ci++) {
        __m256 P[2];
        if (ci & 1)
            CSA_V(gi_rows8)(rp, ci, 1, 0, pfr, act + ci, P);
        else
            CSA_V(gi_rows8)(rp, ci, 1, 1, pfr, act + ci, P);
        const __m256 sa = _mm256_set1_ps(as[ci / 2]);
        for (int b = 0; b < 2; b++)
            c = _mm256_fmadd_ps(_mm256_mul_ps(P[b], _mm256_set1_ps(0x1p-10f)),
                                _mm256_mul_ps(sa, CSA_V(gi_sb8)(sbt, 2 * ci + b, e8, plain)), c);
    }
    if (nb & 1) {
        __m256 P[2];
        CSA_V(gi_rows8_half)(rp, nfull, act + nfull, P);
        c = _mm256_fmadd_ps(_mm256_mul_ps(P[0], _mm256_set1_ps(0x1p-10f)),
                            _mm256_mul_ps(_mm256_set1_ps(as[nfull / 2]), CSA_V(gi_sb8)(sbt, nb - 1, e8, plain)), c);
    }
    _mm256_storeu_ps(res, c);
}

/* The job of fp4_gemm with one activation row (K a multiple of 32): 1 prepared, 0 when a
 * code of the row is NaN (another path takes it), -1 when an allocation failed. */
static int CSA_V(gi_prepare_fp4)(const struct csa_gemm_args *g, struct CSA_V(g_job) *jb)
{
    const csa_idx K = g->K, nch = (K + 63) / 64, ng = (K + 127) / 128;
    struct CSA_V(gi_chunk) *act = malloc((size_t)nch * sizeof *act);
    float *as = malloc((size_t)ng * sizeof *as);
    if (!act || !as) {
        free(act);
        free(as);
        return -1;
    }
    if (CSA_V(gi_act)(g, act)) {
        free(act);
        free(as);
        return 0;
    }
    for (csa_idx j = 0; j < ng; j++) as[j] = g_scale(g->as, g->as_fmt, j * g->sas_col);
    *jb = (struct CSA_V(g_job)){g, CSA_V(gi_fp4_row8), 8, act, as};
    return 1;
}
