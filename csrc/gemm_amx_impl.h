/* fp8_gemm / fp4_gemm prefill as one bf16 GEMM: on AMX-BF16 tiles (ISA level amx) or by
 * AVX512_BF16 dot products (level avx512 on CPUs with AVX512_BF16 and no tiles, e.g. AMD
 * Zen 4).  The one-row paths are gemm_row_vnni_impl.h.
 *
 * Included by gemm_impl.h into its AVX-512 variant only, and reached only when the
 * run-time level is amx, or avx512 with csa_cpu_features() & CSA_CPU_BF16, and the call
 * qualifies (CSA_V(ga_ok)): FP4 weights
 * with e8m0 scales or FP8 weights with power-of-two scales, activations whose scales are
 * powers of two (e8m0, or float32 with an empty
 * mantissa -- what the released act_quant gives with scale_fmt set, as V4 runs it), more
 * than 16 activation rows, K a multiple of 128 (at most 2^20), and every scale exponent
 * within [-GA_EMAX, GA_EMAX].  The functions carry the tile target, but only
 * gemm_bf16's tiles = 1 branch executes a tile instruction.
 *
 * Then every scale is folded into its operand exactly: e4m3 and e2m1 values are bf16
 * values, and so are they times a power of two as long as the result stays a normal
 * bf16 -- the exponent bound guarantees that, and that every product a * sa * w * sb
 * (exact in float32) and every partial sum is normal and finite, so the tiles' DAZ / FTZ
 * never change a value.  The whole GEMM is then one bf16 tile GEMM with float32
 * accumulation, C = (A * sa) (B * sb)^T, rounded once at the store as the other levels.
 *
 * The products are the oracle's; only the order of the float32 additions differs (the
 * oracle sums each 32-block in eight lanes and a tree, scales it and adds it; here
 * TDPBF16PS or VDPBF16PS accumulates pairs of k), so the bits differ from the other
 * levels by float32 rounding: |C - oracle| <= 2 K 2^-24 sum_k |a sa w sb| (docs/kernels.md
 * section 9).  They do not depend on the thread count: each output element is one tile
 * chain over k in increasing order, whatever thread computes it.
 *
 * Layout: the activations are decoded once to bf16 in tile blocks (Ab: each A tile, 16
 * rows x 32 values of one k-step, 1 KiB contiguous; Mp = M rounded up to GA_MB rows, pad
 * rows zero).  Each task takes a panel of GA_NP weight rows and decodes it into Bp, the
 * pairs (w[n, 2i], w[n, 2i + 1]) as 32-bit words in 16-column blocks [GA_NP / 16][K / 2][16]
 * (each B tile 1 KiB contiguous; 1 MiB at K = 4096: it stays in L2 while every activation
 * row block sweeps it).  Tiles: 0-3 a 2 x 2 block of 16 x 16 results, 4-5 A (two 16-row slices),
 * 6-7 B (two 16-column slices). */

#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")

#define GA_NP 128  /* weight rows per panel */
#define GA_MB 32   /* activation rows per tile block */
/* Scale exponents folded into bf16 operands: |e| <= 44, and K <= 2^20.  Then every
 * operand and product is normal -- the least product, 2^-9 * 2^-9 (e4m3 by e4m3) *
 * 2^-88, is 2^-106 -- and no partial sum can reach 2^128: K * 448 * 448 * 2^88 < 2^126. */
#define GA_EMAX 44

/* The exponent of a power-of-two scale, or a value outside [-GA_EMAX, GA_EMAX] when the
 * scale is not one (or is zero, subnormal, infinite, NaN, negative). */
static inline int CSA_V(ga_exp)(const void *s, int fmt, csa_idx i)
{
    if (fmt == CSA_S_E8M0) {
        const int v = ((const uint8_t *)s)[i];
        return v == 0 || v == 0xff ? 1000 : v - 127;
    }
    uint32_t u;
    memcpy(&u, (const float *)s + i, 4);
    if (u & 0x807fffffu) return 1000; /* sign or mantissa bits */
    const int e = (int)(u >> 23);
    return e == 0 || e == 0xff ? 1000 : e - 127;
}

