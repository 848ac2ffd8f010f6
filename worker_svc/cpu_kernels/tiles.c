// The fast numerics' matrix multiply for the CPU: y = x @ W^T with W kept in tiles of 16 output rows, for
// every number of rows of x (a lone decode, a batch of decodes, a verify chunk, a prefill chunk).
//
// Why tiles. The row layout (quant.h, qgemm.c) keeps each weight row's blocks together: a dot product per
// (row of x, row of W) and, for quantized weights, a float conversion per block of 32 per such pair. Here a
// vector lane is an output row instead: 16 rows' weights for the same 4 (or 2) inputs lie side by side, one
// broadcast of x meets all of them, and a block's integer sums convert once per 16 rows. With AVX512-VNNI a
// block of 16 rows x 32 inputs is 8 vpdpbusd per pass of x (64 multiply-adds each); on AVX2 the same code
// runs 8 lanes at a time (isa.h). A strip of W rows stays in L1 while every row of x passes over it; with VNNI
// two strips go together, so each broadcast of x meets 32 rows of W (half the loads per dot: 1.3-2x from 8
// rows of x on a Zen 5, the same bits).
//
// Tile layout, per group of 16 output rows (the last group padded with zero rows), nb = K / 32 blocks:
//
//   Q4_0, Q4_1: [q: nb x 256 B][d: nb x 16 fp16][m: nb x 16 fp16, Q4_1 only]
//     block b's 256 B are 4 slots of 64 B; slot s holds, for row r, the 4 bytes s of the row's GGUF nibbles
//     (bytes 4s..4s+3) at 4r: low nibbles are inputs 4s..4s+3, high nibbles inputs 16+4s..16+4s+3.
//   Q8_0: [q: nb x 512 B][d: nb x 16 fp16]; 8 k-groups of 64 B, k-group j holding row r's int8 inputs
//     4j..4j+3 at 4r.
//   BF16 (dense): [K/2 pairs x 16 rows x 2 bf16]: 64 B per pair of inputs.
//
// The bytes per row are those of the GGUF row (or of the bf16 row), so a tiled weight is no larger.
//
// Numerics (the worker's --numerics fast). Quantized weights: x is quantized per block of 32 in P int8 passes
// (quantize_rows; P = 2: ~15 bits), each block's products summed exactly in int32, then scaled in fp32: one
// rounding per block, and each output's blocks summed in order, so a row of y does not depend on how many rows
// x has, nor on the instruction set. BF16 weights: x rounded to bf16 (P = 1, what transformers and vLLM
// compute in bf16) or split in two bf16 (P = 2: ~16 bits), products summed in fp32 (vdpbf16ps).

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "quant.h"
#include "simd.h"
#include "xquant.h"

enum { TILE = 16, MR = ISA_VNNI ? 8 : 4, STRIPS = TILE / W };
enum { TILE_WIDE = 4 };  // added to tile_gemm's passes: the bf16 numerics (see "widened to bf16" below)
// Rows of x from which the strip path writes a fused gate/up projection's silu(gate) * up itself (tile_gemm_swiglu):
// below, the (M, 2I) product is small and its prefetch of the next item's weights is one range (a lone decode).
enum { SWIGLU_ROWS = 16 };

// Rows of x's passes tile_gemm keeps: with AMX up to a whole tile of 16 (bf16 weights load them 16 at a time).
static inline int64_t pass_rows(int64_t M) { return ISA_AMX ? (M + 15) / 16 * 16 : M; }

static inline int64_t tile_quant_bytes(int type) { return (int64_t)TILE * quant_bytes(type); }  // per block

// Strip h (W rows) of a group of TILE rows of quantized weights over nb blocks: its quants at *q, its fp16 scales
// at *d and (Q4_1) its fp16 mins at *m (NULL for the other types). A group holds all its quants, then its scales,
// then its mins.
static inline void strip_parts(int type, const uint8_t *group, int64_t nb, int64_t h, const uint8_t **q,
                               const uint8_t **d, const uint8_t **m) {
    *q = group + h * W * 4;
    *d = group + nb * tile_quant_bytes(type) + h * W * 2;
    *m = type == TYPE_Q4_1 ? *d + nb * TILE * 2 : NULL;
}

// ---------------------------------------------------------------- quantized weights

// The running int32 sums of one (row of x, strip) over a block: with VNNI one per pass of x (combined at the
// end); on AVX2 one (two passes go as one 16-bit x: x16_rows).
typedef struct {
    vi a, b;
} Sum;

static inline __attribute__((always_inline)) void sum_add(Sum *s, vi u, vi x0, vi x1, int passes) {
#if ISA_VNNI
    s->a = dot_u8s8(s->a, u, x0);
    if (passes == 2) s->b = dot_u8s8(s->b, u, x1);
#else
    (void)x1, (void)passes;  // two passes take strip_q's 16-bit path (x16_rows)
    s->a = dot_u8s8(s->a, u, x0);
#endif
}

static inline __attribute__((always_inline)) vi sum_total(Sum s, int passes) {
#if ISA_VNNI
    return passes == 2 ? vi_add32(vi_mullo32(s.a, vi_set1_32(RATIO)), s.b) : s.a;
#else
    (void)passes;
    return s.a;
#endif
}

// The 4-bit types' k-group j (inputs 4j..4j+3 of the block) at q: the low nibbles of the 64 bytes at 64 j (j < 4),
// then the high nibbles of those at 64 (j - 4), each in the low 4 bits of its byte, the bits above not cleared.
static inline __attribute__((always_inline)) vi nibbles(const uint8_t *q, int j) {
    const vi packed = vi_load(q + 64 * (j & 3));
    return j < 4 ? packed : vi_srli16(packed, 4);
}

// The weights of k-group j (inputs 4j..4j+3 of the block) for one strip, as the unsigned side of the dot: Q4
// nibbles as they are (0..15); Q8_0 with VNNI its int8 values + 128 (the offset is taken off per block);
// Q8_0 on AVX2 |w| (its signs are moved onto x: sign_x).
static inline __attribute__((always_inline)) vi weights_u8(int type, const uint8_t *q, int j, vi *signs) {
    if (type == TYPE_Q8_0) {
        const vi w = vi_load(q + 64 * j);
#if ISA_VNNI
        (void)signs;
        return vi_xor(w, vi_set1_8(0x80));
#else
        *signs = w;
        return _mm256_sign_epi8(w, w);
#endif
    }
    return vi_and(nibbles(q, j), vi_set1_8(0x0F));
}

static inline __attribute__((always_inline)) vi sign_x(int type, vi x, vi signs) {
#if ISA_VNNI
    (void)type, (void)signs;
    return x;
#else
    return type == TYPE_Q8_0 ? _mm256_sign_epi8(x, signs) : x;
#endif
}

// What the unsigned side adds to each block's sum per unit of sum(x): Q4_0's nibbles are w / d + 8; Q8_0's
// are w / d + 128 with VNNI. Taken off in int32, so the sum is exactly that of w / d times x.
static inline int weight_offset(int type) {
    if (type == TYPE_Q4_0) return 8;
    return type == TYPE_Q8_0 && ISA_VNNI ? 128 : 0;
}

#if !ISA_VNNI
// One pass on AVX2 with 4-bit weights: a lane's pair of products is at most 2 x 15 x 127 = 3,810 (nibbles
// 0..15 times x in [-127, 127]), so a block's 8 k-groups add up in 16 bits (at most 30,480: no saturation, no
// wrap) and go to int32 with one madd a block instead of one a k-group: the same sums, so the same bits, with 9
// multiplies a block where there were 16; strip_q loads a block's 8 k-groups of weights once and takes its rows one
// by one, each row's sum in one register (k-groups outside, rows inside, the compiler spilled the sums): q4_0 at
// 1 / 8 / 32 / 512 rows 1.08 / 1.12 / 1.21 / 1.29x on a Zen 4. Q8_0's pairs reach 32,258 and keep a madd each.
//
// Two passes on AVX2, which has no vpdpbusd: each pass's bytes cost two multiplies per 32 products (maddubs, then
// madd), so x's passes go as one 16-bit value, RATIO q0 + q1 (|.| <= 32,385: exact), against the weights widened to
// 16 bits, two products a madd: half the multiplies, and the same int32 sums (so the same bits as the two passes).
// x16_rows writes each row's values in place of its passes, a k-group's 4 inputs in the order 0, 2, 1, 3: the
// pairs a lane's weights form without crossing bytes (weights_i16).
static void x16_rows(int8_t *xq, int64_t M, int64_t K, uint8_t *scratch, int64_t scratch_bytes) {
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++) {
        int8_t *row = xq + m * 2 * K, *q = (int8_t *)scratch + omp_get_thread_num() * scratch_bytes;
        memcpy(q, row, 2 * K);  // the passes, read while the values are written over them
        int16_t *out = (int16_t *)row;
        for (int64_t k = 0; k < K; k += 16) {
            const __m256i q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + k)));
            const __m256i q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + K + k)));
            const __m256i v = _mm256_add_epi16(_mm256_mullo_epi16(q0, _mm256_set1_epi16(RATIO)), q1);
            _mm256_storeu_si256((__m256i *)(out + k), _mm256_shuffle_epi8(v, order));
        }
    }
}

