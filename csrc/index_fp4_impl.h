/* ------------------------------------------------------------------ FP4 rows
 * The indexer on FP4 keys (and FP4 queries), by exact integer dot products; included
 * by index_impl.h into every level (docs/kernels.md, section 4, "The integer path").
 *
 * The oracle (score_ref_fp4) scores a key as: per head h, per block j of 32 features,
 * c_j = isum_j * 2^(eq_j + ek_j - 256) (isum_j the integer sum of the 2x codes, |isum_j|
 * <= 32 * 144 = 4608), dot = ((0 + c_0) + c_1) + ... in float32, then acc += relu(dot)
 * * w_h over the heads in order.  This path keeps that order bit for bit with the keys
 * in the int32 lanes of a vector (a tile of IX4_NK keys): each lane runs one key's
 * float32 steps, heads one after the other, so no lane ever adds across heads or keys.
 *
 * Where exactness comes from:
 * - c_j is exact whenever 2^(E_j - 256) is a normal float32 and the product does not
 *   overflow (E_j = eq_j + ek_j in [130, 360], checked per tile; outside, and for any
 *   NaN scale byte 0xff, the tile runs the oracle's own function);
 * - the block dots are exact integer sums (unsigned-byte x signed-byte products
 *   summed into int32 lanes, never saturating: the bounds below);
 * - the fast path: if the nonzero blocks of a key lie within 2^DK of each other (DK = 3
 *   with VNNI, 2 without) and those of a head within 2^DQ, the codes are prescaled per
 *   block by 2^(e_j - e_min) (a byte still: 12 * 8 = 96) and one integer sum over all
 *   Di features gives N = sum_j isum_j 2^(E_j - Emin).  Each of the oracle's partial
 *   sums is then a multiple of 2^(Emin - 256) below nb * 4608 * 2^6 < 2^24 times it
 *   (nb <= 56, Di <= IX4_FAST_DI), so every float32 addition of the oracle is exact,
 *   and dot = N * 2^(Emin - 256) is the oracle's dot: one conversion, one multiply;
 * - otherwise (per head or per tile) each block's integer sum is converted, scaled
 *   and added in block order, the oracle's own operations on the same values;
 * - a block whose codes are all zero adds an exact +0 to the dot, whatever its finite
 *   scale, so it takes no part in the spread (its scale still bounds Emax: 0 times an
 *   infinite scale would be the oracle's NaN);
 * - relu is max(0, dot) (NaN and -0 pass, as in the oracle), and relu(dot) * w_h is
 *   rounded on its own before the head sum (an empty asm keeps the compiler from
 *   fusing it into an FMA under -ffp-contract=fast, which the oracle's level lacks).
 *
 * Keys are the unsigned operand: byte 2k 2^de + OFF (OFF = 128 with VNNI: [32, 224];
 * 48 without: [0, 96]); the query bytes are signed, 2q 2^de; the per-head start value
 * -OFF * sum(q bytes) removes the offset.  VPDPBUSD adds 4 products into an int32 lane;
 * without VNNI, VPMADDUBSW adds 2 into a saturating int16 lane and two of them are
 * added in int16 before VPMADDWD widens: 4 * 96 * 48 = 18432 < 2^15.  At level amx
 * with AMX-INT8 the same integer sums come from TDPBSUD on tiles (ix4_tiles_amx). */

#ifndef IX4_TILE_FAST
#define IX4_TILE_FAST 0   /* every key of the tile prescaled */
#define IX4_TILE_BLOCKS 1 /* some key's blocks spread too far: block by block */
#define IX4_TILE_SCALAR 2 /* a NaN scale: the oracle's function */
#define IX4_FAST_DI 1792  /* 56 blocks * 4608 * 2^6 < 2^24 */
#define IX4B_CAT_(a, b) a##b
#define IX4B_CAT(a, b) IX4B_CAT_(a, b)
/* Byte offset of dword f (features 4f .. 4f+3) of head h in the packed query bytes: the
 * heads in groups of 8, a group's 8 dwords of one f side by side, so that the one-sum
 * path reads a group's dwords at constant offsets from one pointer. */
#define IX4_QOFF(h, f, Di) (((((h) >> 3) * ((Di) / 4) + (f)) * 8 + ((h) & 7)) * 4)
/* Byte position of feature d in a packed row, keys' and queries' alike: in each group
 * of 8 features (4 bytes of FP4 codes) the even ones fill the first dword, the odd
 * ones the second, as the codes' low and high nibbles decode, so that neither decode
 * interleaves them (two VPERMT2B a transposed vector at AVX-512 VBMI, 30% of the
 * decode's samples; VPUNPCK*BW in the others).  Dot products do not care, blocks of
 * 32 stay whole. */
#define IX4_POS(d) (((d) & ~(csa_idx)7) | (((d) & 1) << 2) | (((d) >> 1) & 3))
#endif
#define IX_FK 16 /* key chunks are whole tiles at every level */
#if defined(__AVX512F__)
#define IX4_NK 16
#if defined(CSA_HAVE_AMX)
#define IX4_HAVE_VNNI 1
#endif
#if defined(CSA_HAVE_AMX)
#define IX4_HAVE_AMX 1
#endif
#else
#define IX4_NK 8
#endif

/* Level amx on a CPU with AMX-INT8: the tile path (ix4_tiles_amx below). */
static inline int CSA_V(ix4_amx)(void)
{
#ifdef IX4_HAVE_AMX
    return csa_isa_get() >= CSA_ISA_AMX && (csa_cpu_features() & CSA_CPU_AMX_INT8);
#else
    return 0;
#endif
}

