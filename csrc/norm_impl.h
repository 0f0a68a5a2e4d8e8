/* Tuned RMSNorm body, compiled once per ISA level by csa_isa_variants.h.
 * Unit inner strides; one row per loop iteration so a row's sum never depends on
 * the thread count. */

static int CSA_V(rms_norm_tuned)(const float *x, csa_idx rows, csa_idx d, csa_idx sx_row,
                                 const float *w, float eps, float *out, csa_idx so_row)
{
    const int nt = csa_threads(rows, 4096 / (d > 0 ? d : 1) + 1);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const float *CSA_RESTRICT xr = x + r * sx_row;
        float *CSA_RESTRICT yr = out + r * so_row;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (csa_idx i = 0; i < d; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        if (w) {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++) yr[i] = xr[i] * inv * w[i];
        } else {
#pragma omp simd
            for (csa_idx i = 0; i < d; i++) yr[i] = xr[i] * inv;
        }
    }
    return CSA_OK;
}