// k-group j's weights of one strip (lane n: its row's inputs 4j..4j+3) as 16-bit pairs: *a inputs 0 and 2, *b 1
// and 3 (x16_rows's order). Q4 nibbles as they are (0..15), Q8_0 sign-extended.
static inline __attribute__((always_inline)) void weights_i16(int type, const uint8_t *q, int j, vi *a, vi *b) {
    if (type == TYPE_Q8_0) {
        const vi w = vi_load(q + 64 * j);
        *a = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);
        *b = _mm256_srai_epi16(w, 8);
        return;
    }
    const vi packed = vi_load(q + 64 * (j & 3)), low = vi_set1_16(0x000F);
    if (j < 4) {
        *a = vi_and(packed, low);
        *b = vi_and(vi_srli16(packed, 8), low);
    } else {
        *a = vi_and(vi_srli16(packed, 4), low);
        *b = vi_srli16(packed, 12);
    }
}
#endif

// A Q4_1 block term (block_terms) as the float it holds.
static inline float term_f32(const int32_t *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

// quantize_rows's xsum (per row and block, the block's sum of x in units of xd) -> in place, what the scaling adds
// besides the integer sums (strip_q, amx_scale): Q4_1's mins factor xd * sum x (float), else weight_offset times
// sum x (int32). Once per product, not once per strip of W.
static void block_terms(int type, const float *xd, int32_t *xsum, int64_t count) {
    const int offset = weight_offset(type);
    for (int64_t i = 0; i < count; i++) {
        if (type == TYPE_Q4_1) {
            const float term = xd[i] * (float)xsum[i];
            memcpy(xsum + i, &term, sizeof term);
        } else {
            xsum[i] *= offset;
        }
    }
}

// The weights a strip call streams in ahead of their use (bytes 0: none). A thread's next item is the next strips
// in memory (the schedule hands out runs of items), so each block of this item prefetches its share of those:
// at one row of x, where nothing else hides memory's latency, 1.2-1.4x (one thread: 14 -> 20 GB/s of weights).
typedef struct {
    const uint8_t *next;
    int64_t bytes;
} Ahead;

// Part ``i`` of ``parts`` of the next item's bytes, prefetched.
static inline __attribute__((always_inline)) void prefetch_part(Ahead ahead, int64_t i, int64_t parts) {
    const int64_t each = (ahead.bytes + parts * 64 - 1) / (parts * 64) * 64;  // whole lines
    for (int64_t at = i * each; at < (i + 1) * each && at < ahead.bytes; at += 64)
        prefetch_line(ahead.next + at);
}

// mr rows of x (their quantized passes from xq, per row ``passes * K`` bytes apart) against ns strips of W rows
// (1, or 2 with VNNI: each broadcast of x then meets 32 rows of W, half the loads per dot), every block:
// out[(s * MR + i) * W + lane] = y of row i of x and row ``lane`` of strip s. Each output's operations are the
// same whatever mr and ns, so its bits are too.
static inline __attribute__((always_inline)) void strip_q(int type, int mr, int passes, int ns, const uint8_t *const *qs,
                                                            const uint8_t *const *ds, const uint8_t *const *ms, int64_t nb,
                                                            const int8_t *xq, int64_t K, const float *xd,
                                                            const int32_t *xadd, float *out, Ahead ahead) {
    const int offset = weight_offset(type);
    const int64_t qstride = tile_quant_bytes(type);
    vf acc[2][MR];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < mr; i++) acc[s][i] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        if (ahead.bytes) prefetch_part(ahead, b, nb);  // block b's share of the next item's weights
        Sum sum[2][MR];
        for (int s = 0; s < ns; s++)
            for (int i = 0; i < mr; i++) sum[s][i].a = sum[s][i].b = vi_zero();
#if !ISA_VNNI
        if (passes == 1 && type != TYPE_Q8_0) {  // 4-bit weights: the block's pair sums in 16 bits (see x16_rows),
            for (int s = 0; s < ns; s++) {     // its 8 k-groups' weights once, then row by row (fewer live sums)
                vi u[8];
                for (int j = 0; j < 8; j++) u[j] = weights_u8(type, qs[s] + b * qstride, j, NULL);
                for (int i = 0; i < mr; i++) {
                    const int8_t *x = xq + i * K + b * QK;
                    vi pairs = _mm256_maddubs_epi16(u[0], vi_bcast32(x));
                    for (int j = 1; j < 8; j++)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[j], vi_bcast32(x + 4 * j)));
                    sum[s][i].a = _mm256_madd_epi16(pairs, vi_set1_16(1));
                }
            }
        } else
#endif
        for (int j = 0; j < 8; j++) {
#if !ISA_VNNI
            if (passes == 2) {  // x16_rows's values; one strip an item on AVX2
                vi wa, wb;
                weights_i16(type, qs[0] + b * qstride, j, &wa, &wb);
                for (int i = 0; i < mr; i++) {
                    const int16_t *x = (const int16_t *)(xq + i * 2 * K) + b * QK + 4 * j;
                    sum[0][i].a = vi_add32(sum[0][i].a, vi_add32(_mm256_madd_epi16(wa, vi_bcast32(x)),
                                                                 _mm256_madd_epi16(wb, vi_bcast32(x + 2))));
                }
                continue;
            }
#endif
            vi signs[2] = {vi_zero(), vi_zero()}, u[2];
            for (int s = 0; s < ns; s++) u[s] = weights_u8(type, qs[s] + b * qstride, j, &signs[s]);
            for (int i = 0; i < mr; i++) {
                const int8_t *x = xq + i * passes * K + b * QK + 4 * j;
                const vi x0 = vi_bcast32(x), x1 = passes == 2 ? vi_bcast32(x + K) : x0;
                for (int s = 0; s < ns; s++)
                    sum_add(&sum[s][i], u[s], sign_x(type, x0, signs[s]), sign_x(type, x1, signs[s]), passes);
            }
        }
        for (int s = 0; s < ns; s++) {
            const vf scale = vf_half(ds[s] + b * TILE * 2);
            for (int i = 0; i < mr; i++) {
                vi total = sum_total(sum[s][i], passes);
                if (offset) total = vi_sub32(total, vi_set1_32(xadd[i * nb + b]));
                acc[s][i] = vf_fma(scale, vf_mul(vf_cvt(total), vf_set1(xd[i * nb + b])), acc[s][i]);
                if (type == TYPE_Q4_1)  // w = d q + m: the mins times the block's sum of x
                    acc[s][i] = vf_fma(vf_half(ms[s] + b * TILE * 2), vf_set1(term_f32(xadd + i * nb + b)), acc[s][i]);
            }
        }
    }
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < mr; i++) vf_store(out + (s * MR + i) * W, acc[s][i]);
}

// Rows per call with two strips (VNNI), by passes: what ran fastest on a Zen 5 (with two passes, 2 rows: 1.7-1.9x
// one strip of 8 rows from 8 rows of x up; with one, 4 rows: ~1.2x), their sums and x's broadcasts in registers.
static inline int rows_for_two(int passes) { return passes == 2 ? 2 : 4; }