/* Byte offsets in a packed FP4 query row: a 64-byte header (int32 NaN flag, least
 * effective exponent, largest exponent, all heads prescaled; with the tiles: the row
 * takes the tile path, the folded weights are exact), then per head its prescaled
 * flag, start value, base exponent, per block start value and exponent, its int16
 * start values, bound and (base - 129) << 23 (ix4_pack_row), the weights
 * (float32), and the query bytes (IX4_QOFF).  With the tiles (ix4_amx) also the A
 * tiles [HG][NC][16 heads][64 bytes] (head group, 64-feature chunk; zero past Hi and
 * Di), the C start tiles [HG][16 heads][16 keys] (int32, each head's start value
 * across its row) and the folded weights [Hi] (float32). */
struct CSA_V(ix4_geo) {
    size_t hnice, hcorr, heqf, hcorrb, heqb, hc16, hsq, hq23, w, qop, qa, ci, wf, bytes;
};

static void CSA_V(ix4_row_geo)(const struct csa_index_problem *p, struct CSA_V(ix4_geo) *g)
{
    const size_t Hi = (size_t)p->Hi, nb = (size_t)(p->Di / 32);
    size_t o = 64;
    g->hnice = o;
    o += 4 * Hi;
    g->hcorr = o;
    o += 4 * Hi;
    g->heqf = o;
    o += 4 * Hi;
    g->hcorrb = o;
    o += 4 * Hi * nb;
    g->heqb = o;
    o += 4 * Hi * nb;
    g->hc16 = o;
    o += 4 * Hi;
    g->hsq = o;
    o += 4 * Hi;
    g->hq23 = o;
    o += 4 * Hi;
    g->w = o;
    o += 4 * Hi;
    o = (o + 63) / 64 * 64;
    g->qop = o;
    o += (Hi + 7) / 8 * 8 * (size_t)p->Di;
    o = (o + 63) / 64 * 64;
    g->qa = g->ci = o;
    if (CSA_V(ix4_amx)()) {
        const size_t HG = (Hi + 15) / 16, NC = (size_t)(p->Di + 63) / 64;
        o += HG * NC * 1024;
        g->ci = o;
        o += HG * 1024;
    }
    g->wf = o;
    o += (Hi + 15) / 16 * 64;
    g->bytes = o;
}

/* A key tile: a 64-byte header (int32 kind, least effective exponent, largest
 * exponent, largest prescale shift of a prescaled key), the effective exponents
 * [nb][nk] (int32), then the key bytes transposed, dword f of key l at
 * (f * nk + l) * 4, padded to a whole number of 64-feature chunks
 * (Di an odd number of blocks: the tiles read a chunk of 16 dwords; the padding bytes
 * are zero, and so are the query bytes they meet). */
static inline size_t CSA_V(ix4_tile_bytes)(csa_idx Di, csa_idx nk)
{
    return (64 + (size_t)(Di / 32) * (size_t)nk * 4 + (size_t)(Di + 63) / 64 * 64 * (size_t)nk + 63) / 64 * 64;
}

static inline int CSA_V(ix4_vnni)(void)
{
#ifdef IX4_HAVE_VNNI
    return (csa_cpu_features() & CSA_CPU_VNNI_VBMI) != 0;
#else
    return 0;
#endif
}

/* Block j of an FP4 row has a nonzero code (8 is -0). */
static inline int CSA_V(ix4_block_nz)(const uint8_t *row, csa_idx j)
{
    uint64_t a, b;
    memcpy(&a, row + 16 * j, 8);
    memcpy(&b, row + 16 * j + 8, 8);
    return ((a | b) & 0x7777777777777777ull) != 0;
}

