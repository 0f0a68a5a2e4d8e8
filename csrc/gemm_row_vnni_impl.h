/* fp4_gemm of one activation row by exact int8 dot products (AVX512_VNNI VPDPBUSD, with
 * AVX512_VBMI byte permutes laying out the activation), and fp8_gemm of one row with
 * its codes decoded by VBMI byte permutes.
 *
 * Included by gemm_impl.h into its AVX-512 variant only, and reached when the run-time
 * level is avx512 or amx, the CPU has AVX512_VNNI and AVX512_VBMI (csa_cpu_features():
 * Intel Ice Lake and later, AMD Zen 4 and later) and the call qualifies
 * (CSA_V(gv_takes)).  The bits are the oracle's, as on every other path. */

#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni,avx512vbmi")

/* ---- one activation row (decode): exact int8 dot products in the oracle's lanes ----
 *
 * Every product of an e4m3 activation and an e2m1 weight is an integer multiple of
 * 2^-10 (the least, 2^-9 * 0.5), and a lane of the oracle adds four of them: at most
 * 4 * 448 * 6 < 2^14 in magnitude, so each lane sum is exact in float32 and equals the
 * integer sum of a_int * w2, a_int = |a| 2^9 (< 2^18) and w2 = +-2|w| (<= 12; the
 * activation's sign flips the weight's), times 2^-10.  VPDPBUSD adds four unsigned-byte
 * by signed-byte products into an int32 lane, and two of them (the lane shifted by 8
 * between) give the lane sum exactly:
 * - a_int = M 2^s with M <= 15 (the code's significand) and s <= 14.  The weight byte
 *   has room for w2 2^j, j <= 3 (12 * 8 < 128), and M 2^(s - j) is a byte for s - j <= 4;
 *   so one pass takes s = 0 .. 7 (byte M 2^min(s, 4), j = max(s - 4, 0)) and the other,
 *   counted 2^8 higher, s = 8 .. 14 (byte M 2^min(s - 8, 4), j = max(s - 12, 0)).  A
 *   column is in one pass, its byte zero in the other; its j rides with the weight
 *   code into a 64-entry byte table (VBMI VPERMB) that also applies the sign.  Byte
 *   splits of a_int (pass k = its byte k) need three passes: 6 dot products a 16-row
 *   block row, against 4 here.
 * The lane sums, converted to float32 (exact: < 2^24), then take the oracle's tree in
 * float32 and its scaled FMA, so the bits are the other levels' bits.  The lanes l[2t]
 * and l[2t + 1] share one int32 accumulator: their integer sum converted once is the
 * tree's first float32 add (both round to nearest-even the exact sum).  Against the
 * bf16 dot products this replaces (VDPBF16PS, 32 products in 2 cycles on the Xeon;
 * VPDPBUSD, 64 in 0.5-0.7): N = 2048, K = 4096, e8m0 scales, Intel Xeon (AMX), 2
 * threads, 0.295 -> 0.135 ms with three passes.  Two passes, on AMD EPYC (Zen 4), 2
 * threads, interleaved in one process: 0.173 -> 0.156 ms; with the four 4-row quads
 * unrolled (the W's stay in registers now that the activation takes 6, not 8) 0.147;
 * with the scales' gather issued before the rows (its latency was exposed) 0.134.
 *
 * A zmm holds 64 bytes of one weight row: 4 blocks of 32 codes (one 128-bit lane each).
 * A byte shuffle puts bytes t, t + 4, t + 8, t + 12 of each block into dword t, so that
 * the low nibbles of dword t are the block's elements 2t + 8q (q < 4: the oracle's lane
 * 2t) and the high nibbles 2t + 1 + 8q (lane 2t + 1).  Each nibble, with its column's
 * sign and j (bits 3 and 4-5 of a byte laid out to match), indexes the table; the
 * activation bytes are laid out the same way (act: per 128 columns, 6 registers: the
 * low pass's bytes, the high pass's bytes and the sign/j bytes for the low nibbles,
 * then the same for the high ones).  Sixteen rows a task; the tree's first level is
 * the conversion above, its other two levels are shuffles that also gather the rows,
 * four at a time, so that the FMAs into the 16 rows' accumulators run a block at a time
 * down one vector. */
#define GV_ACT_REGS 6 /* activation registers per 128 columns */

/* The activation row as gv_fp4_row16 reads it: per 128 columns g, 6 x 64 bytes
 * act[g][reg][b * 16 + t * 4 + q] for column k = 128 g + 32 b + 2 t + 8 q (+ 1 for the
 * high-nibble registers 3-5); regs 0 / 3: the low pass's byte, 1 / 4: the high pass's,
 * 2 / 5: 0x08 where a is negative, or'ed with j << 4.  Columns past K are zero (their
 * weight bytes are loaded as zero).  Two-source byte permutes place the codes and look
 * their bytes up in 128-entry tables (the scalar loop took half of a 16 x 4096 call). */
