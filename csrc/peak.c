#include "peak.h"

static double peak_ref(long long iters, int threads, float *sink)
{
    (void)threads;
    float acc = 1.0f;
    for (long long i = 0; i < iters; i++) acc = acc * 0.999999f + 1e-7f;
    *sink += acc;
    return (double)iters * 2;
}

#define CSA_IMPL "peak_impl.h"
#include "csa_isa_variants.h"

double csa_peak_fma(long long iters, int threads, float *sink)
{
    CSA_DISPATCH(peak_fma, (iters, threads, sink), peak_ref(iters, threads, sink));
}

void csa_stream_triad(float *a, const float *b, const float *c, csa_idx n, float s, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (csa_idx i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
