/* fp32 FMA peak body, compiled once per ISA level by csa_isa_variants.h.
 *
 * A peak needs as many independent accumulator chains as FMA latency x FMA ports
 * (4 cycles x 2 ports = 8 on Zen 2-4 and Skylake-class cores; 10-12 keeps Haswell's
 * 5-cycle FMA busy) and all of them in registers: a chain that spills turns every
 * FMA into a load-FMA-store and measures the store port instead (16 accumulators of
 * 64 bytes on AVX2 need 32 ymm registers out of 16, which reported 12.7 GFLOP/s on a
 * host whose true AVX2 peak is ~200).  Per level (GCC defines __AVX2__ / __AVX512F__
 * inside the `#pragma GCC target` regions):
 *   avx512, amx:  16 x 64 B (zmm), of 32 registers
 *   avx2:         12 x 32 B (ymm), of 16 registers (+2 for the constants)
 *   base x86-64:  12 x 16 B (xmm), SSE2 has no FMA: a multiply and an add, still 2 flops
 *   base other:   16 x 16 B (NEON q registers: 32 of them; FMLA latency 4, 2-4 pipes) */
#if defined(__AVX512F__)
#define PK_BYTES 64
#define PK_ACC 16
#elif defined(__AVX2__) || defined(__FMA__)
#define PK_BYTES 32
#define PK_ACC 12
#elif defined(__x86_64__)
#define PK_BYTES 16
#define PK_ACC 12
#else
#define PK_BYTES 16
#define PK_ACC 16
#endif
#define PK_LANES (PK_BYTES / 4)

typedef float CSA_V(pkvec) __attribute__((vector_size(PK_BYTES), aligned(PK_BYTES)));

/* The read probe (csa_stream_read) at this level's vector width, four accumulators.
 * The width matters to a stream from memory: one Sapphire Rapids core (KVM) read 34 MB
 * cold at 12.8 GB/s with 16-byte loads, 16.0 with 32-byte and 20.2 with 64-byte ones
 * (2 threads: 31.8, 35.1, 44.3 GB/s): a narrower loop has more instructions per line in
 * the out-of-order window, so fewer lines in flight. */
static float CSA_V(stream_read)(const float *b, csa_idx n, int threads)
{
    float part[256] = {0};
    if (threads > 256) threads = 256;
#pragma omp parallel num_threads(threads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const csa_idx lo = n * t / nt, hi = n * (t + 1) / nt;
        CSA_V(pkvec) acc[4];
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < PK_LANES; l++) acc[j][l] = 0.0f;
        csa_idx i = lo;
        for (; i + 4 * PK_LANES <= hi; i += 4 * PK_LANES)
            for (int j = 0; j < 4; j++) {
                CSA_V(pkvec) x;
                memcpy(&x, b + i + j * PK_LANES, sizeof x);
                acc[j] += x;
            }
        float s = 0.0f;
        for (; i < hi; i++) s += b[i];
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < PK_LANES; l++) s += acc[j][l];
        part[t] = s;
    }
    float s = 0.0f;
    for (int t = 0; t < threads; t++) s += part[t];
    return s;
}

static int CSA_V(peak_fma_shape)(int *vec_bytes)
{
    *vec_bytes = PK_BYTES;
    return PK_ACC;
}

static double CSA_V(peak_fma)(long long iters, int threads, float *sink)
{
#pragma omp parallel num_threads(threads)
    {
        CSA_V(pkvec) acc[PK_ACC];
        CSA_V(pkvec) m, a;
        for (int l = 0; l < PK_LANES; l++) {
            m[l] = 0.999999f;
            a[l] = 1e-7f;
        }
        for (int k = 0; k < PK_ACC; k++) acc[k] = m * (float)(k + 1);
        for (long long i = 0; i < iters; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < PK_ACC; k++) acc[k] = acc[k] * m + a;
        }
        CSA_V(pkvec) s = acc[0];
        for (int k = 1; k < PK_ACC; k++) s += acc[k];
        float t = 0;
        for (int l = 0; l < PK_LANES; l++) t += s[l];
#pragma omp atomic
        *sink += t;
    }
#ifndef _OPENMP
    threads = 1; /* serial build: one thread ran, whatever was asked */
#endif
    return (double)iters * threads * PK_ACC * PK_LANES * 2;
}


/* ---- integer dot-product peak: the instruction mix of the FP4 indexer's dot products
 * (index_fp4_body.h): VPDPBUSD (64 byte products an instruction) on the avx512 / amx
 * levels when the CPU has AVX512_VNNI (csa_cpu_features), else VPMADDUBSW whose int16
 * sums are added into int16 accumulators by VPADDW (the one-sum path's int16 lanes,
 * widened once a head: 64 products, 2 instructions, zmm or ymm), scalar byte products at 'base'.  Counted as
 * 2 integer ops a product (multiply, add), comparable to the FMA peak's flops.
 * VPDPBUSD has latency 5 on Intel and AMD: 10 chains cover one or two ports.  The
 * asm barrier on the operands keeps the compiler from folding constant products. */