static void strip_q_any(int type, int mr, int passes, int ns, const uint8_t *const *qs, const uint8_t *const *ds,
                        const uint8_t *const *ms, int64_t nb, const int8_t *xq, int64_t K, const float *xd,
                        const int32_t *xadd, float *out, Ahead ahead) {
    // constant type, rows, passes and strips per instance, so the sums stay in registers
#define ARGS qs, ds, ms, nb, xq, K, xd, xadd, out, ahead
#define ROWS(T, P)  /* ns is 2 only with VNNI: the test lets AVX2 builds skip those instances */              \
    if (ns == 2 && ISA_VNNI) {                                                                                  \
        switch (mr) {                                                                                           \
            case 1: strip_q(T, 1, P, 2, ARGS); break;                                                           \
            case 2: strip_q(T, 2, P, 2, ARGS); break;                                                           \
            case 3: strip_q(T, 3, P, 2, ARGS); break;                                                           \
            default: strip_q(T, rows_for_two(P), P, 2, ARGS); break;                                            \
        }                                                                                                       \
    } else {                                                                                                    \
        switch (mr) {                                                                                           \
            case 1: strip_q(T, 1, P, 1, ARGS); break;                                                           \
            case 2: strip_q(T, 2, P, 1, ARGS); break;                                                           \
            case 3: strip_q(T, 3, P, 1, ARGS); break;                                                           \
            case 4: strip_q(T, 4, P, 1, ARGS); break;                                                           \
            default: strip_q(T, MR, P, 1, ARGS); break;                                                         \
        }                                                                                                       \
    }
#define TYPES(P)                                                                                                \
    if (type == TYPE_Q4_0) { ROWS(TYPE_Q4_0, P) }                                                               \
    else if (type == TYPE_Q4_1) { ROWS(TYPE_Q4_1, P) }                                                          \
    else { ROWS(TYPE_Q8_0, P) }
    if (passes == 1) { TYPES(1) } else { TYPES(2) }
#undef TYPES
#undef ROWS
#undef ARGS
}

// The groups a pair of the bf16 products (amx_bf16_gemm, amx_wide_gemm, the strip path's fused SwiGLU) multiplies:
// 2 pair and the next, or with ``swiglu`` gate group pair and its up group (swiglu / 16 on).
static inline int64_t pair_group(int64_t pair, int64_t swiglu) { return swiglu ? pair : pair * 2; }
static inline int64_t second_group(int64_t g, int64_t swiglu) { return swiglu ? g + swiglu / TILE : g + 1; }

// ---------------------------------------------------------------- quantized weights with AMX tiles

// With AMX one instruction multiplies a tile of x (16 rows x one block of 32 int8: a pass) with a tile of W (a
// block of 16 output rows, its 8 k-groups as B's rows: the tile layout's, Q4 nibbles spread to bytes first) into
// 16 x 16 int32 sums: a block's exact integer dots for 16 rows of x at once (8,192 multiply-adds, against 64 per
// vpdpbusd). They go through memory (no move from a tile to a vector register), and each row's block is scaled
// and summed as strip_q does, vector for vector: the same operations on the same integers, so the same bits as
// the other instruction sets. Rows of x come 16 at a time; the rest of a batch goes through strip_q.
// Per block the tile unit and the vector unit each have about as much to do (a block's sums are 4 bytes per 32
// products and pass, written and read back: 1.3x AVX512-VNNI's tiles at 256 rows, two passes, on a Sapphire
// Rapids VM), so block b + 2 is multiplied while block b is scaled.
#if ISA_AMX
#include <sys/syscall.h>
#include <unistd.h>

enum { AMX_ROWS = 16, AMX_B_BYTES = 8 * 64, AMX_C_BYTES = AMX_ROWS * 64, AMX_RING = 4 };

// Linux grants a process the tiles' 8 KB of register state only when asked (arch_prctl, kernel 5.16 and later).
// Returns 1 when it did; asked once, before the threads that use them run.
int tile_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

// ldtilecfg with the whole of *c written first: GCC's _tile_loadconfig names only its first 8 bytes as read, so
// the stores of a configuration built on the stack can be dropped as dead (rows 0: the next tile op faults).
static inline void load_tile_config(const TileConfig *c) {
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(c);
}

// Per thread. Tiles 0, 1 and 5, 6: C, the sums of x's two passes (16 rows of x x 16 W rows, int32) for even and
// odd blocks; 2, 3: A, x's passes (16 rows x 32 int8); 4 and 7: B, a block of 16 W rows for even and odd blocks
// (8 k-groups x 16 rows x 4 bytes).
static void amx_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
    c.colsb[2] = c.colsb[3] = QK;
    c.rows[4] = c.rows[7] = 8;
    load_tile_config(&c);
}

// A group's nb blocks of W as B tiles, 512 B each: Q8_0's as they are (signed: tdpbssd, no offset), Q4's nibbles
// spread to one byte each (k-groups 0-3 the low nibbles of the 4 slots, 4-7 the high ones, as weights_u8 reads).
static const uint8_t *amx_weights(int type, const uint8_t *group, int64_t nb, uint8_t *buf) {
    if (type == TYPE_Q8_0) return group;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++)
        for (int s = 0; s < 4; s++) {
            const __m512i packed = _mm512_loadu_si512(group + b * 256 + 64 * s);
            _mm512_store_si512(buf + b * AMX_B_BYTES + 64 * s, _mm512_and_si512(packed, low));
            _mm512_store_si512(buf + b * AMX_B_BYTES + 64 * (s + 4), _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
        }
    return buf;
}

// Block b's sums: x's passes (tiles 2, 3) times W (tile BT) into tiles C0, C1, stored to cb and cb + 256.
#define AMX_BLOCK(b, C0, C1, BT, cb)                                                                            \
    do {                                                                                                        \
        _tile_loadd(BT, bw + (b) * AMX_B_BYTES, 64);                                                            \
        _tile_loadd(2, xq + (b) * QK, passes * K);                                                              \
        _tile_zero(C0);                                                                                         \
        if (type == TYPE_Q8_0) _tile_dpbssd(C0, 2, BT);                                                         \
        else _tile_dpbsud(C0, 2, BT);                                                                           \
        _tile_stored(C0, cb, 64);                                                                               \
        if (passes == 2) {                                                                                      \
            _tile_loadd(3, xq + K + (b) * QK, passes * K);                                                      \
            _tile_zero(C1);                                                                                     \
            if (type == TYPE_Q8_0) _tile_dpbssd(C1, 3, BT);                                                     \
            else _tile_dpbsud(C1, 3, BT);                                                                       \
            _tile_stored(C1, (cb) + 256, 64);                                                                   \
        }                                                                                                       \
    } while (0)

// strip_q's scaling of block b's sums (c: pass 0, c + 256: pass 1) into each row's running sums. ``xadd``:
// block_terms (Q4_0's offset 8 sum x, Q4_1's mins factor xd sum x), as strip_q takes them.
static inline __attribute__((always_inline)) void amx_scale(int type, int passes, const int32_t *c, int64_t b,
                                                              const uint8_t *ds, const uint8_t *ms, int64_t nb,
                                                              const float *xd, const int32_t *xadd, vf acc[AMX_ROWS]) {
    const vf scale = vf_half(ds + b * TILE * 2);
    const vf mins = type == TYPE_Q4_1 ? vf_half(ms + b * TILE * 2) : vf_zero();
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) {  // unrolled: the sums stay in registers
        vi total = _mm512_load_si512(c + 16 * i);
        if (passes == 2) total = vi_add32(vi_mullo32(total, vi_set1_32(RATIO)), _mm512_load_si512(c + 256 + 16 * i));
        if (type == TYPE_Q4_0) total = vi_sub32(total, vi_set1_32(xadd[i * nb + b]));
        acc[i] = vf_fma(scale, vf_mul(vf_cvt(total), vf_set1(xd[i * nb + b])), acc[i]);
        if (type == TYPE_Q4_1) acc[i] = vf_fma(mins, vf_set1(term_f32(xadd + i * nb + b)), acc[i]);
    }
}

// 16 rows of y from 16 rows of x, the 16 columns of one group (``valid`` of them real). c: a ring of AMX_RING
// buffers of a block's two C tiles.
static inline __attribute__((always_inline)) void amx_rows(int type, int passes, const uint8_t *bw, const uint8_t *ds,
                                                             const uint8_t *ms, int64_t nb, const int8_t *xq,
                                                             int64_t K, const float *xd, const int32_t *xadd,
                                                             int32_t *c, float *y, int64_t N, int64_t valid) {
    vf acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) acc[i] = vf_zero();
#define RING(i) (c + ((i) % AMX_RING) * 2 * AMX_C_BYTES / 4)
    AMX_BLOCK(0, 0, 1, 4, RING(0));
    if (nb > 1) AMX_BLOCK(1, 5, 6, 7, RING(1));
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 2 < nb) AMX_BLOCK(b + 2, 0, 1, 4, RING(b + 2));
        amx_scale(type, passes, RING(b), b, ds, ms, nb, xd, xadd, acc);
        if (b + 1 < nb) {
            if (b + 3 < nb) AMX_BLOCK(b + 3, 5, 6, 7, RING(b + 3));
            amx_scale(type, passes, RING(b + 1), b + 1, ds, ms, nb, xd, xadd, acc);
        }
    }
