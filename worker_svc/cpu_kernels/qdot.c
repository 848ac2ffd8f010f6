// Integer-dot quantized matrix multiply for the CPU (the worker's "fast" numerics): y = x @ W^T.
//
// As ggml does: each row of x is quantized per block of 32 to int8 with one fp32 scale (Q8_0
// style: dx = max|x| / 127, xq = round(x / dx)), then every block pair is an integer dot product
// (u8 x s8 pairs into s16 with maddubs, pairs of s16 into s32 with madd): 32 multiply-adds in two
// instructions, against eight 8-wide FMAs after expanding each weight to fp32 in the exact path
// (qgemm.c). Per block, with isum = sum_i wq_i * xq_i and xsum = sum_i xq_i:
//   Q4_0 (w = d (q - 8)):  d dx isum - 8 d dx xsum
//   Q4_1 (w = d q + m):    d dx isum + m dx xsum
//   Q8_0 (w = d q):        d dx isum   (signed x signed: |w| and x * sign(w) make it u8 x s8)
// The only error against the exact product is x's rounding, weights are used exactly. In one pass
// that is 8 bits (relative ~0.4 % per element: top-1 agreed with transformers on 95.6 % of positions),
// so the fast mode quantizes in two passes, the second taking what the first left (~15 bits).
//
// Meant for few rows (decode): x is quantized once, each weight block is unpacked once and used
// for every row. Work is split over weight rows with OpenMP, ``guided`` (see qgemm.c).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"
#include "simd.h"

enum { MAX_ROWS = 8 };

// One block of 32 floats -> 32 int8 (xq) with its scale, and scale * (sum of the int8 values).
static inline void quantize_block(const float *x, int8_t *xq, float *scale, float *sum_scaled) {
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, q[i]);
    }
    // 4 x 8 int32 -> 32 int8 in order (packs interleave 128-bit lanes; the permute undoes it)
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)xq, p);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    *scale = d;
    *sum_scaled = d * (float)_mm_cvtsi128_si32(t);
}

// x as P int8 blocks per block of 32: x ~ d q_0 + (d / 254) q_1, the second pass quantizing what the
// first left (|rest| <= d / 2, so q_1 is in [-127, 127]). The fixed ratio lets one block's two
// integer dots be summed in int32 (254 * dot_0 + dot_1) before the one conversion to float.
// xq[(m P + p) nb + b] holds pass p of block b of row m; xd[m nb + b] = d (1 pass) or d / 254 (2);
// xs[m nb + b] = xd * (sum over passes of the pass's scale ratio * sum(q_p)).
enum { RATIO = 254 };

static void quantize_rows(const float *x, int64_t M, int64_t K, int passes, int8_t *xq, float *xd, float *xs) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t first = (m * passes) * nb + b;
            float d, sum_scaled;
            quantize_block(x + m * K + b * QK, xq + first * QK, &d, &sum_scaled);
            xd[m * nb + b] = d;
            xs[m * nb + b] = sum_scaled;
            if (passes == 1) continue;
            const float d2 = d / RATIO, id2 = d2 != 0.0f ? 1.0f / d2 : 0.0f;
            int8_t *q2 = xq + (first + nb) * QK;
            int32_t sum2 = 0;
            for (int i = 0; i < QK; i++) {
                const float rest = x[m * K + b * QK + i] - d * (float)xq[first * QK + i];
                int32_t q = (int32_t)lrintf(rest * id2);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                q2[i] = (int8_t)q;
                sum2 += q;
            }
            xd[m * nb + b] = d2;
            xs[m * nb + b] = sum_scaled + d2 * (float)sum2;
        }
    }
}

// 32 nibbles -> 32 bytes 0..15 in weight order (low nibbles are weights 0..15, high 16..31).
static inline __m256i unpack_nibbles(const uint8_t *p) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 8 int32 partial sums of u . s (u8 x s8), each pair sum scaled by ``scale`` (1, or RATIO for a first pass).
static inline __m256i dot_u8_s8(__m256i u, __m256i s, __m256i scale) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);  // |15 * 127 * 2|, |127 * 127 * 2| < 32768: no saturation
    return _mm256_madd_epi16(pairs, scale);  // |254 * 2 * 32258| < 2^31
}

// One block's dot of weights (u8 form, or |w| with x's signs flipped for Q8_0) with every pass of x.
static inline __attribute__((always_inline)) __m256 block_dot(__m256i u, const int8_t *x0, int64_t pass_stride,
                                                               int passes, const __m256i *signs) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i x = _mm256_loadu_si256((const __m256i *)x0);
    if (signs) x = _mm256_sign_epi8(x, *signs);
    if (passes == 1) return _mm256_cvtepi32_ps(dot_u8_s8(u, x, one));
    __m256i x2 = _mm256_loadu_si256((const __m256i *)(x0 + pass_stride));
    if (signs) x2 = _mm256_sign_epi8(x2, *signs);
    const __m256i sum = _mm256_add_epi32(dot_u8_s8(u, x, _mm256_set1_epi16(RATIO)), dot_u8_s8(u, x2, one));
    return _mm256_cvtepi32_ps(sum);
}

