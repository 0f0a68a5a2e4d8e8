/* Tuned fp8_gemm / fp4_gemm bodies, compiled once per ISA level by
 * csa_isa_variants.h.  Every output element is computed by one thread in the
 * oracle's order (gemm.h), so the bits depend on neither the level nor the threads.
 *
 * Structure: the activations are decoded once to float32 rows (they are small next
 * to the weights); the weights are never expanded as a whole: each task takes a
 * panel of NC rows of b and, G_KC columns at a time, decodes that slice into a
 * thread-private float buffer (16 KiB for decode shapes, L1; 64 KiB for prefill, L2)
 * which every activation row then reuses, so the weight bytes stream from memory
 * once.  The microkernel multiplies 1 or 2 activation rows by 4 weight rows, eight k
 * a vector (8 accumulators, FMA on AVX2), reduces each block's lanes by the fixed
 * tree and adds partial * scale into the float32 output tile.
 *
 * One activation row (decode) takes a path of its own, g_row1: 4 weight rows at a
 * time decoded straight into registers by shifts, masks and byte shuffles (no
 * conversion instructions, no buffer), each weight byte read once, the quads handed
 * out dynamically so a descheduled thread on a shared host does not hold the others. */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define G_SIMD 1
#else
#define G_SIMD 0
#endif

/* One activation row to float32 (true values). */
static void CSA_V(g_dec_a)(const uint8_t *CSA_RESTRICT a, float *CSA_RESTRICT f, csa_idx K)
{
#pragma omp simd
    for (csa_idx k = 0; k < K; k++) f[k] = g_e4m3(a[k]);
}

#if G_SIMD
/* 16 e4m3 bytes -> 16 floats, each 1/256 of its value: the byte moved to the top of a
 * 16-bit lane and shifted right once (arithmetic, then the sign copy cleared) is the
 * fp16 encoding of value / 256, subnormals included, which F16C widens exactly.
 * NaN codes (x & 0x7f == 0x7f) would come out finite: such chunks take the scalar path. */
static inline void CSA_V(g_dec16_e4m3)(const uint8_t *p, float *dst)
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m128i s7 = _mm_set1_epi8(0x7f);
    if (__builtin_expect(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(x, s7), s7)), 0)) {
        for (int i = 0; i < 16; i++) dst[i] = g_e4m3(p[i]) * (1.0f / 256.0f);
        return;
    }
    const __m128i z = _mm_setzero_si128(), keep = _mm_set1_epi16((short)0xBFFF);
    const __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(z, x), 1), keep);
    const __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(z, x), 1), keep);
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(lo));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(hi));
}

#endif

#if G_SIMD
/* 16 bytes of packed e2m1 (32 values, element 2i in the low nibble of byte i) ->
 * 32 floats: each nibble indexes an in-register table of the high bytes of the fp16
 * values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; the low bytes are zero). */
static inline __attribute__((always_inline)) void CSA_V(g_reg32_e2m1)(const uint8_t *p,
                                                                     __m256 v[4])
{
    const __m128i x = _mm_loadu_si128((const __m128i *)p);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m128i tbl = _mm_setr_epi8(0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46,
                                      (char)0x80, (char)0xb8, (char)0xbc, (char)0xbe,
                                      (char)0xc0, (char)0xc2, (char)0xc4, (char)0xc6);
    const __m128i lv = _mm_shuffle_epi8(tbl, _mm_and_si128(x, m4));
    const __m128i hv = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(x, 4), m4));
    const __m128i e0 = _mm_unpacklo_epi8(lv, hv), e1 = _mm_unpackhi_epi8(lv, hv);
    const __m128i z = _mm_setzero_si128();
    v[0] = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, e0));
    v[1] = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, e0));
    v[2] = _mm256_cvtph_ps(_mm_unpacklo_epi8(z, e1));
    v[3] = _mm256_cvtph_ps(_mm_unpackhi_epi8(z, e1));
}

/* 32 e2m1 codes (16 bytes) into a float32 buffer: the register decoder, stored. */
static inline void CSA_V(g_dec32_e2m1)(const uint8_t *p, float *dst)
{
    __m256 v[4];
    CSA_V(g_reg32_e2m1)(p, v);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, v[i]);
}