#undef RING
    const __mmask16 keep = (__mmask16)((1u << valid) - 1);
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) _mm512_mask_storeu_ps(y + i * N, keep, acc[i]);
}
#undef AMX_BLOCK

static void amx_rows_any(int type, int passes, const uint8_t *bw, const uint8_t *ds, const uint8_t *ms, int64_t nb,
                         const int8_t *xq, int64_t K, const float *xd, const int32_t *xadd, int32_t *c, float *y,
                         int64_t N, int64_t valid) {
#define ARGS bw, ds, ms, nb, xq, K, xd, xadd, c, y, N, valid
#define TYPES(P)                                                                                                \
    if (type == TYPE_Q4_0) amx_rows(TYPE_Q4_0, P, ARGS);                                                        \
    else if (type == TYPE_Q4_1) amx_rows(TYPE_Q4_1, P, ARGS);                                                   \
    else amx_rows(TYPE_Q8_0, P, ARGS);
    if (passes == 1) { TYPES(1) } else { TYPES(2) }
#undef TYPES
#undef ARGS
}

// bf16 weights with AMX (tdpbf16ps: 16 x 16 fp32 sums of 32 products each). Unlike integer sums, these are not
// the bits of vdpbf16ps (the tile unit adds a tile's products in its own order: 16 % of sums of 32 differ from
// either pairwise order on a Sapphire Rapids), so every row count takes the tiles here, one row alone too: a row
// of y still does not depend on its batch. No block scales: a tile of sums stays in its register over all of K,
// and is stored once. x's rows come in tiles of 16 (rows past M zero); two tiles of x and two groups of W an
// item (4 sums, each tile loaded once for two products).
void tile_bf16_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;  // 0-3 C, 4-5 A (x), 6-7 B (W)
    load_tile_config(&c);
}

// C tiles (MT rows of tiles of x x NT groups of W) over all of K: x's tiles at xb (rows passes * K values apart),
// the groups' tiles at w0, w1; tile 2i + j stored to c[2i + j], rows ldc[2i + j] floats apart.
static inline __attribute__((always_inline)) void amx_bf16_tiles(int mt, int nt, int passes, const uint16_t *xb,
                                                                   int64_t K, const uint8_t *w0, const uint8_t *w1,
                                                                   float *const c[4], const int64_t ldc[4]) {
    const int64_t stride = passes * K * 2;
    _tile_zero(0);
    if (nt == 2) _tile_zero(1);
    if (mt == 2) _tile_zero(2);
    if (mt == 2 && nt == 2) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {  // 16 pairs of inputs: a B tile's 16 rows of 64 B
        _tile_loadd(6, w0 + k * 32, 64);
        if (nt == 2) _tile_loadd(7, w1 + k * 32, 64);
        for (int p = 0; p < passes; p++) {
            _tile_loadd(4, xb + p * K + k, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (nt == 2) _tile_dpbf16ps(1, 4, 7);
            if (mt == 2) {
                _tile_loadd(5, xb + AMX_ROWS * passes * K + p * K + k, stride);
                _tile_dpbf16ps(2, 5, 6);
                if (nt == 2) _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    _tile_stored(0, c[0], ldc[0] * 4);
    if (nt == 2) _tile_stored(1, c[1], ldc[1] * 4);
    if (mt == 2) _tile_stored(2, c[2], ldc[2] * 4);
    if (mt == 2 && nt == 2) _tile_stored(3, c[3], ldc[3] * 4);
}

// One item of the bf16 product: y's row tiles r, r + 1 (of row_tiles) x groups g, g + 1 (of groups) from x's
// tiles (xb: rows of ``passes`` x K values) and the groups' B tiles at w0, w1. A whole C tile goes straight into
// y, a partial one through c (4 x 256 floats) and a copy of its valid rows and columns. With ``swiglu`` = I > 0,
// w0 is gate group g and w1 its up group (g + I / 16 of W = [gate; up]), and y (M, I) gets silu(gate) * up.
static inline __attribute__((always_inline)) void amx_bf16_item(int passes, const uint16_t *xb, int64_t M, int64_t K,
                                                                  const uint8_t *w0, const uint8_t *w1, int64_t r,
                                                                  int64_t row_tiles, int64_t g, int64_t groups,
                                                                  int64_t N, float *y, float *c, int64_t swiglu) {
    const int nt = swiglu || g + 1 < groups ? 2 : 1, mt = r + 1 < row_tiles ? 2 : 1;
    const uint16_t *x0 = xb + r * AMX_ROWS * passes * K;
    float *to[4];
    int64_t ld[4];
    for (int t = 0; t < 4; t++) {
        const int64_t m0 = (r + t / 2) * AMX_ROWS, n0 = (g + t % 2) * TILE;
        const int whole = !swiglu && m0 + AMX_ROWS <= M && n0 + TILE <= N;
        to[t] = whole ? y + m0 * N + n0 : c + 256 * t;
        ld[t] = whole ? N : TILE;
    }
    if (mt == 2 && nt == 2) amx_bf16_tiles(2, 2, passes, x0, K, w0, w1, to, ld);
    else if (mt == 2) amx_bf16_tiles(2, 1, passes, x0, K, w0, w1, to, ld);
    else if (nt == 2) amx_bf16_tiles(1, 2, passes, x0, K, w0, w1, to, ld);
    else amx_bf16_tiles(1, 1, passes, x0, K, w0, w1, to, ld);
    if (swiglu) {
        for (int i = 0; i < mt; i++)
            for (int64_t row = 0; row < AMX_ROWS; row++) {
                const int64_t m = (r + i) * AMX_ROWS + row;
                const float *gate = c + 256 * (2 * i) + 16 * row, *up = gate + 256;
                if (m < M)
                    for (int h = 0; h < 16; h += 8)
                        _mm256_storeu_ps(y + m * swiglu + g * TILE + h,
                                         silu_mul8(_mm256_load_ps(gate + h), _mm256_load_ps(up + h)));
            }
        return;
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            const int64_t n0 = (g + j) * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
            if (to[2 * i + j] != c + 256 * (2 * i + j)) continue;
            for (int64_t row = 0; row < AMX_ROWS; row++) {
                const int64_t m = (r + i) * AMX_ROWS + row;
                if (m < M) memcpy(y + m * N + n0, c + 256 * (2 * i + j) + 16 * row, cols * sizeof(float));
            }
        }
}

// y (M, N) = x @ W^T for bf16 W in tiles; xb: x as bf16 passes (bf16_rows), its rows allocated up to a multiple
// of 16 (zeroed here). ``swiglu`` > 0: y (M, swiglu) = silu(gate) * up instead (amx_bf16_item).
static void amx_bf16_gemm(int passes, uint16_t *xb, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                          int64_t swiglu) {
    const int64_t groups = (N + TILE - 1) / TILE, group_bytes = TILE * K * 2, padded = pass_rows(M);
    memset(xb + M * passes * K, 0, (padded - M) * passes * K * sizeof(uint16_t));
    const int64_t pairs = swiglu ? swiglu / TILE : (groups + 1) / 2, row_tiles = padded / AMX_ROWS,
                  rpairs = (row_tiles + 1) / 2, second = swiglu ? swiglu / TILE * group_bytes : group_bytes;
#pragma omp parallel
    {
        tile_bf16_configure();
        float c[4 * 256] __attribute__((aligned(64)));
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < pairs * rpairs; item++) {
            // row tiles r, r + 1 (the faster index: a thread's next item reads the same groups of W, from L1);
            // groups g, g + 1
            const int64_t g = pair_group(item / rpairs, swiglu), r = item % rpairs * 2;
            const uint8_t *w0 = w + g * group_bytes;
            amx_bf16_item(passes, xb, M, K, w0, w0 + second, r, row_tiles, g, groups, N, y, c, swiglu);
        }
        _tile_release();
    }
}

// Bytes of each thread's buffer: a group's B tiles, then the ring of C tiles.
static int64_t amx_buffer_bytes(int64_t K) { return K / QK * AMX_B_BYTES + AMX_RING * 2 * AMX_C_BYTES; }

// Rows [0, M) of y (M a multiple of 16) from x quantized (xq, xd: quantize_rows; xadd: block_terms), W in tiles;
// each thread's buffer (amx_buffer_bytes) at ``buffers`` + its number x ``stride``.
static void amx_gemm(int type, int passes, const int8_t *xq, const float *xd, const int32_t *xadd, int64_t M,
                     int64_t K, const uint8_t *w, int64_t N, float *y, uint8_t *buffers, int64_t stride) {
    const int64_t nb = K / QK, groups = (N + TILE - 1) / TILE, row_bytes = nb * block_bytes(type);
#pragma omp parallel
    {
        amx_configure();
        uint8_t *buf = buffers + omp_get_thread_num() * stride;
        int32_t *c = (int32_t *)(buf + nb * AMX_B_BYTES);
#pragma omp for schedule(guided)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *group = w + g * TILE * row_bytes, *qs, *ds, *ms;
            strip_parts(type, group, nb, 0, &qs, &ds, &ms);
            const uint8_t *bw = amx_weights(type, group, nb, buf);
            const int64_t valid = N - g * TILE < TILE ? N - g * TILE : TILE;
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS)
                amx_rows_any(type, passes, bw, ds, ms, nb, xq + m0 * passes * K, K, xd + m0 * nb, xadd + m0 * nb, c,
                             y + m0 * N + g * TILE, N, valid);
        }
        _tile_release();
    }
}
#else
int tile_amx_ready(void) { return 0; }
#endif

// ---------------------------------------------------------------- quantized weights, the fp32 product

// Where integer dots are slower than fp32 FMAs (AVX2 has no vpdpbusd: a 2-pass block takes four multiplies
// per 32 products, against four FMAs that need no pass over x), a batch of rows multiplies the dequantized
// weights instead: each weight exactly the fp32 value gguf-py gives, summed in order of the inputs.

// k-group j of a block's 16 rows at q (lane n: row n's inputs 4j..4j+3), for expand_group: Q8_0's bytes, the
// 4-bit types' nibbles (with AVX512 the bits above them left: vpermps reads only an index's low 4 bits).
static inline __attribute__((always_inline)) vi group_bytes(int type, const uint8_t *q, int j) {
    if (type == TYPE_Q8_0) return vi_load(q + 64 * j);
    return ISA_VNNI ? nibbles(q, j) : vi_and(nibbles(q, j), vi_set1_8(0x0F));
}

// The W rows' weights at input k = 4 j + t of block b, as fp32 vectors (t = 0..3 of k-group j), from u =
// group_bytes: exactly the values gguf-py gives.
static inline __attribute__((always_inline)) void expand_group(int type, vi u, vf scale, vf min, vf out[4]) {
    for (int t = 0; t < 4; t++) {
        vf q;
        if (type == TYPE_Q8_0) {  // the byte t of each lane, sign-extended
#if ISA_VNNI
            q = vf_cvt(_mm512_srai_epi32(_mm512_slli_epi32(u, 24 - 8 * t), 24));
#else
            q = vf_cvt(_mm256_srai_epi32(_mm256_slli_epi32(u, 24 - 8 * t), 24));
#endif
            out[t] = vf_mul(scale, q);  // d * q, exact
        } else {
#if ISA_VNNI  // the nibble's value looked up (q, or q - 8 for Q4_0): no mask, no conversion, no add
            const __m512 values = type == TYPE_Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                                    : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
            q = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(u, 8 * t) : u, values);
            out[t] = type == TYPE_Q4_1 ? vf_fma(scale, q, min)  // d * q + m (d * q is exact)
                                       : vf_mul(scale, q);      // d * (q - 8)
#else
            q = vf_cvt(vi_and(_mm256_srli_epi32(u, 8 * t), vi_set1_32(0xFF)));
            out[t] = type == TYPE_Q4_1 ? vf_fma(scale, q, min)                      // d * q + m (d * q is exact)
                                       : vf_mul(scale, vf_add(q, vf_set1(-8.0f)));  // d * (q - 8)
#endif
        }
    }
}

