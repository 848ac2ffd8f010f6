"""Settings of ``conveyor serve worker`` (flags and ``CONVEYOR_WORKER_*`` environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import parse_size, require, setting

ENV_PREFIX = "CONVEYOR_WORKER_"
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION = ("auto", "native", "flex", "sdpa")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
CPU_ISAS = ("auto", "avx2", "avx512", "avx512bf16", "amx")  # worker_svc.cpu_kernels.ISAS
QUANTIZE_AT_LOAD = ("none", "q8_0", "q4_0")  # --quantize: none, or a key of worker_svc.cpu_kernels.QUANTIZE
# --numerics: the int8 passes per block of 32 that x is quantized in for a quantized weight (0: the exact product),
# plus WIDE: from 16 rows of x, quantized weights widened to bf16 and multiplied with bf16 dots, in AMX-BF16 tiles
# or with AVX512-BF16's vdpbf16ps (tiles.c's TILE_WIDE)
WIDE = 4
NUMERICS = {"exact": 0, "fast": 2, "int8": 1, "bf16": 2 | WIDE}


@dataclass
class WorkerConfig:
    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), a .gguf file, or a Hugging Face folder")
    host: str = setting("127.0.0.1", "address to listen on (internal service: localhost by default)")
    port: int = setting(50053, "gRPC port (0 picks a free one)")
    link_port: int = setting(0, "port of the link the scheduler sends engine steps on (0: a free one; the worker's "
                                "Link call names it)")
    device: str = setting("auto", "'auto' (cuda when present, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    dtype: str = setting("auto", "compute dtype; auto is bfloat16 on cuda and float32 on cpu", choices=DTYPES)
    block_size: int = setting(16, "tokens per KV cache block")
    kv_cache_bytes: int | None = setting(None, "KV cache budget, e.g. 512M or 4G (default: a share of free memory)", parse=parse_size)
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's total memory this worker may use (as vLLM's): weights and the activations of a "
        "profile step of --profile-tokens tokens first, the KV cache the rest, when --kv-cache-bytes is unset")
    profile_tokens: int = setting(8192, "tokens of the profile step that measures a GPU's activation memory (the "
                                        "scheduler's --max-num-batched-tokens on a GPU)")
    max_model_len: int | None = setting(None, "longest sequence (prompt + output) in tokens (default: the model's)")
    numerics: str = setting(
        "fast", "with native attention: exact = the dequantized fp32 product of quantized weights (logits within "
        "1e-4 of transformers); fast = quantized weights multiply with integer dot products, the activations "
        "quantized to two int8 passes per block of 32 (log-probabilities within ~2e-3 of exact), and bf16 weights "
        "with bf16 dot products, the activations rounded to bf16, where the CPU has them (AVX512-BF16); int8 = as "
        "fast, the activations in one int8 pass (llama.cpp's Q8 activations: about twice as fast from 8 rows, "
        "96 %% top-1 agreement with exact where fast has 99.9 %%); bf16 = as fast below 16 rows of activations, and "
        "from 16 rows (prefill, large decode batches) quantized weights widened to bf16 and multiplied with the "
        "activations rounded to bf16, in AMX-BF16 tiles where the CPU has them (2-3x fast's prefill), else with "
        "AVX512-BF16's bf16 dots (1.3x fast's matrices; elsewhere bf16 is fast); a row's bits then depend on its "
        "batch's size",
        choices=tuple(NUMERICS),
    )
    kv_cache_dtype: str = setting(
        "auto", "what the KV cache holds: auto = float16 with native attention under fast and int8 (half the "
        "memory a decode's attention reads and twice the tokens in the same budget; K and V rounded to fp16 once, as "
        "llama.cpp's default cache does), bfloat16 under bf16 where the CPU has AMX (as vLLM keeps it: a prompt's "
        "attention then runs in AMX-BF16 tiles), else the compute dtype (exact keeps float32); float32, float16 or "
        "bfloat16 to choose, or int8 (K and V rounded to int8 with a scale per 32 values, as llama.cpp's q8_0 "
        "cache: 9/16 of fp16's memory, so 1.78x the tokens, at 98.9 %% top-1 agreement where fp16 has 99.95 %%; "
        "a dtype other than the compute dtype needs native attention)", choices=KV_CACHE_DTYPES)
    cpu_isa: str = setting("auto", "with native attention: the instruction set the CPU kernels are compiled for "
                                    "(auto: the best this CPU has)", choices=CPU_ISAS)
    quantize: str = setting(
        "none", "with native attention: quantize the model's dense linear weights at load (a Hugging Face folder's, "
        "or a GGUF's F16/BF16/F32 tensors) to GGUF q8_0 or q4_0 blocks, as llama.cpp's quantizer does, so they take "
        "the integer-dot path (q4_0 keeps the embedding and output layer at q8_0); none: as stored (bf16 stays "
        "bf16, multiplied in fp32)", choices=QUANTIZE_AT_LOAD)
    attention: str = setting(
        "auto", "how a step runs: native = the CPU kernels (GGUF Q4_0/Q4_1/Q8_0 weights kept quantized, any other "
        "weight as stored, the whole decoder in one native call, attention reading the KV cache in place); "
        "flex = the model in PyTorch, flex_attention reading the KV cache in place (fused by torch.compile on a "
        "GPU); sdpa = the model in PyTorch, each context gathered for scaled_dot_product_attention (weights "
        "dense in --dtype for both); auto: native on a CPU that has AVX2 and a C compiler, else flex on a GPU "
        "and sdpa on a CPU", choices=ATTENTION)
    cuda_graphs: bool = setting(True, "on a GPU with flex attention, replay decode steps from CUDA graphs captured "
                                      "per padded batch size (--no-cuda-graphs: every step eager)")
    max_graph_batch: int = setting(256, "largest decode batch replayed from a CUDA graph (bigger ones run eager)")
    threads: int = setting(0, "CPU threads the model computes with (0: PyTorch's default, one per core it may use)")
    small_step_threads: int = setting(
        0, "CPU threads for a step of a single token (one stream decoding): 0 as many as --threads; -1 leaves one "
        "core to the scheduler, detokenizer and frontend, which work between every two tokens and otherwise preempt "
        "a model thread mid-step while the others wait for it, when the weights are quantized (dense ones, a bf16 "
        "folder as stored, read 2 bytes a weight a token and take every thread); n: that many")
    model_nice: int = setting(
        10, "on a CPU: added to the nice value of the thread that runs the model and of its OpenMP threads (0-19), "
        "below the worker's other threads and the other processes: the scheduler, detokenizer and frontend work "
        "between every two tokens, and at an equal nice one that wakes while the model's threads hold every core "
        "waits for a time slice, so tokens reach the client in bursts (2 cores, one stream: inter-token p90 8.8-11.1 "
        "ms at 0, 5.9-8.8 ms at 10, throughput within noise); 0 treats them alike")
    spec_min_ngram: int = setting(3, "speculation: the shortest run of last tokens a draft is looked up by (what "
                                     "followed it earlier in the sequence is the draft)")
    spec_max_ngram: int = setting(5, "speculation: the longest run of last tokens a draft is looked up by (the "
                                     "longest that matches wins)")
    seed: int | None = setting(None, "seed of the worker's generator for unseeded requests")
    fail_on_token: int = setting(-1, "fault injection for tests: every step that computes this token id fails "
                                     "(as a kernel or device error would); -1: off")
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint (0.0.0.0 for a scraper elsewhere)")
    metrics_port: int = setting(9103, "port of the Prometheus /metrics endpoint (0: any free port)")
    log_level: str = setting("INFO", "logging level")

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(0 <= self.link_port < 65536, "link_port", f"must be in [0, 65535], got {self.link_port}")
        require(0 <= self.metrics_port < 65536, "metrics_port", f"must be in [0, 65535], got {self.metrics_port}")
        require(1 <= self.block_size <= 1024, "block_size", f"must be in [1, 1024], got {self.block_size}")
        require(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        require(self.profile_tokens >= 1, "profile_tokens", "must be >= 1")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        require(self.attention in ATTENTION, "attention", f"must be one of {', '.join(ATTENTION)}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        require(self.cpu_isa in CPU_ISAS, "cpu_isa", f"must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")
        require(1 <= self.max_graph_batch <= 4096, "max_graph_batch", f"must be in [1, 4096], got {self.max_graph_batch}")
        require(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")
        require(1 <= self.spec_min_ngram <= self.spec_max_ngram <= 64, "spec_min_ngram",
                f"must be in [1, spec_max_ngram] and spec_max_ngram at most 64, got {self.spec_min_ngram} and "
                f"{self.spec_max_ngram}")
        require(0 <= self.model_nice <= 19, "model_nice", f"must be in [0, 19], got {self.model_nice}")
        require(self.small_step_threads >= -1, "small_step_threads", f"must be >= -1, got {self.small_step_threads}")
        require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
                f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