/* May the bf16 GEMM compute this call?  A scan of the scales: O(M K / 128 + N K / 32). */
static int CSA_V(ga_ok)(const struct csa_gemm_args *g)
{
    const int fp8 = g->b_fmt == CSA_W_E4M3;
    if ((!fp8 && g->bs_fmt != CSA_S_E8M0) || g->M <= 16 || g->K % 128 ||
        g->K > ((csa_idx)1 << 20))
        return 0;
    const csa_idx KB = g->K / 128, KBW = fp8 ? KB : g->K / 32, NW = fp8 ? (g->N + 127) / 128 : g->N;
    for (csa_idx m = 0; m < g->M; m++)
        for (csa_idx j = 0; j < KB; j++) {
            const int e = CSA_V(ga_exp)(g->as, g->as_fmt, m * g->sas_row + j * g->sas_col);
            if (e < -GA_EMAX || e > GA_EMAX) return 0;
        }
    for (csa_idx n = 0; n < NW; n++)
        for (csa_idx j = 0; j < KBW; j++) {
            const int e = CSA_V(ga_exp)(g->bs, g->bs_fmt, n * g->sbs_row + j * g->sbs_col);
            if (e < -GA_EMAX || e > GA_EMAX) return 0;
        }
    return 1;
}

/* 32 e4m3 codes (one in the low byte of each 16-bit lane of x) -> their bf16 bits times
 * 2^(E / 128) (E: the scale exponent times 128, bf16's exponent field), exact, by
 * integer arithmetic: a normal code's exponent and mantissa bits moved up by 4 and its
 * exponent rebased (+120); the eight codes below 8 (zero and the subnormals m 2^-9)
 * from a table; 0x7f NaN; the sign copied; the scale's exponent added to every nonzero,
 * non-NaN value. */
static inline __m512i CSA_V(ga_e4m3_bf16)(__m512i x, __m512i E)
{
    /* bf16 bits of m * 2^-9 for m < 8 (the permute reads 5 index bits: 8-31 unused) */
    static const uint16_t sub[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
    const __m512i m7f = _mm512_set1_epi16(0x7f);
    const __m512i mag = _mm512_and_si512(x, m7f);
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      _mm512_loadu_si512(sub));
    const __mmask32 isnan = _mm512_cmpeq_epi16_mask(mag, m7f);
    v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(mag, m7f) & ~isnan, v, E);
    v = _mm512_mask_mov_epi16(v, isnan, _mm512_set1_epi16(0x7fc0));
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_srli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0xff)), 7), 15));
}

/* e2m1 code -> bf16 bits, as a table for a 16-bit permute, twice over (the permute
 * reads 5 index bits: bit 4, the next nibble's lowest, is don't-care). */
static inline __m512i CSA_V(ga_e2m1_table)(void)
{
    static const uint16_t t16[16] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080,
                                     0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040,
                                     0xC080, 0xC0C0};
    uint16_t t32[32];
    for (int i = 0; i < 32; i++) t32[i] = t16[i & 15];
    return _mm512_loadu_si512(t32);
}

/* Activation row m -> bf16 (value * sa, exact) into the tile layout of Ab: row m's
 * 32 values of k-step t at Ab + ((m / 32) * (K / 32) + t) * 1024 + (m % 32) * 32, so that
 * each A tile (16 rows x 32 values) is 1 KiB contiguous.  K a multiple of 128.
 * e4m3 -> bf16 by integer arithmetic, 32 codes a step (CSA_V(ga_e4m3_bf16); the float32
 * decode and a conversion took 20 ms of a 2048 x 4096 call, 2 threads; this, about 1). */
static void CSA_V(ga_dec_a)(const struct csa_gemm_args *g, csa_idx m, csa_bf16 *Ab)
{
    const csa_idx K = g->K;
    csa_bf16 *dst = Ab + (m / 32) * (K / 32) * 1024 + (m % 32) * 32;
    const uint8_t *ar = g->a + m * g->sa_row;
    for (csa_idx j = 0; j < K / 128; j++) {
        const int e = CSA_V(ga_exp)(g->as, g->as_fmt, m * g->sas_row + j * g->sas_col);
        const __m512i E = _mm512_set1_epi16((short)(e * 128));
        for (csa_idx k = 128 * j; k < 128 * j + 128; k += 32) {
            const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ar + k)));
            _mm512_storeu_si512(dst + (k / 32) * 1024, CSA_V(ga_e4m3_bf16)(x, E));
        }
    }
}

/* Weight rows [n0, n0 + nr) -> the panel Bp in tile layout: the pair (w[n, 2i],
 * w[n, 2i + 1]) (bf16, each times its block's scale, exact) as the 32-bit word
 * Bp[((n - n0) / 16) * (K / 2) * 16 + i * 16 + (n - n0) % 16], so that each B tile (16
 * pairs of k x 16 columns) is 1 KiB contiguous; rows past nr are zero.  Sixteen rows a
 * step: their 16 bytes of a 32-block are transposed in registers (byte i of the 16 rows
 * together: the 16 words of B tile row i), decoded by a table lookup of each nibble and
 * scaled by adding the scale exponent to every nonzero value's exponent field. */
