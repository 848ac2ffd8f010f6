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
// When there are fewer items than threads can share evenly (one stream decoding: 1 token x 3 KV
// heads on 2 threads left one idle a third of the time) and the context is long, each item's keys
// are split into ranges computed apart, then merged by their maxima and sums (as flash-decoding does).
// With AVX512, a prompt's tokens go in runs of consecutive tokens of one sequence, items of their own: up to
// 16 query rows against 16 keys at a time (flash_run); the other tokens' items take 16 keys at a time with
// 16-lane vectors, their rows prefetched ahead (attend16: 1.5x at 32 streams of 256 keys on a Zen 5).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "simd.h"

// The cache holds fp32 values, or fp16 or bf16 ones (``kv``: KV_F16, KV_BF16; --kv-cache-dtype float16 or
// bfloat16, half the bytes a decode's attention reads, which at 8-32 streams is most of its time), or int8 ones;
// each is read as fp32 vectors, so the arithmetic after the load is the same. ``index`` counts values (bytes for
// int8).
// KV_I8 (--kv-cache-dtype int8): a head's row is its D values as int8 in blocks of I8_BLOCK, then each block's
// scale (fp32): value = q * scale, scale = max |x| / 127 over the block, q = x / scale rounded to nearest, as
// llama.cpp's q8_0 (D a multiple of I8_BLOCK); 9/16 of fp16's bytes. Values are read as fp32 times their scale.
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };
enum { I8_BLOCK = 32 };

static inline __attribute__((always_inline)) int64_t kv_bytes(int kv) { return kv == KV_F32 ? 4 : kv == KV_I8 ? 1 : 2; }

// Values (of kv_bytes each) between one head's row and the next: D, and with int8 the scales' bytes too.
static inline __attribute__((always_inline)) int64_t kv_head(int64_t D, int kv) {
    return kv == KV_I8 ? D + D / I8_BLOCK * 4 : D;
}

static inline __attribute__((always_inline)) const void *kv_at(const void *cache, int64_t index, int kv) {
    return (const char *)cache + index * kv_bytes(kv);
}

static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int kv) {
    if (kv == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kv == KV_BF16)  // a bf16 value is the high half of its fp32 value
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (kv == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_loadu_ps((const float *)p);
}

// Values d .. d + 7 of the head's row at ``row`` as fp32 (an int8 row's times their block's scale).
static inline __attribute__((always_inline)) __m256 kv_row8(const void *row, int64_t d, int64_t D, int kv) {
    const __m256 v = kv_load8(kv_at(row, d, kv), kv);
    if (kv != KV_I8) return v;
    return _mm256_mul_ps(v, _mm256_broadcast_ss((const float *)((const char *)row + D) + d / I8_BLOCK));
}

// s[0..n) -> exp(s - max) in place; returns the max, and the sum of the exps in *sum.
static float exp_shifted(float *s, int64_t n, float *sum) {
    // the max 32 at a time in four vectors (one scalar chain of compares was a fifth of a decode's attention; the
    // max is the same whatever the order)
    __m256 m4[4] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY),
                    _mm256_set1_ps(-INFINITY)};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int i = 0; i < 4; i++) m4[i] = _mm256_max_ps(m4[i], _mm256_loadu_ps(s + k + 8 * i));
    for (; k + 8 <= n; k += 8) m4[0] = _mm256_max_ps(m4[0], _mm256_loadu_ps(s + k));
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(m4[0], m4[1]), _mm256_max_ps(m4[2], m4[3]));
    float mx = hmax8(m8);
    for (; k < n; k++) mx = s[k] > mx ? s[k] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float total = hsum8(vsum);
    for (; j < n; j++) {
        s[j] = expf(s[j] - mx);
        total += s[j];
    }
    *sum = total;
    return mx;
}

enum { MAX_D = 256, MIN_SPLIT_KEYS = 256 };

// The cache slot of a sequence's key at position ``key``, through its block table. A block size that is a power of
// two (16, the default) takes a shift and a mask: a 64-bit division costs ~10 cycles or more, and a decode's
// item asked for three a key (its K row, the rows it prefetches for K and for V).
static inline int64_t slot_of(const int32_t *table, int64_t key, int64_t block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        const int shift = __builtin_ctzll((unsigned long long)block_size);
        return (int64_t)table[key >> shift] * block_size + (key & (block_size - 1));
    }
    return (int64_t)table[key / block_size] * block_size + key % block_size;
}

enum { AHEAD = 32 };  // keys between a row's prefetch and its use

// Rows [j0, j1) of a cache (D values of one head each) fetched toward L2 ahead of their use: the blocks of a
// sequence lie anywhere, so the hardware's stride prefetchers do not see them coming (AVX512: 1.3-1.6x at 8-32
// streams; AVX2: see ``attend``).
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, const int32_t *table, int64_t j0,
                                                                 int64_t j1, int64_t block_size, int64_t row,
                                                                 int64_t D, int kv) {
    for (int64_t key = j0; key < j1; key++) {
        const char *at = (const char *)kv_at(cache, slot_of(table, key, block_size) * row, kv);
        for (int64_t b = 0; b < kv_head(D, kv) * kv_bytes(kv); b += 64) prefetch_line(at + b);
    }
}

// Heads of a group whose scores (and outputs) one pass over a key's (value's) row computes in ``attend``: the
// row is loaded and widened once for them, not once per head (a third of the loads and conversions at G = 3).
enum { ROW_HEADS = 4, OUT_HEADS = 3, OUT_VECS = 4 };

