/* Micro-kernels that measure this machine's ceilings for the benchmarks. */
#ifndef CSA_PEAK_H
#define CSA_PEAK_H
#include "csa.h"

/* Runs `iters` rounds of independent fp32 FMAs on `threads` threads at the best ISA
 * level; returns the flops done (2 per lane per FMA).  sink keeps the result alive. */
double csa_peak_fma(long long iters, int threads, float *sink);

/* Runs `iters` rounds of four independent AMX-BF16 tile products (16 x 16 x 32 each)
 * on `threads` threads; returns the flops done, or 0 below ISA level amx. */
double csa_peak_amx_bf16(long long iters, int threads, float *sink);

/* STREAM triad a[i] = b[i] + s * c[i] over n floats, on `threads` threads. */
void csa_stream_triad(float *a, const float *b, const float *c, csa_idx n, float s, int threads);
#endif
