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

// Each row's index of its largest value, the first where several are (as torch.max(dim=-1).indices: a NaN counts as
// the largest, its first one wins; -0.0 and 0.0 are equal). Greedy sampling's argmax over a vocabulary: PyTorch's
// reduction took ~45 us a row of 49,152 on a Zen 4, 2 threads, and ~0.34 ms for 8 rows; this ~3 us a row.
// Two passes over the row (in cache after the first): its max, then the first lane equal to it.
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            top = _mm256_max_ps(top, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float best = hmax8(top);  // a NaN is handled apart: these lanes' max is what counts without one
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (int64_t j = i; j < n; j++) {
            if (xr[j] != xr[j]) any_nan = 1;
            best = xr[j] > best ? xr[j] : best;
        }
        int64_t at = 0;
        if (any_nan) {
            while (xr[at] == xr[at]) at++;
        } else {
            const __m256 want = _mm256_set1_ps(best);
            for (at = 0; at + 8 <= n; at += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xr + at), want, _CMP_EQ_OQ));
                if (hit) {
                    at += __builtin_ctz((unsigned)hit);
                    break;
                }
            }
            while (at < n && xr[at] != best) at++;  // the tail (or n < 8)
        }
        out[r] = at;
    }
}