static void CSA_V(gv_act16)(const struct csa_gemm_args *g, uint8_t *act)
{
    const csa_idx K = g->K, ng = (K + 127) / 128;
    uint8_t tab[3][128]; /* |e4m3 code v|: low pass byte, high pass byte, j << 4; v < 128 */
    for (int v = 0; v < 128; v++) {
        const int e = v >> 3, M = e ? 8 + (v & 7) : v & 7, s = e ? e - 1 : 0;
#ifndef CSA_MUTANT_GEMM_VNNI_PASS
        const int hi = s >= 8, sp = hi ? s - 8 : s, j = sp > 4 ? sp - 4 : 0;
#else /* planted (make mutants): one shift too few in the weight, so the byte of a
       * column with s = 5 .. 7 or 13, 14 wraps */
        const int hi = s >= 8, sp = hi ? s - 8 : s, j = sp > 5 ? sp - 5 : 0;
#endif
        tab[0][v] = hi ? 0 : (uint8_t)(M << (sp - j));
        tab[1][v] = hi ? (uint8_t)(M << (sp - j)) : 0;
        tab[2][v] = (uint8_t)(j << 4);
    }
    __m512i T[3][2];
    for (int i = 0; i < 3; i++) {
        T[i][0] = _mm512_loadu_si512(tab[i]);
        T[i][1] = _mm512_loadu_si512(tab[i] + 64);
    }
    uint8_t ix[64];
    for (int p = 0; p < 64; p++) ix[p] = (uint8_t)(32 * (p / 16) + 2 * (p / 4 % 4) + 8 * (p % 4));
    const __m512i idx_lo = _mm512_loadu_si512(ix);
    const __m512i idx_hi = _mm512_add_epi8(idx_lo, _mm512_set1_epi8(1));
    const __m512i m7f = _mm512_set1_epi8(0x7f), m08 = _mm512_set1_epi8(0x08);
    for (csa_idx gi = 0; gi < ng; gi++) {
        const csa_idx k0 = 128 * gi, left = K - k0;
        const __mmask64 m0 = left >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << left) - 1;
        const __mmask64 m1 = left >= 128 ? ~(__mmask64)0
                             : left <= 64 ? 0 : ((__mmask64)1 << (left - 64)) - 1;
        const __m512i v0 = _mm512_maskz_loadu_epi8(m0, g->a + k0);
        const __m512i v1 = _mm512_maskz_loadu_epi8(m1, g->a + k0 + 64);
        uint8_t *dst = act + gi * GV_ACT_REGS * 64;
        for (int h = 0; h < 2; h++) {
            const __m512i c = _mm512_permutex2var_epi8(v0, h ? idx_hi : idx_lo, v1);
            const __m512i mag = _mm512_and_si512(c, m7f);
            for (int i = 0; i < 2; i++)
                _mm512_storeu_si512(dst + (3 * h + i) * 64, _mm512_permutex2var_epi8(T[i][0], mag, T[i][1]));
            _mm512_storeu_si512(dst + (3 * h + 2) * 64,
                                _mm512_or_si512(_mm512_permutex2var_epi8(T[2][0], mag, T[2][1]),
                                                _mm512_and_si512(_mm512_srli_epi16(c, 4), m08)));
        }
    }
}

/* One activation row against 16 weight rows n0 .. n0 + 15 (rows past nr repeat the last
 * one, their results dropped): res[r] = the oracle's C[0, n0 + r]. */
