#include "sinkhorn.h"

#include <math.h>

static inline float s_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

int csa_hc_sinkhorn_ref(const float *mixes, csa_idx rows, csa_idx smix_row,
                        const float *hc_scale, const float *hc_base, int h, int iters,
                        float eps, float *pre, float *post, float *comb)
{
    if (h < 1 || h > 64 || iters < 1) return CSA_EINVAL;
    for (csa_idx r = 0; r < rows; r++) {
        const float *m = mixes + r * smix_row;
        float *c = comb + r * h * h;
        for (int i = 0; i < h; i++) {
            pre[r * h + i] = s_sigmoid(fmaf(m[i], hc_scale[0], hc_base[i])) + eps;
            post[r * h + i] = 2.0f * s_sigmoid(fmaf(m[h + i], hc_scale[1], hc_base[h + i]));
        }
        for (int i = 0; i < h * h; i++) c[i] = fmaf(m[2 * h + i], hc_scale[2], hc_base[2 * h + i]);
        for (int i = 0; i < h; i++) {
            float mx = c[i * h];
            for (int j = 1; j < h; j++) mx = c[i * h + j] > mx ? c[i * h + j] : mx;
            float sum = 0.0f;
            for (int j = 0; j < h; j++) {
                c[i * h + j] = expf(c[i * h + j] - mx);
                sum += c[i * h + j];
            }
            for (int j = 0; j < h; j++) c[i * h + j] = c[i * h + j] / sum + eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0)
                for (int i = 0; i < h; i++) {
                    float rs = 0.0f;
                    for (int j = 0; j < h; j++) rs += c[i * h + j];
                    for (int j = 0; j < h; j++) c[i * h + j] /= rs + eps;
                }
            for (int j = 0; j < h; j++) {
                float cs = 0.0f;
                for (int i = 0; i < h; i++) cs += c[i * h + j];
                for (int i = 0; i < h; i++) c[i * h + j] /= cs + eps;
            }
        }
    }
    return CSA_OK;
}

#define CSA_IMPL "sinkhorn_impl.h"
#include "csa_isa_variants.h"

int csa_hc_sinkhorn(const float *mixes, csa_idx rows, csa_idx smix_row, const float *hc_scale,
                    const float *hc_base, int h, int iters, float eps, float *pre, float *post,
                    float *comb)
{
    if (h < 1 || h > 64 || iters < 1) return CSA_EINVAL;
    CSA_DISPATCH(hc_sinkhorn_tuned,
                 (mixes, rows, smix_row, hc_scale, hc_base, h, iters, eps, pre, post, comb),
                 csa_hc_sinkhorn_ref(mixes, rows, smix_row, hc_scale, hc_base, h, iters, eps,
                                     pre, post, comb));
}