/* e4m3 codes -> float32 by shift and mask alone: ((b & 0x80) << 24) | ((b & 0x7f) << 20)
 * is 2^-120 times the value, exactly, e4m3 subnormals (m * 2^-9) included (they land on
 * the float32 subnormals m * 2^-129).  The byte is put at the top of its 32-bit lane by
 * a byte shuffle of 16 codes broadcast to both halves (ctl picks codes 0-7 or 8-15 of
 * them, in order), then shifted right arithmetically by 4 (the sign copied into bits
 * 27-31) and masked back to sign + the 7 bits.  NaN codes come out finite: the callers
 * note them apart.  Three instructions for eight codes, no conversion unit. */
static inline __attribute__((always_inline)) __m256 CSA_V(g_w8)(__m256i bb, __m256i ctl)
{
    const __m256i v = _mm256_shuffle_epi8(bb, ctl);
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_srai_epi32(v, 4), _mm256_set1_epi32((int)0x87f00000u)));
}

/* One activation row against 4 weight rows (rows past nr repeat the last one, their
 * results dropped), decoding straight into registers as the bytes stream in: no
 * buffer, each weight byte read once.  af holds the activation times 2^112 (exact), so
 * af * g_w8(b) = a * b / 256 exactly: the very products of the oracle, summed in its
 * order (lanes = k mod 8 within a block, the tree), then one FMA per block into the
 * float32 accumulators. */
