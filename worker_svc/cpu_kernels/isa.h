// The vector primitives the tile kernels (tiles.c) are written in, for the instruction set this file is
// compiled for (one shared library per set, chosen at run time by worker_svc/cpu_kernels/__init__.py):
//
//   AVX512 + VNNI (+ BF16): 16 lanes; u8 x s8 dot products of 4 pairs into int32 in one instruction
//     (vpdpbusd), bf16 x bf16 dot products of 2 pairs into fp32 (vdpbf16ps) where the CPU has BF16;
//   AVX2 + FMA + F16C: 8 lanes; the same dot products in two (maddubs, then madd) and, for bf16, two FMAs.
//
// A lane is one output row of a weight tile: the kernels hold W rows' partial sums in one vector.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

// A line the kernels will read soon (weights of a thread's next item, keys and values ahead of a decode's
// attention), fetched into L2 (hint T1), not L1: on a 2-core Zen 4 VM, decode attention over 32 x 288 keys (fp16
// cache) 15.4 -> 10.5 ms, the default model's 120 matrices at 8 rows 7.6-7.8 -> 6.8-6.9 ms, a bf16 folder's decode
// step of 8 18-21 -> 14-15 ms; on a Sapphire Rapids VM hints T0-T2 were within noise of each other.
static inline __attribute__((always_inline)) void prefetch_line(const void *p) {
    _mm_prefetch((const char *)p, _MM_HINT_T1);
}

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

enum { W = 16 };
typedef __m512i vi;
typedef __m512 vf;
#define vi_zero() _mm512_setzero_si512()
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_set1_8(c) _mm512_set1_epi8((char)(c))
#define vi_set1_16(c) _mm512_set1_epi16((short)(c))
#define vi_set1_32(c) _mm512_set1_epi32(c)
#define vi_bcast32(p) _mm512_set1_epi32(load32(p))
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_xor(a, b) _mm512_xor_si512(a, b)
#define vi_srli16(a, n) _mm512_srli_epi16(a, n)
#define vi_slli32(a, n) _mm512_slli_epi32(a, n)
#define vi_add32(a, b) _mm512_add_epi32(a, b)
#define vi_sub32(a, b) _mm512_sub_epi32(a, b)
#define vi_mullo32(a, b) _mm512_mullo_epi32(a, b)
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_cvt(i) _mm512_cvtepi32_ps(i)
#define vf_cast(i) _mm512_castsi512_ps(i)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))  // W fp16 -> fp32

// acc + sum over each lane's 4 byte pairs of u (unsigned) * s (signed), in int32 (no saturation)
#define dot_u8s8(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define ISA_VNNI 1

#if defined(__AVX512BF16__)
// acc + w.bf16[2i+1] x.bf16[2i+1] + w.bf16[2i] x.bf16[2i] per lane i, fp32 accumulation
#define dot_bf16(acc, w, x) _mm512_dpbf16_ps(acc, (__m512bh)(w), (__m512bh)(x))
#define ISA_BF16 1

// Two fp32 vectors (lanes n) as one of bf16 pairs, each value rounded to nearest even: lane n holds (lo[n], hi[n]),
// lo in the low half: the layout of dense bf16 weights in tiles and of an AMX-BF16 B tile's row (tiles.c's widened
// weights, attention.c's P).
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    static const int16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(order), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

#else  // AVX2

enum { W = 8 };
typedef __m256i vi;
typedef __m256 vf;
#define vi_zero() _mm256_setzero_si256()
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1_8(c) _mm256_set1_epi8((char)(c))
#define vi_set1_16(c) _mm256_set1_epi16((short)(c))
#define vi_set1_32(c) _mm256_set1_epi32(c)
#define vi_bcast32(p) _mm256_set1_epi32(load32(p))
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_xor(a, b) _mm256_xor_si256(a, b)
#define vi_srli16(a, n) _mm256_srli_epi16(a, n)
#define vi_slli32(a, n) _mm256_slli_epi32(a, n)
#define vi_add32(a, b) _mm256_add_epi32(a, b)
#define vi_sub32(a, b) _mm256_sub_epi32(a, b)
#define vi_mullo32(a, b) _mm256_mullo_epi32(a, b)
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_cvt(i) _mm256_cvtepi32_ps(i)
#define vf_cast(i) _mm256_castsi256_ps(i)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

// maddubs saturates a pair sum at 32767: callers keep |u * s| <= 127 * 127 (quant.h's weights, signs moved to s)
#define dot_u8s8(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define ISA_VNNI 0

#endif

// AMX (Sapphire Rapids and later): tile registers of up to 16 rows x 64 bytes and one instruction multiplying
// two of them into a third (tdpbsud: 16 x 16 int32 sums of 64 products each; tdpbf16ps: fp32 sums of 32 bf16
// products each); tiles.c uses them for 16 rows of x at a time.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && ISA_VNNI
#define ISA_AMX 1
#else
#define ISA_AMX 0
#endif

#ifndef ISA_BF16
// The products of two bf16 values are exact in fp32, so two FMAs (odd pair first, as vdpbf16ps orders them)
// give what the instruction gives (but for its flushing of denormals).
static inline vf dot_bf16(vf acc, vi w, vi x) {
    const vi high = vi_set1_32((int32_t)0xFFFF0000);
    acc = vf_fma(vf_cast(vi_and(w, high)), vf_cast(vi_and(x, high)), acc);
    return vf_fma(vf_cast(vi_slli32(w, 16)), vf_cast(vi_slli32(x, 16)), acc);
}
#define ISA_BF16 0
#endif