// A group's 16 rows of weights, every input, as fp32: buf[k * 16 + row].
static inline __attribute__((always_inline)) void expand_group_rows(int type, const uint8_t *group, int64_t nb,
                                                                      float *buf) {
    const int64_t qstride = tile_quant_bytes(type);
    const uint8_t *d = group + nb * qstride, *mins = d + nb * TILE * 2;
    for (int h = 0; h < STRIPS; h++) {
        const uint8_t *q = group + h * W * 4;
        for (int64_t b = 0; b < nb; b++, q += qstride) {
            const vf scale = vf_half(d + b * TILE * 2 + h * W * 2);
            const vf min = type == TYPE_Q4_1 ? vf_half(mins + b * TILE * 2 + h * W * 2) : vf_zero();
            for (int j = 0; j < 8; j++) {
                vf w[4];
                expand_group(type, group_bytes(type, q, j), scale, min, w);
                for (int t = 0; t < 4; t++) vf_store(buf + (b * QK + 4 * j + t) * TILE + h * W, w[t]);
            }
        }
    }
}

static void expand_any(int type, const uint8_t *group, int64_t nb, float *buf) {
    if (type == TYPE_Q4_0) expand_group_rows(TYPE_Q4_0, group, nb, buf);
    else if (type == TYPE_Q4_1) expand_group_rows(TYPE_Q4_1, group, nb, buf);
    else expand_group_rows(TYPE_Q8_0, group, nb, buf);
}

enum { MR_F32 = ISA_VNNI ? 12 : 6 };

// mr rows of x (fp32, K apart) against an expanded group: out[i * 16 + row]. Each output is its inputs' products
// summed in order, so it does not depend on mr.
static inline __attribute__((always_inline)) void group_f32(int mr, const float *buf, int64_t K, const float *x,
                                                             float *out) {
    vf acc[MR_F32][STRIPS];
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < STRIPS; h++) acc[i][h] = vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf w[STRIPS];
        for (int h = 0; h < STRIPS; h++) w[h] = *(const vf *)(buf + k * TILE + h * W);
        for (int i = 0; i < mr; i++) {
            const vf xv = vf_set1(x[i * K + k]);
            for (int h = 0; h < STRIPS; h++) acc[i][h] = vf_fma(xv, w[h], acc[i][h]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < STRIPS; h++) vf_store(out + i * TILE + h * W, acc[i][h]);
}

static void group_f32_any(int mr, const float *buf, int64_t K, const float *x, float *out) {
    switch (mr) {
        case 1: group_f32(1, buf, K, x, out); break;
        case 2: group_f32(2, buf, K, x, out); break;
        case 3: group_f32(3, buf, K, x, out); break;
        case 4: group_f32(4, buf, K, x, out); break;
        case 5: group_f32(5, buf, K, x, out); break;
        default: group_f32(MR_F32, buf, K, x, out); break;
    }
}

// ---------------------------------------------------------------- bf16 weights

// mr rows of x as bf16 passes (per row ``passes * K`` values) against ns strips (1, or 2 with AVX512: each
// broadcast of x then meets 32 rows of W): two running sums per row and strip (even and odd pairs of inputs, added
// at the end), so a dot's latency does not bound a lone row. out as strip_q's; the same bits whatever mr and ns.
static inline __attribute__((always_inline)) void strip_bf16(int mr, int passes, int ns, const uint8_t *const *ws,
                                                               int64_t K, const uint16_t *xb, float *out,
                                                               Ahead ahead) {
    vf acc[2][MR][2];
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < mr; i++) acc[s][i][0] = acc[s][i][1] = vf_zero();
    for (int64_t k = 0; k < K; k += 4) {  // K is a multiple of 32: pairs k (even sums) and k + 2 (odd)
        if (ahead.bytes && k % 32 == 0) prefetch_part(ahead, k / 32, K / 32);  // as strip_q, a block of 32 a part
        for (int parity = 0; parity < 2; parity++) {
            const int64_t kk = k + 2 * parity;
            vi wv[2];
            for (int s = 0; s < ns; s++) wv[s] = vi_load(ws[s] + (kk / 2) * TILE * 4);
            for (int i = 0; i < mr; i++) {
                const uint16_t *x = xb + i * passes * K + kk;
                const vi x0 = vi_bcast32(x);
                for (int s = 0; s < ns; s++) acc[s][i][parity] = dot_bf16(acc[s][i][parity], wv[s], x0);
                if (passes == 2) {
                    const vi x1 = vi_bcast32(x + K);
                    for (int s = 0; s < ns; s++) acc[s][i][parity] = dot_bf16(acc[s][i][parity], wv[s], x1);
                }
            }
        }
    }
    for (int s = 0; s < ns; s++)
        for (int i = 0; i < mr; i++) vf_store(out + (s * MR + i) * W, vf_add(acc[s][i][0], acc[s][i][1]));
}

