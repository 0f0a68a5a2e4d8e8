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

static int CSA_V(rms_norm_bf16_tuned)(const csa_bf16 *x, csa_idx rows, csa_idx d,
                                      csa_idx sx_row, const float *w, float eps,
                                      csa_bf16 *out, csa_idx so_row)
{
    const int nt = csa_threads(rows, 4096 / (d > 0 ? d : 1) + 1);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const csa_bf16 *CSA_RESTRICT xr = x + r * sx_row;
        csa_bf16 *CSA_RESTRICT yr = out + r * so_row;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (csa_idx i = 0; i < d; i++) {
            const float v = csa_bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
        for (csa_idx i = 0; i < d; i++) {
            const float y = csa_bf16_to_f32(xr[i]) * inv;
            yr[i] = csa_f32_to_bf16(w ? y * w[i] : y);
        }
    }
    return CSA_OK;
}
