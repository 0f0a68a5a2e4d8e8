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

#undef PK_BYTES
#undef PK_ACC
#undef PK_LANES