// ``n`` fp16 values -> fp32, eight at a time.
static inline void fp16_run(const uint8_t *h, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * i))));
    for (; i < n; i++) out[i] = fp16_to_fp32(h + 2 * i);
}

static inline float dot_run(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// y[m, n] for every row m < M of one weight row n (kernel layout, quant.h). The per-block float work is
// done for the whole row first, eight blocks at a time: each block's scale d * dx per row of x, and
// the term of the mins (Q4_1: sum of m dx xsum; Q4_0: of -8 d dx xsum), so a block's own work is its
// integer dot, one conversion and one multiply-add.
static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *bytes, int64_t nb, int64_t M,
                                                           int passes, const int8_t *xq, const float *xd,
                                                           const float *xs, float *y, int64_t N, int64_t n) {
    const RowView r = row_view(type, bytes, nb);
    float d[MAX_K / QK], scale[MAX_ROWS * (MAX_K / QK)];
    fp16_run(r.d, nb, d);
    for (int64_t m = 0; m < M; m++) {
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
            _mm256_storeu_ps(scale + m * nb + b, _mm256_mul_ps(_mm256_loadu_ps(d + b), _mm256_loadu_ps(xd + m * nb + b)));
        for (; b < nb; b++) scale[m * nb + b] = d[b] * xd[m * nb + b];
    }
    float corr[MAX_ROWS] = {0};
    if (type != TYPE_Q8_0) {
        float c[MAX_K / QK];
        if (type == TYPE_Q4_1) fp16_run(r.m, nb, c);
        for (int64_t m = 0; m < M; m++)
            corr[m] = type == TYPE_Q4_1 ? dot_run(c, xs + m * nb, nb) : -8.0f * dot_run(d, xs + m * nb, nb);
    }
    __m256 acc[MAX_ROWS];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
    const int64_t stride = nb * QK;  // from one pass of a row to the next
    for (int64_t b = 0; b < nb; b++) {
        if (type == TYPE_Q8_0) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(r.q + 32 * b));
            const __m256i wabs = _mm256_sign_epi8(w, w);
            for (int64_t m = 0; m < M; m++) {
                const __m256 s = block_dot(wabs, xq + (m * passes * nb + b) * QK, stride, passes, &w);
                acc[m] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(scale + m * nb + b), acc[m]);
            }
        } else {
            const __m256i w = unpack_nibbles(r.q + 16 * b);
            for (int64_t m = 0; m < M; m++) {
                const __m256 s = block_dot(w, xq + (m * passes * nb + b) * QK, stride, passes, NULL);
                acc[m] = _mm256_fmadd_ps(s, _mm256_broadcast_ss(scale + m * nb + b), acc[m]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * N + n] = hsum8(acc[m]) + corr[m];
}

// Entry point: M <= 8 rows, x quantized in 1 or 2 passes (2: ~15-bit activations for twice the integer
// work). Returns 0, or -1 for an unknown type / K not a multiple of 32 / too many rows or passes.
int qgemm_q8dot(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int passes) {
    if (block_bytes(type) == 0 || is_dense(type) || K % QK != 0 || K > MAX_K || M < 1 || M > MAX_ROWS || passes < 1 ||
        passes > 2)
        return -1;
    const int64_t nb = K / QK;
    int8_t xq[passes * M * K] __attribute__((aligned(32)));
    float xd[M * nb], xs[M * nb];
    quantize_rows(x, M, K, passes, xq, xd, xs);
    const int64_t row_bytes = nb * block_bytes(type);
#pragma omp parallel for schedule(guided)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        // constant type, M and passes per call let the compiler unroll and keep accumulators in registers
#define ROWS(T, P)                                                                   \
    switch (M) {                                                                     \
        case 1: row_dot(T, row, nb, 1, P, xq, xd, xs, y, N, n); break;               \
        case 2: row_dot(T, row, nb, 2, P, xq, xd, xs, y, N, n); break;               \
        default: row_dot(T, row, nb, M, P, xq, xd, xs, y, N, n); break;              \
    }
#define TYPES(P)                                                                     \
    if (type == TYPE_Q4_0) { ROWS(TYPE_Q4_0, P) }                                    \
    else if (type == TYPE_Q4_1) { ROWS(TYPE_Q4_1, P) }                               \
    else { ROWS(TYPE_Q8_0, P) }
        if (passes == 1) { TYPES(1) } else { TYPES(2) }
#undef TYPES
#undef ROWS
    }
    return 0;
}

int qgemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y);

enum { FAST_MAX_ROWS = 2 };  // more rows: the exact kernel's tiles amortize expanding the weights as well

int qdot_max_rows(void) { return FAST_MAX_ROWS; }

// The product for any number of rows: integer dots (``passes`` > 0, quantized weights) for decode batches of at most
// FAST_MAX_ROWS rows, where they are ~1.6x faster than the exact kernel; the exact kernel otherwise.
int qgemm_auto(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int passes) {
    if (passes > 0 && M <= FAST_MAX_ROWS && !is_dense(type)) return qgemm_q8dot(type, x, M, K, w, N, y, passes);
    return qgemm(type, x, M, K, w, N, y);
}