static void CSA_V(ix4_pack_row)(const struct ix_call *x, csa_idx b, csa_idx s, uint8_t *buf)
{
    const struct csa_index_problem *p = x->p;
    const csa_idx Hi = p->Hi, Di = p->Di, nb = Di / 32;
    struct CSA_V(ix4_geo) g;
    CSA_V(ix4_row_geo)(p, &g);
    const int vn = CSA_V(ix4_vnni)(), dq = vn ? 3 : 2, off = vn ? 128 : 48;
    int32_t *hdr = (int32_t *)buf, *hnice = (int32_t *)(buf + g.hnice);
    int32_t *hcorr = (int32_t *)(buf + g.hcorr), *heqf = (int32_t *)(buf + g.heqf);
    int32_t *hcorrb = (int32_t *)(buf + g.hcorrb), *heqb = (int32_t *)(buf + g.heqb);
    int32_t *hc16 = (int32_t *)(buf + g.hc16), *hsq = (int32_t *)(buf + g.hsq);
    uint32_t *hq23 = (uint32_t *)(buf + g.hq23);
    float *w = (float *)(buf + g.w);
    int8_t *qop = (int8_t *)(buf + g.qop);
    memset(qop, 0, (size_t)(g.bytes - g.qop)); /* the last group's padding heads */
    int nan = 0, emin = 1 << 20, emax = 0, all = 1;
    const uint8_t *qr0 = x->qp + b * x->qpb + s * x->qps;
    for (csa_idx h = 0; h < Hi; h++) {
        const uint8_t *qr = qr0 + h * x->qph;
        int lo = 1 << 20, hi = -1;
        for (csa_idx j = 0; j < nb; j++) {
            const int e = qr[Di / 2 + j];
            nan |= e == 0xff;
            emax = e > emax ? e : emax;
            if (CSA_V(ix4_block_nz)(qr, j)) {
                lo = e < lo ? e : lo;
                hi = e > hi ? e : hi;
            }
        }
        const int nice = hi < 0 || hi - lo <= dq, base = hi < 0 ? 127 : lo;
        all &= nice;
        emax = base > emax ? base : emax;
        int32_t tot = 0, ls[2] = {0, 0}, la[2] = {0, 0};
        for (csa_idx j = 0; j < nb; j++) {
            const int e = qr[Di / 2 + j], nz = CSA_V(ix4_block_nz)(qr, j);
            const int de = nice && nz ? e - base : 0;
            int32_t sum = 0;
            for (csa_idx d = 32 * j; d < 32 * j + 32; d++) {
                const int v = fp4_v2[fp4_code(qr, d)] * (1 << de);
                const csa_idx pd = IX4_POS(d);
                qop[IX4_QOFF(h, pd / 4, Di) + pd % 4] = (int8_t)v;
                sum += v;
                ls[(pd % 4) / 2] += v;
                la[(pd % 4) / 2] += v < 0 ? -v : v;
            }
            const int eb = nice || !nz ? base : e;
            hcorrb[h * nb + j] = -off * sum;
            heqb[h * nb + j] = eb;
            emin = eb < emin ? eb : emin;
            tot += sum;
        }
        hnice[h] = nice;
        hcorr[h] = -off * tot;
        heqf[h] = base;
        /* the one-sum path in int16 lanes (ix4_tiles_*_fast16): lane p of a dword
         * holds its bytes 2p, 2p+1; its start value is -OFF * their query sum modulo
         * 2^16, and the sum of the |q| it meets bounds its true value */
        hc16[h] = (int32_t)((uint32_t)(uint16_t)(-off * ls[0]) | (uint32_t)(uint16_t)(-off * ls[1]) << 16);
        hsq[h] = la[0] > la[1] ? la[0] : la[1];
        hq23[h] = (uint32_t)(base - 129) << 23; /* SCALE's head term, shifted in place */
    }
    hdr[0] = nan;
    hdr[1] = emin;
    hdr[2] = emax;
    hdr[3] = all;
    const csa_idx w0 = b * p->swb + s * p->sws;
    for (csa_idx h = 0; h < Hi; h++) w[h] = ld(p->w, p->w_bf16, w0 + h * p->swh);
    /* The weights with the head's scale folded in, w 2^(eq - 129) (the tiles' and the
     * VNNI path's factored head sum, ix4_tiles_vnni): exact when the double rounds to
     * itself.  hdr[6]: every one exact and finite; hdr[7] / hdr[8]: the least / largest
     * binary exponent of the nonzero ones (|wf| in [2^hdr[7], 2^(hdr[8] + 1))). */
    float *wf = (float *)(buf + g.wf);
    int fin = 1, wlo = 1 << 20, whi = -(1 << 20);
    for (csa_idx h = 0; h < Hi; h++) {
        const double a = (double)w[h] * ldexp(1.0, heqf[h] - 129);
        wf[h] = (float)a;
        fin &= isfinite(wf[h]) && (double)wf[h] == a;
        if (wf[h] != 0.0f && isfinite(wf[h])) {
            const int e = ilogbf(wf[h]);
            wlo = e < wlo ? e : wlo;
            whi = e > whi ? e : whi;
        }
    }
    hdr[6] = fin;
    hdr[7] = wlo;
    hdr[8] = whi;
    if (!CSA_V(ix4_amx)()) return;
    /* The tile path's operands (zeroed above with the query bytes): the A tiles, the C
     * start tiles, and the weights with the head's scale folded in, w 2^(eq - 129), used
     * when every one of them is exact (in double, then checked to round to itself):
     * relu(N 2^(ek - 127)) * (w 2^(eq - 129)) is then the oracle's relu(dot) * w, the
     * same real number rounded once. */
    const csa_idx NC = (Di + 63) / 64;
    int8_t *qa = (int8_t *)(buf + g.qa);
    int32_t *ci = (int32_t *)(buf + g.ci);
    int fold = 1;
    for (csa_idx h = 0; h < Hi; h++) {
        int8_t *qah = qa + ((h / 16) * NC * 16 + h % 16) * 64;
        for (csa_idx d = 0; d < Di; d++) qah[(d / 64) * 1024 + d % 64] = qop[IX4_QOFF(h, d / 4, Di) + d % 4];
        for (int l = 0; l < 16; l++) ci[h * 16 + l] = hcorr[h];
        const double a = (double)w[h] * ldexp(1.0, heqf[h] - 129);
#ifndef CSA_MUTANT_FP4_INDEX_AMX /* planted (make mutants): the folded weights used unchecked */
        fold &= w[h] != w[h] || (double)wf[h] == a;
#endif
    }
    hdr[4] = all && Di <= IX4_FAST_DI;
    hdr[5] = fold;
}

#ifdef IX4_HAVE_VNNI
#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni,avx512vbmi")
/* The decode tables of ix4_decode_tile_vbmi, built once a chunk of keys. */
struct CSA_V(ix4_vbmi_tab) {
    __m512i t;
};

static void CSA_V(ix4_vbmi_tables)(int off, struct CSA_V(ix4_vbmi_tab) *tb)
{
    uint8_t tab[64];
    for (int de = 0; de < 4; de++)
        for (int c = 0; c < 16; c++) tab[16 * de + c] = (uint8_t)(fp4_v2[c] * (1 << de) + off);
    tb->t = _mm512_loadu_si512(tab);
}

/* The key bytes of a tile of 16 keys whose blocks' exponents (e[j], the keys in the
 * lanes) all lie within 2^3 of the keys' least ones emn, on CPUs with AVX512_VBMI (the
 * VNNI path's feature set): the keys' packed nibbles are transposed first (a dword is
 * 8 features), then each transposed vector is decoded for all 16 keys at once by two
 * 64-entry byte lookups (VPERMB, the index carrying the key's shift for the block in
 * its top bits), its low / high nibbles into two output vectors, the even / odd
 * features' dwords of the layout (IX4_POS).  Against the decode a key at a time (a table
 * per block, then the dword transpose): 0.44 of the instructions a tile (Xeon, Di =
 * 128).  A block of zero codes here counts in the spread and may set the key's base
 * (the scalar pass leaves it out): its bytes are OFF whatever the shift, it adds an
 * exact 0, and the others' shifts stay within 2^3, so the one-sum path is exact all
 * the same.  Testing each key's blocks for a nonzero code first, 64 scalar tests and
 * branches a tile, was a third of the pack's samples (perf, Tc = 64K, 1 thread). */