#define PKI_ACC 10
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
#if defined(__clang__)
CSA_TARGET_POP
#endif
CSA_TARGET_PUSH512("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni")
static double CSA_V(peak_idot_vnni)(long long iters, int threads, float *sink)
{
#pragma omp parallel num_threads(threads)
    {
        __m512i acc[PKI_ACC];
        __m512i a = _mm512_set1_epi8(3), bq = _mm512_set1_epi8(-2);
        for (int k = 0; k < PKI_ACC; k++) acc[k] = _mm512_set1_epi32(k);
        for (long long i = 0; i < iters; i++) {
            __asm__("" : "+v"(a), "+v"(bq));
#pragma GCC unroll 16
            for (int k = 0; k < PKI_ACC; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, bq);
        }
        __m512i s = acc[0];
        for (int k = 1; k < PKI_ACC; k++) s = _mm512_add_epi32(s, acc[k]);
        const float t = (float)_mm512_reduce_add_epi32(s);
#pragma omp atomic
        *sink += t;
    }
#ifndef _OPENMP
    threads = 1;
#endif
    return (double)iters * threads * PKI_ACC * 64 * 2;
}
CSA_TARGET_POP
#if defined(__clang__)
CSA_TARGET_PUSH512(CSA_TARGET_AVX512)
#endif
#endif

#if defined(__AVX2__)
#if defined(__AVX512F__)
typedef __m512i CSA_V(pkiv);
#define PKI_MADDUBS _mm512_maddubs_epi16
#define PKI_ADD16 _mm512_add_epi16
#define PKI_MADD _mm512_madd_epi16
#define PKI_ADD32 _mm512_add_epi32
#define PKI_SET8 _mm512_set1_epi8
#define PKI_SET16 _mm512_set1_epi16
#define PKI_SET32 _mm512_set1_epi32
#define PKI_BYTES 64
#else
typedef __m256i CSA_V(pkiv);
#define PKI_MADDUBS _mm256_maddubs_epi16
#define PKI_ADD16 _mm256_add_epi16
#define PKI_MADD _mm256_madd_epi16
#define PKI_ADD32 _mm256_add_epi32
#define PKI_SET8 _mm256_set1_epi8
#define PKI_SET16 _mm256_set1_epi16
#define PKI_SET32 _mm256_set1_epi32
#define PKI_BYTES 32
#endif
/* 16 registers on AVX2: 6 chains + operands and the int16 temporaries */
#define PKI_ACC_MB (PKI_BYTES == 64 ? 10 : 6)
static double CSA_V(peak_idot_mb)(long long iters, int threads, float *sink)
{
#pragma omp parallel num_threads(threads)
    {
        CSA_V(pkiv) acc[PKI_ACC_MB];
        CSA_V(pkiv) a = PKI_SET8(3), bq = PKI_SET8(-2), one = PKI_SET16(1);
        for (int k = 0; k < PKI_ACC_MB; k++) acc[k] = PKI_SET32(k);
        for (long long i = 0; i < iters; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < PKI_ACC_MB; k++) {
                /* a barrier per chain: the products do not depend on the accumulator,
                 * and without it one pair of VPMADDUBSW served all chains */
                __asm__("" : "+v"(a), "+v"(bq));
                acc[k] = PKI_ADD16(acc[k], PKI_ADD16(PKI_MADDUBS(a, bq), PKI_MADDUBS(bq, a)));
            }
        }
        int32_t lanes[PKI_BYTES / 4];
        CSA_V(pkiv) s = PKI_MADD(acc[0], one);
        for (int k = 1; k < PKI_ACC_MB; k++) s = PKI_ADD32(s, PKI_MADD(acc[k], one));
        memcpy(lanes, &s, sizeof lanes);
        float t = 0;
        for (int l = 0; l < PKI_BYTES / 4; l++) t += (float)lanes[l];
#pragma omp atomic
        *sink += t;
    }
#ifndef _OPENMP
    threads = 1;
#endif
    return (double)iters * threads * PKI_ACC_MB * 2 * PKI_BYTES * 2;
}
#endif

static int CSA_V(peak_idot_shape)(int *vec_bytes, int *vnni)
{
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
    if (csa_cpu_features() & CSA_CPU_VNNI_VBMI) {
        *vec_bytes = 64;
        *vnni = 1;
        return PKI_ACC;
    }
#endif
    *vnni = 0;
#if defined(__AVX2__)
    *vec_bytes = PKI_BYTES;
    return PKI_ACC_MB;
#else
    *vec_bytes = 4;
    return PKI_ACC;
#endif
}

static double CSA_V(peak_idot)(long long iters, int threads, float *sink)
{
#if defined(__AVX512F__) && defined(CSA_HAVE_AMX)
    if (csa_cpu_features() & CSA_CPU_VNNI_VBMI) return CSA_V(peak_idot_vnni)(iters, threads, sink);
#endif
#if defined(__AVX2__)
    return CSA_V(peak_idot_mb)(iters, threads, sink);
#else
#pragma omp parallel num_threads(threads)
    {
        int32_t acc[PKI_ACC];
        int32_t a = 3, bq = -2;
        for (int k = 0; k < PKI_ACC; k++) acc[k] = k;
        for (long long i = 0; i < iters; i++) {
            for (int k = 0; k < PKI_ACC; k++) {
                __asm__("" : "+r"(a), "+r"(bq)); /* one product a chain, not one for all */
                acc[k] += a * bq;
            }
        }
        int32_t s = 0;
        for (int k = 0; k < PKI_ACC; k++) s += acc[k];
#pragma omp atomic
        *sink += (float)s;
    }
#ifndef _OPENMP
    threads = 1;
#endif
    return (double)iters * threads * PKI_ACC * 2;
#endif
}
#ifdef PKI_BYTES
#undef PKI_MADDUBS
#undef PKI_ADD16
#undef PKI_MADD
#undef PKI_ADD32
#undef PKI_SET8
#undef PKI_SET16
#undef PKI_SET32
#undef PKI_BYTES
#undef PKI_ACC_MB
#endif
#undef PKI_ACC

#undef PK_BYTES
#undef PK_ACC
#undef PK_LANES
