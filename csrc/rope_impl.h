/* Tuned RoPE body: unit inner strides.  Rows (i0, i1) are split across threads;
 * each pair's rotation is independent, so any split gives the same bits. */

static int CSA_V(apply_rope_tuned)(float *x, csa_idx n0, csa_idx n1, csa_idx n2, csa_idx half,
                                   csa_idx s0, csa_idx s1, csa_idx s2,
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
        float sn[half > 0 ? half : 1];
#pragma omp simd
        for (csa_idx i = 0; i < half; i++) sn[i] = sgn * s[i];
        for (csa_idx h = 0; h < n2; h++) {
            float *CSA_RESTRICT v = x + i0 * s0 + i1 * s1 + h * s2;
            /* Rows sit a head stride apart, too far for the hardware prefetcher to
             * follow: ask for the tail a few heads ahead. */
            if (h + 4 < n2)
                for (csa_idx k = 0; k < 2 * half; k += 16) __builtin_prefetch(v + 4 * s2 + k, 1);
#pragma omp simd
            for (csa_idx i = 0; i < half; i++) {
                const float re = v[2 * i], im = v[2 * i + 1];
                v[2 * i] = re * c[i] - im * sn[i];
                v[2 * i + 1] = re * sn[i] + im * c[i];
            }
        }
    }
    return CSA_OK;
}
