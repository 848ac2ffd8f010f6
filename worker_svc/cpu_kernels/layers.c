// The whole decoder stack in one call, for a model whose linear layers are all GGUF-quantized.
//
// The same kernels, in the same order, as the Python CPU-kernel path of worker_svc/model.py (so
// the same numbers): per layer add_rms_norm, qkv, rope_store + paged_attention, o, add_rms_norm,
// gate_up, silu_mul, down; then the final norm. What it saves is Python: at batch 1 a decoder layer
// is ~1 ms of arithmetic spread over eight kernel calls, each of which cost microseconds of module
// dispatch, tensor allocation and ctypes argument conversion (~2 ms a step over 30 layers).
// Activations live in one scratch buffer the caller owns (no allocation per call).
//
// decoder_profile turns on timers around each part of a layer (bench/worker_step.py --parts): where a step's
// time goes inside the one call that a profiler of the Python process sees as a single frame. Off, each part
// costs one branch.

#include <stdint.h>
#include <string.h>

#include <omp.h>

int qgemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y);
int tile_gemm(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int passes,
              void *work);
int64_t tile_work_bytes(int64_t M, int64_t K, int passes, int threads);
int tile_gemm_swiglu(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t I, float *act,
                     int passes, void *work);
int paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *q_seq, const int32_t *q_pos,
                    const uint8_t *q_prompt, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                    float *out, int kv);
void rope_store(float *qkv, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int32_t *pos, const float *cos,
                const float *sin, const int64_t *slots, void *k_cache, void *v_cache, int kv);
void add_rms_norm(float *x, const float *add, const float *w, int64_t rows, int64_t n, float eps, float *out);
void silu_mul(const float *gu, int64_t rows, int64_t n, float *out);

typedef struct {
    const uint8_t *weight;  // GGUF blocks or dense rows: in rows (quant.h) for passes 0, in tiles (tiles.c) else
    const float *bias;      // (out,) or NULL
    int64_t in, out;
    int32_t type;           // ggml type id
    int32_t passes;         // 0: the exact product (qgemm.c); 1 or 2: the fast numerics' passes of x (tiles.c)
} QLinear;

typedef struct {
    const float *input_norm, *post_norm;  // (hidden,)
    QLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;  // (num_blocks, block_size, Hkv, D), fp32, fp16 or bf16; int8: D + D/8 bytes (Dims.kv)
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos, *sin;  // (positions, head_dim) RoPE tables
    const float *final_norm;
    int32_t kv;  // what the KV cache holds: 0 fp32, 1 fp16, 2 bf16 (attention.c's KV_F32, KV_F16, KV_BF16)
} Dims;

static int linear(const QLinear *l, const float *x, int64_t rows, float *y, void *work) {
    const int code = l->passes ? tile_gemm(l->type, x, rows, l->in, l->weight, l->out, y, l->passes, work)
                               : qgemm(l->type, x, rows, l->in, l->weight, l->out, y);
    if (code != 0) return -1;
    if (l->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < l->out; i++) y[r * l->out + i] += l->bias[i];
    return 0;
}

// act = silu(gate) * up of the fused gate/up projection: in one pass where the tiles can (tile_gemm_swiglu),
// else the product into gate_up, then silu_mul.
static int swiglu(const QLinear *l, const float *x, int64_t rows, int64_t I, float *gate_up, float *act, void *work) {
    if (l->passes && !l->bias) {
        const int code = tile_gemm_swiglu(l->type, x, rows, l->in, l->weight, I, act, l->passes, work);
        if (code <= 0) return code;
    }
    if (linear(l, x, rows, gate_up, work)) return -1;
    silu_mul(gate_up, rows, I, act);
    return 0;
}

// The parts decoder_profile times, in its order: the norms (both of each layer, and the final one), the qkv
// product, RoPE with the KV cache's write, attention, the o product, gate/up with SwiGLU, the down product.
enum { PART_NORMS, PART_QKV, PART_ROPE, PART_ATTENTION, PART_O, PART_GATE_UP, PART_DOWN, PARTS };
static double part_seconds[PARTS];
static int profiling;