static void CSA_V(gv_fp4_row16)(const struct csa_gemm_args *g, const void *actv, const float *as,
                            csa_idx n0, csa_idx nr, float *sbt, float *res)
{
    const uint8_t *act = actv;
    const csa_idx K = g->K, nb = K / 32, ng = (K + 127) / 128;
    const uint8_t *rp[16];
    for (int r = 0; r < 16; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    const int e8 = g->bs_fmt == CSA_S_E8M0;
    const uint8_t *sb8 = (const uint8_t *)sbt;
    /* The 16 rows' scales of a block, one a lane: gathered straight from the scale rows
     * (e8m0 with unit column stride: the 4 bytes of a whole group in one dword gather,
     * never past the rows' ends; float32: a gather per block).  Transposing them into
     * sbt first cost a quarter of the time (2048 x 4096, one thread: 0.37 -> 0.27 ms
     * without it).  Other strides, or offsets beyond int32, take the transposition. */
    const csa_idx esz = e8 ? 1 : 4;
    const int gat = (!e8 || g->sbs_col == 1) && 15 * g->sbs_row * esz <= INT32_MAX &&
                    g->sbs_col * esz * nb <= INT32_MAX;
    __m512i vidx = _mm512_setzero_si512();
    const uint8_t *sbase = (const uint8_t *)g->bs + n0 * g->sbs_row * esz;
    if (gat) {
        int32_t ix[16];
        for (int r = 0; r < 16; r++) ix[r] = (int32_t)((r < nr ? r : nr - 1) * g->sbs_row * esz);
        vidx = _mm512_loadu_si512(ix);
    } else {
        CSA_V(g_rows_scales)(g, n0, nr, 16, sbt);
    }
    /* dword t of each block <- its bytes t, t + 4, t + 8, t + 12 */
#ifndef CSA_MUTANT_GEMM_VNNI_ORDER
    const __m512i gather = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
#else /* planted (make mutants): the block's bytes left in place, so a dword holds
       * elements of four different lanes of the oracle */
    const __m512i gather = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
#endif
    /* byte j << 4 | sign << 3 | e2m1 magnitude -> +-2 |w| 2^j as a signed byte (a constant:
     * built by a loop, it ran once per 16-row task) */
    static const int8_t wt[64] = {
        0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
        0, 2, 4, 6, 8, 12, 16, 24, 0, -2, -4, -6, -8, -12, -16, -24,
        0, 4, 8, 12, 16, 24, 32, 48, 0, -4, -8, -12, -16, -24, -32, -48,
        0, 8, 16, 24, 32, 48, 64, 96, 0, -8, -16, -24, -32, -48, -64, -96,
    };
    const __m512i wtab = _mm512_loadu_si512(wt);
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i z = _mm512_setzero_si512(), ff = _mm512_set1_epi32(0xff);
    const __m512i qbit = _mm512_set1_epi32(0x00400000), m_ff8 = _mm512_set1_epi8((char)0xff);
    /* Weights that come from memory (a model's experts, each read once a token): the
     * rows and the scale rows of the task two ahead into L2, the scales here, the rows
     * a line a group below.  AMD EPYC (Zen 4), 2 threads, interleaved in one process,
     * cycling through 24-40 weights of 4-8 MiB: N = 4096, K = 4096 0.65-0.72 -> 0.43-0.47
     * ms; N = 4096, K = 2048 0.45-0.47 -> 0.23-0.24; N = 2048, K = 4096 0.33 -> 0.22
     * (rows alone: 0.49-0.54, 0.23-0.26, 0.25); one task ahead within noise. */
    const csa_idx pfr = n0 + 32 < g->N ? 32 * g->sb_row : 0;
    for (int r = 0; r < 16 && n0 + 32 + r < g->N; r++) {
        const uint8_t *sr = (const uint8_t *)g->bs + (n0 + 32 + r) * g->sbs_row * esz;
        for (csa_idx off = 0; off < nb * g->sbs_col * esz; off += 64)
            _mm_prefetch((const char *)(sr + off), _MM_HINT_T1);
    }
    __m512 c = _mm512_setzero_ps();
    for (csa_idx gi = 0; gi < ng; gi++) {
        const uint8_t *A = act + gi * GV_ACT_REGS * 64;
        const __m512i Lol = _mm512_loadu_si512(A), Hil = _mm512_loadu_si512(A + 64);
        const __m512i Sl = _mm512_loadu_si512(A + 128), Loh = _mm512_loadu_si512(A + 192);
        const __m512i Hih = _mm512_loadu_si512(A + 256), Sh = _mm512_loadu_si512(A + 320);
        const csa_idx nbg = nb - 4 * gi < 4 ? nb - 4 * gi : 4; /* blocks in this group */
        const __mmask64 lm = nbg == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * nbg)) - 1;
        __m512i sg = _mm512_setzero_si512(); /* e8m0, gathered: block b in byte b; first,
                                              * so that its loads overlap the rows' work */
        if (e8 && gat) {
            if (nbg == 4) {
                sg = _mm512_i32gather_epi32(vidx, sbase + 4 * gi, 1);
            } else {
                uint32_t v[16] = {0};
                for (int r = 0; r < 16; r++)
                    for (csa_idx b = 0; b < nbg; b++)
                        v[r] |= (uint32_t)sbase[(r < nr ? r : nr - 1) * g->sbs_row + 4 * gi + b] << (8 * b);
                sg = _mm512_loadu_si512(v);
            }
        }
        __m512 W[4];
#pragma GCC unroll 4 /* see the measurement above */
        for (int qd = 0; qd < 4; qd++) {
            __m512 X[4];
            for (int rr = 0; rr < 4; rr++) {
                const uint8_t *src = rp[4 * qd + rr] + 64 * gi;
                /* two groups ahead in the row (2048 x 4096, 2 threads: 0.167 ms with the
                 * next task's rows prefetched instead, 0.151 with this; 1 or 4 ahead: 0.17
                 * / 0.156; the hardware prefetchers do not keep 16 rows' streams ahead) */
                _mm_prefetch((const char *)(src + 128), _MM_HINT_T0);
                if (pfr) _mm_prefetch((const char *)(src + pfr), _MM_HINT_T1);
                const __m512i x = _mm512_shuffle_epi8(_mm512_maskz_loadu_epi8(lm, src), gather);
                /* (nibble & 15) ^ (sign | j << 4), then the table */
                const __m512i lo = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(x, m0f, Sl, 0x6a), wtab);
                const __m512i hi = _mm512_permutexvar_epi8(
                    _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 4), m0f, Sh, 0x6a), wtab);
                /* lane (b, t): the integer l[2t] + l[2t + 1] of block b (times 2^10; < 2^25),
                 * one conversion rounding it as the tree's first float32 add would */
                __m512i s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, Hil, lo), Hih, hi);
                s2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(s2, 8), Lol, lo), Loh, hi);
                X[rr] = _mm512_cvtepi32_ps(s2);
            }
            /* per block: (X0 + X1, X2 + X3) of rows 0, 1 (and 2, 3), then their sum in
             * lane rr -- the tree's second and third levels */
            const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(X[0], X[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_ps(X[0], X[1], _MM_SHUFFLE(3, 1, 3, 1)));
            const __m512 u23 = _mm512_add_ps(_mm512_shuffle_ps(X[2], X[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_ps(X[2], X[3], _MM_SHUFFLE(3, 1, 3, 1)));
            W[qd] = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
        }
        /* W[qd] lane (b, rr) -> P[b] lane 4 qd + rr: block b's sums of the 16 rows */
        const __m512 L01 = _mm512_shuffle_f32x4(W[0], W[1], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 H01 = _mm512_shuffle_f32x4(W[0], W[1], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 L23 = _mm512_shuffle_f32x4(W[2], W[3], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 H23 = _mm512_shuffle_f32x4(W[2], W[3], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 P[4] = {_mm512_shuffle_f32x4(L01, L23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(L01, L23, _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(H01, H23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(H01, H23, _MM_SHUFFLE(3, 1, 3, 1))};
        const __m512 sa = _mm512_set1_ps(as[gi]);
        /* Gathered e8m0 scales none of which is 0 or 0xff (the usual group): each is v << 23
         * straight from its byte, a shift and a mask where the general decode below takes
         * six instructions (N = 2048, K = 4096, AMD EPYC Zen 4, 2 threads, interleaved:
         * 0.159 -> 0.151 ms; the test of special codes and strides takes the general one) */
        const __mmask64 odd = _mm512_cmpeq_epi8_mask(sg, z) | _mm512_cmpeq_epi8_mask(sg, m_ff8);
        if (e8 && gat && nbg == 4 && !odd) {
            const __m512i em = _mm512_set1_epi32(0x7f800000);
            const __m512i sbs[4] = {_mm512_and_si512(_mm512_slli_epi32(sg, 23), em),
                                    _mm512_and_si512(_mm512_slli_epi32(sg, 15), em),
                                    _mm512_and_si512(_mm512_slli_epi32(sg, 7), em),
                                    _mm512_and_si512(_mm512_srli_epi32(sg, 1), em)};
            for (int b = 0; b < 4; b++)
                c = _mm512_fmadd_ps(_mm512_mul_ps(P[b], _mm512_set1_ps(0x1p-10f)),
                                    _mm512_mul_ps(sa, _mm512_castsi512_ps(sbs[b])), c);
            continue;
        }
        for (csa_idx b = 0; b < nbg; b++) {
            const csa_idx j = 4 * gi + b;
            __m512 sb;
            if (e8) {
                /* e8m0: v << 23, and 0x00400000 for 0 (2^-127) and 0xff (NaN), as g_e8m0 */
                const __m512i x = gat ? _mm512_and_si512(_mm512_srli_epi32(sg, (unsigned)(8 * b)), ff)
                                      : _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb8 + 16 * j)));
                const __mmask16 fix = _mm512_cmpeq_epi32_mask(x, z) | _mm512_cmpeq_epi32_mask(x, ff);
                sb = _mm512_castsi512_ps(_mm512_mask_or_epi32(_mm512_slli_epi32(x, 23), fix,
                                                              _mm512_slli_epi32(x, 23), qbit));
            } else {
                sb = gat ? _mm512_i32gather_ps(vidx, sbase + j * g->sbs_col * 4, 1)
                         : _mm512_loadu_ps(sbt + 16 * j);
            }
            c = _mm512_fmadd_ps(_mm512_mul_ps(P[b], _mm512_set1_ps(0x1p-10f)), _mm512_mul_ps(sa, sb), c);
        }
    }
    _mm512_storeu_ps(res, c);
}

/* The job of fp4_gemm with one activation row (K a multiple of 32, no NaN code in it):
 * the activation laid out by gv_act16.  CSA_OK, or CSA_ENOMEM. */
static int CSA_V(gv_prepare_fp4)(const struct csa_gemm_args *g, struct CSA_V(g_job) *jb)
{
    const csa_idx K = g->K, ng = (K + 127) / 128;
    uint8_t *act = malloc((size_t)(ng * GV_ACT_REGS * 64));
    float *as = malloc((size_t)ng * sizeof *as);
    if (!act || !as) {
        free(act);
        free(as);
        return CSA_ENOMEM;
    }
    CSA_V(gv_act16)(g, act);
    for (csa_idx j = 0; j < ng; j++) as[j] = g_scale(g->as, g->as_fmt, j * g->sas_col);
    *jb = (struct CSA_V(g_job)){g, CSA_V(gv_fp4_row16), 16, act, as};
    return CSA_OK;
}
#undef GV_ACT_REGS

/* ---- fp8_gemm, one activation row: the oracle's float32 lanes, 16 products an FMA ----
 *
 * e4m3 x e4m3 products are exact in float32, so the lane sums are the oracle's own
 * float32 FMAs in its order, as in g_row1; what this path changes is the decode, which
 * bounds g_row1 on AVX-512 CPUs (docs/kernels.md section 9):
 * - A vector lane is (weight row, oracle lane j): rows 2p and 2p + 1 of the task share
 *   a register, 32 columns of each.  One byte permute (VBMI) puts the codes of two
 *   consecutive steps of lane j (columns 8s + j and 8s + 8 + j) at the top of the low
 *   and the high 16-bit half of the lane, an arithmetic 16-bit shift by 4 spreads sign
 *   and magnitude, and a mask (after a 32-bit shift for the low half) leaves 2^-120
 *   times each value as a float32 (g_w16's encoding).  The activation holds 2^112
 *   times its values, so each FMA adds the oracle's product a * b / 256, step s then
 *   step s + 1: 16 products for about 2.5 instructions besides the FMA (g_w16: 8 for
 *   about 3).
 * - 8 rows a task, read together 32 columns at a time, prefetched as G_PF_L1 and
 *   G_PF_TASKS say (gemm.c); the tree's first two levels are shuffles across the 4 pair
 *   registers, its last the two 128-bit halves of each row.
 * NaN weight codes are noted by a running byte maximum; a block that has one is redone
 * by the scalar loop. */
/* Rows pa, pb: 32 bytes of each, pa's in the low half (with the prefetches of gemm.c's
 * G_PF_L1 / G_PF_TASKS once a 64-byte line, when pf). */
static inline __attribute__((always_inline)) __m512i CSA_V(gv_pair)(const uint8_t *pa, const uint8_t *pb,
                                                                   int pf, csa_idx pfd2)
{
    if (pf) {
        _mm_prefetch((const char *)(pa + G_PF_L1), _MM_HINT_T0);
        _mm_prefetch((const char *)(pb + G_PF_L1), _MM_HINT_T0);
        _mm_prefetch((const char *)(pa + pfd2), _MM_HINT_T1);
        _mm_prefetch((const char *)(pb + pfd2), _MM_HINT_T1);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)pa)),
                              _mm256_loadu_si256((const __m256i *)pb), 1);
}

/* The oracle's tree, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), of the 8 rows
 * whose lanes acc[p] holds (128-bit chunk c of acc[p]: lanes 4 (c & 1) .. + 3 of row
 * 2p + c / 2): rows 0, 2, 4, 6 in lanes 0-3 of the result, rows 1, 3, 5, 7 in 8-11. */
static inline __attribute__((always_inline)) __m512 CSA_V(gv_tree8)(const __m512 acc[4])
{
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_ps(acc[2], acc[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(acc[2], acc[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}

/* The 8 rows' results: rows 0, 2, 4, 6 in c0, rows 1, 3, 5, 7 in c1. */
static inline __attribute__((always_inline)) void CSA_V(gv_store8)(__m128 c0, __m128 c1, float *res)
{
    _mm_storeu_ps(res, _mm_unpacklo_ps(c0, c1));
    _mm_storeu_ps(res + 4, _mm_unpackhi_ps(c0, c1));
}

static void CSA_V(gv_fp8_row8)(const struct csa_gemm_args *g, const void *actv, const float *as,
                               csa_idx n0, csa_idx nr, float *sbt, float *res)
{
    (void)sbt;
    const float *af = actv;
    const csa_idx K = g->K;
    const uint8_t *rp[8];
    for (int r = 0; r < 8; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    /* lane l: row 2p + l / 8 of the pair, oracle lane l % 8; byte 1 <- step 2h, byte 3 <-
     * step 2h + 1 of the 32 columns */
    uint8_t jx[2][64];
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 16; l++) {
            jx[h][4 * l] = jx[h][4 * l + 2] = 0;
            jx[h][4 * l + 1] = (uint8_t)((l < 8 ? 0 : 32) + 16 * h + (l & 7));
            jx[h][4 * l + 3] = (uint8_t)((l < 8 ? 0 : 32) + 16 * h + 8 + (l & 7));
        }
    const __m512i J0 = _mm512_loadu_si512(jx[0]), J1 = _mm512_loadu_si512(jx[1]);
    const __m512i M = _mm512_set1_epi32((int)0x87f00000u), s7 = _mm512_set1_epi8(0x7f);
    const csa_idx pfd2 = G_PF_TASKS * 8 * g->sb_row;
    __m128 c0 = _mm_setzero_ps(), c1 = _mm_setzero_ps();
    for (csa_idx k0 = 0, j = 0; k0 < K; k0 += 128, j++) {
        const csa_idx k1 = K - k0 < 128 ? K : k0 + 128;
        __m512 acc[4];
        for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
        __m512i mx = _mm512_setzero_si512();
        for (csa_idx k = k0; k < k1; k += 32) {
            const __m512 x0 = _mm512_broadcast_f32x8(_mm256_loadu_ps(af + k));
            const __m512 x1 = _mm512_broadcast_f32x8(_mm256_loadu_ps(af + k + 8));
            const __m512 x2 = _mm512_broadcast_f32x8(_mm256_loadu_ps(af + k + 16));
            const __m512 x3 = _mm512_broadcast_f32x8(_mm256_loadu_ps(af + k + 24));
            for (int p = 0; p < 4; p++) {
                const __m512i Z = CSA_V(gv_pair)(rp[2 * p] + k, rp[2 * p + 1] + k, !(k & 32), pfd2);
                mx = _mm512_max_epu8(mx, _mm512_and_si512(Z, s7));
                const __m512i q0 = _mm512_srai_epi16(_mm512_permutexvar_epi8(J0, Z), 4);
                const __m512i q1 = _mm512_srai_epi16(_mm512_permutexvar_epi8(J1, Z), 4);
                __m512 a = acc[p];
                a = _mm512_fmadd_ps(x0, _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(q0, 16), M)), a);
                a = _mm512_fmadd_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(q0, M)), a);
                a = _mm512_fmadd_ps(x2, _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(q1, 16), M)), a);
                a = _mm512_fmadd_ps(x3, _mm512_castsi512_ps(_mm512_and_si512(q1, M)), a);
                acc[p] = a;
            }
        }
        __m128 p0, p1; /* rows 0, 2, 4, 6 and 1, 3, 5, 7 */
        if (__builtin_expect(_mm512_cmpeq_epi8_mask(mx, s7) != 0, 0)) {
            float pr[8];
            for (int r = 0; r < 8; r++) pr[r] = CSA_V(g_e4m3_block)(af, rp[r], k0, k1);
            p0 = _mm_setr_ps(pr[0], pr[2], pr[4], pr[6]);
            p1 = _mm_setr_ps(pr[1], pr[3], pr[5], pr[7]);
        } else {
            const __m512 w = CSA_V(gv_tree8)(acc);
            p0 = _mm512_castps512_ps128(w);
            p1 = _mm512_extractf32x4_ps(w, 2);
        }
        /* one weight scale per 128 rows: n0 is a multiple of 8 */
        const __m128 s = _mm_set1_ps(as[j] * g_bscale(g, n0, j));
        c0 = _mm_fmadd_ps(p0, s, c0);
        c1 = _mm_fmadd_ps(p1, s, c1);
    }
    CSA_V(gv_store8)(c0, c1, res);
}