// gh heads (a constant, at most ROW_HEADS) of the group against keys [j0, j1): s[g * n + j - j0] = q_g . k_j * scale.
// A score's D products go into two vectors of partial sums (even and odd 8-value steps), added, then summed across
// lanes: the same operations whichever heads share the row.
static inline __attribute__((always_inline)) void score_rows8(int gh, const float *q, const void *k_cache,
                                                               const int32_t *table, int64_t j0, int64_t j1,
                                                               int64_t block_size, int64_t row, int64_t D, float scale,
                                                               float *s, int64_t n, int kv, int ahead) {
    for (int64_t j = j0; j < j1;) {  // block by block through the table
        const int64_t blk = j / block_size, o0 = j % block_size;
        const void *kb = kv_at(k_cache, (int64_t)table[blk] * block_size * row, kv);
        const int64_t stop = (blk + 1) * block_size < j1 ? (blk + 1) * block_size : j1;
        for (int64_t o = o0; j < stop; o++, j++) {
            const void *key = kv_at(kb, o * row, kv);
            if (ahead && j + AHEAD < j1) prefetch_rows(k_cache, table, j + AHEAD, j + AHEAD + 1, block_size, row, D, kv);
            __m256 a0[ROW_HEADS], a1[ROW_HEADS];
            for (int g = 0; g < gh; g++) a0[g] = a1[g] = _mm256_setzero_ps();
            int64_t d = 0;
            for (; d + 16 <= D; d += 16) {
                const __m256 k0 = kv_row8(key, d, D, kv), k1 = kv_row8(key, d + 8, D, kv);
                for (int g = 0; g < gh; g++) {
                    a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k0, a0[g]);
                    a1[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), k1, a1[g]);
                }
            }
            for (; d < D; d += 8) {
                const __m256 k0 = kv_row8(key, d, D, kv);
                for (int g = 0; g < gh; g++) a0[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k0, a0[g]);
            }
            for (int g = 0; g < gh; g++) s[g * n + j - j0] = hsum8(_mm256_add_ps(a0[g], a1[g])) * scale;
        }
    }
}

// gh heads (a constant, at most OUT_HEADS) of the group: out_g = sum_j p_gj v_j over keys [j0, j1), p_g = p + g * n,
// OUT_VECS vectors of D at a time (their sums in registers), key by key.
static inline __attribute__((always_inline)) void weigh_values8(int gh, const void *v_cache, const int32_t *table,
                                                                 int64_t j0, int64_t j1, int64_t block_size,
                                                                 int64_t row, int64_t D, const float *p, int64_t n,
                                                                 float *out, int kv, int ahead) {
    for (int64_t d0 = 0; d0 < D; d0 += 8 * OUT_VECS) {
        const int64_t nv = (D - d0) / 8 < OUT_VECS ? (D - d0) / 8 : OUT_VECS;
        __m256 acc[OUT_HEADS][OUT_VECS];
        for (int g = 0; g < gh; g++)
            for (int64_t v = 0; v < nv; v++) acc[g][v] = _mm256_setzero_ps();
        for (int64_t j = j0; j < j1;) {
            const int64_t blk = j / block_size, o0 = j % block_size;
            const void *vb = kv_at(v_cache, (int64_t)table[blk] * block_size * row, kv);
            const int64_t stop = (blk + 1) * block_size < j1 ? (blk + 1) * block_size : j1;
            for (int64_t o = o0; j < stop; o++, j++) {
                const void *value = kv_at(vb, o * row, kv);
                if (ahead && d0 == 0 && j + AHEAD < j1)
                    prefetch_rows(v_cache, table, j + AHEAD, j + AHEAD + 1, block_size, row, D, kv);
                __m256 pj[OUT_HEADS];
                for (int g = 0; g < gh; g++) pj[g] = _mm256_set1_ps(p[g * n + j - j0]);
                for (int64_t v = 0; v < nv; v++) {
                    const __m256 vv = kv_row8(value, d0 + 8 * v, D, kv);
                    for (int g = 0; g < gh; g++) acc[g][v] = _mm256_fmadd_ps(pj[g], vv, acc[g][v]);
                }
            }
        }
        for (int g = 0; g < gh; g++)
            for (int64_t v = 0; v < nv; v++) _mm256_storeu_ps(out + g * D + d0 + 8 * v, acc[g][v]);
    }
}

// One (token, kv head) item over keys [j0, j1): G query heads against those keys of one sequence.
// out_g = sum_j exp(s_gj - mx_g) v_j, not yet divided by sum_g (the caller merges or normalizes). A score's and an
// output's bits do not depend on how many heads share a row.
static inline __attribute__((always_inline)) void attend(const float *qt, const void *k_cache,
                                                          const void *v_cache, const int32_t *table,
                                                          int64_t j0, int64_t j1, int64_t block_size, int64_t row,
                                                          int64_t G, int64_t D, float scale, float *scores,
                                                          float *out, float *mx, float *sum, int kv, int ahead) {
    const int64_t n = j1 - j0;
    // ``ahead`` (a decode's keys, from memory): as attend16, the rows AHEAD keys on are prefetched as the loops go
    // (by the first group of heads only), the first AHEAD rows of K here and of V while the scores' exps run (AVX2
    // on a Zen 4, 30 layers' fp16 caches of 288 keys: 1 / 8 / 32 streams 1.35 / 2.2 / 2.1x). A prompt's tokens read
    // keys its chunk's first token just brought into the caches: prefetching cost them 12-15 %.
    if (ahead) prefetch_rows(k_cache, table, j0, j0 + AHEAD < j1 ? j0 + AHEAD : j1, block_size, row, D, kv);
    for (int64_t g0 = 0; g0 < G; g0 += ROW_HEADS) {
        const int64_t gh = G - g0 < ROW_HEADS ? G - g0 : ROW_HEADS;
#define SCORE(GH) score_rows8(GH, qt + g0 * D, k_cache, table, j0, j1, block_size, row, D, scale, scores + g0 * n, n, kv, \
                          ahead && g0 == 0)
        switch (gh) {  // a constant count of heads, so their partial sums stay in registers
            case 1: SCORE(1); break;
            case 2: SCORE(2); break;
            case 3: SCORE(3); break;
            default: SCORE(4); break;
        }
#undef SCORE
    }
    if (ahead) prefetch_rows(v_cache, table, j0, j0 + AHEAD < j1 ? j0 + AHEAD : j1, block_size, row, D, kv);
    for (int64_t g = 0; g < G; g++) mx[g] = exp_shifted(scores + g * n, n, sum + g);
    for (int64_t g0 = 0; g0 < G; g0 += OUT_HEADS) {
        const int64_t gh = G - g0 < OUT_HEADS ? G - g0 : OUT_HEADS;
#define WEIGH(GH) weigh_values8(GH, v_cache, table, j0, j1, block_size, row, D, scores + g0 * n, n, out + g0 * D, \
                            kv, ahead && g0 == 0)
        switch (gh) {
            case 1: WEIGH(1); break;
            case 2: WEIGH(2); break;
            default: WEIGH(3); break;
        }
#undef WEIGH
    }
}