static void CSA_V(ga_dec_b)(const struct csa_gemm_args *g, csa_idx n0, csa_idx nr, uint32_t *Bp)
{
    const csa_idx K = g->K, K2 = K / 2;
    const __m512i T = CSA_V(ga_e2m1_table)();
    /* byte 16 r + i of a 4-row register -> byte 4 i + r: dwords transposed 4 x 4 across
     * the 128-bit lanes, then bytes 4 x 4 within each lane */
    const __m512i idx_lane = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i ctl_b = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    /* dwords i of two registers interleaved (i < 8: lo; i >= 8: hi), then qwords */
    const __m512i idx_dlo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i idx_dhi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i idx_qlo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i idx_qhi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i m7fff = _mm512_set1_epi16(0x7fff);
    static const uint8_t zero16[16];
    for (csa_idx rb = 0; rb < GA_NP; rb += 16) {
        uint32_t *dst = Bp + (rb / 16) * K2 * 16;
        if (rb >= nr) {
            memset(dst, 0, (size_t)K2 * 16 * sizeof *dst);
            continue;
        }
        const uint8_t *rp[16];
        const uint8_t *sp[16];
        for (int r = 0; r < 16; r++) {
            const csa_idx n = n0 + rb + r;
            rp[r] = rb + r < nr ? g->b + n * g->sb_row : zero16;
            sp[r] = rb + r < nr ? (const uint8_t *)g->bs + n * g->sbs_row : NULL;
        }
        for (csa_idx j = 0; j < K / 32; j++) {
            __m512i Y[4];
            for (int q = 0; q < 4; q++) {
                __m128i x[4];
                for (int r = 0; r < 4; r++)
                    x[r] = _mm_loadu_si128((const __m128i *)(rp[4 * q + r] == zero16
                                                                 ? zero16 : rp[4 * q + r] + 16 * j));
                __m512i z = _mm512_castsi128_si512(x[0]);
                z = _mm512_inserti32x4(z, x[1], 1);
                z = _mm512_inserti32x4(z, x[2], 2);
                z = _mm512_inserti32x4(z, x[3], 3);
                Y[q] = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(idx_lane, z), ctl_b);
            }
            /* dword i of Y[q] = byte i of rows 4q .. 4q + 3 */
            const __m512i P01l = _mm512_permutex2var_epi32(Y[0], idx_dlo, Y[1]);
            const __m512i P01h = _mm512_permutex2var_epi32(Y[0], idx_dhi, Y[1]);
            const __m512i P23l = _mm512_permutex2var_epi32(Y[2], idx_dlo, Y[3]);
            const __m512i P23h = _mm512_permutex2var_epi32(Y[2], idx_dhi, Y[3]);
            uint8_t S[256];
            _mm512_storeu_si512(S, _mm512_permutex2var_epi64(P01l, idx_qlo, P23l));
            _mm512_storeu_si512(S + 64, _mm512_permutex2var_epi64(P01l, idx_qhi, P23l));
            _mm512_storeu_si512(S + 128, _mm512_permutex2var_epi64(P01h, idx_qlo, P23h));
            _mm512_storeu_si512(S + 192, _mm512_permutex2var_epi64(P01h, idx_qhi, P23h));
            /* S[16 i + r]: byte i of row r; the scale exponents of the 16 rows, times 128
             * (bf16's exponent field), in both halves of the row's word */
            uint8_t sc[16];
            for (int r = 0; r < 16; r++) sc[r] = sp[r] ? sp[r][j * g->sbs_col] : 127;
#ifdef CSA_MUTANT_GEMM_AMX_FOLD /* planted (make mutants): the last block's weight scale
                                 * folded as 1 */
            if (j == K / 32 - 1)
                for (int r = 0; r < 16; r++) sc[r] = 127;
#endif
            __m512i E = _mm512_slli_epi32(
                _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc)),
                                 _mm512_set1_epi32(127)), 7);
            E = _mm512_or_si512(_mm512_and_si512(E, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(E, 16));
            uint32_t *d = dst + (16 * j) * 16;
            for (int i = 0; i < 16; i++) {
                const __m512i D = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(S + 16 * i)));
                /* even words: the byte's low nibble looked up; odd words: index 0, bf16 0 */
                const __m512i lo = _mm512_permutexvar_epi16(D, T);
                const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi32(D, 4), T);
                __m512i w = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                w = _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, m7fff), w, E);
                _mm512_storeu_si512(d + 16 * i, w);
            }
        }
    }
}

