// The GGUF block formats the CPU kernels read: 32 weights per block, fp16 scale (and min) first.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { QK = 32, MAX_K = 16384 };
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 };  // ggml type ids

static inline int block_bytes(int type) {
    switch (type) {
        case TYPE_Q4_0: return 18;  // fp16 d, 16 bytes of nibbles
        case TYPE_Q4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
        case TYPE_Q8_0: return 34;  // fp16 d, 32 int8
        default: return 0;
    }
}

static inline float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