#if defined(__AVX512F__)
// The same item with 16 lanes, for D a multiple of 16. Scores: a key's D products go into one vector of 16
// partial sums (D / 16 FMAs), and 16 keys' vectors are summed lane-wise into one vector of their 16 scores
// (sum16: 15 shuffles and 15 adds, against a horizontal sum per key). Values: each row of V is loaded once for
// up to 4 heads of the group, their outputs in registers. A key's score, and each head's output, take the same
// operations in the same order whichever keys share its vectors: the bits depend on the key range only.
enum { HEADS_AT_ONCE = 4 };

static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int kv) {
    if (kv == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (kv == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (kv == KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_loadu_ps((const float *)p);
}

static inline __attribute__((always_inline)) __m512 kv_row16(const void *row, int64_t d, int64_t D, int kv) {
    const __m512 v = kv_load16(kv_at(row, d, kv), kv);
    if (kv != KV_I8) return v;
    return _mm512_mul_ps(v, _mm512_set1_ps(((const float *)((const char *)row + D))[d / I8_BLOCK]));
}

// v[i]'s lanes summed, for i = 0..15, as the lanes of one vector.
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: v[2i] 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: the four keys 4i..4i+3
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  // 128-bit lanes: keys 8i..8i+3 (lanes 0+1, 2+3), keys 8i+4..8i+7 (likewise)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// gh heads (at most HEADS_AT_ONCE) of the group against 16 keys (rows kr): s[g * n + i] = q_g . k_i * scale for the
// keys in ``keep``. Each key's row is read and widened once for the gh heads (once per head was a third of a
// decode's attention); a score's operations and their order are a key's own.
static inline __attribute__((always_inline)) void score16(int gh, const float *q, const void *const kr[16], int64_t D,
                                                           __m512 vscale, float *s, int64_t n, __mmask16 keep, int kv) {
    __m512 part[HEADS_AT_ONCE][16];
    for (int i = 0; i < 16; i++) {
        __m512 acc[HEADS_AT_ONCE];
        const __m512 k = kv_row16(kr[i], 0, D, kv);
        for (int g = 0; g < gh; g++) acc[g] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k);
        for (int64_t d = 16; d < D; d += 16) {
            const __m512 kd = kv_row16(kr[i], d, D, kv);
            for (int g = 0; g < gh; g++) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kd, acc[g]);
        }
        for (int g = 0; g < gh; g++) part[g][i] = acc[g];
    }
    for (int g = 0; g < gh; g++) _mm512_mask_storeu_ps(s + g * n, keep, _mm512_mul_ps(sum16(part[g]), vscale));
}

// gh heads (at most HEADS_AT_ONCE) of the group: out_g += sum_j p_gj v_j over keys [j0, j1), p_g = scores + g * n.
static inline __attribute__((always_inline)) void weigh_values(int gh, const void *v_cache, const int32_t *table,
                                                                int64_t j0, int64_t j1, int64_t block_size,
                                                                int64_t row, int64_t D, const float *scores,
                                                                int64_t n, float *out, int kv) {
    __m512 acc[HEADS_AT_ONCE][MAX_D / 16];
    for (int g = 0; g < gh; g++)
        for (int64_t d = 0; d < D / 16; d++) acc[g][d] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1;) {
        const int64_t blk = j / block_size, o0 = j % block_size;
        const void *vb = kv_at(v_cache, (int64_t)table[blk] * block_size * row, kv);
        const int64_t stop = (blk + 1) * block_size < j1 ? (blk + 1) * block_size : j1;
        for (int64_t o = o0; j < stop; o++, j++) {
            const void *vr = kv_at(vb, o * row, kv);
            if (j + AHEAD < j1) prefetch_rows(v_cache, table, j + AHEAD, j + AHEAD + 1, block_size, row, D, kv);
            for (int64_t d = 0; d < D / 16; d++) {
                const __m512 v = kv_row16(vr, 16 * d, D, kv);
                for (int g = 0; g < gh; g++)
                    acc[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + j - j0]), v, acc[g][d]);
            }
        }
    }
    for (int g = 0; g < gh; g++)
        for (int64_t d = 0; d < D / 16; d++) _mm512_storeu_ps(out + g * D + 16 * d, acc[g][d]);
}

static inline __attribute__((always_inline)) void attend16(const float *qt, const void *k_cache,
                                                            const void *v_cache, const int32_t *table,
                                                            int64_t j0, int64_t j1, int64_t block_size, int64_t row,
                                                            int64_t G, int64_t D, float scale, float *scores,
                                                            float *out, float *mx, float *sum, int kv) {
    const int64_t n = j1 - j0;
    const __m512 vscale = _mm512_set1_ps(scale);
    // the loops below prefetch AHEAD keys ahead of their use; the first AHEAD rows of K (and, while the scores'
    // exps run, of V) are fetched here, not met as misses: a decode's attention at 8 and 32 streams 6-8 % faster
    prefetch_rows(k_cache, table, j0, j0 + AHEAD < j1 ? j0 + AHEAD : j1, block_size, row, D, kv);
    for (int64_t j = j0; j < j1; j += 16) {
        const int64_t count = j1 - j < 16 ? j1 - j : 16;
        const void *kr[16];
        for (int64_t i = 0; i < 16; i++) {  // past the range: the range's first key (computed, never stored)
            const int64_t key = i < count ? j + i : j0;
            kr[i] = kv_at(k_cache, slot_of(table, key, block_size) * row, kv);
        }
        prefetch_rows(k_cache, table, j + AHEAD < j1 ? j + AHEAD : j1, j + AHEAD + 16 < j1 ? j + AHEAD + 16 : j1,
                      block_size, row, D, kv);
        const __mmask16 keep = (__mmask16)((1u << count) - 1);
        for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
            const int64_t gh = G - g0 < HEADS_AT_ONCE ? G - g0 : HEADS_AT_ONCE;
            const float *q = qt + g0 * D;
            float *s = scores + g0 * n + j - j0;
            switch (gh) {  // a constant count of heads, so their partial sums stay in registers
                case 1: score16(1, q, kr, D, vscale, s, n, keep, kv); break;
                case 2: score16(2, q, kr, D, vscale, s, n, keep, kv); break;
                case 3: score16(3, q, kr, D, vscale, s, n, keep, kv); break;
                default: score16(4, q, kr, D, vscale, s, n, keep, kv); break;
            }
        }
    }
    prefetch_rows(v_cache, table, j0, j0 + AHEAD < j1 ? j0 + AHEAD : j1, block_size, row, D, kv);
    for (int64_t g = 0; g < G; g++) mx[g] = exp_shifted(scores + g * n, n, sum + g);
    for (int64_t g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
        const int64_t gh = G - g0 < HEADS_AT_ONCE ? G - g0 : HEADS_AT_ONCE;
        const float *p = scores + g0 * n;
        float *o = out + g0 * D;
        switch (gh) {  // a constant count of heads, so their sums stay in registers
            case 1: weigh_values(1, v_cache, table, j0, j1, block_size, row, D, p, n, o, kv); break;
            case 2: weigh_values(2, v_cache, table, j0, j1, block_size, row, D, p, n, o, kv); break;
            case 3: weigh_values(3, v_cache, table, j0, j1, block_size, row, D, p, n, o, kv); break;
            default: weigh_values(4, v_cache, table, j0, j1, block_size, row, D, p, n, o, kv); break;
        }
    }
}
#endif