// Copies the seconds each part took since the last call into ``out`` (PARTS doubles; NULL: not wanted), sets
// them to 0, and turns the timers on or off. Not for concurrent calls of decoder_forward (one model thread).
void decoder_profile(int on, double *out) {
    if (out) memcpy(out, part_seconds, sizeof part_seconds);
    memset(part_seconds, 0, sizeof part_seconds);
    profiling = on;
}

// The time since the last mark, added to ``part``.
#define MARK(part)                                                   \
    do {                                                             \
        if (profiling) {                                             \
            const double now = omp_get_wtime();                      \
            part_seconds[part] += now - mark;                        \
            mark = now;                                              \
        }                                                            \
    } while (0)

static int64_t activation_floats(const Dims *d, int64_t T) {
    const int64_t qkv = (d->heads + 2 * d->kv_heads) * d->head_dim;
    return T * (2 * d->hidden + qkv + d->heads * d->head_dim + 3 * d->intermediate);
}

// Floats of scratch needed for T tokens: the activations, then the tile kernels' work memory (for the widest
// input, two passes, the threads OpenMP runs now).
int64_t decoder_scratch(const Dims *d, int64_t T) {
    const int64_t widest = d->intermediate > d->heads * d->head_dim ? d->intermediate : d->heads * d->head_dim;
    const int64_t K = widest > d->hidden ? widest : d->hidden;
    return activation_floats(d, T) + tile_work_bytes(T, K, 2, omp_get_max_threads()) / 4 + 16;
}

// x: (T, hidden) embedded tokens, used as the residual stream; out: (T, hidden) the final norm of the
// last layer's output. Attention metadata as for paged_attention / rope_store. Returns 0, or -1 on
// a shape a kernel rejects.
int decoder_forward(const Layer *layers, int64_t num_layers, const Dims *d, float *x, int64_t T,
                    const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *q_seq,
                    const int32_t *q_pos, const uint8_t *q_prompt, float *scratch, float *out) {
    const int64_t hd = d->heads * d->head_dim, qkv_width = (d->heads + 2 * d->kv_heads) * d->head_dim;
    float *h = scratch;                           // (T, hidden) a layer's output
    float *normed = h + T * d->hidden;            // (T, hidden)
    float *qkv = normed + T * d->hidden;          // (T, qkv_width)
    float *attn = qkv + T * qkv_width;            // (T, heads * head_dim)
    float *gate_up = attn + T * hd;               // (T, 2 * intermediate)
    float *act = gate_up + T * 2 * d->intermediate;  // (T, intermediate)
    void *work = scratch + activation_floats(d, T);  // the tile kernels' (decoder_scratch)
    double mark = profiling ? omp_get_wtime() : 0.0;
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *l = &layers[i];
        add_rms_norm(x, i == 0 ? NULL : h, l->input_norm, T, d->hidden, d->eps, normed);
        MARK(PART_NORMS);
        if (linear(&l->qkv, normed, T, qkv, work)) return -1;
        MARK(PART_QKV);
        rope_store(qkv, T, d->heads, d->kv_heads, d->head_dim, q_pos, d->cos, d->sin, slots, l->k_cache, l->v_cache,
                   d->kv);
        MARK(PART_ROPE);
        if (paged_attention(qkv, qkv_width, l->k_cache, l->v_cache, block_tables, max_blocks, q_seq, q_pos, q_prompt,
                            T, d->heads, d->kv_heads, d->head_dim, d->block_size, d->scale, attn, d->kv))
            return -1;
        MARK(PART_ATTENTION);
        if (linear(&l->o, attn, T, h, work)) return -1;
        MARK(PART_O);
        add_rms_norm(x, h, l->post_norm, T, d->hidden, d->eps, normed);
        MARK(PART_NORMS);
        if (swiglu(&l->gate_up, normed, T, d->intermediate, gate_up, act, work)) return -1;
        MARK(PART_GATE_UP);
        if (linear(&l->down, act, T, h, work)) return -1;
        MARK(PART_DOWN);
    }
    add_rms_norm(x, num_layers ? h : NULL, d->final_norm, T, d->hidden, d->eps, out);
    MARK(PART_NORMS);
    return 0;
}