// Rows per call with two strips (AVX512): 4 running sums a row, 16 in registers (6 rows ran no faster).
enum { BF16_ROWS_FOR_TWO = 4 };

static void strip_bf16_any(int mr, int passes, int ns, const uint8_t *const *ws, int64_t K, const uint16_t *xb,
                           float *out, Ahead ahead) {
#define ROWS(P)                                                                                                 \
    if (ns == 2 && ISA_VNNI) {                                                                                  \
        switch (mr) {                                                                                           \
            case 1: strip_bf16(1, P, 2, ws, K, xb, out, ahead); break;                                          \
            case 2: strip_bf16(2, P, 2, ws, K, xb, out, ahead); break;                                          \
            case 3: strip_bf16(3, P, 2, ws, K, xb, out, ahead); break;                                          \
            default: strip_bf16(BF16_ROWS_FOR_TWO, P, 2, ws, K, xb, out, ahead); break;                         \
        }                                                                                                       \
    } else {                                                                                                    \
        switch (mr) {                                                                                           \
            case 1: strip_bf16(1, P, 1, ws, K, xb, out, ahead); break;                                          \
            case 2: strip_bf16(2, P, 1, ws, K, xb, out, ahead); break;                                          \
            case 3: strip_bf16(3, P, 1, ws, K, xb, out, ahead); break;                                          \
            case 4: strip_bf16(4, P, 1, ws, K, xb, out, ahead); break;                                          \
            default: strip_bf16(MR, P, 1, ws, K, xb, out, ahead); break;                                        \
        }                                                                                                       \
    }
    if (passes == 1) { ROWS(1) } else { ROWS(2) }
#undef ROWS
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// 16 values of the high halves of a and b's lanes, in order, as bf16.
static inline void store_bf16_16(uint16_t *out, __m256i a, __m256i b) {
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));  // per 128 bits
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

// x (M, K) -> (M, passes, K) bf16: each value rounded, and with two passes what the first left, rounded (K is a
// multiple of 32). With AVX512-BF16, 32 values an instruction (vcvtne2ps2bf16: the same rounding, but a
// denormal counts as 0; a tenth of the instructions, and 5 % of a bf16 prefill went here).
static void bf16_rows(const float *x, int64_t M, int64_t K, int passes, uint16_t *xb) {
#if ISA_BF16
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 32) {
            const __m512 v0 = _mm512_loadu_ps(x + m * K + k), v1 = _mm512_loadu_ps(x + m * K + k + 16);
            const __m512bh h = _mm512_cvtne2ps_pbh(v1, v0);
            _mm512_storeu_si512(xb + m * passes * K + k, (__m512i)h);
            if (passes == 2) {  // what the first pass left: the bf16 value as fp32 is its bits shifted up
                const __m512i wide0 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256((__m512i)h)), 16);
                const __m512i wide1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64((__m512i)h, 1)), 16);
                _mm512_storeu_si512(xb + m * passes * K + K + k,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, _mm512_castsi512_ps(wide1)),
                                                                 _mm512_sub_ps(v0, _mm512_castsi512_ps(wide0))));
            }
        }
#else
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16) {
            const __m256 v0 = _mm256_loadu_ps(x + m * K + k), v1 = _mm256_loadu_ps(x + m * K + k + 8);
            const __m256i h0 = to_bf16_8(v0), h1 = to_bf16_8(v1);
            store_bf16_16(xb + m * passes * K + k, h0, h1);
            if (passes == 2)
                store_bf16_16(xb + m * passes * K + K + k, to_bf16_8(_mm256_sub_ps(v0, _mm256_castsi256_ps(h0))),
                              to_bf16_8(_mm256_sub_ps(v1, _mm256_castsi256_ps(h1))));
        }
#endif
}

// ---------------------------------------------------------------- quantized weights widened to bf16

// The bf16 numerics (--numerics bf16) for quantized weights: from 16 rows of x a group's weights are widened to
// their fp32 values (expand_group: what gguf-py gives), rounded to bf16 and multiplied like bf16 weights, x
// rounded to bf16 once: no block scales, so a sum stays in its register over all of K (integer dots must scale
// every block's). With AMX in AMX-BF16 tiles (amx_wide_gemm), else with vdpbf16ps (the strip path's strip_bf16:
// per row and block of 32 inputs 16 dots, as many as fast's two int8 passes, but none of their scaling). Widening
// a group costs about as much as multiplying it by 16 rows, so a group is widened once per item and every row of x
// meets it. Fewer rows take the integer dots of ``passes`` (a decode reads a quarter of bf16's bytes), so a row's
// bits depend on its batch's size.
#if ISA_BF16
enum { WIDE_ROWS = 16 };

// A group's 16 rows of W as bf16 B tiles (the dense layout: K/2 pairs x 16 rows x 2 bf16): each weight's fp32
// value as the fp32 product expands it (expand_group: what gguf-py gives), rounded to nearest bf16.
static inline __attribute__((always_inline)) void wide_group(int type, const uint8_t *group, int64_t nb,
                                                             uint16_t *out, Ahead ahead) {
    const int64_t qstride = tile_quant_bytes(type);
    const uint8_t *d = group + nb * qstride, *mins = d + nb * TILE * 2;
    const uint8_t *q = group;
    for (int64_t b = 0; b < nb; b++, q += qstride) {
        if (ahead.bytes) prefetch_part(ahead, b, nb);  // block b's share of the next group's weights
        const vf scale = vf_half(d + b * TILE * 2);
        const vf min = type == TYPE_Q4_1 ? vf_half(mins + b * TILE * 2) : vf_zero();
        for (int j = 0; j < 8; j++) {  // inputs 4j..4j+3 of the block
            vf w[4];
            expand_group(type, group_bytes(type, q, j), scale, min, w);
            uint16_t *pair = out + (b * QK + 4 * j) * TILE;
            _mm512_store_si512(pair, bf16_pairs(w[0], w[1]));  // lane n: row n's inputs 4j, 4j + 1
            _mm512_store_si512(pair + 32, bf16_pairs(w[2], w[3]));
        }
    }
}

static void wide_any(int type, const uint8_t *group, int64_t nb, uint16_t *out, Ahead ahead) {
    if (type == TYPE_Q4_0) wide_group(TYPE_Q4_0, group, nb, out, ahead);
    else if (type == TYPE_Q4_1) wide_group(TYPE_Q4_1, group, nb, out, ahead);
    else wide_group(TYPE_Q8_0, group, nb, out, ahead);
}

// Bytes of each thread's buffer: two groups' B tiles.
static int64_t wide_buffer_bytes(int64_t K) { return 2 * K * TILE * (int64_t)sizeof(uint16_t); }
#endif

#if ISA_AMX
// y (M, N) = x @ W^T, W quantized in tiles, M >= 16: xb x as one bf16 pass (bf16_rows, rows up to a multiple
// of 16); each thread's buffer (wide_buffer_bytes) at ``buffers`` + its number x ``stride``. An item is two
// groups, widened once, against every row tile of x.

static void amx_wide_gemm(int type, uint16_t *xb, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                          uint8_t *buffers, int64_t stride, int64_t swiglu) {
    const int64_t groups = (N + TILE - 1) / TILE, row_bytes = K / QK * block_bytes(type), padded = pass_rows(M);
    memset(xb + M * K, 0, (padded - M) * K * sizeof(uint16_t));
    const int64_t pairs = swiglu ? swiglu / TILE : (groups + 1) / 2, row_tiles = padded / AMX_ROWS;
#pragma omp parallel
    {
        tile_bf16_configure();
        uint16_t *w0 = (uint16_t *)(buffers + omp_get_thread_num() * stride), *w1 = w0 + K * TILE;
        const int64_t threads = omp_get_num_threads();
        float c[4 * 256] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic)
        for (int64_t pair = 0; pair < pairs; pair++) {
            // the schedule hands out one item at a time, so a thread's next is likely ``threads`` on
            const int64_t next = pair + threads, g = pair_group(pair, swiglu), g1 = second_group(g, swiglu),
                          n0 = pair_group(next, swiglu), n1 = second_group(n0, swiglu);
            const Ahead a0 = {w + n0 * TILE * row_bytes, next < pairs ? TILE * row_bytes : 0};
            const Ahead a1 = {w + n1 * TILE * row_bytes, next < pairs && n1 < groups ? TILE * row_bytes : 0};
            wide_any(type, w + g * TILE * row_bytes, K / QK, w0, a0);
            if (g1 < groups) wide_any(type, w + g1 * TILE * row_bytes, K / QK, w1, a1);
            for (int64_t r = 0; r < row_tiles; r += 2)
                amx_bf16_item(1, xb, M, K, (const uint8_t *)w0, (const uint8_t *)w1, r, row_tiles, g, groups, N, y, c,
                              swiglu);
        }
        _tile_release();
    }
}
#endif