static void CSA_V(ix4_decode_tile_vbmi)(const uint8_t *kr0, csa_idx skt, csa_idx Di, __m512i emn,
                                        const __m512i *e, const struct CSA_V(ix4_vbmi_tab) *tb,
                                       uint8_t *CSA_RESTRICT kv)
{
    typedef CSA_V(vf) vf;
    const csa_idx nb = Di / 32;
    const __m512i T = tb->t;
    const __m512i m4 = _mm512_set1_epi8(15);
    for (csa_idx cb = 0; cb < nb; cb += 4) {
        const csa_idx nbc = imin(4, nb - cb);
        const __mmask64 lm = nbc == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * nbc)) - 1;
        vf r[16];
        for (int l = 0; l < 16; l++) r[l] = (vf)_mm512_maskz_loadu_epi8(lm, kr0 + l * skt + 16 * cb);
        CSA_V(ix_transpose)(r); /* r[i]: raw dword i (features 32 cb + 8 i ..) of each key */
        for (csa_idx jj = 0; jj < nbc; jj++) {
            const __m512i deb = _mm512_mullo_epi32(_mm512_sub_epi32(e[cb + jj], emn), _mm512_set1_epi32(0x10101010));
            for (int u = 0; u < 4; u++) {
                const __m512i v = (__m512i)r[4 * jj + u];
                const __m512i lo = _mm512_permutexvar_epi8(_mm512_or_si512(_mm512_and_si512(v, m4), deb), T);
                const __m512i hi = _mm512_permutexvar_epi8(
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), deb), T);
                const csa_idx F = 8 * (cb + jj) + 2 * u;
                _mm512_store_si512((void *)(kv + F * 64), lo); /* even features (IX4_POS) */
                _mm512_store_si512((void *)(kv + (F + 1) * 64), hi);
            }
        }
    }
}
CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
#endif

/* Lays keys [t0, t1) of batch entry b out as tiles of IX4_NK keys at dst (the last
 * tile padded with zero keys).  Per key, a scalar pass over its scale bytes finds its
 * base exponent and prescale shifts; then per 4 blocks (AVX-512; 2 on AVX2) one byte
 * shuffle per nibble half decodes a key's codes through a table per block (its shift
 * and the offset baked in), and the keys' dwords are transposed in registers
 * (ix_transpose).  Each row is prefetched 16 rows ahead: at 1M tokens a layer's keys
 * (17 MiB) come from memory. */
