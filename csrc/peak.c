#include "peak.h"

#include "amx.h"

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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

static int peak_ref_shape(int *vec_bytes)
{
    *vec_bytes = 4;
    return 1;
}

double csa_peak_fma(long long iters, int threads, float *sink)
{
    CSA_DISPATCH(peak_fma, (iters, threads, sink), peak_ref(iters, threads, sink));
}

int csa_peak_fma_shape(int *vec_bytes)
{
    CSA_DISPATCH(peak_fma_shape, (vec_bytes), peak_ref_shape(vec_bytes));
}

static double peak_idot_ref(long long iters, int threads, float *sink)
{
    (void)threads;
    int32_t acc = 1, a = 3, b = -2;
    for (long long i = 0; i < iters; i++) {
        __asm__("" : "+r"(a), "+r"(b));
        acc += a * b;
    }
    *sink += (float)acc;
    return (double)iters * 2;
}

static int peak_idot_ref_shape(int *vec_bytes, int *vnni)
{
    *vec_bytes = 4;
    *vnni = 0;
    return 1;
}

double csa_peak_idot(long long iters, int threads, float *sink)
{
    CSA_DISPATCH(peak_idot, (iters, threads, sink), peak_idot_ref(iters, threads, sink));
}

int csa_peak_idot_shape(int *vec_bytes, int *vnni)
{
    CSA_DISPATCH(peak_idot_shape, (vec_bytes, vnni), peak_idot_ref_shape(vec_bytes, vnni));
}

void csa_stream_triad(float *a, const float *b, const float *c, csa_idx n, float s, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (csa_idx i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}

static float stream_read_ref(const float *b, csa_idx n, int threads)
{
    (void)threads;
    float s = 0.0f;
    for (csa_idx i = 0; i < n; i++) s += b[i];
    return s;
}

float csa_stream_read(const float *b, csa_idx n, int threads)
{
    CSA_DISPATCH(stream_read, (b, n, threads), stream_read_ref(b, n, threads));
}

#if defined(CSA_HAVE_AMX)
CSA_TARGET_PUSH("avx512f,avx512bf16,amx-tile,amx-bf16")
static void amx_peak_thread(long long iters, float *sink)
{
    csa_amx_tiles_16x64();
    uint16_t ab[16 * 32];
    float out[16 * 16];
    for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3c00; /* 2^-7: sums stay finite */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    for (long long i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    *sink += out[0];
}
CSA_TARGET_POP
#endif

double csa_peak_amx_bf16(long long iters, int threads, float *sink)
{
#if defined(CSA_HAVE_AMX)
    if (csa_isa_get() < CSA_ISA_AMX) return 0.0;
#ifndef _OPENMP
    threads = 1;
#endif
    float s = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : s)
    amx_peak_thread(iters, &s);
    *sink += s;
    return (double)iters * threads * 4 * (16.0 * 16 * 32 * 2);
#else
    (void)iters;
    (void)threads;
    (void)sink;
    return 0.0;
#endif
}