// ---------------------------------------------------------------- entry points

int tile_supported(int type) { return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0 || type == TYPE_BF16; }

// Most rows of x a quantized weight multiplies with integer dots in ``passes`` passes; more take the fp32 product.
// With VNNI, never. On AVX2 one pass costs two multiplies per 32 products, and beat the fp32 product at every row
// count (1.3-2.2x, the AVX2 build on a Zen 5); two passes, as one 16-bit x (x16_rows), cost two too. On a Zen 3
// they beat it at 4-8 rows (the default model's gate/up product: 8 rows 1.2-1.7x; a decode of 8 in the model 1.5x),
// were even with it at 16-32 (alternating runs went either way) and lost from 128 (0.8-0.9x), where the fp32
// product's weights, expanded once per item for all the rows, cost least. (When two passes cost four multiplies,
// the fp32 product was faster from 4 rows, on a Zen 1.)
int tile_int8_max_rows(int passes) { return ISA_VNNI || passes == 1 ? 1 << 30 : 16; }

// What the kernels were compiled for: 2 AVX2, 512 AVX512-VNNI (bf16 dots emulated), 513 with AVX512-BF16, 514
// with AMX too (used once tile_amx_ready() said yes).
int tile_isa(void) { return ISA_VNNI ? (ISA_AMX ? 514 : ISA_BF16 ? 513 : 512) : 2; }

static inline int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

// Bytes of each thread's own work memory: the fp32 product's expanded group, or two widened groups (and AMX's
// B and C tiles).
static int64_t thread_bytes(int64_t K) {
    int64_t bytes = round64(K * TILE * (int64_t)sizeof(float));
#if ISA_BF16
    if (round64(wide_buffer_bytes(K)) > bytes) bytes = round64(wide_buffer_bytes(K));
#endif
#if ISA_AMX
    if (round64(amx_buffer_bytes(K)) > bytes) bytes = round64(amx_buffer_bytes(K));
#endif
    return bytes;
}

// Bytes of work memory tile_gemm needs for M rows of K on ``threads`` threads.
int64_t tile_work_bytes(int64_t M, int64_t K, int passes, int threads) {
    const int64_t nb = K / QK;
    return round64(passes * pass_rows(M) * K * 2) + round64(M * nb * (int64_t)(sizeof(float) + sizeof(int32_t))) +
           (int64_t)threads * thread_bytes(K) + 64;
}

