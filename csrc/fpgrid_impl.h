/* The float grids of the FP8 (e4m3) and FP4 (e2m1) formats, shared by the QAT
 * rounding (quant.c) and the quantizers to codes (qpack.c): one construction, so the
 * two give the same bits.  Internal: static inline, no symbols. */
#ifndef CSA_FPGRID_IMPL_H
#define CSA_FPGRID_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t q_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float q_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The block's amax as a float: the largest magnitude by its bits, so a NaN (whose bits
 * exceed +inf's) wins and propagates to the scale, as the released amax does.  An
 * unsigned max is order-free, so the vectorized reduction gives the same bits. */
static inline __attribute__((always_inline)) float q_block_amax(const float *xb, ptrdiff_t block)
{
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (ptrdiff_t i = 0; i < block; i++) {
        const uint32_t u = q_bits(xb[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    return q_float(m);
}

/* Rounds v (|v| at most the grid's max, or NaN) to nearest-even on a float grid with
 * `mbits` mantissa bits whose smallest normal binade has biased float32 exponent
 * field `emin` (pre-shifted by 23): below it the step stays that of the smallest
 * binade (subnormals).  c = step * 2^23, so a + c lands where the float32 ulp IS the
 * step and the hardware's nearest-even addition does the rounding; subtracting c
 * again is exact.  A carry into the next binade comes out right by itself.  The sign
 * bit is put back afterwards, so -0 stays -0; NaN + c stays NaN. */
static inline float q_round_grid(float v, uint32_t emin, uint32_t c_shift)
{
    const uint32_t b = q_bits(v);
    const uint32_t e0 = b & 0x7f800000u;
    const uint32_t e = e0 > emin ? e0 : emin;
    const float c = q_float(e + c_shift);
    const float a = q_float(b & 0x7fffffffu);
    const float r = (a + c) - c;
    return q_float(q_bits(r) | (b & 0x80000000u));
}

/* e4m3: 3 mantissa bits, smallest normal 2^-6 (step 2^-9 below it): c = 2^(E + 20).
 * e2m1: 1 mantissa bit, smallest normal 2^0 (step 0.5 below it):  c = 2^(E + 22). */
#define Q_E4M3_EMIN ((uint32_t)(127 - 6) << 23)
#define Q_E4M3_CSHIFT ((uint32_t)20 << 23)
#define Q_E2M1_EMIN ((uint32_t)127 << 23)
#define Q_E2M1_CSHIFT ((uint32_t)22 << 23)

#endif
