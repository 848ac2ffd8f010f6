// The fast numerics' tile kernels (worker_svc/cpu_kernels/tiles.c) built for two instruction sets and checked
// against each other and against a product in double precision: linked from a build for AVX2 (``avx2_``
// names, the set the test suite checks against gguf-py and transformers) and one for the set under test
// (``isa_`` names). Run by bench/isa_check.py: natively, or on bare metal (boot.S, runtime.c) in an emulator of
// a CPU this machine is not.
//
// Checks, for Q4_0, Q4_1, Q8_0 and BF16, 1 and 2 passes of x, many row counts and shapes with tails:
//   - both builds lay out the same tiles and expand the same fp32 values;
//   - the product is within the numerics' error of the exact one, and every row of it equals that row
//     multiplied alone (the batch does not change a row);
//   - integer dots give the bits AVX2 gives (bf16 dots: within fp32 rounding; emulated on AVX2).

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DECLARE(prefix)                                                                                          \
    int prefix##tile_gemm(int, const float *, int64_t, int64_t, const uint8_t *, int64_t, float *, int, void *); \
    int prefix##tile_repack(int, const uint8_t *, int64_t, int64_t, uint8_t *);                                 \
    int prefix##tile_dequant_rows(int, const uint8_t *, int64_t, const int64_t *, int64_t, float *);            \
    int prefix##tile_isa(void);                                                                                 \
    int prefix##tile_int8_max_rows(int passes);
DECLARE(avx2_)
DECLARE(isa_)

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, BF16 = 30 };

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)state;
}
static float uniform(void) { return (next() >> 8) / 16777216.0f; }  // [0, 1)
static float normal(void) {
    float s = 0;
    for (int i = 0; i < 12; i++) s += uniform();
    return s - 6.0f;
}

static uint16_t half(float f) {  // fp32 -> fp16 (the values used are normal and in range), round to nearest
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000, exp = (u >> 23) & 0xFF, mant = u & 0x7FFFFF;
    const int e = (int)exp - 127 + 15;
    uint32_t h = sign | (uint32_t)(e << 10) | (mant >> 13);
    if ((mant >> 12) & 1) h++;
    return (uint16_t)h;
}

static int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 64; }

// Random weights as GGUF rows (N, K / 32 * block bytes), or bf16 rows (N, K).
static uint8_t *random_rows(int type, int64_t N, int64_t K) {
    const int64_t row = K / 32 * block_bytes(type);
    uint8_t *w = malloc(N * row);
    for (int64_t n = 0; n < N; n++) {
        uint8_t *r = w + n * row;
        if (type == BF16) {
            for (int64_t k = 0; k < K; k++) {
                const float v = normal();
                uint32_t u;
                memcpy(&u, &v, 4);
                const uint16_t h = (uint16_t)(u >> 16);
                memcpy(r + 2 * k, &h, 2);
            }
            continue;
        }
        for (int64_t b = 0; b < K / 32; b++) {
            uint8_t *blk = r + b * block_bytes(type);
            const uint16_t d = half(0.001f + 0.05f * uniform()), m = half(-0.2f * uniform());
            memcpy(blk, &d, 2);
            if (type == Q4_1) memcpy(blk + 2, &m, 2);
            uint8_t *q = blk + block_bytes(type) - (type == Q8_0 ? 32 : 16);
            for (int i = 0; i < (type == Q8_0 ? 32 : 16); i++)
                q[i] = type == Q8_0 ? (uint8_t)(int8_t)((int)(next() % 255) - 127) : (uint8_t)next();
        }
    }
    return w;
}

static int failures = 0;
#define CHECK(cond, ...)                  \
    do {                                  \
        if (!(cond)) {                    \
            failures++;                   \
            printf("FAIL " __VA_ARGS__);  \
            printf("\n");                 \
        }                                 \
    } while (0)

