/* Tuned RoPE body: unit inner strides, half <= 4096.  Rows (i0, i1) are split
 * across threads; each pair's rotation is independent, so any split gives the same
 * bits.  bfloat16 rows are widened into a float32 scratch row, rotated by the same
 * code, and rounded back. */

static inline void CSA_V(rotate_pairs)(float *CSA_RESTRICT v, const float *CSA_RESTRICT c,
                                       const float *CSA_RESTRICT sn, csa_idx half)
{
#pragma omp simd
    for (csa_idx i = 0; i < half; i++) {
        const float re = v[2 * i], im = v[2 * i + 1];
        v[2 * i] = re * c[i] - im * sn[i];
        v[2 * i + 1] = re * sn[i] + im * c[i];
    }
}

static int CSA_V(apply_rope_tuned)(void *x, int bf16, csa_idx n0, csa_idx n1, csa_idx n2,
                                   csa_idx half, csa_idx s0, csa_idx s1, csa_idx s2,
                                   const float *cos, csa_idx scr, const float *sin, csa_idx ssr,
                                   int inverse)
{
    const csa_idx rows = n0 * n1;
    const float sgn = inverse ? -1.0f : 1.0f;
    const int nt = csa_threads(rows, 1 + 2048 / (n2 * half + 1));
#pragma omp parallel for num_threads(nt) schedule(static)
    for (csa_idx r = 0; r < rows; r++) {
        const csa_idx i0 = r / n1, i1 = r % n1;
        const float *CSA_RESTRICT c = cos + i1 * scr;
        const float *CSA_RESTRICT s = sin + i1 * ssr;
        float sn[half > 0 ? half : 1], tmp[half > 0 ? 2 * half : 1];
#pragma omp simd
        for (csa_idx i = 0; i < half; i++) sn[i] = sgn * s[i];
        for (csa_idx h = 0; h < n2; h++) {
            const csa_idx off = i0 * s0 + i1 * s1 + h * s2;
            if (!bf16) {
                float *v = (float *)x + off;
                /* Rows sit a head stride apart, too far for the hardware prefetcher to
                 * follow: ask for the tail a few heads ahead. */
                if (h + 4 < n2)
                    for (csa_idx k = 0; k < 2 * half; k += 16) __builtin_prefetch(v + 4 * s2 + k, 1);
                CSA_V(rotate_pairs)(v, c, sn, half);
            } else {
                csa_bf16 *CSA_RESTRICT v = (csa_bf16 *)x + off;
#pragma omp simd
                for (csa_idx k = 0; k < 2 * half; k++) tmp[k] = csa_bf16_to_f32(v[k]);
                CSA_V(rotate_pairs)(tmp, c, sn, half);
#pragma omp simd
                for (csa_idx k = 0; k < 2 * half; k++) v[k] = csa_f32_to_bf16(tmp[k]);
            }
        }
    }
    return CSA_OK;
}