/* FP8 weight rows [n0, n0 + nr) -> the panel Bp in the same tile layout (pairs of e4m3
 * values as bf16, each times its 128 x 128 block's scale).  Sixteen rows a step: a
 * gather of one 32-bit word per row (codes 4i .. 4i + 3) gives two B tile rows, each code
 * spread to a 16-bit lane and converted by CSA_V(ga_e4m3_bf16); a panel starts at a
 * multiple of 128 rows, so its 16-row groups share one scale per 128 columns. */
static void CSA_V(ga_dec_b8)(const struct csa_gemm_args *g, csa_idx n0, csa_idx nr, uint32_t *Bp)
{
    const csa_idx K = g->K, K2 = K / 2;
    for (csa_idx rb = 0; rb < GA_NP; rb += 16) {
        uint32_t *dst = Bp + (rb / 16) * K2 * 16;
        if (rb >= nr) {
            memset(dst, 0, (size_t)K2 * 16 * sizeof *dst);
            continue;
        }
        /* byte offsets of the 16 rows from row n0 + rb; rows past nr are masked out of
         * the gathers (their lanes read as code 0) */
        const uint8_t *base = g->b + (n0 + rb) * g->sb_row;
        int32_t off[16];
        __mmask16 live = 0;
        for (int r = 0; r < 16; r++) {
            off[r] = rb + r < nr ? (int32_t)(r * g->sb_row) : 0;
            if (rb + r < nr) live |= (__mmask16)(1u << r);
        }
        const __m512i vo = _mm512_loadu_si512(off);
        const __m512i lo8 = _mm512_set1_epi32(0xff), hi8 = _mm512_set1_epi32(0xff00);
        for (csa_idx kb = 0; kb < K / 128; kb++) {
#ifndef CSA_MUTANT_GEMM_AMX_FP8 /* planted (make mutants): the scale of the block before */
            const int e = CSA_V(ga_exp)(g->bs, g->bs_fmt, ((n0 + rb) / 128) * g->sbs_row + kb * g->sbs_col);
#else
            const int e = CSA_V(ga_exp)(g->bs, g->bs_fmt, ((n0 + rb) / 128) * g->sbs_row + (kb ? kb - 1 : 0) * g->sbs_col);
#endif
            const __m512i E = _mm512_set1_epi16((short)(e * 128));
            for (csa_idx k = 128 * kb; k < 128 * kb + 128; k += 4) {
                const __m512i D = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vo,
                                                              base + k, 1);
                /* codes (4i, 4i + 1) and (4i + 2, 4i + 3): one to each 16-bit half */
                const __m512i p0 = _mm512_or_si512(_mm512_and_si512(D, lo8),
                                                   _mm512_slli_epi32(_mm512_and_si512(D, hi8), 8));
                const __m512i D2 = _mm512_srli_epi32(D, 16);
                const __m512i p1 = _mm512_or_si512(_mm512_and_si512(D2, lo8),
                                                   _mm512_slli_epi32(_mm512_and_si512(D2, hi8), 8));
                _mm512_storeu_si512(dst + (k / 2) * 16, CSA_V(ga_e4m3_bf16)(p0, E));
                _mm512_storeu_si512(dst + (k / 2 + 1) * 16, CSA_V(ga_e4m3_bf16)(p1, E));
            }
        }
    }
}

/* Rows [m0, m0 + 32) of the activations (At: their tile-layout block) times panel
 * columns [c0, c0 + 32) (Bt: their two 16-column blocks, K2 * 16 words apart), over all
 * of K, into T [32][32] float32. */
static inline void CSA_V(ga_block)(const csa_bf16 *At, csa_idx K, const uint32_t *Bt, float *T)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const csa_idx K2 = K / 2;
    for (csa_idx t = 0; t < K / 32; t++) {
        _tile_loadd(4, At + t * 1024, 64);
        _tile_loadd(5, At + t * 1024 + 512, 64);
        _tile_loadd(6, Bt + t * 256, 64);
        _tile_loadd(7, Bt + K2 * 16 + t * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, T, 128);
    _tile_stored(1, T + 16, 128);
    _tile_stored(2, T + 16 * 32, 128);
    _tile_stored(3, T + 16 * 32 + 16, 128);
}


/* ga_block's product by AVX512_BF16 dot products, for CPUs without tiles (AMD Zen 4):
 * the same operands in the same layout, each output one chain of VDPBF16PS over the
 * pairs of k in increasing order.  Eight rows x 32 columns a pass (16 accumulators; a
 * pass reads its B pairs from L1 / L2 while the A pairs are broadcast); the four passes
 * of a 32-row block run one after the other. */