CSA_TARGET_POP
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni,avx512vbmi,avx512bf16")

/* ---- fp8_gemm, one activation row, by bf16 dot products in the oracle's order ----
 *
 * VDPBF16PS adds two products into a float32 lane, the odd (high) element's first, each
 * addition rounded to nearest-even (Intel's definition; gv_dp_in_order checks it on the
 * CPU at hand, and the path is not taken where it fails).  Every e4m3 value is a bf16
 * value and the product of two is exact in float32, so one instruction does two of the
 * oracle's FMA steps in its order when a lane's high word holds step s and its low word
 * step s + 1 (columns 8s + j and 8s + 8 + j of oracle lane j).  DAZ / FTZ never act:
 * the codes become bf16 by table (subnormal e4m3 codes are normal bf16 values), the
 * activation is held times 2^-8 (its least, 2^-17, is normal) and every partial sum is
 * a multiple of 2^-26.  A NaN code looks up a bf16 NaN, which the lane carries as the
 * oracle's FMAs do, so no NaN test.  Per 64 products: two table lookups (two-source
 * byte permutes, 128 entries, the code's sign bit ignored), the sign or'ed in, two
 * permutes that interleave the bytes into bf16 words in the oracle's lane order, and
 * two VDPBF16PS -- 6 instructions against the float32 decode's 16 (gv_fp8_row8).  Lanes,
 * rows, prefetches and the tree are gv_fp8_row8's.  AMD EPYC (Zen 4), 2 threads,
 * interleaved in one process, against gv_fp8_row8: N = 32768, K = 1024 1.14 -> 0.84 ms;
 * N = 4096, K = 4096 0.74 -> 0.61; N = 2048, K = 7168 0.48 -> 0.37; N = 1024, K = 4096
 * 0.17 -> 0.16 (with the tables built in each task instead of once a call, K = 1024 was
 * 0.94x of gv_fp8_row8). */