static inline __attribute__((always_inline)) void attend_d(const float *qt, const void *kc, const void *vc,
                                                            const int32_t *table, int64_t j0, int64_t j1,
                                                            int64_t block_size, int64_t row, int64_t G, int64_t D,
                                                            float scale, float *scores, float *out, float *mx,
                                                            float *sum, int kv, int ahead) {
#if defined(__AVX512F__)
    if (D == 64) return attend16(qt, kc, vc, table, j0, j1, block_size, row, G, 64, scale, scores, out, mx, sum, kv);
    if (D == 128) return attend16(qt, kc, vc, table, j0, j1, block_size, row, G, 128, scale, scores, out, mx, sum, kv);
    if (D % 16 == 0) return attend16(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, out, mx, sum, kv);
#endif
    // ``ahead`` a constant in each copy: a test of it per key cost a prompt's tokens (which never prefetch) 1-5 %
#define ATTEND(DD) (ahead ? attend(qt, kc, vc, table, j0, j1, block_size, row, G, DD, scale, scores, out, mx, sum, kv, 1) \
                          : attend(qt, kc, vc, table, j0, j1, block_size, row, G, DD, scale, scores, out, mx, sum, kv, 0))
    if (D == 64) ATTEND(64);
    else if (D == 128) ATTEND(128);
    else ATTEND(D);
#undef ATTEND
}

static void attend_any_d(const float *qt, const void *kc, const void *vc, const int32_t *table, int64_t j0, int64_t j1,
                         int64_t block_size, int64_t row, int64_t G, int64_t D, float scale, float *scores, float *out,
                         float *mx, float *sum, int kv, int ahead) {
    if (kv == KV_F16) attend_d(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, out, mx, sum, KV_F16, ahead);
    else if (kv == KV_BF16) attend_d(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, out, mx, sum, KV_BF16, ahead);
    else if (kv == KV_I8) attend_d(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, out, mx, sum, KV_I8, ahead);
    else attend_d(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, out, mx, sum, KV_F32, ahead);
}

#if defined(__AVX512F__)
// A prompt's tokens: a run of consecutive tokens of one sequence shares its keys, so a run's query rows (n tokens
// x the G heads of one KV head, at most 16) sit in the 16 lanes of one vector and meet the keys 16 at a time, as
// flash attention does: s_j = sum_d q[., d] k_j[d] for 16 keys j at once (each key's k_j[d] broadcast), a running
// max and sum per row (lane), then o[d] += sum_j p_j v_j[d]; o (D x 16) stays in a buffer of this thread, the
// scores in registers. Each lane is its own query: its bits do not depend on the other rows of its run, nor on
// how long the run is (tiles start at key 0; a tile past a row's position scales it by exactly 1 and adds 0).
// A 512-token prompt's prefill runs 1.2-1.35x faster than with the row path on a Zen 5.
enum { LANES = 16, KEYS = 16 };


// Tokens t0 .. t0 + n - 1 (positions p0 .. p0 + n - 1 of one sequence, n * G <= 16), KV head kvh. ``work``:
// (2 KEYS + 2 LANES) * D floats of this thread's scratch: the tile's keys and values, q^T and o.
static inline __attribute__((always_inline)) void flash_run(const float *q, int64_t q_stride, const void *k_cache,
                                                             const void *v_cache, const int32_t *table, int64_t t0,
                                                             int64_t n, int64_t p0, int64_t kvh, int64_t G, int64_t H,
                                                             int64_t D, int64_t block_size, int64_t row, float scale,
                                                             float *work, float *out, int kv) {
    float *kt = work, *vt = kt + KEYS * D, *qt = vt + KEYS * D, *o = qt + LANES * D;
    const int64_t rows = n * G, ctx = p0 + n;
    int32_t pos_of[LANES];
    for (int64_t r = 0; r < LANES; r++) {  // lanes past the run repeat its first row (computed, never stored)
        const int64_t rr = r < rows ? r : 0, i = rr / G, g = rr % G;
        pos_of[r] = (int32_t)(p0 + i);
        const float *qr = q + (t0 + i) * q_stride + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) qt[d * LANES + r] = qr[d] * scale;
    }
    const __m512i pos = _mm512_loadu_si512(pos_of);
    memset(o, 0, D * LANES * sizeof(float));
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < ctx; j0 += KEYS) {
        for (int j = 0; j < KEYS; j++) {  // the tile's keys and values side by side; past the context, key 0's
            const int64_t key = j0 + j < ctx ? j0 + j : 0;
            const int64_t at = slot_of(table, key, block_size) * row + kvh * kv_head(D, kv);
            for (int64_t d = 0; d < D; d += 8) {  // D is a multiple of 8
                _mm256_storeu_ps(kt + j * D + d, kv_row8(kv_at(k_cache, at, kv), d, D, kv));
                _mm256_storeu_ps(vt + j * D + d, kv_row8(kv_at(v_cache, at, kv), d, D, kv));
            }
        }
        __m512 s[KEYS];
        for (int j = 0; j < KEYS; j++) s[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 qd = _mm512_loadu_ps(qt + d * LANES);
            for (int j = 0; j < KEYS; j++) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kt[j * D + d]), s[j]);
        }
        __m512 top = m;
        __mmask16 masked[KEYS];
        for (int j = 0; j < KEYS; j++) {  // causal: a row sees the keys up to its own position
            masked[j] = _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32((int32_t)(j0 + j)), _MM_CMPINT_LT);
            s[j] = _mm512_mask_mov_ps(s[j], masked[j], _mm512_set1_ps(-INFINITY));
            top = _mm512_max_ps(top, s[j]);
        }
        const __m512 alpha = exp512(_mm512_sub_ps(m, top));  // the old sums' weight under the new max
        m = top;
        l = _mm512_mul_ps(l, alpha);
        for (int j = 0; j < KEYS; j++) {
            s[j] = _mm512_maskz_mov_ps((__mmask16)~masked[j], exp512(_mm512_sub_ps(s[j], top)));
            l = _mm512_add_ps(l, s[j]);
        }
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m512 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_mul_ps(_mm512_loadu_ps(o + (d0 + k) * LANES), alpha);
            for (int j = 0; j < KEYS; j++)
                for (int k = 0; k < 8; k++) acc[k] = _mm512_fmadd_ps(s[j], _mm512_set1_ps(vt[j * D + d0 + k]), acc[k]);
            for (int k = 0; k < 8; k++) _mm512_storeu_ps(o + (d0 + k) * LANES, acc[k]);
        }
    }
    float inv[LANES];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((t0 + r / G) * H + kvh * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[d * LANES + r] * inv[r];
    }
}