static void CSA_V(ix4_pack_keys)(const struct csa_index_problem *p, csa_idx b, csa_idx t0,
                                 csa_idx t1, uint8_t *CSA_RESTRICT dst)
{
#if defined(__AVX2__)
    typedef CSA_V(vf) vf;
    const csa_idx Di = p->Di, nb = Di / 32, NK = IX4_NK;
#ifndef CSA_MUTANT_FP4_INDEX_SPREAD
    const int vn = CSA_V(ix4_vnni)(), dk = vn ? 3 : 2, off = vn ? 128 : 48;
#else /* planted (make mutants): keys whose blocks spread by one more octave prescaled too */
    const int vn = CSA_V(ix4_vnni)(), dk = vn ? 4 : 3, off = vn ? 128 : 48;
#endif
    const size_t TB = CSA_V(ix4_tile_bytes)(Di, NK);
    __m128i lut[4];
    for (int de = 0; de < 4; de++) {
        uint8_t tab[16];
        for (int c = 0; c < 16; c++) tab[c] = (uint8_t)(fp4_v2[c] * (1 << de) + off);
        lut[de] = _mm_loadu_si128((const __m128i *)tab);
    }
    const uint8_t *kb = (const uint8_t *)p->k + b * p->skb;
#ifdef IX4_HAVE_VNNI
    struct CSA_V(ix4_vbmi_tab) vtab;
    if (vn) CSA_V(ix4_vbmi_tables)(off, &vtab);
#endif
#if defined(__AVX512F__)
#define IX4_BPC 4 /* blocks per decoded register */
    typedef __m512i vb;
    const vb m4 = _mm512_set1_epi8(15), voff = _mm512_set1_epi8((char)off);
#else
#define IX4_BPC 2
    typedef __m256i vb;
    const vb m4 = _mm256_set1_epi8(15), voff = _mm256_set1_epi8((char)off);
#endif
    for (csa_idx t = t0, i = 0; t < t1; t += NK, i++) {
        uint8_t *tile = dst + (size_t)i * TB;
        int32_t *th = (int32_t *)tile, *ekb = (int32_t *)(tile + 64);
        uint8_t *kv = tile + 64 + (size_t)nb * NK * 4;
        if (Di % 64) memset(kv + (size_t)Di * NK, 0, (size_t)(64 - Di % 64) * NK); /* chunk padding */
        int kind = IX4_TILE_FAST, tmn = 1 << 20, tmx = 0, tde = 0;
        int base[IX4_NK], nice[IX4_NK];
        const csa_idx nk = imin(NK, t1 - t);
        /* The usual tile, all its keys with every block nonzero and within 2^dk, found
         * with the keys in the lanes (a gather per block); the scalar pass below (a
         * third of the pack on Gaussian keys) is left for the others. */
        if (nk == NK && p->skt <= (1 << 26)) {
            const uint8_t *kr0 = kb + t * p->skt;
            int ok = 1;
#ifdef IX4_HAVE_VNNI
            __m512i ev[64];
            const int vq = vn && nb <= 64; /* zero blocks may join the spread (the decode) */
#else
            const int vq = 0;
#endif
            if (vq)
                for (csa_idx l = 0; l < NK; l++)
                    _mm_prefetch((const char *)(kr0 + (l + 64) * p->skt), _MM_HINT_T0);
            else
                for (csa_idx l = 0; l < NK && ok; l++) {
                    const uint8_t *kr = kr0 + l * p->skt;
                    _mm_prefetch((const char *)(kr + 64 * p->skt), _MM_HINT_T0);
                    for (csa_idx j = 0; j < nb && ok; j++)
                        ok = !_mm_testz_si128(_mm_loadu_si128((const __m128i *)(kr + 16 * j)), _mm_set1_epi8(0x77));
                }
#if defined(__AVX512F__)
            const __m512i vidx = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32((int)p->skt));
            __m512i emn = _mm512_set1_epi32(255), emx = _mm512_setzero_si512();
            for (csa_idx j = 0; j < nb && ok; j++) {
                /* the dword ending at the scale byte: never past the row */
                const __m512i e = _mm512_srli_epi32(
                    _mm512_i32gather_epi32(vidx, (const void *)(kr0 + Di / 2 + j - 3), 1), 24);
#ifdef IX4_HAVE_VNNI
                if (vq) ev[j] = e;
#endif
                emn = _mm512_min_epi32(emn, e);
                emx = _mm512_max_epi32(emx, e);
            }
            if (ok && !_mm512_cmpeq_epi32_mask(emx, _mm512_set1_epi32(255)) &&
                !_mm512_cmpgt_epi32_mask(_mm512_sub_epi32(emx, emn), _mm512_set1_epi32(dk))) {
#ifdef IX4_HAVE_VNNI
                if (vq) {
                    CSA_V(ix4_decode_tile_vbmi)(kr0, p->skt, Di, emn, ev, &vtab, kv);
                    for (csa_idx j = 0; j < nb; j++) _mm512_store_si512(ekb + j * NK, emn);
                    th[0] = IX4_TILE_FAST;
                    th[1] = _mm512_reduce_min_epi32(emn);
                    th[2] = _mm512_reduce_max_epi32(emx);
                    th[3] = _mm512_reduce_max_epi32(_mm512_sub_epi32(emx, emn));
                    continue;
                }
#endif
                _mm512_storeu_si512(base, emn);
                for (csa_idx j = 0; j < nb; j++) _mm512_store_si512(ekb + j * NK, emn);
                tmn = _mm512_reduce_min_epi32(emn);
                tmx = _mm512_reduce_max_epi32(emx);
                tde = _mm512_reduce_max_epi32(_mm512_sub_epi32(emx, emn));
#else
            const __m256i vidx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                    _mm256_set1_epi32((int)p->skt));
            __m256i emn = _mm256_set1_epi32(255), emx = _mm256_setzero_si256();
            for (csa_idx j = 0; j < nb && ok; j++) {
                const __m256i e = _mm256_srli_epi32(
                    _mm256_i32gather_epi32((const int *)(kr0 + Di / 2 + j - 3), vidx, 1), 24);
                emn = _mm256_min_epi32(emn, e);
                emx = _mm256_max_epi32(emx, e);
            }
            const __m256i bad = _mm256_or_si256(_mm256_cmpeq_epi32(emx, _mm256_set1_epi32(255)),
                                                _mm256_cmpgt_epi32(_mm256_sub_epi32(emx, emn), _mm256_set1_epi32(dk)));
            if (ok && _mm256_testz_si256(bad, bad)) {
                _mm256_storeu_si256((__m256i *)base, emn);
                for (csa_idx j = 0; j < nb; j++) _mm256_store_si256((__m256i *)(ekb + j * NK), emn);
                int32_t mn[8], mx[8];
                _mm256_storeu_si256((__m256i *)mn, emn);
                _mm256_storeu_si256((__m256i *)mx, emx);
                for (int l = 0; l < 8; l++) {
                    tmn = mn[l] < tmn ? mn[l] : tmn;
                    tmx = mx[l] > tmx ? mx[l] : tmx;
                    tde = mx[l] - mn[l] > tde ? mx[l] - mn[l] : tde;
                }
#endif
                for (csa_idx l = 0; l < NK; l++) nice[l] = 1;
                goto decode;
            }
        }
        for (csa_idx l = 0; l < NK; l++) {
            if (l >= nk) {
                for (csa_idx j = 0; j < nb; j++) ekb[j * NK + l] = 127;
                continue;
            }
            const uint8_t *kr = kb + (t + l) * p->skt;
            /* 64 rows (4 KiB) ahead: the pack runs at ~10 ns a row, a miss to memory
             * costs ~100 ns; 16 rows ahead left a stall on every row's first load */
            _mm_prefetch((const char *)(kr + 64 * p->skt), _MM_HINT_T0);
            int lo = 1 << 20, hi = -1;
            uint64_t nzm = 0;
            for (csa_idx j = 0; j < nb; j++) {
                const int e = kr[Di / 2 + j];
                const __m128i v = _mm_loadu_si128((const __m128i *)(kr + 16 * j));
                const int nz = !_mm_testz_si128(v, _mm_set1_epi8(0x77));
                kind = e == 0xff ? IX4_TILE_SCALAR : kind;
                tmx = e > tmx ? e : tmx;
                nzm |= (uint64_t)nz << (j & 63);
                lo = nz && e < lo ? e : lo;
                hi = nz && e > hi ? e : hi;
            }
            nice[l] = hi < 0 || hi - lo <= dk;
            base[l] = hi < 0 ? 127 : lo;
            tde = nice[l] && hi - lo > tde ? hi - lo : tde;
            if (!nice[l] && kind == IX4_TILE_FAST) kind = IX4_TILE_BLOCKS;
            tmx = base[l] > tmx ? base[l] : tmx;
            tmn = base[l] < tmn ? base[l] : tmn;
            if (nice[l]) {
                for (csa_idx j = 0; j < nb; j++) ekb[j * NK + l] = base[l];
            } else {
                for (csa_idx j = 0; j < nb; j++) {
                    const int e = kr[Di / 2 + j];
                    const int nz = j < 64 ? (int)((nzm >> j) & 1) : CSA_V(ix4_block_nz)(kr, j);
                    ekb[j * NK + l] = nz ? e : base[l];
                }
            }
        }
    decode:
        th[0] = kind;
        th[1] = tmn;
        th[2] = tmx;
        th[3] = tde; /* the largest prescale shift: |key byte - OFF| <= 12 << tde */
        for (csa_idx cb = 0; cb < nb; cb += IX4_BPC) {
            const csa_idx nbc = imin(IX4_BPC, nb - cb);
            vf lo4[IX4_NK], hi4[IX4_NK];
            for (csa_idx l = 0; l < NK; l++) {
                if (l >= nk) {
                    lo4[l] = hi4[l] = (vf)voff;
                    continue;
                }
                const uint8_t *kr = kb + (t + l) * p->skt + 16 * cb;
                __m128i tl[IX4_BPC];
                for (int j = 0; j < IX4_BPC; j++) {
                    /* a zero block's codes are +-0: any table gives the offset */
                    int de = j < nbc && nice[l] ? kr[Di / 2 - 15 * cb + j] - base[l] : 0;
                    de = de < 0 ? 0 : de > 3 ? 3 : de;
                    tl[j] = lut[de];
                }
#if defined(__AVX512F__)
                const vb v = _mm512_maskz_loadu_epi8(nbc == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * nbc)) - 1, kr);
                vb tz = _mm512_castsi128_si512(tl[0]);
                tz = _mm512_inserti32x4(tz, tl[1], 1);
                tz = _mm512_inserti32x4(tz, tl[2], 2);
                tz = _mm512_inserti32x4(tz, tl[3], 3);
                const vb c0 = _mm512_shuffle_epi8(tz, _mm512_and_si512(v, m4));
                const vb c1 = _mm512_shuffle_epi8(tz, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                lo4[l] = (vf)c0;
                hi4[l] = (vf)c1;
#else
                const vb v = nbc == 2 ? _mm256_loadu_si256((const __m256i *)kr)
                                      : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)kr), 0);
                const vb tz = _mm256_set_m128i(tl[1], tl[0]);
                const vb c0 = _mm256_shuffle_epi8(tz, _mm256_and_si256(v, m4));
                const vb c1 = _mm256_shuffle_epi8(tz, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                lo4[l] = (vf)c0;
                hi4[l] = (vf)c1;
#endif
            }
            /* lane j of lo4[l]: the even features' dwords 0, 2, 4, 6 of block cb + j of key
             * l (IX4_POS), hi4: the odd features' 1, 3, 5, 7 */
            CSA_V(ix_transpose)(lo4);
            CSA_V(ix_transpose)(hi4);
            for (csa_idx j = 0; j < nbc; j++)
                for (int u = 0; u < 4; u++) {
                    memcpy(kv + ((8 * (cb + j) + 2 * u) * NK) * 4, &lo4[4 * j + u], sizeof(vf));
                    memcpy(kv + ((8 * (cb + j) + 2 * u + 1) * NK) * 4, &hi4[4 * j + u], sizeof(vf));
                }
        }
    }