// y (M, N) = x (M, K) @ W^T, W (N, K) in tiles (tile_repack). ``passes``: 1 or 2 (see the top), plus TILE_WIDE
// for the bf16 numerics (quantized weights, 16 rows or more, where the CPU has bf16 dots: widened to bf16, see
// above). ``work``: tile_work_bytes of scratch for omp_get_max_threads() threads, or NULL (allocated here).
// Returns 0, or -1 on an unsupported type or shape. ``swiglu`` > 0: tile_gemm_swiglu's (y is act), or 1 where it
// does not apply.
static int tile_product(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                        int passes, void *work, int64_t swiglu) {
#if ISA_BF16
    const int wide = (passes & TILE_WIDE) && type != TYPE_BF16 && M >= WIDE_ROWS;
#else
    const int wide = 0;
#endif
#if ISA_AMX
    const int amx_bf16 = (wide || type == TYPE_BF16) && tile_amx_ready();
    const int amx_int8 = !wide && type != TYPE_BF16 && M >= AMX_ROWS && tile_amx_ready();  // its whole row tiles
#else
    const int amx_bf16 = 0, amx_int8 = 0;
#endif
    // the strip path fuses it where its items are groups (AVX512, whose int8 strips have VNNI) multiplied with bf16
    // or integer dots, from SWIGLU_ROWS rows
    const int fused = swiglu && !amx_bf16 && !amx_int8 && ISA_VNNI && M >= SWIGLU_ROWS;
    if (swiglu && (!(amx_bf16 || fused) || swiglu % TILE != 0 || N != 2 * swiglu)) return 1;
    passes &= ~TILE_WIDE;
    if (!tile_supported(type) || K % QK != 0 || K <= 0 || M < 1 || N < 1 || passes < 1 || passes > 2) return -1;
    const int threads = omp_get_max_threads();
    void *owned = NULL;
    if (work == NULL) work = owned = aligned_alloc(64, round64(tile_work_bytes(M, K, passes, threads)));
    if (work == NULL) return -1;
    work = (void *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    const int64_t nb = K / QK, groups = (N + TILE - 1) / TILE, row_bytes = nb * block_bytes(type);
    const int dense = type == TYPE_BF16, dots = dense || wide || M <= tile_int8_max_rows(passes);
    int8_t *xq = work;  // (M, passes, K) int8, or (M, passes, K) bf16
    float *xd = (float *)((uint8_t *)work + round64(passes * pass_rows(M) * K * 2));
    int32_t *xsum = (int32_t *)(xd + M * nb);
    float *expanded = (float *)((uint8_t *)xd + round64(M * nb * (int64_t)(sizeof(float) + sizeof(int32_t))));
#if ISA_AMX
    if (wide && amx_bf16) {
        bf16_rows(x, M, K, 1, (uint16_t *)xq);
        amx_wide_gemm(type, (uint16_t *)xq, M, K, w, N, y, (uint8_t *)expanded, thread_bytes(K), swiglu);
        free(owned);
        return 0;
    }
#endif
    if (dense || wide) {
        if (wide) passes = 1;  // x rounded to bf16 once
        bf16_rows(x, M, K, passes, (uint16_t *)xq);
#if ISA_AMX
        if (amx_bf16) {
            amx_bf16_gemm(passes, (uint16_t *)xq, M, K, w, N, y, swiglu);
            free(owned);
            return 0;
        }
#endif
    } else if (dots) {
        quantize_rows(x, M, K, passes, xq, xd, xsum);
        block_terms(type, xd, xsum, M * nb);  // xsum now holds the terms the scaling adds
#if !ISA_VNNI
        if (passes == 2) x16_rows(xq, M, K, (uint8_t *)expanded, thread_bytes(K));  // 2 K bytes a thread
#endif
    }
    int64_t first = 0;  // rows before this one are done (by AMX)
#if ISA_AMX
    if (amx_int8) {
        first = M / AMX_ROWS * AMX_ROWS;
        amx_gemm(type, passes, xq, xd, xsum, first, K, w, N, y, (uint8_t *)expanded, thread_bytes(K));
        if (first == M) {
            free(owned);
            return 0;
        }
    }
#endif
    if (!dots) {  // the fp32 product, a group of 16 rows per item
#pragma omp parallel
        {
            float *buf = expanded + omp_get_thread_num() * (thread_bytes(K) / sizeof(float));
            float out[MR_F32 * TILE] __attribute__((aligned(64)));
#pragma omp for schedule(guided)
            for (int64_t g = 0; g < groups; g++) {
                expand_any(type, w + g * TILE * row_bytes, nb, buf);
                const int64_t n0 = g * TILE, valid = N - n0 < TILE ? N - n0 : TILE;
                for (int64_t m0 = 0; m0 < M; m0 += MR_F32) {
                    const int mr = (int)(M - m0 < MR_F32 ? M - m0 : MR_F32);
                    group_f32_any(mr, buf, K, x + m0 * K, out);
                    for (int i = 0; i < mr; i++) memcpy(y + (m0 + i) * N + n0, out + i * TILE, valid * sizeof(float));
                }
            }
        }
        free(owned);
        return 0;
    }
    // two strips an item with AVX512 (more rows of W per broadcast of x), else one; widened, two groups; fused,
    // gate group ``item`` and its up group (pair_group, second_group)
    const int64_t strips = groups * STRIPS, ns = ISA_VNNI ? 2 : 1;
    const int64_t mrows = ns == 1 ? MR : dense || wide ? BF16_ROWS_FOR_TWO : rows_for_two(passes);
    const int64_t items = fused ? swiglu / TILE : (strips + ns - 1) / ns;
#pragma omp parallel for schedule(guided)
    for (int64_t item = 0; item < items; item++) {
        const uint8_t *qs[2], *ds[2], *ms[2];
        int64_t n0[2];
        int count = 0;
        for (int64_t s = item * ns; s < item * ns + ns && s < strips && !fused; s++) {
            const int64_t g = s / STRIPS, h = s % STRIPS;
            if (g * TILE + h * W >= N) break;
            n0[count] = g * TILE + h * W;
            strip_parts(type, w + g * TILE * row_bytes, nb, h, &qs[count], &ds[count], &ms[count]);
            count++;
        }
        if (fused) {
            const int64_t g = pair_group(item, swiglu);
            for (count = 0; count < 2; count++) {
                n0[count] = (count ? second_group(g, swiglu) : g) * TILE;
                strip_parts(type, w + n0[count] * row_bytes, nb, 0, &qs[count], &ds[count], &ms[count]);  // W = TILE
            }
        }
        if (count == 0) continue;
        // The next item's weights, streamed in while this one runs: the W rows after this item's, or where an item
        // is a pair of groups (widened, fused), that pair's two groups, one to each call that can take it
        const int64_t from = (item + 1) * ns * W, to = from + ns * W < groups * TILE ? from + ns * W : groups * TILE;
        Ahead ahead[2] = {{w + from * row_bytes, to > from ? (to - from) * row_bytes : 0}, {NULL, 0}};
        if (fused || wide) {
            const int64_t sw = fused ? swiglu : 0, g = pair_group(item + 1, sw);
            for (int s = 0; s < 2; s++) {
                const int64_t next = s ? second_group(g, sw) : g, each = TILE * row_bytes;
                ahead[s] = (Ahead){w + next * each, item + 1 < items && next < groups ? each : 0};
            }
        }
#if ISA_BF16
        if (wide) {  // with AVX512 a strip is a group: each widened into this thread's buffer
            uint16_t *buf = (uint16_t *)((uint8_t *)expanded + omp_get_thread_num() * thread_bytes(K));
            for (int s = 0; s < count; s++) {
                wide_any(type, qs[s], nb, buf + s * K * TILE, ahead[s]);
                qs[s] = (const uint8_t *)(buf + s * K * TILE);
                ahead[s].bytes = 0;
            }
        }
#endif
        float out[2 * MR * W] __attribute__((aligned(64)));
        for (int64_t m0 = first; m0 < M; m0 += mrows) {
            const int mr = (int)(M - m0 < mrows ? M - m0 : mrows);
            const Ahead next = m0 == first ? ahead[0] : m0 == first + mrows ? ahead[1] : (Ahead){NULL, 0};
            if (dense || wide) strip_bf16_any(mr, passes, count, qs, K, (const uint16_t *)xq + m0 * passes * K, out,
                                              next);
            else strip_q_any(type, mr, passes, count, qs, ds, ms, nb, xq + m0 * passes * K, K, xd + m0 * nb,
                             xsum + m0 * nb, out, next);
            if (fused) {  // silu_mul's bits, 8 at a time (I a multiple of 16: no tail)
                for (int i = 0; i < mr; i++)
                    for (int h = 0; h < W; h += 8) {
                        const __m256 gate = _mm256_load_ps(out + i * W + h);
                        const __m256 up = _mm256_load_ps(out + (MR + i) * W + h);
                        _mm256_storeu_ps(y + (m0 + i) * swiglu + n0[0] + h, silu_mul8(gate, up));
                    }
                continue;
            }
            for (int s = 0; s < count; s++) {  // a whole strip's W outputs a row as one vector (a memcpy call each
                const int64_t valid = N - n0[s] < W ? N - n0[s] : W;  // was a tenth of a 512-row product's time)
                for (int i = 0; i < mr; i++) {
                    float *dst = y + (m0 + i) * N + n0[s];
                    const float *src = out + (s * MR + i) * W;
                    if (valid == W) vf_store(dst, vf_load(src));
                    else memcpy(dst, src, valid * sizeof(float));
                }
            }
        }
    }
    free(owned);
    return 0;
}

// GGUF rows (N, nb * block bytes; or dense bf16 rows (N, K)) -> tiles, into out (ceil(N / 16) * 16 rows of the
// same bytes). Returns 0, or -1 on an unsupported type or K.
int tile_repack(int type, const uint8_t *rows, int64_t N, int64_t K, uint8_t *out) {
    if (!tile_supported(type) || K % QK != 0 || K <= 0) return -1;
    const int64_t nb = K / QK, bb = block_bytes(type), row_bytes = nb * bb, groups = (N + TILE - 1) / TILE;
    memset(out, 0, groups * TILE * row_bytes);
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *src = rows + n * row_bytes;
        uint8_t *group = out + (n / TILE) * TILE * row_bytes;
        const int64_t r = n % TILE;
        if (type == TYPE_BF16) {
            for (int64_t k = 0; k < K; k++) memcpy(group + (k / 2) * TILE * 4 + r * 4 + (k % 2) * 2, src + 2 * k, 2);
            continue;
        }
        const int64_t qb = tile_quant_bytes(type);
        uint8_t *d = group + nb * qb, *mins = d + nb * TILE * 2;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + b * bb;
            memcpy(d + b * TILE * 2 + r * 2, blk, 2);
            if (type == TYPE_Q4_1) memcpy(mins + b * TILE * 2 + r * 2, blk + 2, 2);
            const uint8_t *qs = blk + bb - quant_bytes(type);
            for (int j = 0; j < quant_bytes(type) / 4; j++) memcpy(group + b * qb + 64 * j + 4 * r, qs + 4 * j, 4);
        }
    }
    return 0;
}

// The fp32 values of the given rows of a tiled weight: out[i, K] for each index in rows (embedding lookups).
int tile_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *rows, int64_t count, float *out) {
    if (!tile_supported(type) || K % QK != 0) return -1;
    const int64_t nb = K / QK, row_bytes = nb * block_bytes(type);
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows[i], r = n % TILE;
        const uint8_t *group = w + (n / TILE) * TILE * row_bytes;
        float *o = out + i * K;
        if (type == TYPE_BF16) {
            for (int64_t k = 0; k < K; k++) {
                uint16_t h;
                memcpy(&h, group + (k / 2) * TILE * 4 + r * 4 + (k % 2) * 2, 2);
                o[k] = from_bf16(h);
            }
            continue;
        }
        const int64_t qb = tile_quant_bytes(type);
        const uint8_t *d = group + nb * qb, *mins = d + nb * TILE * 2;
        for (int64_t b = 0; b < nb; b++) {
            const float scale = fp16_to_fp32(d + b * TILE * 2 + r * 2);
            const uint8_t *q = group + b * qb + 4 * r;
            for (int k = 0; k < QK; k++) {
                float v;
                if (type == TYPE_Q8_0) {
                    v = scale * (float)(int8_t)q[64 * (k / 4) + k % 4];  // exact, as gguf-py's d * q
                } else {
                    const int low = k < 16, at = 64 * ((k % 16) / 4) + k % 4;
                    const int nibble = low ? q[at] & 0x0F : q[at] >> 4;
                    v = type == TYPE_Q4_1 ? scale * (float)nibble + fp16_to_fp32(mins + b * TILE * 2 + r * 2)
                                          : scale * (float)(nibble - 8);
                }
                o[b * QK + k] = v;
            }
        }
    }
    return 0;
}

int tile_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int passes,
              void *work) {
    return tile_product(type, x, M, K, w, N, y, passes, work, 0);
}

// The SwiGLU of a fused gate/up projection, W = [gate; up] (2I rows in tiles): act (M, I) = silu(x gate^T) *
// (x up^T), silu_mul's bits. Where the product takes AMX's bf16 tiles (bf16 weights; quantized ones under
// TILE_WIDE from 16 rows), or AVX512's strips from SWIGLU_ROWS rows (bf16 or integer dots; not the rows AMX's
// integer tiles take), an item multiplies a gate group and its up group and writes only act: half the bytes
// of the (M, 2I) product, and no pass over them (at 512 rows writing y was a third of the product's time).
// Returns 1 where it does not apply (the caller multiplies with tile_gemm, then silu_mul), else tile_gemm's.
int tile_gemm_swiglu(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t I, float *act,
                     int passes, void *work) {
    return I > 0 ? tile_product(type, x, M, K, w, 2 * I, act, passes, work, I) : 1;
}