// CALL(DD, KV) with the head dimension D as a constant where it is a common one (64, 128), so loops over it unroll.
#define BY_D(CALL, KV)                      \
    do {                                    \
        if (D == 64) CALL(64, KV);          \
        else if (D == 128) CALL(128, KV);   \
        else CALL(D, KV);                   \
    } while (0)

static void flash_run_any_d(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const int32_t *table, int64_t t0, int64_t n, int64_t p0, int64_t kvh, int64_t G,
                            int64_t H, int64_t D, int64_t block_size, int64_t row, float scale, float *work,
                            float *out, int kv) {
#define FLASH(DD, KV) flash_run(q, q_stride, k_cache, v_cache, table, t0, n, p0, kvh, G, H, DD, block_size, row, \
                                scale, work, out, KV)
    if (kv == KV_F16) BY_D(FLASH, KV_F16);
    else if (kv == KV_BF16) BY_D(FLASH, KV_BF16);
    else if (kv == KV_I8) BY_D(FLASH, KV_I8);
    else BY_D(FLASH, KV_F32);
#undef FLASH
}
#endif

#if ISA_AMX
// A prompt's runs under a bf16 cache (--kv-cache-dtype bfloat16, what --numerics bf16 keeps), or an int8 one (its
// values widened to bf16 on the way in), in AMX-BF16 tiles: the products of flash attention in bf16 with fp32 sums,
// as vLLM computes them. A run's rows (up to AMX_RUN_ROWS:
// consecutive tokens of one sequence x the G heads of one KV head) go in query tiles of 16, each against the keys
// 32 at a time:
//   S^T = K Q^T: A is 16 keys x 32 of their values, loaded from the cache as it lies (a block's keys are a fixed
//     stride apart), B is q (scaled, rounded to bf16) in pairs of values x 16 rows, made once per run; S^T's rows
//     are keys and its lanes query rows, so the softmax runs lane by lane as flash_run's does (a running max and
//     sum per row, no horizontal reduction);
//   O += P V: A is P (16 rows x 32 keys, rounded to bf16: the softmax's vectors in pairs of keys, transposed), B
//     is V in pairs of keys x 16 values, made once per key block for every query tile of the run; O stays in this
//     thread's memory (16 rows x D fp32 a tile), scaled by the change of each row's max only when one changed.
// Each query row is a lane of its own through all of it, and a key block past a row's position scales it by 1 and
// adds 0: a row's bits depend on its keys, not on the rows beside it.
enum { AMX_KEYS = 32, AMX_RUN_ROWS = 64, AMX_QTILES = AMX_RUN_ROWS / 16 };

void tile_bf16_configure(void);  // tiles.c: the 8 tiles as 16 rows x 64 bytes
int tile_amx_ready(void);

// r[i] <- the 16 32-bit lanes i of r[0..15] (a 16 x 16 transpose of 32-bit values).
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {  // per 128 bits: rows 2i, 2i + 1 interleaved
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  // b[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g + 3
        b[4 * g] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), c1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(c0, c2, 0x88), r[4 + c] = _mm512_shuffle_i32x4(c1, c3, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(c0, c2, 0xDD), r[12 + c] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
    }
}

// Bytes of a thread's work memory for head size D.
static int64_t amx_run_bytes(int64_t D) {
    return AMX_QTILES * (D / 32) * 1024      // q^T: per query tile, D / 32 B tiles
           + AMX_RUN_ROWS * D * 4            // o
           + (D / 16) * 1024                 // a key block's V as B tiles
           + AMX_KEYS * D * 2                // a key block's keys gathered (when not one stride apart)
           + AMX_KEYS * 16 * 4 + 1024;       // S^T, P
}

// Values d .. d + 31 of the head's row at ``row`` as bf16, in order: a bf16 cache's as they lie, an int8 cache's
// times their block's scale, rounded to bf16.
static inline __attribute__((always_inline)) __m512i bf16_32(const void *row, int64_t d, int64_t D, int kv) {
    if (kv == KV_BF16) return _mm512_loadu_si512((const uint16_t *)row + d);
    return (__m512i)_mm512_cvtne2ps_pbh(kv_row16(row, d + 16, D, kv), kv_row16(row, d, D, kv));
}