static void CSA_V(g_row1)(const struct csa_gemm_args *g, const float *af, const float *as,
                          csa_idx n0, csa_idx nr, float *res)
{
    const csa_idx K = g->K;
    const uint8_t *rp[4];
    for (int r = 0; r < 4; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    __m128 c = _mm_setzero_ps();
    if (g->b_fmt == CSA_W_E4M3) {
        const __m256i ctl0 = _mm256_setr_epi8(-128, -128, -128, 0, -128, -128, -128, 1, -128,
                                              -128, -128, 2, -128, -128, -128, 3, -128, -128,
                                              -128, 4, -128, -128, -128, 5, -128, -128, -128, 6,
                                              -128, -128, -128, 7);
        const __m256i ctl1 = _mm256_add_epi32(ctl0, _mm256_set1_epi32(8 << 24));
        const __m256i s7 = _mm256_set1_epi8(0x7f);
        const csa_idx pfd = G_PF * g->sb_row;
        for (csa_idx k0 = 0, j = 0; k0 < K; k0 += 128, j++) {
            const csa_idx k1 = K - k0 < 128 ? K : k0 + 128;
            __m256 acc[4];
            __m256i mx = _mm256_setzero_si256();
            for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
            /* 32 codes of a row a step.  NaN codes (b & 0x7f == 0x7f, the largest
             * magnitude) are only noted here, by a running byte maximum: a block that has
             * one is redone by the scalar path. */
            for (csa_idx k = k0; k < k1; k += 32) {
                const __m256 x0 = _mm256_loadu_ps(af + k), x1 = _mm256_loadu_ps(af + k + 8);
                const __m256 x2 = _mm256_loadu_ps(af + k + 16), x3 = _mm256_loadu_ps(af + k + 24);
                for (int r = 0; r < 4; r++) {
                    const uint8_t *p = rp[r] + k;
                    if (!(k & 32)) _mm_prefetch((const char *)(p + pfd), _MM_HINT_T0);
                    mx = _mm256_max_epu8(mx, _mm256_and_si256(
                                                 _mm256_loadu_si256((const __m256i *)p), s7));
                    const __m256i b0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
                    const __m256i b1 =
                        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 16)));
                    __m256 a = acc[r];
                    a = _mm256_fmadd_ps(x0, CSA_V(g_w8)(b0, ctl0), a);
                    a = _mm256_fmadd_ps(x1, CSA_V(g_w8)(b0, ctl1), a);
                    a = _mm256_fmadd_ps(x2, CSA_V(g_w8)(b1, ctl0), a);
                    a = _mm256_fmadd_ps(x3, CSA_V(g_w8)(b1, ctl1), a);
                    acc[r] = a;
                }
            }
            __m128 p;
            if (__builtin_expect(_mm256_movemask_epi8(_mm256_cmpeq_epi8(mx, s7)) != 0, 0)) {
                float pr[4];
                for (int r = 0; r < 4; r++) {
                    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    for (csa_idx k = k0; k < k1; k++)
                        l[(k - k0) & 7] +=
                            (af[k] * 0x1p-112f) * (g_e4m3(rp[r][k]) * (1.0f / 256.0f));
                    pr[r] = g_tree(l);
                }
                p = _mm_loadu_ps(pr);
            } else {
                const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]),
                                                _mm256_hadd_ps(acc[2], acc[3]));
                p = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
            }
            c = _mm_fmadd_ps(p, _mm_set1_ps(as[j] * g_bscale(g, n0, j)), c);
        }
    } else {
        /* e2m1 codes straight to float32 bits by byte shuffles, no conversion: a table
         * maps each code to sign << 7 | 2 |value| (2 |value| = 0, 1, 2, 3, 4, 6, 8, 12),
         * a second shuffle puts that byte at bits 16-23 and 24-31 of the code's lane, and
         * the mask 0x807f0000 keeps the sign and the 7 low bits: the float32 subnormal
         * |value| * 2^-132 with the code's sign.  af holds a * 2^118, so every product is
         * a * value * 2^-14 exactly (normal: |a * value| >= 2^-10) and every partial sum
         * the oracle's times 2^-14 (all stay normal); one multiply by 2^14 a block takes
         * it back.  Single thread, N = 512, K = 4096 (L2/L3-resident): 272 -> 238 us
         * against the fp16 table + F16C conversion this replaces. */
        const __m128i tbl = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, (char)0x80, (char)0x81,
                                          (char)0x82, (char)0x83, (char)0x84, (char)0x86,
                                          (char)0x88, (char)0x8c);
        /* lane i of a 128-bit half: the code's table byte (from u = tl[0..7] | th[0..7])
         * twice at the top; element 2i is tl[i], 2i + 1 is th[i] */
        const __m256i pl0 = _mm256_setr_epi8(-128, -128, 0, 0, -128, -128, 8, 8, -128, -128, 1, 1,
                                             -128, -128, 9, 9, -128, -128, 2, 2, -128, -128, 10,
                                             10, -128, -128, 3, 3, -128, -128, 11, 11);
        const __m256i pl1 = _mm256_add_epi32(pl0, _mm256_set1_epi32(0x04040000));
        const __m256i keep = _mm256_set1_epi32((int)0x807f0000u);
        const __m256i m4 = _mm256_set1_epi8(0x0f), tb2 = _mm256_broadcastsi128_si256(tbl);
        const csa_idx nl = n0 + nr - 1;
        /* two 32-blocks (32 bytes of a row) a step: one split into nibbles and one table
         * lookup for both; their lanes are reduced and scaled block by block */
        for (csa_idx k0 = 0, j = 0; k0 < K; k0 += 64, j += 2) {
            const int two = K - k0 >= 64;
            __m256 acc[8];
            for (int r = 0; r < 4; r++) {
                const uint8_t *p = rp[r] + k0 / 2;
                const __m256i x = two ? _mm256_loadu_si256((const __m256i *)p)
                                      : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p));
                const __m256i tl = _mm256_shuffle_epi8(tb2, _mm256_and_si256(x, m4));
                const __m256i th = _mm256_shuffle_epi8(tb2, _mm256_and_si256(_mm256_srli_epi16(x, 4), m4));
                const __m256i lo = _mm256_unpacklo_epi64(tl, th), hi = _mm256_unpackhi_epi64(tl, th);
                for (int h = 0; h < 2; h++) {
                    const __m256i u0 = _mm256_permute2x128_si256(lo, lo, h ? 0x11 : 0x00);
                    const __m256i u1 = _mm256_permute2x128_si256(hi, hi, h ? 0x11 : 0x00);
                    const float *ap = af + k0 + 32 * h;
                    __m256 a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(ap),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_shuffle_epi8(u0, pl0), keep)),
                        _mm256_setzero_ps());
                    a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(ap + 8),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_shuffle_epi8(u0, pl1), keep)), a);
                    a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(ap + 16),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_shuffle_epi8(u1, pl0), keep)), a);
                    a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(ap + 24),
                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_shuffle_epi8(u1, pl1), keep)), a);
                    acc[4 * h + r] = a;
                    if (!two) break;
                }
            }
            for (int h = 0; h < 1 + two; h++) {
                const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[4 * h], acc[4 * h + 1]),
                                                _mm256_hadd_ps(acc[4 * h + 2], acc[4 * h + 3]));
                const __m128 p = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
                const csa_idx jb = j + h;
                const __m128 sb = _mm_setr_ps(g_bscale(g, n0, jb), g_bscale(g, nr > 1 ? n0 + 1 : nl, jb),
                                              g_bscale(g, nr > 2 ? n0 + 2 : nl, jb),
                                              g_bscale(g, nr > 3 ? n0 + 3 : nl, jb));
                /* p * 2^14 is the oracle's partial sum again (exact), so the scale and
                 * the FMA are its own too, whatever the scales' range */
                c = _mm_fmadd_ps(_mm_mul_ps(p, _mm_set1_ps(0x1p14f)),
                                 _mm_mul_ps(_mm_set1_ps(as[jb / 4]), sb), c);
            }
        }
    }
    _mm_storeu_ps(res, c);
}
#endif

