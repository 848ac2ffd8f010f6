// Attention straight from the paged KV cache, fp32, for the CPU.
//
// Every query token t of the step belongs to a sequence (row q_seq[t] of block_tables) and sits at
// position q_pos[t]; it attends to that sequence's keys at positions 0..q_pos[t] (causal, and
// chunked prefill falls out of it). Keys and values are read in place through the block table:
// no gather into a padded copy, no mask. Grouped-query attention: the G = H / Hkv query heads
// that share a KV head are computed together, so each K/V row is fetched from memory once.
//
// Work items are (token, kv head) pairs, split over threads with OpenMP. Per item: scores for all
// keys (dot products), an exact max, exp with a vectorised polynomial, then the weighted sum of V.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t D) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    for (; d < D; d += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

// Softmax in place over s[0..n): returns nothing, s becomes probabilities.
static void softmax(float *s, int64_t n) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum8(vsum);
    for (; j < n; j++) {
        s[j] = expf(s[j] - mx);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    for (j = 0; j < n; j++) s[j] *= inv;
}

enum { MAX_D = 256 };

// One (token, kv head) item: G query heads against ctx keys of one sequence.
static inline __attribute__((always_inline)) void attend(const float *qt, const float *k_cache,
                                                          const float *v_cache, const int32_t *table,
                                                          int64_t ctx, int64_t block_size, int64_t row,
                                                          int64_t G, int64_t D, float scale, float *scores,
                                                          float *out) {
    // scores[g * ctx + j] = q_g . k_j * scale, walking the block table block by block
    for (int64_t j0 = 0, blk = 0; j0 < ctx; j0 += block_size, blk++) {
        const float *kb = k_cache + (int64_t)table[blk] * block_size * row;
        const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
        for (int64_t o = 0; o < n; o++)
            for (int64_t g = 0; g < G; g++) scores[g * ctx + j0 + o] = dot(qt + g * D, kb + o * row, D) * scale;
    }
    for (int64_t g = 0; g < G; g++) softmax(scores + g * ctx, ctx);
    // out_g = sum_j p_gj v_j, accumulated in registers (D / 8 vectors) one head at a time
    for (int64_t g = 0; g < G; g++) {
        __m256 acc[MAX_D / 8];
        for (int64_t d = 0; d < D / 8; d++) acc[d] = _mm256_setzero_ps();
        const float *p = scores + g * ctx;
        for (int64_t j0 = 0, blk = 0; j0 < ctx; j0 += block_size, blk++) {
            const float *vb = v_cache + (int64_t)table[blk] * block_size * row;
            const int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
            for (int64_t o = 0; o < n; o++) {
                const __m256 pj = _mm256_set1_ps(p[j0 + o]);
                for (int64_t d = 0; d < D / 8; d++)
                    acc[d] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vb + o * row + 8 * d), acc[d]);
            }
        }
        for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(out + g * D + 8 * d, acc[d]);
    }
}

// q: (T, H, D) with rows q_stride floats apart; out: (T, H, D) contiguous; k_cache, v_cache:
// (num_blocks, block_size, Hkv, D); block_tables: (B, max_blocks) int32; q_seq, q_pos: (T,) int32.
// D must be a multiple of 8, at most 256. Returns 0, or -1 on bad shapes.
int paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *q_seq, const int32_t *q_pos,
                    int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale, float *out) {
    if (D % 8 != 0 || D > MAX_D || Hkv <= 0 || H % Hkv != 0) return -1;
    const int64_t G = H / Hkv;
    int64_t max_ctx = 0;
    for (int64_t t = 0; t < T; t++) max_ctx = q_pos[t] + 1 > max_ctx ? q_pos[t] + 1 : max_ctx;
    const int64_t row = Hkv * D;  // floats per cache slot
#pragma omp parallel
    {
        float *scores = aligned_alloc(32, ((G * max_ctx + 7) / 8 * 8) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < T * Hkv; item++) {
            const int64_t t = item / Hkv, kvh = item % Hkv, ctx = q_pos[t] + 1;
            const int32_t *table = block_tables + (int64_t)q_seq[t] * max_blocks;
            const float *qt = q + t * q_stride + kvh * G * D;
            float *ot = out + (t * H + kvh * G) * D;
            const float *kc = k_cache + kvh * D, *vc = v_cache + kvh * D;
            if (D == 64) attend(qt, kc, vc, table, ctx, block_size, row, G, 64, scale, scores, ot);
            else if (D == 128) attend(qt, kc, vc, table, ctx, block_size, row, G, 128, scale, scores, ot);
            else attend(qt, kc, vc, table, ctx, block_size, row, G, D, scale, scores, ot);
        }
        free(scores);
    }
    return 0;
}

// Rotary embedding (halves layout, as in HF weights) on the q and k heads of each row of qkv, in
// place, then k and v copied into their cache slots. qkv: (T, (H + 2 Hkv) * D); cos, sin: (P, D)
// tables indexed by position. Same arithmetic as x * cos + rotate_half(x) * sin.
void rope_store(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int32_t *pos, const float *cos,
                const float *sin, const int64_t *slots, float *k_cache, float *v_cache) {
    const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos + (int64_t)pos[t] * D, *s = sin + (int64_t)pos[t] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] + (-x2) * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        memcpy(k_cache + slots[t] * Hkv * D, row + H * D, Hkv * D * sizeof(float));
        memcpy(v_cache + slots[t] * Hkv * D, row + (H + Hkv) * D, Hkv * D * sizeof(float));
    }
}
