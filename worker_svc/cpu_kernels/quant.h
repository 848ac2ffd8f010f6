// The block formats the CPU kernels read: GGUF's Q4_0, Q4_1 and Q8_0 (32 weights per block, an fp16 scale,
// and for Q4_1 an fp16 min), rearranged within each row (``qrepack``, once at load) so that a row's
// scales, mins and quants each lie together:
//
//   GGUF row:    [d m q...][d m q...] ...        (block after block, block_bytes each)
//   kernel row:  [d d ... d][m m ... m][q... q...]  (nb fp16 scales, nb fp16 mins for Q4_1, nb quant runs)
//
// The row's size is unchanged. A kernel converts eight scales with one instruction and reads each
// block's quants alone, where the GGUF layout cost scalar conversions and loads in every block.
//
// The same kernels also read dense rows, F32, F16 and BF16 (a Hugging Face checkpoint's weights as stored):
// a "block" is then 32 consecutive values, with no scales and no repacking. Each value widens exactly
// to fp32, so the product is the one PyTorch computes in fp32 from the upcast weights, at a half
// (F16, BF16) of its weight traffic.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { QK = 32, MAX_K = 16384 };
enum { TYPE_F32 = 0, TYPE_F16 = 1, TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_BF16 = 30 };  // ggml type ids

static inline int is_dense(int type) { return type == TYPE_F32 || type == TYPE_F16 || type == TYPE_BF16; }

static inline int block_bytes(int type) {
    switch (type) {
        case TYPE_F32: return 128;
        case TYPE_F16:
        case TYPE_BF16: return 64;
        case TYPE_Q4_0: return 18;  // fp16 d, 16 bytes of nibbles
        case TYPE_Q4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
        case TYPE_Q8_0: return 34;  // fp16 d, 32 int8
        default: return 0;
    }
}

static inline int quant_bytes(int type) { return type == TYPE_Q8_0 ? 32 : 16; }

// Where a kernel-layout row's parts start (``m`` is NULL but for Q4_1).
typedef struct {
    const uint8_t *d, *m, *q;
} RowView;

static inline RowView row_view(int type, const uint8_t *row, int64_t nb) {
    if (is_dense(type)) return (RowView){NULL, NULL, row};
    RowView r = {row, NULL, row + 2 * nb};
    if (type == TYPE_Q4_1) {
        r.m = row + 2 * nb;
        r.q = row + 4 * nb;
    }
    return r;
}

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
