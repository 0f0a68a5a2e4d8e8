/* 16 independent accumulator vectors: enough to cover FMA latency x 2 ports. */
typedef float CSA_V(vec) __attribute__((vector_size(64), aligned(64)));

static double CSA_V(peak_fma)(long long iters, int threads, float *sink)
{
#pragma omp parallel num_threads(threads)
    {
        CSA_V(vec) acc[16];
        CSA_V(vec) m, a;
        for (int l = 0; l < 16; l++) {
            m[l] = 0.999999f;
            a[l] = 1e-7f;
        }
        for (int k = 0; k < 16; k++) acc[k] = m * (float)(k + 1);
        for (long long i = 0; i < iters; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) acc[k] = acc[k] * m + a;
        }
        CSA_V(vec) s = acc[0];
        for (int k = 1; k < 16; k++) s += acc[k];
        float t = 0;
        for (int l = 0; l < 16; l++) t += s[l];
#pragma omp atomic
        *sink += t;
    }
    return (double)iters * threads * 16 * 16 * 2;
}