// Tokens t0 .. t0 + n - 1 (positions p0 .. of one sequence, n * G <= AMX_RUN_ROWS), KV head kvh; a bf16 cache, or
// an int8 one (its keys always gathered, widened to bf16).
static inline __attribute__((always_inline)) void amx_run(const float *q, int64_t q_stride, const void *k_cache,
                                                           const void *v_cache, const int32_t *table, int64_t t0,
                                                           int64_t n, int64_t p0, int64_t kvh, int64_t G, int64_t H,
                                                           int64_t D, int64_t block_size, int64_t row, float scale,
                                                           uint8_t *work, float *out, int kv) {
    uint8_t *qt = work;                                     // [tile][D / 32][16 pairs x 16 rows x 4 B]
    float *o = (float *)(qt + AMX_QTILES * (D / 32) * 1024);  // [row][D]
    uint8_t *vb = (uint8_t *)(o + AMX_RUN_ROWS * D);        // [D / 16][16 key pairs x 16 values x 4 B]
    uint16_t *kg = (uint16_t *)(vb + (D / 16) * 1024);      // [32 keys][D]
    float *st = (float *)(kg + AMX_KEYS * D);               // [32 keys][16 rows]
    uint8_t *pa = (uint8_t *)(st + AMX_KEYS * 16);          // [16 rows][32 keys bf16]
    const int64_t rows = n * G, tiles = (rows + 15) / 16, ctx = p0 + n;
    __m512 m[AMX_QTILES], l[AMX_QTILES];
    __m512i pos[AMX_QTILES];
    int64_t last[AMX_QTILES];  // the highest position among a tile's rows
    for (int64_t t = 0; t < tiles; t++) {
        int32_t pos_of[16];
        for (int r = 0; r < 16; r++) {
            const int64_t rr = t * 16 + r < rows ? t * 16 + r : t * 16;  // rows past the run: its tile's first
            pos_of[r] = (int32_t)(p0 + rr / G);
        }
        pos[t] = _mm512_loadu_si512(pos_of);
        last[t] = p0 + ((t * 16 + 15 < rows ? t * 16 + 15 : rows - 1) / G);
        m[t] = _mm512_set1_ps(-INFINITY), l[t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; c++) {  // q^T in pairs of values: B's row i, lane r = values 2i, 2i + 1 of row r
            __m512i x[16];
            for (int r = 0; r < 16; r++) {
                const int64_t rr = t * 16 + r;
                if (rr >= rows) {
                    x[r] = _mm512_setzero_si512();
                    continue;
                }
                const float *qr = q + (t0 + rr / G) * q_stride + (kvh * G + rr % G) * D + c * 32;
                const __m512 s = _mm512_set1_ps(scale);
                x[r] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + 16), s),
                                                    _mm512_mul_ps(_mm512_loadu_ps(qr), s));
            }
            transpose16(x);
            for (int i = 0; i < 16; i++) _mm512_store_si512(qt + (t * (D / 32) + c) * 1024 + 64 * i, x[i]);
        }
    }
    memset(o, 0, tiles * 16 * D * sizeof(float));
    static const int16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int64_t stride = row * 2;  // bytes between a block's keys
    for (int64_t j0 = 0; j0 < ctx; j0 += AMX_KEYS) {
        // V's B tiles: row i, lane c = values c of keys j0 + 2i, j0 + 2i + 1 (past the context, key 0's)
        for (int64_t i = 0; i < AMX_KEYS / 2; i++) {
            const int64_t k0 = j0 + 2 * i < ctx ? j0 + 2 * i : 0, k1 = j0 + 2 * i + 1 < ctx ? j0 + 2 * i + 1 : 0;
            const void *v0 = kv_at(v_cache, slot_of(table, k0, block_size) * row + kvh * kv_head(D, kv), kv);
            const void *v1 = kv_at(v_cache, slot_of(table, k1, block_size) * row + kvh * kv_head(D, kv), kv);
            for (int64_t d = 0; d < D; d += 32) {
                const __m512i a = bf16_32(v0, d, D, kv), b = bf16_32(v1, d, D, kv);
                _mm512_store_si512(vb + (d / 16) * 1024 + 64 * i, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_store_si512(vb + (d / 16 + 1) * 1024 + 64 * i, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
        // K's A tiles: 16 keys a block's stride apart where they lie so, else gathered (past the context, key 0)
        const uint16_t *ka[2];
        int64_t kstride[2];
        for (int h = 0; h < 2; h++) {
            const int64_t k = j0 + 16 * h;
            if (kv == KV_BF16 && k + 16 <= ctx && k % block_size + 16 <= block_size) {
                ka[h] = (const uint16_t *)k_cache + slot_of(table, k, block_size) * row + kvh * D, kstride[h] = stride;
                continue;
            }
            for (int64_t j = 0; j < 16; j++) {  // an int8 cache's keys always: rounded to bf16 here
                const int64_t key = k + j < ctx ? k + j : 0;
                const void *at = kv_at(k_cache, slot_of(table, key, block_size) * row + kvh * kv_head(D, kv), kv);
                for (int64_t d = 0; d < D; d += 32) _mm512_storeu_si512(kg + (16 * h + j) * D + d, bf16_32(at, d, D, kv));
            }
            ka[h] = kg + 16 * h * D, kstride[h] = D * 2;
        }
        for (int64_t t = 0; t < tiles; t++) {
            if (j0 > last[t]) continue;  // every key past every row of the tile: no change to it
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t c = 0; c < D / 32; c++) {
                _tile_loadd(3, qt + (t * (D / 32) + c) * 1024, 64);
                _tile_loadd(2, ka[0] + c * 32, kstride[0]);
                _tile_dpbf16ps(0, 2, 3);
                _tile_loadd(2, ka[1] + c * 32, kstride[1]);
                _tile_dpbf16ps(1, 2, 3);
            }
            _tile_stored(0, st, 64);
            _tile_stored(1, st + 256, 64);
            __m512 s[AMX_KEYS], top = m[t];
            __mmask16 masked[AMX_KEYS];
            for (int j = 0; j < AMX_KEYS; j++) {  // causal: a row sees the keys up to its own position
                masked[j] = _mm512_cmp_epi32_mask(pos[t], _mm512_set1_epi32((int32_t)(j0 + j)), _MM_CMPINT_LT);
                s[j] = _mm512_mask_mov_ps(_mm512_load_ps(st + 16 * j), masked[j], _mm512_set1_ps(-INFINITY));
                top = _mm512_max_ps(top, s[j]);
            }
            const __m512 alpha = exp512(_mm512_sub_ps(m[t], top));  // the old sums' weight under the new max
            m[t] = top;
            l[t] = _mm512_mul_ps(l[t], alpha);
            for (int j = 0; j < AMX_KEYS; j++) {
                s[j] = _mm512_maskz_mov_ps((__mmask16)~masked[j], exp512(_mm512_sub_ps(s[j], top)));
                l[t] = _mm512_add_ps(l[t], s[j]);
            }
            __m512i p[16];  // P^T in pairs of keys (row i, lane r: keys 2i, 2i + 1 of row r), transposed: P
            for (int i = 0; i < 16; i++) p[i] = bf16_pairs(s[2 * i], s[2 * i + 1]);
            transpose16(p);
            for (int r = 0; r < 16; r++) _mm512_store_si512(pa + 64 * r, p[r]);
            float *ot = o + t * 16 * D;
            if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ)) {
                float a[16];
                _mm512_storeu_ps(a, alpha);
                for (int r = 0; r < 16; r++)
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps(ot + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(ot + r * D + d), _mm512_set1_ps(a[r])));
            }
            _tile_loadd(5, pa, 64);
            for (int64_t c = 0; c < D / 16; c++) {
                _tile_loadd(4, ot + c * 16, D * 4);
                _tile_loadd(6, vb + c * 1024, 64);
                _tile_dpbf16ps(4, 5, 6);
                _tile_stored(4, ot + c * 16, D * 4);
            }
        }
    }
    for (int64_t t = 0; t < tiles; t++) {
        float inv[16];
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l[t]));
        for (int64_t r = 0; r < 16 && t * 16 + r < rows; r++) {
            const int64_t rr = t * 16 + r;
            float *dst = out + ((t0 + rr / G) * H + kvh * G + rr % G) * D;
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + rr * D + d), w));
        }
    }
}

