/* Tuned hc_split_sinkhorn: token rows split across threads; each row's h x h matrix
 * normalised in a stack buffer by the oracle's operations in the oracle's order
 * (explicit fmaf for the affine maps, so no level contracts differently), so every
 * level and thread count gives the same bits.  Column sums run over whole rows at a
 * time (a vector of h running sums), the same additions in the same order. */

static void CSA_V(s_row)(const float *m, const float *sc, const float *base, int h, int iters,
                         float eps, float *pre, float *post, float *out)
{
    float c[64 * 64], cs[64];
    for (int i = 0; i < h; i++) {
        pre[i] = s_sigmoid(fmaf(m[i], sc[0], base[i])) + eps;
        post[i] = 2.0f * s_sigmoid(fmaf(m[h + i], sc[1], base[h + i]));
    }
    for (int i = 0; i < h * h; i++) c[i] = fmaf(m[2 * h + i], sc[2], base[2 * h + i]);
    for (int i = 0; i < h; i++) {
        float *ci = c + i * h, mx = ci[0], sum = 0.0f;
        for (int j = 1; j < h; j++) mx = ci[j] > mx ? ci[j] : mx;
        for (int j = 0; j < h; j++) {
            ci[j] = expf(ci[j] - mx);
            sum += ci[j];
        }
        for (int j = 0; j < h; j++) ci[j] = ci[j] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            for (int i = 0; i < h; i++) {
                float *ci = c + i * h, rs = 0.0f;
                for (int j = 0; j < h; j++) rs += ci[j];
                const float d = rs + eps;
                for (int j = 0; j < h; j++) ci[j] /= d;
            }
        for (int j = 0; j < h; j++) cs[j] = 0.0f;
        for (int i = 0; i < h; i++)
#pragma omp simd
            for (int j = 0; j < h; j++) cs[j] += c[i * h + j];
        for (int j = 0; j < h; j++) cs[j] += eps;
        for (int i = 0; i < h; i++)
#pragma omp simd
            for (int j = 0; j < h; j++) c[i * h + j] /= cs[j];
    }
    for (int i = 0; i < h * h; i++) out[i] = c[i];
}

static int CSA_V(hc_sinkhorn_tuned)(const float *mixes, csa_idx rows, csa_idx smix_row,
                                    const float *hc_scale, const float *hc_base, int h,
                                    int iters, float eps, float *pre, float *post, float *comb)
{
    const int nt = csa_threads(rows, 1 + 4096 / ((csa_idx)h * h * iters));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++)
#ifdef CSA_MUTANT_SINKHORN_ITERS /* planted (make mutants): one Sinkhorn iteration fewer */
        CSA_V(s_row)(mixes + r * smix_row, hc_scale, hc_base, h, iters > 1 ? iters - 1 : iters,
                     eps, pre + r * h, post + r * h, comb + r * h * h);
#else
        CSA_V(s_row)(mixes + r * smix_row, hc_scale, hc_base, h, iters, eps, pre + r * h,
                     post + r * h, comb + r * h * h);
#endif
    return CSA_OK;
}
