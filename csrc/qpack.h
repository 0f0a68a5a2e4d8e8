/* Quantization to codes and scales (docs/kernels.md section 9: the released `act_quant` and
 * `fp4_act_quant` when not in place).  The same per-block arithmetic as
 * csa_quant_round (quant.h: amax, floor, scale rule, x / s, clamp, nearest-even onto
 * the grid), but the rounded values are stored as their codes instead of being
 * multiplied back:
 *   CSA_Q_E4M3: q [rows, d] e4m3fn bytes (NaN -> 0x7f with its sign);
 *   CSA_Q_E2M1: q [rows, d / 2] two e2m1 codes a byte, element 2i in the low nibble
 *               (torch's float4_e2m1fn_x2); a NaN value (a NaN block) encodes as +-0,
 *               its scale carries the NaN.
 * Scales s [rows, d / block] as float32 (s_bytes = 0) or as bytes (s_bytes = 1):
 * e8m0 (the exponent field; inf and NaN -> 0xff) for CSA_QS_UE8M0 scales, e4m3 for
 * CSA_QS_E4M3 scales; CSA_QS_FP32 scales cannot be bytes (CSA_EINVAL).
 * x: float32 or (x_bf16) bfloat16 [rows, d], strides in elements; d % block == 0,
 * and for E2M1 block and d even.  dequantize(q) * s is bitwise csa_quant_round. */
#ifndef CSA_QPACK_H
#define CSA_QPACK_H
#include "csa.h"

int csa_quant_pack(const void *x, int x_bf16, csa_idx rows, csa_idx d, csa_idx sx_row,
                   csa_idx sx_col, csa_idx block, int fmt, int scale, uint8_t *q,
                   csa_idx sq_row, void *s, int s_bytes, csa_idx ss_row, csa_idx ss_col);
int csa_quant_pack_ref(const void *x, int x_bf16, csa_idx rows, csa_idx d, csa_idx sx_row,
                       csa_idx sx_col, csa_idx block, int fmt, int scale, uint8_t *q,
                       csa_idx sq_row, void *s, int s_bytes, csa_idx ss_row, csa_idx ss_col);
#endif