#undef IX4_BPC
#else
    (void)p;
    (void)b;
    (void)t0;
    (void)t1;
    (void)dst;
#endif
}

/* Scores of keys [t0, t1) by the oracle's own function (NaN scales, exponents out of
 * the exact range, the baseline level). */
static void CSA_V(ix4_scalar)(const struct ix_call *x, csa_idx b, csa_idx s, csa_idx t0,
                              csa_idx t1, float *o)
{
    const uint8_t *qr = x->qp + b * x->qpb + s * x->qps;
    for (csa_idx t = t0; t < t1; t++) o[t] = score_ref_fp4(x->p, qr, x->qph, b, s, t);
}

#if defined(__AVX512F__)
#ifdef IX4_HAVE_VNNI
#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni")
#define IX4B_NAME CSA_V(ix4_tiles_vnni)
#define IX4B_W 512
#define IX4B_VNNI 1
#include "index_fp4_body.h"
#undef IX4B_NAME
#undef IX4B_W
#undef IX4B_VNNI
CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
#endif
#define IX4B_NAME CSA_V(ix4_tiles_bw)
#define IX4B_W 512
#define IX4B_VNNI 0
#include "index_fp4_body.h"
#undef IX4B_NAME
#undef IX4B_W
#undef IX4B_VNNI
#elif defined(__AVX2__)
#define IX4B_NAME CSA_V(ix4_tiles_avx2)
#define IX4B_W 256
#define IX4B_VNNI 0
#include "index_fp4_body.h"
#undef IX4B_NAME
#undef IX4B_W
#undef IX4B_VNNI
#endif

#if defined(__AVX512F__)
/* The VNNI path where the CPU has it, else the VPMADDUBSW pairs. */
static void CSA_V(ix4_tiles_vnni_or_bw)(const struct ix_call *x, const uint8_t *qb, csa_idx b,
                                        csa_idx s, const uint8_t *kc, csa_idx kt0, csa_idx t0,
                                        csa_idx t1, const uint8_t *cm, csa_idx scn, csa_idx bs,
                                        float *o)
{
#ifdef IX4_HAVE_VNNI
    if (CSA_V(ix4_vnni)()) {
        CSA_V(ix4_tiles_vnni)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
        return;
    }
#endif
    CSA_V(ix4_tiles_bw)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
}
#endif