/* What gv_fp8_row8_dp reads, laid out once a call (built in each 8-row task, the
 * tables took about a third of an N = 32768, K = 1024 call): */
struct gv_dp_act {
    /* the bf16 of e4m3 code v < 128: low byte, high byte (the sign bit is or'ed in after) */
    uint8_t tlo[128], thi[128];
    /* Z = 32 bytes of row 2p, then 32 of row 2p + 1.  Byte i of W0 / W1 (h = 0 / 1; word
     * w = i / 2, dword L = w / 2: row 2p + L / 8, oracle lane j = L % 8) takes its low byte
     * from the tlo lookup (index < 64), its high byte from the thi one (64 + ...); odd
     * words step s (column 16 h + j), even words step s + 1 (column 16 h + 8 + j). */
    uint8_t ix[2][64];
    /* per 32 columns, two runs of 8 dwords: dword j = (low word: the bf16 of a[8 + j]
     * 2^-8, high word: of a[j] 2^-8), then the same for a[24 + j], a[16 + j] */
    uint16_t a[];
};

static void CSA_V(gv_act_dp)(const struct csa_gemm_args *g, struct gv_dp_act *t)
{
    for (int v = 0; v < 128; v++) {
        const float f = g_e4m3((uint8_t)v);
        uint32_t u;
        memcpy(&u, &f, 4);
        t->tlo[v] = (uint8_t)(u >> 16);
        t->thi[v] = (uint8_t)(u >> 24);
    }
    for (int h = 0; h < 2; h++)
        for (int L = 0; L < 16; L++)
            for (int odd = 0; odd < 2; odd++) {
#ifndef CSA_MUTANT_GEMM_DP_ORDER
                const int col = 32 * (L / 8) + 16 * h + (odd ? 0 : 8) + L % 8;
#else /* planted (make mutants): the pair's two steps swapped (the activation too), so
       * each instruction adds step s + 1 before step s */
                const int col = 32 * (L / 8) + 16 * h + (odd ? 8 : 0) + L % 8;
#endif
                t->ix[h][4 * L + 2 * odd] = (uint8_t)col;
                t->ix[h][4 * L + 2 * odd + 1] = (uint8_t)(64 + col);
            }
    for (csa_idx k0 = 0; k0 < g->K; k0 += 32)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 8; j++) {
                uint32_t lo, hi;
#ifndef CSA_MUTANT_GEMM_DP_ORDER
                const float flo = g_e4m3(g->a[k0 + 16 * h + 8 + j]) * 0x1p-8f;
                const float fhi = g_e4m3(g->a[k0 + 16 * h + j]) * 0x1p-8f;
#else
                const float flo = g_e4m3(g->a[k0 + 16 * h + j]) * 0x1p-8f;
                const float fhi = g_e4m3(g->a[k0 + 16 * h + 8 + j]) * 0x1p-8f;
#endif
                memcpy(&lo, &flo, 4);
                memcpy(&hi, &fhi, 4);
                t->a[k0 + 16 * h + 2 * j] = (uint16_t)(lo >> 16); /* exact: e4m3 */
                t->a[k0 + 16 * h + 2 * j + 1] = (uint16_t)(hi >> 16);
            }
}