static void check(int type, int64_t N, int64_t K, int passes) {
    const char *name = type == Q4_0 ? "Q4_0" : type == Q4_1 ? "Q4_1" : type == Q8_0 ? "Q8_0" : "BF16";
    const int64_t row = K / 32 * block_bytes(type), padded = (N + 15) / 16 * 16, M = 37;
    uint8_t *rows = random_rows(type, N, K), *t2 = malloc(padded * row), *t = malloc(padded * row);
    CHECK(avx2_tile_repack(type, rows, N, K, t2) == 0 && isa_tile_repack(type, rows, N, K, t) == 0, "%s repack", name);
    CHECK(memcmp(t, t2, padded * row) == 0, "%s: the tiles differ between builds", name);
    int64_t *all = malloc(N * sizeof(int64_t));
    for (int64_t n = 0; n < N; n++) all[n] = N - 1 - n;
    float *w = malloc(N * K * sizeof(float)), *w2 = malloc(N * K * sizeof(float));
    isa_tile_dequant_rows(type, t, K, all, N, w);
    avx2_tile_dequant_rows(type, t2, K, all, N, w2);
    CHECK(memcmp(w, w2, N * K * sizeof(float)) == 0, "%s: expanded values differ", name);
    float *x = malloc(M * K * sizeof(float)), *y = malloc(M * N * sizeof(float)), *alone = malloc(N * sizeof(float));
    float *ref = malloc(N * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) x[i] = 2.0f * normal();
    const double bound = type == BF16 ? (passes == 1 ? 1e-2 : 2e-5) : (passes == 1 ? 2e-2 : 2e-4);
    const int64_t counts[] = {1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25, 37};
    for (unsigned c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
        const int64_t m = counts[c];
        CHECK(isa_tile_gemm(type, x, m, K, t, N, y, passes, NULL) == 0, "%s gemm", name);
        double err = 0, norm = 0;
        for (int64_t i = 0; i < m; i++) {
            for (int64_t n = 0; n < N; n++) {  // row n of the weight is expanded row N - 1 - n
                double s = 0;
                for (int64_t k = 0; k < K; k++) s += (double)x[i * K + k] * w[(N - 1 - n) * K + k];
                err += (y[i * N + n] - s) * (y[i * N + n] - s), norm += s * s;
            }
            isa_tile_gemm(type, x + i * K, 1, K, t, N, alone, passes, NULL);
            const int dots = type == BF16 || m <= isa_tile_int8_max_rows(passes);  // more: the fp32 product
            CHECK(!dots || memcmp(alone, y + i * N, N * sizeof(float)) == 0, "%s P%d: row %lld of %lld differs from it alone",
                  name, passes, (long long)i, (long long)m);
            avx2_tile_gemm(type, x + i * K, 1, K, t2, N, ref, passes, NULL);
            if (type == BF16) {
                for (int64_t n = 0; n < N; n++)
                    CHECK(fabsf(ref[n] - alone[n]) <= 1e-5f * (1 + fabsf(ref[n])), "%s P%d: %g against AVX2's %g", name,
                          passes, alone[n], ref[n]);
            } else {
                CHECK(memcmp(alone, ref, N * sizeof(float)) == 0, "%s P%d: row %lld differs from AVX2's", name, passes,
                      (long long)i);
            }
        }
        CHECK(sqrt(err / norm) < bound, "%s P%d M=%lld: relative error %g", name, passes, (long long)m, sqrt(err / norm));
    }
    printf("checked %s N=%lld K=%lld passes=%d\n", name, (long long)N, (long long)K, passes);
    free(rows), free(t2), free(t), free(all), free(w), free(w2), free(x), free(y), free(alone), free(ref);
}

int main(void) {
    printf("isa_check: tiles built for %d against AVX2 (%d); integer dots up to %d rows there with two passes\n", isa_tile_isa(),
           avx2_tile_isa(), avx2_tile_int8_max_rows(2));
    const int types[] = {Q4_0, Q4_1, Q8_0, BF16};
    for (int i = 0; i < 4; i++)
        for (int passes = 1; passes <= 2; passes++) {
            check(types[i], 83, 320, passes);
            check(types[i], 32, 64, passes);
            check(types[i], 40, 96, passes);  // an odd number of tiles (VNNI takes two at a time)
        }
    printf("isa_check: %s (%d failures)\n", failures ? "FAILED" : "PASSED", failures);
    return failures != 0;
}
