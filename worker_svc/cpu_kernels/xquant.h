// x quantized per block of 32 to int8, for the integer dot products of the fast numerics (tiles.c).
//
// As ggml does for Q8: dx = max|x| / 127, xq = round(x / dx). One pass keeps 8 bits of each block (relative
// ~0.4 % per element: top-1 agreed with transformers on 95.6 % of the default model's positions), so the fast
// mode quantizes in two passes, the second taking what the first left (~15 bits): x ~ dx q_0 + (dx / 254) q_1,
// |rest| <= dx / 2 so q_1 is in [-127, 127]. The fixed ratio lets a block's two integer dots be summed in int32
// (254 dot_0 + dot_1) before the one conversion to float.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd.h"

enum { RATIO = 254 };

// 4 x 8 int32 (each in [-127, 127]) -> 32 int8 in order at xq; returns their sum.
static inline int32_t store_block(const __m256i q[4], int8_t *xq) {
    // packs interleave 128-bit lanes; the permute undoes it
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)xq, p);
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    return _mm_cvtsi128_si32(t);
}

static inline __m256i round_to_int(__m256 v) {
    return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One block of 32 floats -> 32 int8 (xq) with its scale; returns the sum of the int8 values.
static inline int32_t quantize_block(const float *x, int8_t *xq, float *scale) {
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = hmax8(amax) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = round_to_int(_mm256_mul_ps(v[i], id));
    *scale = d;
    return store_block(q, xq);
}

// The second pass over a block: what the first (q0, scale d) left, in units of d / RATIO, clamped to [-127, 127],
// into q1; returns its sum. The same arithmetic as rest = x - d q0, q1 = lrintf(rest / (d / RATIO)).
static inline int32_t quantize_rest(const float *x, const int8_t *q0, float d, int8_t *q1) {
    const float d2 = d / RATIO;
    const __m256 vd = _mm256_set1_ps(d), id2 = _mm256_set1_ps(d2 != 0.0f ? 1.0f / d2 : 0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q0 + 8 * i))));
        const __m256 rest = _mm256_sub_ps(_mm256_loadu_ps(x + 8 * i), _mm256_mul_ps(vd, first));
        __m256 r = _mm256_round_ps(_mm256_mul_ps(rest, id2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    return store_block(q, q1);
}

#if defined(__AVX512F__)
// 16 int32 (each in [-127, 127]) -> 16 int8 at xq.
static inline void store16(__m512i q, int8_t *xq) { _mm_storeu_si128((__m128i *)xq, _mm512_cvtsepi32_epi8(q)); }

// quantize_block, then with two passes quantize_rest, for one row of x, 16 lanes at a time: the same operations on
// each value in the same order, so the same bits as the 8-lane code. Blocks go 16 at a time: their maxima first,
// then their scales with one vector division each (where the 8-lane code's four dependent scalar divisions per
// block bounded it), then their values, the first pass's integers kept in registers for the second. Writes the
// row's xq (passes x K), xd and xsum as quantize_rows does. 512 x 1536 values on one thread of a Zen 4: two passes
// 0.58 ms with the 8-lane code, 0.44 with the blocks one at a time in 16 lanes, 0.29 so; one pass 0.22 -> 0.15 ms
// (the 8-lane code was 8 % of a prefill step of 2 x 256 tokens under the fast numerics).
static void quantize_row16(const float *x, int64_t K, int passes, int8_t *xq, float *xd, int32_t *xsum) {
    const int64_t nb = K / 32;
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        float amax[16] = {0}, scale[4][16];  // d, 1 / d, d / RATIO, 1 / (d / RATIO) per block
        for (int j = 0; j < n; j++) {
            const float *xb = x + (b0 + j) * 32;
            amax[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)),
                                                         _mm512_abs_ps(_mm512_loadu_ps(xb + 16))));
        }
        const __m512 d = _mm512_div_ps(_mm512_loadu_ps(amax), _mm512_set1_ps(127.0f));
        const __m512 d2 = _mm512_div_ps(d, _mm512_set1_ps((float)RATIO));
        _mm512_storeu_ps(scale[0], d);
        _mm512_storeu_ps(scale[1], _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ), one, d));
        _mm512_storeu_ps(scale[2], d2);
        _mm512_storeu_ps(scale[3], _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d2, zero, _CMP_NEQ_UQ), one, d2));
        for (int j = 0; j < n; j++) {
            const int64_t b = b0 + j;
            const __m512 v[2] = {_mm512_loadu_ps(x + b * 32), _mm512_loadu_ps(x + b * 32 + 16)};
            const __m512 id = _mm512_set1_ps(scale[1][j]);
            __m512i q[2];
            for (int i = 0; i < 2; i++) {
                q[i] = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                store16(q[i], xq + b * 32 + 16 * i);
            }
            const int32_t sum0 = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
            if (passes == 1) {
                xd[b] = scale[0][j], xsum[b] = sum0;
                continue;
            }
            const __m512 vd = _mm512_set1_ps(scale[0][j]), id2 = _mm512_set1_ps(scale[3][j]);
            __m512i r[2];
            for (int i = 0; i < 2; i++) {
                const __m512 rest = _mm512_sub_ps(v[i], _mm512_mul_ps(vd, _mm512_cvtepi32_ps(q[i])));
                const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(rest, id2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r[i] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, lo), hi));
                store16(r[i], xq + K + b * 32 + 16 * i);
            }
            xd[b] = scale[2][j], xsum[b] = RATIO * sum0 + _mm512_reduce_add_epi32(_mm512_add_epi32(r[0], r[1]));
        }
    }
}
#endif

// M rows of K (a multiple of 32) -> xq (M, passes, K) int8; per row m and block b: xd[m nb + b] the scale of one
// unit of the combined sum (dx, or dx / 254 for two passes), xsum[m nb + b] the block's combined sum of its int8
// values (sum q_0, or 254 sum q_0 + sum q_1), so that x's block sums to xd * xsum.
static void quantize_rows(const float *x, int64_t M, int64_t K, int passes, int8_t *xq, float *xd, int32_t *xsum) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
#if defined(__AVX512F__)
        quantize_row16(x + m * K, K, passes, xq + m * passes * K, xd + m * nb, xsum + m * nb);
#else
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * 32;
            int8_t *q0 = xq + m * passes * K + b * 32;
            float d;
            const int32_t sum0 = quantize_block(xb, q0, &d);
            xd[m * nb + b] = d;
            xsum[m * nb + b] = sum0;
            if (passes == 1) continue;
            const int32_t sum1 = quantize_rest(xb, q0, d, q0 + K);
            xd[m * nb + b] = d / RATIO;
            xsum[m * nb + b] = RATIO * sum0 + sum1;
        }
#endif
    }
}