static void CSA_V(gv_fp8_row8_dp)(const struct csa_gemm_args *g, const void *actv, const float *as,
                                  csa_idx n0, csa_idx nr, float *sbt, float *res)
{
    (void)sbt;
    const struct gv_dp_act *t = actv;
    const uint16_t *ab = t->a;
    const csa_idx K = g->K;
    const uint8_t *rp[8];
    for (int r = 0; r < 8; r++) rp[r] = g->b + (n0 + (r < nr ? r : nr - 1)) * g->sb_row;
    const __m512i TL0 = _mm512_loadu_si512(t->tlo), TL1 = _mm512_loadu_si512(t->tlo + 64);
    const __m512i TH0 = _mm512_loadu_si512(t->thi), TH1 = _mm512_loadu_si512(t->thi + 64);
    const __m512i I0 = _mm512_loadu_si512(t->ix[0]), I1 = _mm512_loadu_si512(t->ix[1]);
    const __m512i m80 = _mm512_set1_epi8((char)0x80);
    const csa_idx pfd2 = G_PF_TASKS * 8 * g->sb_row; /* as gv_fp8_row8 */
    __m128 c0 = _mm_setzero_ps(), c1 = _mm_setzero_ps();
    for (csa_idx k0 = 0, j = 0; k0 < K; k0 += 128, j++) {
        const csa_idx k1 = K - k0 < 128 ? K : k0 + 128;
        __m512 acc[4];
        for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
        for (csa_idx k = k0; k < k1; k += 32) {
            const __m512bh x0 = (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ab + k)));
            const __m512bh x1 = (__m512bh)_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ab + k + 16)));
            for (int p = 0; p < 4; p++) {
                const __m512i Z = CSA_V(gv_pair)(rp[2 * p] + k, rp[2 * p + 1] + k, !(k & 32), pfd2);
                const __m512i L = _mm512_permutex2var_epi8(TL0, Z, TL1);
                const __m512i H = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(TH0, Z, TH1), Z, m80, 0xf8);
                acc[p] = _mm512_dpbf16_ps(acc[p], (__m512bh)_mm512_permutex2var_epi8(L, I0, H), x0);
                acc[p] = _mm512_dpbf16_ps(acc[p], (__m512bh)_mm512_permutex2var_epi8(L, I1, H), x1);
            }
        }
        const __m512 w = CSA_V(gv_tree8)(acc);
        const __m128 s = _mm_set1_ps(as[j] * g_bscale(g, n0, j));
        c0 = _mm_fmadd_ps(_mm512_castps512_ps128(w), s, c0);
        c1 = _mm_fmadd_ps(_mm512_extractf32x4_ps(w, 2), s, c1);
    }
    CSA_V(gv_store8)(c0, c1, res);
}

