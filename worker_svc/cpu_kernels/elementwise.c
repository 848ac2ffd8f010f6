// The element-wise parts of a decoder layer, one call each instead of a handful of PyTorch ops
// (each PyTorch op costs microseconds of dispatch, which add up over 30 layers at small batch).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

// x <- x + add (when add is not NULL); out = x / sqrt(mean(x^2) + eps) * w, per row of n.
void add_rms_norm(float *x, const float *add, const float *w, int64_t rows, int64_t n, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        float *o = out + r * n;
        if (add) {
            const float *ar = add + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] = xr[i] + ar[i];
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum8(acc);
        for (; i < n; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

// out[r, i] = silu(gu[r, i]) * gu[r, n + i]: the SwiGLU of a fused gate/up projection (rows, 2n).
void silu_mul(const float *gu, int64_t rows, int64_t n, float *out) {
#pragma omp parallel for schedule(static) if (rows > 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