static inline void CSA_V(ga_block_dp)(const csa_bf16 *At, csa_idx K, const uint32_t *Bt, float *T)
{
    const csa_idx K2 = K / 2;
    const uint32_t *B1 = Bt + K2 * 16;
    for (int r0 = 0; r0 < 32; r0 += 8) {
        __m512 c[8][2];
        for (int r = 0; r < 8; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
#ifndef CSA_MUTANT_GEMM_DP_LAST
        for (csa_idx t = 0; t < K / 32; t++) {
#else /* planted (make mutants): the last 32 columns of k left out of the dot products */
        for (csa_idx t = 0; t < K / 32 - 1; t++) {
#endif
            const uint32_t *A = (const uint32_t *)(At + t * 1024 + r0 * 32);
            for (int p = 0; p < 16; p++) {
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bt + (16 * t + p) * 16);
                const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B1 + (16 * t + p) * 16);
                for (int r = 0; r < 8; r++) {
                    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * 16 + p]);
                    c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
                    c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
                }
            }
        }
        for (int r = 0; r < 8; r++) {
            _mm512_storeu_ps(T + (r0 + r) * 32, c[r][0]);
            _mm512_storeu_ps(T + (r0 + r) * 32 + 16, c[r][1]);
        }
    }
}

/* The bf16 GEMM, C = (A sa)(B sb)^T: AMX tiles (tiles = 1, the amx level) or
 * AVX512_BF16 dot products (tiles = 0: the avx512 level on CPUs that have them). */
static int CSA_V(gemm_bf16)(const struct csa_gemm_args *g, int tiles)
{
    const csa_idx M = g->M, N = g->N, K = g->K;
    const csa_idx Mp = (M + GA_MB - 1) / GA_MB * GA_MB;
    const csa_idx npan = (N + GA_NP - 1) / GA_NP;
    csa_bf16 *Ab = malloc((size_t)(Mp * K) * sizeof *Ab);
    if (!Ab) return CSA_ENOMEM;
    int fail = 0;
    {
        const int nt = csa_threads(M, 1 + 65536 / K);
#pragma omp parallel num_threads(nt)
        {
#pragma omp for schedule(static)
            for (csa_idx m = 0; m < Mp; m++) {
                if (m >= M)
                    for (csa_idx t = 0; t < K / 32; t++)
                        memset(Ab + ((m / 32) * (K / 32) + t) * 1024 + (m % 32) * 32, 0, 64);
                else
                    CSA_V(ga_dec_a)(g, m, Ab);
            }
        }
    }
    const int nt = csa_threads(npan, 1);
#pragma omp parallel num_threads(nt)
    {
        uint32_t *Bp = malloc((size_t)(K / 2 * GA_NP) * sizeof *Bp);
        float *T = malloc(32 * 32 * sizeof *T);
        if (!Bp || !T) {
#pragma omp atomic write
            fail = 1;
        }
        if (Bp && T && tiles) csa_amx_tiles_16x64();
#pragma omp for schedule(dynamic, 1)
        for (csa_idx p = 0; p < npan; p++) {
            if (!Bp || !T) continue;
            const csa_idx n0 = p * GA_NP, nr = N - n0 < GA_NP ? N - n0 : GA_NP;
            if (g->b_fmt == CSA_W_E4M3)
                CSA_V(ga_dec_b8)(g, n0, nr, Bp);
            else
                CSA_V(ga_dec_b)(g, n0, nr, Bp);
            for (csa_idx m0 = 0; m0 < Mp; m0 += GA_MB) {
                const csa_idx mr = M - m0 < GA_MB ? M - m0 : GA_MB;
                for (csa_idx c0 = 0; c0 < nr; c0 += 32) {
                    if (tiles)
                        CSA_V(ga_block)(Ab + m0 * K, K, Bp + (c0 / 16) * (K / 2) * 16, T);
                    else
                        CSA_V(ga_block_dp)(Ab + m0 * K, K, Bp + (c0 / 16) * (K / 2) * 16, T);
                    const csa_idx cr = nr - c0 < 32 ? nr - c0 : 32;
                    for (csa_idx i = 0; i < mr; i++)
                        for (csa_idx c = 0; c < cr; c++) g_store(g, m0 + i, n0 + c0 + c, T[i * 32 + c]);
                }
            }
        }
        if (Bp && T && tiles) _tile_release();
        free(Bp);
        free(T);
    }
    free(Ab);
    return fail ? CSA_ENOMEM : CSA_OK;
}

#undef GA_NP
#undef GA_MB
#undef GA_EMAX

CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