/* 1 when VDPBF16PS adds its two products as Intel defines it (high element first, each
 * addition rounded), 0 otherwise; measured once.  Two cases decide: 1 + 2^-24 + 2^-24
 * is 1 with each addition rounded (1 + 2^-23 fused), and (1 - 1) + 2^-30 is 2^-30 with
 * the high element first (0 low first). */
static int CSA_V(gv_dp_in_order)(void)
{
    static int known = -1;
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        /* bf16 words (low, high): case 0: 2^-12 * 2^-12 twice onto 1; case 1: (2^-15 *
         * 2^-15 low, -1 * 1 high) onto 1 */
        uint16_t x[32] = {0}, y[32] = {0};
        x[0] = 0x3980; x[1] = 0x3980; y[0] = 0x3980; y[1] = 0x3980;  /* 2^-12 */
        x[2] = 0x3800; x[3] = 0xbf80; y[2] = 0x3800; y[3] = 0x3f80;  /* 2^-15, -1 / 1 */
        float r[16];
        _mm512_storeu_ps(r, _mm512_dpbf16_ps(_mm512_set1_ps(1.0f), (__m512bh)_mm512_loadu_si512(x),
                                             (__m512bh)_mm512_loadu_si512(y)));
        v = r[0] == 1.0f && r[1] == 0x1p-30f;
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}