#ifdef IX4_HAVE_AMX
/* ------------------------------------------------------------------ AMX-INT8
 * The one-sum path on tiles: per key tile (16 keys) and head group (16 heads), one
 * TDPBSUD does C[16 heads x 16 keys] += A[16 heads x 64 query bytes, signed] .
 * B[64 key bytes x 16 keys, unsigned], B in the "VNNI" layout, row r holding dword r
 * (features 4r .. 4r+3) of each key: exactly the key tile's layout (dword f of key l at
 * (f * 16 + l) * 4), so a 64-feature chunk of a tile is a B tile read in place.  C
 * starts at each head's start value (-OFF * sum of its query bytes), so row h of C is
 * the accumulator the VNNI path has for head h: N_h of the 16 keys in the int32 lanes,
 * the same exact integers.  The float epilogue then runs the oracle's per-key steps in
 * head order as the VNNI path does, four key tiles side by side (four independent
 * chains of head sums: a chain's additions wait on each other, 4 cycles each).  With
 * the folded weights (ix4_pack_row) a head costs a conversion, two products, a max
 * and an addition; without (a weight that w 2^(eq - 129) would round, or a tile whose
 * keys' exponents leave N 2^(ek - 127) outside the normal range) the VNNI path's
 * scale 2^(ek + eq - 256) and w.  Only query rows whose heads are all prescaled and
 * FAST tiles come here; the others take the VNNI path (tile by tile) or the oracle's.
 *
 * Tiles (all 16 rows x 64 bytes, csa_amx_tiles_16x64): tmm0-3 C of four head groups
 * (64 heads a pass, passes in head order), tmm4 / tmm6 A (alternating, so a load
 * seldom waits for the product still reading its tile), tmm5 / tmm7 B (even / odd
 * chunks). */
#define IX4_AMX_FN                                                                         \
    static __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,"        \
                                 "amx-tile,amx-int8"),                                      \
                          noinline))

IX4_AMX_FN void CSA_V(ix4_amx_begin)(void) { csa_amx_tiles_16x64(); }

IX4_AMX_FN void CSA_V(ix4_amx_end)(void) { _tile_release(); }

/* C tiles 0 .. NG-1 of one key tile (B chunks at kv) against head groups g0 .. g0+NG-1
 * (A tiles at qa, start tiles at ci), stored to cb [NG][16 heads][16 keys]. */
#define IX4_AMX_DP(NG, BT, c)                                                              \
    do {                                                                                   \
        const int8_t *qc = qa + (g0 * NC + (c)) * 1024;                                    \
        _tile_loadd(BT, kv + (c) * 1024, 64);                                              \
        _tile_loadd(4, qc, 64);                                                            \
        _tile_dpbsud(0, 4, BT);                                                            \
        if (NG > 1) {                                                                      \
            _tile_loadd(6, qc + NC * 1024, 64);                                            \
            _tile_dpbsud(1, 6, BT);                                                        \
        }                                                                                  \
        if (NG > 2) {                                                                      \
            _tile_loadd(4, qc + 2 * NC * 1024, 64);                                        \
            _tile_dpbsud(2, 4, BT);                                                        \
        }                                                                                  \
        if (NG > 3) {                                                                      \
            _tile_loadd(6, qc + 3 * NC * 1024, 64);                                        \
            _tile_dpbsud(3, 6, BT);                                                        \
        }                                                                                  \
    } while (0)
#define IX4_AMX_C(NG)                                                                      \
    do {                                                                                   \
        _tile_loadd(0, ci + g0 * 256, 64);                                                 \
        if (NG > 1) _tile_loadd(1, ci + (g0 + 1) * 256, 64);                               \
        if (NG > 2) _tile_loadd(2, ci + (g0 + 2) * 256, 64);                               \
        if (NG > 3) _tile_loadd(3, ci + (g0 + 3) * 256, 64);                               \
        csa_idx c = 0;                                                                     \
        for (; c + 2 <= NC; c += 2) {                                                      \
            IX4_AMX_DP(NG, 5, c);                                                          \
            IX4_AMX_DP(NG, 7, c + 1);                                                      \
        }                                                                                  \
        if (c < NC) IX4_AMX_DP(NG, 5, c);                                                  \
        _tile_stored(0, cb, 64);                                                           \
        if (NG > 1) _tile_stored(1, cb + 256, 64);                                         \
        if (NG > 2) _tile_stored(2, cb + 512, 64);                                         \
        if (NG > 3) _tile_stored(3, cb + 768, 64);                                         \
    } while (0)

/* tot + relu(x * sk) * wv for four key tiles at once, heads h0 .. h1-1 (x: their C
 * rows, cb[i] + (h - h0) * 16; ek: 2^(ek - 127) per key as float32 bits; with fold,
 * x 2^(ek - 127) then the folded weights wv, else x 2^(ek + eq - 256) then the weights w). */
static inline __attribute__((always_inline)) void
CSA_V(ix4_amx_epi)(const int fold, const int32_t *const cb[4], csa_idx h0, csa_idx h1,
                   const __m512i ek[4], const int32_t *heqf, const float *wv, __m512 tot[4])
{
    const __m512 zero = _mm512_setzero_ps();
    for (csa_idx h = h0; h < h1; h++) {
        const __m512 w = _mm512_set1_ps(wv[h]);
        const __m512i eq = _mm512_set1_epi32(fold ? 0 : (int32_t)((uint32_t)(heqf[h] - 129) << 23));
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512 x = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb[i] + (h - h0) * 16)));
            const __m512 sc = _mm512_castsi512_ps(fold ? ek[i] : _mm512_add_epi32(ek[i], eq));
            __m512 m = _mm512_mul_ps(_mm512_max_ps(zero, _mm512_mul_ps(x, sc)), w);
            __asm__("" : "+v"(m)); /* rounded on its own, as in the oracle */
            tot[i] = _mm512_add_ps(tot[i], m);
        }
    }
}

/* Scores of query row (b, s), packed in qb, against keys [t0, t1) laid out in kc from
 * kt0 = t0 (ix4_tiles_vnni's contract), on the tiles. */