/* Weight row slice [k0, k0 + kl) of row n into dst (floats; e4m3 as value / 256). */
static void CSA_V(g_dec_b)(const struct csa_gemm_args *g, csa_idx n, csa_idx k0, csa_idx kl,
                           float *CSA_RESTRICT dst)
{
    const uint8_t *br = g->b + n * g->sb_row;
    if (g->b_fmt == CSA_W_E4M3) {
        csa_idx k = 0;
#if G_SIMD
        for (; k + 16 <= kl; k += 16) CSA_V(g_dec16_e4m3)(br + k0 + k, dst + k);
#endif
        for (; k < kl; k++) dst[k] = g_e4m3(br[k0 + k]) * (1.0f / 256.0f);
    } else {
        const uint8_t *p = br + k0 / 2;   /* k0 even */
        csa_idx k = 0;
#if G_SIMD
        for (; k + 32 <= kl; k += 32) CSA_V(g_dec32_e2m1)(p + k / 2, dst + k);
#endif
        for (; k < kl; k++) dst[k] = g_e2m1(k & 1 ? p[k / 2] >> 4 : p[k / 2] & 15u);
    }
}

/* MR activation rows (a0, a1: float rows at the slice) times 4 weight rows (b, row
 * stride G_KC) over kl columns in blocks of bk; after each block, the 4 x MR partial
 * sums are scaled by sa[i][block] * sbx and added into c (row stride ldc).
 * fp8: sbx[j] is the weight scale of block j (one for the 4 rows); fp4: sbq + j * ldq
 * holds the 4 rows' scales of block j.  as_i[j]: the activation scale of the 128-block
 * holding block j. */
static inline __attribute__((always_inline)) void CSA_V(g_micro)(
    const int MR, const float *a0, const float *a1, const float *b, csa_idx ldb, csa_idx kl,
    csa_idx bk,
    const float *sbx, const float *sbq, csa_idx ldq, const float *sa0, const float *sa1,
    float *c, csa_idx ldc)
{
    const int fp4 = bk == 32;
    for (csa_idx k0 = 0, j = 0; k0 < kl; k0 += bk, j++) {
        const csa_idx len = kl - k0 < bk ? kl - k0 : bk;
        const csa_idx jb = fp4 ? j / 4 : j;   /* 128-block of the activation scale */
#if G_SIMD
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
        __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
        const float *r0 = b, *r1 = b + ldb, *r2 = b + 2 * ldb, *r3 = b + 3 * ldb;
        for (csa_idx k = k0; k < k0 + len; k += 8) {
            __m256 b0 = _mm256_loadu_ps(r0 + k), b1 = _mm256_loadu_ps(r1 + k);
            __m256 b2 = _mm256_loadu_ps(r2 + k), b3 = _mm256_loadu_ps(r3 + k);
            /* keep the four weight vectors in registers: GCC would otherwise fold each
             * load into the FMAs of both activation rows (two loads per vector) */
            if (MR == 2) __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3));
            const __m256 x0 = _mm256_loadu_ps(a0 + k);
            c00 = _mm256_fmadd_ps(x0, b0, c00);
            c01 = _mm256_fmadd_ps(x0, b1, c01);
            c02 = _mm256_fmadd_ps(x0, b2, c02);
            c03 = _mm256_fmadd_ps(x0, b3, c03);
            if (MR == 2) {
                const __m256 x1 = _mm256_loadu_ps(a1 + k);
                c10 = _mm256_fmadd_ps(x1, b0, c10);
                c11 = _mm256_fmadd_ps(x1, b1, c11);
                c12 = _mm256_fmadd_ps(x1, b2, c12);
                c13 = _mm256_fmadd_ps(x1, b3, c13);
            }
        }
        /* the tree: hadd pairs, then the two 128-bit halves */
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(c00, c01), _mm256_hadd_ps(c02, c03));
        const __m128 p0 = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
        const __m128 sb = fp4 ? _mm_loadu_ps(sbq + j * ldq) : _mm_set1_ps(sbx[j]);
        _mm_storeu_ps(c, _mm_fmadd_ps(p0, _mm_mul_ps(_mm_set1_ps(sa0[jb]), sb),
                                      _mm_loadu_ps(c)));
        if (MR == 2) {
            const __m256 u1 =
                _mm256_hadd_ps(_mm256_hadd_ps(c10, c11), _mm256_hadd_ps(c12, c13));
            const __m128 p1 =
                _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1));
            _mm_storeu_ps(c + ldc, _mm_fmadd_ps(p1, _mm_mul_ps(_mm_set1_ps(sa1[jb]), sb),
                                                _mm_loadu_ps(c + ldc)));
        }
