// Weight-only quantized matrix multiply for the CPU: y[M, N] = x[M, K] @ W[N, K]^T.
//
// W stays in its GGUF block format (Q4_0, Q4_1 or Q8_0: 32 weights per block, one or two fp16
// scales each; each row rearranged as quant.h says; or dense F32 / F16 / BF16 rows), x and y are fp32. Each weight is expanded to exactly the fp32 value the
// reference dequantizer (gguf-py) produces, so this computes the same product as the dense fp32
// matmul, only summed in another order. Reading 0.56-1.06 bytes per weight instead of 4 is
// what makes decoding fast on a CPU, where a matrix-vector product is memory bound.
//
// Two paths:
//   - few rows (M <= 2, decode at small batch): expand each block in registers and multiply;
//   - more rows: expand NR weight rows into an L1 buffer once, then run an MR x NR register
//     tile of fp32 FMAs over all rows of x (a small GEMM micro-kernel).
// Work is split over weight rows with OpenMP; loaded into a PyTorch process, the OpenMP runtime
// is PyTorch's own (same soname), so both share one thread pool. The split is ``guided``: each
// thread first takes a long contiguous run of rows (the memory prefetcher streams it; the old
// dynamic chunks of 32 rows ran the whole-model batch-1 step at half the speed: 8.4 against 3.9 ms
// of matmuls per token), then ever smaller ones, so a thread the OS preempts still does not stall
// the rest for long.
//
// Built by worker_svc/cpu_kernels/__init__.py.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"
#include "simd.h"

enum { NR = 4, MR = 3 };

// Expand block kb of a row into 4 x 8 floats: v[0] = weights 0..7, ..., v[3] = weights 24..31.
static inline __attribute__((always_inline)) void expand_block(int type, RowView r, int64_t kb, __m256 v[4]) {
    if (type == TYPE_F32) {
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps((const float *)(r.q + 128 * kb) + 8 * i);
        return;
    }
    if (type == TYPE_F16 || type == TYPE_BF16) {
        for (int i = 0; i < 4; i++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(r.q + 64 * kb + 16 * i));
            v[i] = type == TYPE_F16 ? _mm256_cvtph_ps(h)  // bf16 is fp32's top half
                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    }
    const __m256 d = _mm256_set1_ps(fp16_to_fp32(r.d + 2 * kb));
    if (type == TYPE_Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(r.q + 32 * kb + 8 * i));
            v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);  // q * d, exact
        }
        return;
    }
    const int has_min = type == TYPE_Q4_1;
    const __m256 m = has_min ? _mm256_set1_ps(fp16_to_fp32(r.m + 2 * kb)) : _mm256_setzero_ps();
    const __m128i packed = _mm_loadu_si128((const __m128i *)(r.q + 16 * kb));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask);                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        if (has_min) {
            v[i] = _mm256_fmadd_ps(d, q, m);  // d * q is exact in fp32, so fma == gguf's (d * q) + m
        } else {
            v[i] = _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(8.0f)));  // d * (q - 8)
        }
    }
}

// Few rows of x: expand each block in registers and use it for every row at once.
static inline __attribute__((always_inline)) void rows_direct(int type, const float *x, int64_t M, int64_t K,
                                                               const uint8_t *w, int64_t n, float *y, int64_t N) {
    const RowView row = row_view(type, w + n * (K / QK) * block_bytes(type), K / QK);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t kb = 0; kb < K / QK; kb++) {
        __m256 v[4];
        expand_block(type, row, kb, v);
        for (int64_t m = 0; m < M; m++) {
            const float *xk = x + m * K + kb * QK;
            for (int i = 0; i < 4; i++) acc[m] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xk + 8 * i), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * N + n] = hsum8(acc[m]);
}

static void gemm_direct(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
#pragma omp parallel for schedule(guided)
    for (int64_t n = 0; n < N; n++) {
        if (M == 1) rows_direct(type, x, 1, K, w, n, y, N);
        else rows_direct(type, x, 2, K, w, n, y, N);
    }
}

