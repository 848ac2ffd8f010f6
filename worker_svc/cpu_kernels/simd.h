// Small vector helpers shared by the CPU kernels (AVX2; exp512 where the build has AVX512).
#pragma once

#include <immintrin.h>

// exp(x) (inputs clamped to [-87.3, 88.7], where float exp is finite and normal). Cephes' range reduction
// x = n ln2 + r with a degree-6 polynomial for e^r: relative error ~1e-7, like expf. Written once for any vector
// width (P: the intrinsics' prefix; ROUND: to the nearest integer; CAST: int32 lanes as floats), so exp256's 8
// lanes and exp512's 16 take the same operations lane for lane: the same bits.
#define DEFINE_EXP(NAME, V, P, ROUND, CAST)                                                                       \
    static inline V NAME(V x) {                                                                                 \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3f)), P##_set1_ps(88.7f));                                 \
        const V log2e = P##_set1_ps(1.44269504088896341f);                                                      \
        const V ln2_hi = P##_set1_ps(0.693359375f), ln2_lo = P##_set1_ps(-2.12194440e-4f);                      \
        const V n = ROUND(P##_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                 \
        V r = P##_fnmadd_ps(n, ln2_hi, x);                                                                      \
        r = P##_fnmadd_ps(n, ln2_lo, r);                                                                        \
        V p = P##_set1_ps(1.9875691500e-4f);                                                                    \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                                  \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                                  \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                                  \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                                  \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                                  \
        const V r2 = P##_mul_ps(r, r);                                                                          \
        p = P##_fmadd_ps(p, r2, P##_add_ps(r, P##_set1_ps(1.0f)));                                              \
        const V e = CAST(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23));         \
        return P##_mul_ps(p, e);                                                                                \
    }

DEFINE_EXP(exp256, __m256, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
#if defined(__AVX512F__)
DEFINE_EXP(exp512, __m512, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#endif

// SwiGLU's silu(g) * u, 8 at a time: g / (1 + exp(-g)) * u (silu_mul, and the AMX products' fused epilogue:
// the same operations, so the same bits).
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The largest of 8 floats (their order of compares fixed, so a NaN lane gives what it always gave).
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 floats -> bf16, rounded to nearest even (a NaN stays a NaN, made quiet), each in the high half of its 32-bit
// lane (the low half zero: the bf16 value as fp32).
static inline __m256i to_bf16_8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), ones = _mm256_set1_epi32(1);
    const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), ones));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_and_si256(_mm256_blendv_epi8(up, quiet, nan), _mm256_set1_epi32((int)0xFFFF0000));
}

// 8 floats -> 8 bf16 values, rounded to nearest even (to_bf16_8), in order.
static inline __m128i bf16_8(__m256 v) {
    const __m256i h = _mm256_srli_epi32(to_bf16_8(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