static void amx_run_any_d(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                          const int32_t *table, int64_t t0, int64_t n, int64_t p0, int64_t kvh, int64_t G, int64_t H,
                          int64_t D, int64_t block_size, int64_t row, float scale, uint8_t *work, float *out,
                          int kv) {
#define RUN(DD, KV) amx_run(q, q_stride, k_cache, v_cache, table, t0, n, p0, kvh, G, H, DD, block_size, row, scale, \
                            work, out, KV)
    if (kv == KV_I8) BY_D(RUN, KV_I8);
    else BY_D(RUN, KV_BF16);
#undef RUN
}
#endif

// q: (T, H, D) with rows q_stride floats apart; out: (T, H, D) contiguous; k_cache, v_cache:
// (num_blocks, block_size, Hkv, D), fp32, fp16 or bf16 (``kv``: KV_F32, KV_F16, KV_BF16); block_tables: (B, max_blocks) int32; q_seq,
// q_pos: (T,) int32; q_prompt: (T,) uint8, 1 for a token of its sequence's prompt (or NULL: none is). D must be a
// multiple of 8, at most 256. Returns 0, or -1 on bad shapes (or no memory).
int paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *q_seq, const int32_t *q_pos,
                    const uint8_t *q_prompt, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                    float *out, int kv) {
    if (D % 8 != 0 || D > MAX_D || Hkv <= 0 || H % Hkv != 0 || kv < KV_F32 || kv > KV_I8 ||
        (kv == KV_I8 && D % I8_BLOCK != 0))
        return -1;
    const int64_t G = H / Hkv, items = T * Hkv;
    int64_t max_ctx = 0;
    for (int64_t t = 0; t < T; t++) max_ctx = q_pos[t] + 1 > max_ctx ? q_pos[t] + 1 : max_ctx;
    const int64_t row = Hkv * kv_head(D, kv);  // values per cache slot
    // key ranges per item: enough items for every thread to get two, ranges of at least MIN_SPLIT_KEYS
    const int64_t threads = omp_get_max_threads();
    int64_t splits = items < 2 * threads ? (2 * threads + items - 1) / items : 1;
    if (splits > max_ctx / MIN_SPLIT_KEYS) splits = max_ctx / MIN_SPLIT_KEYS > 1 ? max_ctx / MIN_SPLIT_KEYS : 1;
    // per (item, range, head): the unnormalized output (D), its max and its sum
    float *part = splits > 1 ? malloc(items * splits * G * (D + 2) * sizeof(float)) : NULL;
    if (splits > 1 && part == NULL) return -1;
    float *part_mx = part ? part + items * splits * G * D : NULL, *part_sum = part ? part_mx + items * splits * G : NULL;
    const int64_t span = (max_ctx + splits - 1) / splits;  // keys per range (of the longest context)
    // prompt tokens take the flash path where it is built, in runs of consecutive tokens of one sequence (a row's
    // result does not depend on its run); decodes and drafts being verified take the row path, so a token decoded
    // alone and the same token verified after a draft give the same bits
    int64_t *run_start = NULL;
    int flash = 0;
#if defined(__AVX512F__)
    int64_t *run_len = NULL, runs = 0;
#if ISA_AMX
    const int amx = q_prompt != NULL && (kv == KV_BF16 || kv == KV_I8) && D % 32 == 0 && G <= AMX_RUN_ROWS &&
                    tile_amx_ready();
    const int64_t run_rows = amx ? AMX_RUN_ROWS : LANES;  // query rows a run may hold
#else
    const int amx = 0;
    const int64_t run_rows = LANES;
#endif
    flash = q_prompt != NULL && (amx || G <= LANES);
    if (flash) {
        run_start = malloc(2 * T * sizeof(int64_t));
        if (run_start == NULL) {
            free(part);
            return -1;
        }
        run_len = run_start + T;
        const int64_t per_run = run_rows / G;
        for (int64_t t = 0; t < T;) {
            if (!q_prompt[t]) {
                t++;
                continue;
            }
            int64_t n = 1;
            while (n < per_run && t + n < T && q_prompt[t + n] && q_seq[t + n] == q_seq[t] && q_pos[t + n] == q_pos[t] + n)
                n++;
            run_start[runs] = t, run_len[runs++] = n;
            t += n;
        }
    }
#endif
#pragma omp parallel
    {
        float *scores = aligned_alloc(32, ((G * (splits > 1 ? span : max_ctx) + 7) / 8 * 8) * sizeof(float));
        float mx[MAX_D], sum[MAX_D];  // G <= H; heads per KV head beyond MAX_D are not a real model
#if defined(__AVX512F__)
#if ISA_AMX
        if (runs && amx) {
            uint8_t *work = aligned_alloc(64, amx_run_bytes(D));
            tile_bf16_configure();
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t item = 0; item < runs * Hkv; item++) {
                const int64_t t0 = run_start[item / Hkv], kvh = item % Hkv;
                amx_run_any_d(q, q_stride, k_cache, v_cache, block_tables + (int64_t)q_seq[t0] * max_blocks, t0,
                              run_len[item / Hkv], q_pos[t0], kvh, G, H, D, block_size, row, scale, work, out, kv);
            }
            _tile_release();
            free(work);
        }
#endif
        if (runs && !amx) {
            float *work = aligned_alloc(64, 2 * (KEYS + LANES) * D * sizeof(float));
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t item = 0; item < runs * Hkv; item++) {
                const int64_t t0 = run_start[item / Hkv], kvh = item % Hkv;
                flash_run_any_d(q, q_stride, k_cache, v_cache, block_tables + (int64_t)q_seq[t0] * max_blocks, t0,
                                run_len[item / Hkv], q_pos[t0], kvh, G, H, D, block_size, row, scale, work, out,
                                kv);
            }
            free(work);
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t work = 0; work < items * splits; work++) {
            const int64_t item = work / splits, range = work % splits;
            const int64_t t = item / Hkv, kvh = item % Hkv, ctx = q_pos[t] + 1;
            if (flash && q_prompt[t]) continue;
            const int decode = q_prompt == NULL || !q_prompt[t];  // its keys come from memory: prefetched
            const int32_t *table = block_tables + (int64_t)q_seq[t] * max_blocks;
            const float *qt = q + t * q_stride + kvh * G * D;
            const void *kc = kv_at(k_cache, kvh * kv_head(D, kv), kv), *vc = kv_at(v_cache, kvh * kv_head(D, kv), kv);
            if (splits == 1) {
                float *ot = out + (t * H + kvh * G) * D;
                attend_any_d(qt, kc, vc, table, 0, ctx, block_size, row, G, D, scale, scores, ot, mx, sum, kv, decode);
                for (int64_t g = 0; g < G; g++) {
                    const __m256 inv = _mm256_set1_ps(1.0f / sum[g]);
                    for (int64_t d = 0; d < D; d += 8)
                        _mm256_storeu_ps(ot + g * D + d, _mm256_mul_ps(_mm256_loadu_ps(ot + g * D + d), inv));
                }
                continue;
            }
            // this item's keys in `splits` equal ranges (a shorter context has empty ones)
            const int64_t each = (ctx + splits - 1) / splits, j0 = range * each < ctx ? range * each : ctx;
            const int64_t j1 = j0 + each < ctx ? j0 + each : ctx;
            float *po = part + work * G * D, *pm = part_mx + work * G, *ps = part_sum + work * G;
            if (j0 == j1) {
                for (int64_t g = 0; g < G; g++) pm[g] = -INFINITY, ps[g] = 0.0f;
                continue;
            }
            attend_any_d(qt, kc, vc, table, j0, j1, block_size, row, G, D, scale, scores, po, pm, ps, kv, decode);
        }
        free(scores);
        if (splits > 1) {
#pragma omp for schedule(static)
            for (int64_t head = 0; head < T * H; head++) {  // merge an item's ranges, head by head
                const int64_t t = head / H, h = head % H, item = t * Hkv + h / G, g = h % G;
                if (flash && q_prompt[t]) continue;
                float top = -INFINITY, total = 0.0f;
                for (int64_t r = 0; r < splits; r++) {
                    const float m = part_mx[(item * splits + r) * G + g];
                    top = m > top ? m : top;
                }
                float *ot = out + head * D;
                for (int64_t d = 0; d < D; d++) ot[d] = 0.0f;
                for (int64_t r = 0; r < splits; r++) {
                    const int64_t at = (item * splits + r) * G + g;
                    if (part_sum[at] == 0.0f) continue;
                    const float w = expf(part_mx[at] - top);
                    total += w * part_sum[at];
                    const float *po = part + at * D;
                    for (int64_t d = 0; d < D; d++) ot[d] += w * po[d];
                }
                const float inv = 1.0f / total;
                for (int64_t d = 0; d < D; d++) ot[d] *= inv;
            }
        }
    }
    free(part), free(run_start);
    return 0;
}