CSA_TARGET_POP
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni,avx512vbmi")

/* The job of fp8_gemm with one activation row (K a multiple of 32): the bf16 dot
 * products' tables and activation where they add in the oracle's order, else the
 * float32 activation (times 2^112, g_w16's scale).  CSA_OK, or CSA_ENOMEM. */
static int CSA_V(gv_prepare_fp8)(const struct csa_gemm_args *g, struct CSA_V(g_job) *jb)
{
    const csa_idx K = g->K, nb = (K + 127) / 128;
    float *afr = malloc(sizeof(struct gv_dp_act) + (size_t)K * sizeof *afr);
    float *as = malloc((size_t)nb * sizeof *as);
    if (!afr || !as) {
        free(afr);
        free(as);
        return CSA_ENOMEM;
    }
    for (csa_idx j = 0; j < nb; j++) as[j] = g_scale(g->as, g->as_fmt, j * g->sas_col);
    if ((csa_cpu_features() & CSA_CPU_BF16) && CSA_V(gv_dp_in_order)()) {
        CSA_V(gv_act_dp)(g, (struct gv_dp_act *)afr);
        *jb = (struct CSA_V(g_job)){g, CSA_V(gv_fp8_row8_dp), 8, afr, as};
    } else {
        for (csa_idx k = 0; k < K; k++) afr[k] = g_e4m3(g->a[k]) * 0x1p112f;
        *jb = (struct CSA_V(g_job)){g, CSA_V(gv_fp8_row8), 8, afr, as};
    }
    return CSA_OK;
}

/* Which one-row path computes this call: 1 FP4 weights (int8 dot products; not when an
 * activation code is NaN: the float32 path), 2 FP8 weights, 0 neither (one activation
 * row and K a multiple of 32 for both). */
static int CSA_V(gv_takes)(const struct csa_gemm_args *g)
{
    if (g->M != 1 || g->K % 32) return 0;
    if (g->b_fmt == CSA_W_E4M3) return 2;
    const __m512i m7f = _mm512_set1_epi8(0x7f);
    for (csa_idx k = 0; k < g->K; k += 64) {
        const __mmask64 m = g->K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (g->K - k)) - 1;
        const __m512i x = _mm512_and_si512(_mm512_maskz_loadu_epi8(m, g->a + k), m7f);
        if (_mm512_mask_cmpeq_epi8_mask(m, x, m7f)) return 0;
    }
    return 1;
}

CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