#else
        for (int i = 0; i < MR; i++) {
            const float *ar = i ? a1 : a0;
            const float sa = (i ? sa1 : sa0)[jb];
            for (int q = 0; q < 4; q++) {
                float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const float *br = b + q * ldb;
                for (csa_idx k = k0; k < k0 + len; k += 8)
                    for (int t = 0; t < 8; t++) l[t] += ar[k + t] * br[k + t];
                const float sb = fp4 ? sbq[j * ldq + q] : sbx[j];
                c[i * ldc + q] = fmaf(g_tree(l), sa * sb, c[i * ldc + q]);
            }
        }
#endif
    }
}

/* The two row counts as separate out-of-line functions: inlined into the panel loop
 * the compiler ran out of registers and spilled the accumulators. */
static __attribute__((noinline)) void CSA_V(g_micro2)(
    const float *a0, const float *a1, const float *b, csa_idx ldb, csa_idx kl, csa_idx bk,
    const float *sbx, const float *sbq, csa_idx ldq, const float *sa0, const float *sa1,
    float *c, csa_idx ldc)
{
    CSA_V(g_micro)(2, a0, a1, b, ldb, kl, bk, sbx, sbq, ldq, sa0, sa1, c, ldc);
}

static __attribute__((noinline)) void CSA_V(g_micro1)(
    const float *a0, const float *b, csa_idx ldb, csa_idx kl, csa_idx bk, const float *sbx,
    const float *sbq, csa_idx ldq, const float *sa0, float *c)
{
    CSA_V(g_micro)(1, a0, NULL, b, ldb, kl, bk, sbx, sbq, ldq, sa0, NULL, c, 0);
}

/* One panel: weight rows [n0, n0 + nr) against every activation row, KC columns of
 * the panel decoded at a time into Bf (row stride KC). */
static void CSA_V(g_panel)(const struct csa_gemm_args *g, const float *Af, const float *AS,
                           csa_idx KB128, csa_idx n0, csa_idx nr, csa_idx NC, csa_idx KC,
                           float *Bf, float *BS, float *C)
{
    const csa_idx M = g->M, K = g->K;
    const int fp8 = g->b_fmt == CSA_W_E4M3;
    const csa_idx bk = fp8 ? 128 : 32;
    const csa_idx nq = (nr + 3) / 4 * 4;    /* rows rounded up to whole quads */
    for (csa_idx m0 = 0; m0 < M; m0 += G_MB) {
        const csa_idx mb = M - m0 < G_MB ? M - m0 : G_MB;
        memset(C, 0, (size_t)(mb * NC) * sizeof *C);
        for (csa_idx kc = 0; kc < K; kc += KC) {
            const csa_idx kl = K - kc < KC ? K - kc : KC;
            const csa_idx nblk = (kl + bk - 1) / bk;
            for (csa_idx r = 0; r < nq; r++) {
                if (r < nr)
                    CSA_V(g_dec_b)(g, n0 + r, kc, kl, Bf + r * KC);
                else
                    memset(Bf + r * KC, 0, (size_t)kl * sizeof *Bf);
            }
            if (fp8) {
                for (csa_idx j = 0; j < nblk; j++) BS[j] = g_bscale(g, n0, kc / 128 + j);
            } else {
                for (csa_idx j = 0; j < nblk; j++)
                    for (csa_idx r = 0; r < nq; r++)
                        BS[j * NC + r] = r < nr ? g_bscale(g, n0 + r, kc / 32 + j) : 0.0f;
            }
            for (csa_idx ms = 0; ms < mb; ms += G_MS) {
                const csa_idx me = mb - ms < G_MS ? mb : ms + G_MS;
                for (csa_idx q = 0; q < nq; q += 4) {
                    const float *bq = Bf + q * KC;
                    csa_idx m = ms;
                    for (; m + 2 <= me; m += 2) {
                        const csa_idx ga = m0 + m;
                        CSA_V(g_micro2)(Af + ga * K + kc, Af + (ga + 1) * K + kc, bq, KC, kl, bk,
                                        BS, BS + q, NC, AS + ga * KB128 + kc / 128,
                                        AS + (ga + 1) * KB128 + kc / 128, C + m * NC + q, NC);
                    }
                    if (m < me) {
                        const csa_idx ga = m0 + m;
                        CSA_V(g_micro1)(Af + ga * K + kc, bq, KC, kl, bk, BS, BS + q, NC,
                                        AS + ga * KB128 + kc / 128, C + m * NC + q);
                    }
                }
            }
        }
        for (csa_idx m = 0; m < mb; m++)
            for (csa_idx r = 0; r < nr; r++) g_store(g, m0 + m, n0 + r, C[m * NC + r]);
    }
}