// An mr x NR tile: rows m0.. of x against NR expanded weight rows in wbuf (each K floats).
static inline __attribute__((always_inline)) void tile(int mr, const float *x, int64_t K, const float *wbuf,
                                                        int nr, float *y, int64_t N) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv[MR];
        for (int i = 0; i < mr; i++) xv[i] = _mm256_loadu_ps(x + i * K + k);
        for (int j = 0; j < NR; j++) {
            const __m256 wv = _mm256_load_ps(wbuf + j * K + k);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * N + j] = hsum8(acc[i][j]);
}

static void gemm_tiled(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    const int bb = block_bytes(type);
    const int64_t groups = (N + NR - 1) / NR;
#pragma omp parallel
    {
        float wbuf[NR * K] __attribute__((aligned(32)));  // NR expanded rows, at most 256 KiB of stack
#pragma omp for schedule(guided)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NR;
            const int nr = (int)(N - n0 < NR ? N - n0 : NR);
            for (int j = 0; j < NR; j++) {
                const RowView row = row_view(type, w + (n0 + (j < nr ? j : 0)) * (K / QK) * bb, K / QK);  // pad with row n0
                for (int64_t kb = 0; kb < K / QK; kb++) {
                    __m256 v[4];
                    expand_block(type, row, kb, v);
                    for (int i = 0; i < 4; i++) _mm256_store_ps(wbuf + j * K + kb * QK + 8 * i, v[i]);
                }
            }
            int64_t m = 0;
            for (; m + MR <= M; m += MR) tile(MR, x + m * K, K, wbuf, nr, y + m * N + n0, N);
            if (M - m == 2) tile(2, x + m * K, K, wbuf, nr, y + m * N + n0, N);
            if (M - m == 1) tile(1, x + m * K, K, wbuf, nr, y + m * N + n0, N);
        }
    }
}

// Entry point. Returns 0 on success, -1 for an unknown type or K not a multiple of 32 / too large.
int qgemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y) {
    if (block_bytes(type) == 0 || K % QK != 0 || K > MAX_K) return -1;
    if (M <= 2) gemm_direct(type, x, M, K, w, N, y);
    else gemm_tiled(type, x, M, K, w, N, y);
    return 0;
}

// Expand whole rows to fp32 (for embedding lookups and tests): out[n, K] for each index in rows.
int qdequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, float *out) {
    const int bb = block_bytes(type);
    if (bb == 0 || K % QK != 0) return -1;
    for (int64_t r = 0; r < count; r++) {
        const RowView row = row_view(type, w + rows[r] * (K / QK) * bb, K / QK);
        for (int64_t kb = 0; kb < K / QK; kb++) {
            __m256 v[4];
            expand_block(type, row, kb, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + r * K + kb * QK + 8 * i, v[i]);
        }
    }
    return 0;
}

// GGUF blocks -> the kernel layout (quant.h), in place, for N rows of K weights (dense rows stay as they are).
// Returns -1 for an unknown type or K not a multiple of 32 / too large.
int qrepack(int type, uint8_t *w, int64_t N, int64_t K) {
    const int bb = block_bytes(type), qb = quant_bytes(type), has_min = type == TYPE_Q4_1;
    if (bb == 0 || K % QK != 0 || K > MAX_K) return -1;
    if (is_dense(type)) return 0;
    const int64_t nb = K / QK;
    uint8_t tmp[MAX_K / QK * 34];
    for (int64_t n = 0; n < N; n++) {
        uint8_t *row = w + n * nb * bb;
        memcpy(tmp, row, nb * bb);
        uint8_t *q = row + (has_min ? 4 : 2) * nb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = tmp + b * bb;
            memcpy(row + 2 * b, blk, 2);
            if (has_min) memcpy(row + 2 * nb + 2 * b, blk + 2, 2);
            memcpy(q + b * qb, blk + bb - qb, qb);
        }
    }
    return 0;
}
