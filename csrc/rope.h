/* Rotary position embedding with YaRN (docs/kernels.md, section 2). */
#ifndef CSA_ROPE_H
#define CSA_ROPE_H
#include "csa.h"

/* cos, sin: [seqlen, rope_dim/2], contiguous.  YaRN applies when original_seq_len > 0. */
int csa_rope_table(float *cos_out, float *sin_out, csa_idx seqlen, csa_idx rope_dim,
                   double base, csa_idx original_seq_len, double factor,
                   double beta_fast, double beta_slow);

/* Rotates, in place, `half` adjacent pairs (x[2i], x[2i+1]) of each vector of
 * x: [n0, n1, n2, 2*half] (strides s0..s3) by the angle whose cos/sin are
 * cos[i1, i], sin[i1, i] (row strides scr/ssr, inner strides scc/ssc): the rows of
 * the tables follow axis 1 of x.  `inverse` rotates by minus the angle. */
int csa_apply_rope(float *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                   csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                   const float *cos, csa_idx scr, csa_idx scc,
                   const float *sin, csa_idx ssr, csa_idx ssc, int inverse);
int csa_apply_rope_ref(float *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                       csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                       const float *cos, csa_idx scr, csa_idx scc,
                       const float *sin, csa_idx ssr, csa_idx ssc, int inverse);

/* The same on bfloat16 x: rotated in float32, rounded to bfloat16 on store. */
int csa_apply_rope_bf16(csa_bf16 *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                        csa_idx s0, csa_idx s1, csa_idx s2, csa_idx s3,
                        const float *cos, csa_idx scr, csa_idx scc,
                        const float *sin, csa_idx ssr, csa_idx ssc, int inverse);
#endif