IX4_AMX_FN void CSA_V(ix4_tiles_amx)(const struct ix_call *x, const uint8_t *qb, csa_idx b,
                                     csa_idx s, const uint8_t *kc, csa_idx kt0, csa_idx t0,
                                     csa_idx t1, const uint8_t *cm, csa_idx scn, csa_idx bs,
                                     float *o)
{
    const struct csa_index_problem *p = x->p;
    const csa_idx Hi = p->Hi, Di = p->Di, nb = Di / 32, HG = (Hi + 15) / 16, NC = (Di + 63) / 64;
    struct CSA_V(ix4_geo) g;
    CSA_V(ix4_row_geo)(p, &g);
    const int32_t *qh = (const int32_t *)qb;
    if (!qh[4]) { /* a head past the prescaled reach: the VNNI path's block sums */
        CSA_V(ix4_tiles_vnni_or_bw)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
        return;
    }
    const size_t TB = CSA_V(ix4_tile_bytes)(Di, 16);
    const int8_t *qa = (const int8_t *)(qb + g.qa);
    const int32_t *ci = (const int32_t *)(qb + g.ci), *heqf = (const int32_t *)(qb + g.heqf);
    const float *w = (const float *)(qb + g.w), *wf = (const float *)(qb + g.wf);
    int32_t cbuf[4][1024] __attribute__((aligned(64)));
    __asm__ volatile("" ::: "memory"); /* the tile loads read the packed row */
    for (csa_idx t = t0; t < t1;) {
        /* up to four FAST tiles of the range, the others scored on the way */
        __m512i ek[4];
        csa_idx tt[4];
        int n = 0, fold = qh[5];
        for (; t < t1 && n < 4; t += 16) {
            const csa_idx nk = imin(16, t1 - t);
            if (cand_tile_skipped(cm, scn, bs, t, nk)) continue;
            const uint8_t *tile = kc + (size_t)((t - kt0) / 16) * TB;
            const int32_t *th = (const int32_t *)tile;
            if (qh[0] || th[0] == IX4_TILE_SCALAR || th[1] + qh[1] < 130 || th[2] + qh[2] > 360) {
                CSA_V(ix4_scalar)(x, b, s, t, t + nk, o);
                continue;
            }
            if (th[0] != IX4_TILE_FAST) {
                CSA_V(ix4_tiles_vnni_or_bw)(x, qb, b, s, kc, kt0, t, t + nk, cm, scn, bs, o);
                continue;
            }
            /* N 2^(ek - 127) exact and normal: |N| < 2^24, every base ek in [1, 230] */
            fold &= th[1] >= 1 && th[2] <= 230;
            ek[n] = _mm512_slli_epi32(_mm512_load_si512((const void *)(tile + 64)), 23);
            tt[n++] = t;
        }
        if (!n) continue;
        const int32_t *cbp[4];
        for (int i = 0; i < 4; i++) { /* unused chains repeat tile 0: computed and dropped */
            cbp[i] = cbuf[i < n ? i : 0];
            ek[i] = ek[i < n ? i : 0];
        }
        __m512 tot[4];
        for (int i = 0; i < 4; i++) tot[i] = _mm512_setzero_ps();
        for (csa_idx g0 = 0; g0 < HG; g0 += 4) {
            const csa_idx ng = imin(4, HG - g0);
            for (int i = 0; i < n; i++) {
                const uint8_t *kv = kc + (size_t)((tt[i] - kt0) / 16) * TB + 64 + (size_t)nb * 64;
                int32_t *cb = cbuf[i];
                switch (ng) {
                case 4: IX4_AMX_C(4); break;
                case 3: IX4_AMX_C(3); break;
                case 2: IX4_AMX_C(2); break;
                default: IX4_AMX_C(1); break;
                }
            }
            __asm__ volatile("" ::: "memory"); /* the vector loads read the stored C */
            const csa_idx h1 = imin(Hi, 16 * (g0 + ng));
            if (fold)
                CSA_V(ix4_amx_epi)(1, cbp, 16 * g0, h1, ek, heqf, wf, tot);
            else
                CSA_V(ix4_amx_epi)(0, cbp, 16 * g0, h1, ek, heqf, w, tot);
        }
        for (int i = 0; i < n; i++) {
            const csa_idx nk = imin(16, t1 - tt[i]);
            _mm512_mask_storeu_ps(o + tt[i], (__mmask16)((1u << nk) - 1u), tot[i]);
        }
    }
}
#undef IX4_AMX_DP
#undef IX4_AMX_C
#undef IX4_AMX_FN
#endif

/* Scores of the packed FP4 query row qb against keys [t0, t1) laid out in kc from
 * kt0 (= t0, a tile boundary). */
static void CSA_V(ix4_score_row)(const struct ix_call *x, const uint8_t *qb, csa_idx b,
                                 csa_idx s, const uint8_t *kc, csa_idx kt0, csa_idx t0,
                                 csa_idx t1, const uint8_t *cm, csa_idx scn, csa_idx bs,
                                 float *o)
{
#if defined(__AVX512F__)
#ifdef IX4_HAVE_AMX
    if (CSA_V(ix4_amx)() && !x->p->bf16_steps) { /* the AMX epilogue has no bf16 steps */
        CSA_V(ix4_tiles_amx)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
        return;
    }
#endif
    CSA_V(ix4_tiles_vnni_or_bw)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
#elif defined(__AVX2__)
    CSA_V(ix4_tiles_avx2)(x, qb, b, s, kc, kt0, t0, t1, cm, scn, bs, o);
#else
    (void)qb;
    (void)kc;
    (void)kt0;
    for (csa_idx t = t0; t < t1; t += IX_FK) {
        const csa_idx nk = imin(IX_FK, t1 - t);
        if (!cand_tile_skipped(cm, scn, bs, t, nk)) CSA_V(ix4_scalar)(x, b, s, t, t + nk, o);
    }
#endif
}