static int CSA_V(gemm_tuned)(const struct csa_gemm_args *g)
{
    const csa_idx M = g->M, N = g->N, K = g->K;
    const csa_idx KB128 = (K + 127) / 128;
    float *Af = malloc((size_t)(M * K) * sizeof *Af);
    float *AS = malloc((size_t)(M * KB128) * sizeof *AS);
    if (!Af || !AS) {
        free(Af);
        free(AS);
        return CSA_ENOMEM;
    }
    {
        const int nt = csa_threads(M, 1 + 65536 / K);
#pragma omp parallel for num_threads(nt) schedule(static)
        for (csa_idx m = 0; m < M; m++) {
            CSA_V(g_dec_a)(g->a + m * g->sa_row, Af + m * K, K);
            for (csa_idx j = 0; j < KB128; j++)
                AS[m * KB128 + j] = g_scale(g->as, g->as_fmt, m * g->sas_row + j * g->sas_col);
        }
    }
#if G_SIMD
    /* One activation row, K a multiple of 32 (e4m3: 16): the fused path. */
    if (M == 1 && K % 32 == 0) {
        /* e4m3: the 2^112 that meets g_w8's 2^-120; e2m1: the 1/2 that meets the
         * doubled table (both exact) */
        const float pre = g->b_fmt == CSA_W_E4M3 ? 0x1p112f : 0x1p118f;
        for (csa_idx k = 0; k < K; k++) Af[k] *= pre;
        const csa_idx nq = (N + 3) / 4;
        const int nt1 = csa_threads(nq, 64);
#pragma omp parallel for num_threads(nt1) schedule(dynamic, 16)
        for (csa_idx q = 0; q < nq; q++) {
            float res[4];
            const csa_idx n0 = 4 * q, nr = N - n0 < 4 ? N - n0 : 4;
            CSA_V(g_row1)(g, Af, AS, n0, nr, res);
            for (csa_idx r = 0; r < nr; r++) g_store(g, 0, n0 + r, res[r]);
        }
        free(Af);
        free(AS);
        return CSA_OK;
    }
#endif
    /* Decode shapes: panels of one quad of whole rows (the weight bytes are read in
     * address order, 4 rows = one contiguous run); prefill: 64 rows x G_KC columns. */
    const int small = M <= 16;
    const csa_idx NC = small ? 4 : G_NC_LARGE;
    const csa_idx KC = small ? (K <= G_KC_SMALL_MAX ? K : G_KC_SMALL_MAX) : G_KC;
    const csa_idx npan = (N + NC - 1) / NC;
    const csa_idx mb = M < G_MB ? M : G_MB;
    int fail = 0;
    const int nt = csa_threads(npan, small ? 16 : 1);
#pragma omp parallel num_threads(nt)
    {
        float *Bf = malloc((size_t)(NC * KC) * sizeof *Bf);
        float *BS = malloc((size_t)(NC * ((KC + 31) / 32)) * sizeof *BS);
        float *C = malloc((size_t)(mb * NC) * sizeof *C);
        const int ok = Bf && BS && C;
        if (!ok) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(static)
        for (csa_idx p = 0; p < npan; p++) {
            if (!ok) continue;
            const csa_idx n0 = p * NC;
            CSA_V(g_panel)(g, Af, AS, KB128, n0, N - n0 < NC ? N - n0 : NC, NC, KC, Bf, BS, C);
        }
        free(Bf);
        free(BS);
        free(C);
    }
    free(Af);
    free(AS);
    return fail ? CSA_ENOMEM : CSA_OK;
}

#undef G_SIMD
