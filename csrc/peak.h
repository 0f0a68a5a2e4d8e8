/* Micro-kernels that measure this machine's ceilings for the benchmarks. */
#ifndef CSA_PEAK_H
#define CSA_PEAK_H
#include "csa.h"

/* Runs `iters` rounds of independent fp32 FMAs on `threads` threads at the CURRENT ISA
 * level (csa_isa_get: the ceiling of the kernels that run at that level), with that
 * level's vector width and enough accumulators to cover FMA latency x ports without
 * spilling (peak_impl.h); returns the flops done (2 per lane per FMA; SSE2, which
 * has no FMA, does a multiply and an add).  sink keeps the result alive. */
double csa_peak_fma(long long iters, int threads, float *sink);

/* The number of accumulators csa_peak_fma uses at the current level, and its vector
 * width in bytes in *vec_bytes ('ref': one scalar chain, 1 and 4). */
int csa_peak_fma_shape(int *vec_bytes);

/* Runs `iters` rounds of independent 8-bit integer dot products on `threads` threads at
 * the CURRENT ISA level, in the instruction mix of the FP4 indexer (peak_impl.h):
 * VPDPBUSD at avx512 / amx where the CPU has AVX512_VNNI (csa_cpu_features), else
 * VPMADDUBSW pairs widened by VPMADDWD (zmm at avx512, ymm at avx2), scalar below;
 * returns the integer ops done (2 per byte product). */
double csa_peak_idot(long long iters, int threads, float *sink);

/* csa_peak_idot's accumulator count at the current level; *vec_bytes its vector width
 * in bytes, *vnni 1 where it runs VPDPBUSD. */
int csa_peak_idot_shape(int *vec_bytes, int *vnni);

/* Runs `iters` rounds of four independent AMX-BF16 tile products (16 x 16 x 32 each)
 * on `threads` threads; returns the flops done, or 0 below ISA level amx (no AMX in
 * this CPU, this build, or at the level set): the caller reports no AMX peak then. */
double csa_peak_amx_bf16(long long iters, int threads, float *sink);

/* STREAM triad a[i] = b[i] + s * c[i] over n floats, on `threads` threads. */
void csa_stream_triad(float *a, const float *b, const float *c, csa_idx n, float s, int threads);

/* A read-only stream at the CURRENT ISA level: the n floats at b summed on `threads`
 * threads, each thread one contiguous share into four vector sums of the level's width
 * (no FMA, no decode: the reads are all there is) -- what a decode GEMV reading the
 * same bytes once could reach.  The sum, whose rounding depends on the thread count,
 * only keeps the reads alive. */
float csa_stream_read(const float *b, csa_idx n, int threads);
#endif
