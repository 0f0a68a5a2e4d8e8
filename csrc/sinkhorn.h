/* Hyper-connection split with Sinkhorn normalisation (docs/kernels.md section 9: the released
 * `hc_split_sinkhorn`), float32, per token row of `mixes` [(2 + h) * h]:
 *   pre[i]  = sigmoid(fma(mixes[i], sc[0], base[i])) + eps
 *   post[i] = 2 * sigmoid(fma(mixes[h + i], sc[1], base[h + i]))
 *   comb    = fma(mixes[2h:], sc[2], base[2h:]) viewed [h, h]
 *   comb    = softmax(comb, last axis) + eps           (max subtracted, expf)
 *   comb   /= column sums + eps                        (sums in index order)
 *   iters - 1 times: comb /= row sums + eps; comb /= column sums + eps
 * sigmoid(x) = 1 / (1 + expf(-x)).  mixes rows with unit inner stride and row stride
 * smix_row; hc_scale [3]; hc_base [(2 + h) * h]; outputs contiguous pre [rows, h],
 * post [rows, h], comb [rows, h, h].  h in [1, 64], iters >= 1 (else CSA_EINVAL). */
#ifndef CSA_SINKHORN_H
#define CSA_SINKHORN_H
#include "csa.h"

int csa_hc_sinkhorn(const float *mixes, csa_idx rows, csa_idx smix_row, const float *hc_scale,
                    const float *hc_base, int h, int iters, float eps, float *pre, float *post,
                    float *comb);
int csa_hc_sinkhorn_ref(const float *mixes, csa_idx rows, csa_idx smix_row,
                        const float *hc_scale, const float *hc_base, int h, int iters,
                        float eps, float *pre, float *post, float *comb);
#endif