// One head's D values (a multiple of I8_BLOCK) as an int8 row: per block of I8_BLOCK, q = x * (127 / max |x|)
// rounded to nearest (even), its scale max |x| / 127 after the row's values (0, and q = 0, for a block of zeros).
static void store_i8(int8_t *dst, const float *x, int64_t D) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < D; b += I8_BLOCK) {
        __m256 top = _mm256_setzero_ps();
        for (int64_t d = b; d < b + I8_BLOCK; d += 8)
            top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t d = b; d < b + I8_BLOCK; d += 8) {
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + d), vinv));  // |q| <= 127
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(dst + d), _mm_packs_epi16(w, w));
        }
        memcpy(dst + D + b / I8_BLOCK * 4, &scale, 4);
    }
}

// Rotary embedding (halves layout, as in HF weights) on the q and k heads of each row of qkv, in
// place, then k and v copied into their cache slots. qkv: (T, (H + 2 Hkv) * D); cos, sin: (P, D)
// tables indexed by position. Same arithmetic as x * cos + rotate_half(x) * sin. With ``kv`` KV_F16 or KV_BF16
// the caches hold fp16 or bf16 values: each rounded to nearest (Hkv * D a multiple of 8).
void rope_store(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int32_t *pos, const float *cos,
                const float *sin, const int64_t *slots, void *k_cache, void *v_cache, int kv) {
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
        const int64_t n = Hkv * D;
        // int8: K's heads, then V's (a D that is no multiple of I8_BLOCK has no int8 layout: nothing is written,
        // and paged_attention refuses it)
        if (kv == KV_I8) {
            for (int64_t h = 0; h < 2 * Hkv && D % I8_BLOCK == 0; h++)
                store_i8((int8_t *)(h < Hkv ? k_cache : v_cache) + (slots[t] * Hkv + h % Hkv) * kv_head(D, KV_I8),
                         row + (H + h) * D, D);
            continue;
        }
        if (kv == KV_F32) {
            memcpy((float *)k_cache + slots[t] * n, row + H * D, n * sizeof(float));
            memcpy((float *)v_cache + slots[t] * n, row + (H + Hkv) * D, n * sizeof(float));
            continue;
        }
        uint16_t *k = (uint16_t *)k_cache + slots[t] * n, *v = (uint16_t *)v_cache + slots[t] * n;
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 kf = _mm256_loadu_ps(row + H * D + i), vf = _mm256_loadu_ps(row + (H + Hkv) * D + i);
            _mm_storeu_si128((__m128i *)(k + i), kv == KV_BF16 ? bf16_8(kf) : _mm256_cvtps_ph(kf, _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(v + i), kv == KV_BF16 ? bf16_8(vf) : _mm256_cvtps_ph(vf, _MM_FROUND_TO_NEAREST_INT));
        }
    }
}
