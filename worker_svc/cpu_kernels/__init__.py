"""CPU kernels for x86 (AVX2/FMA/F16C), built from the C files beside this one on first use:

- ``qgemm``: matmul with weights kept in GGUF Q4_0 / Q4_1 / Q8_0 blocks or dense F32 / F16 / BF16 rows
  (``qgemm.c``: the exact fp32 product), or in tiles of 16 output rows (``tiles.c``: the worker's
  ``--numerics fast``, integer dot products of x quantized to int8 blocks, or bf16 dot products, for any
  number of rows);
- ``attention``: RoPE, the KV write and attention read in place from the paged cache (``attention.c``);
- ``add_rms_norm``, ``silu_mul``: the element-wise rest of a decoder layer (``elementwise.c``), and ``argmax``,
  greedy sampling's pick over the logits.

They exist because on a CPU at small batch a decoder layer is dominated by the per-op cost of
PyTorch's dispatch and by fp32 weight traffic; the arithmetic is the same as the PyTorch path

The shared library is compiled with the system C compiler into the Conveyor cache folder (keyed by
the source's hash and the instruction set), then loaded with ``ctypes``; compiling takes a few seconds, once
per machine. There is one library per instruction set (``ISAS``): AVX2 (every x86-64 CPU the kernels run
on), AVX512 with VNNI (Ice Lake, Zen 4 and later: ``vpdpbusd``), that with BF16 too (Cooper Lake,
Sapphire Rapids, Zen 4: ``vdpbf16ps``) and that with AMX tiles (Sapphire Rapids and later, AMX-INT8 and
AMX-BF16: quantized weights multiplied 16 rows of x at a time with the other sets' bits, bf16 weights in tiles at
every row count); ``use_isa`` picks one, by default the best this CPU has.
``available()`` says whether the kernels can be used here and, when not, why (no compiler, no AVX2, ...).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from conveyor.cache import cache_root, write_atomic
from worker_svc.config import NUMERICS

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("qgemm.c", "tiles.c", "attention.c", "elementwise.c", "layers.c")]
HEADERS = [HERE / name for name in ("simd.h", "quant.h", "isa.h", "xquant.h")]
# -ffp-contract=off: a * b + c in plain C stays two roundings, as in PyTorch (intrinsics are explicit)
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]
# ggml type ids -> bytes per block of 32 weights
QUANTIZED = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
DENSE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # rows as stored; each value widens exactly to fp32
BLOCK_BYTES = QUANTIZED | {0: 128, 1: 64, 30: 64}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
QUANTIZE = {"q8_0": 8, "q4_0": 2}  # --quantize: the block types dense weights can be quantized to at load
QK = 32
TILE = 16  # output rows per tile (tiles.c)
# instruction set -> (the /proc/cpuinfo flags it needs, the compiler flags that enable it), weakest first
ISAS = {
    "avx2": ({"avx2", "fma", "f16c"}, []),
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    "avx512bf16": ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"},
                   ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16"]),
    "amx": ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
            ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
             "-mamx-bf16"]),
}
_chosen = {"isa": "auto"}


class QLinear(ctypes.Structure):
    """layers.c's QLinear: one quantized linear layer."""

    _fields_ = [("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("in_", ctypes.c_int64),
                ("out", ctypes.c_int64), ("type", ctypes.c_int32), ("passes", ctypes.c_int32)]


class Layer(ctypes.Structure):
    """layers.c's Layer: a decoder layer's weights and its KV cache."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", QLinear), ("o", QLinear),
                ("gate_up", QLinear), ("down", QLinear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class Dims(ctypes.Structure):
    """layers.c's Dims: the model's shapes and shared tables."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("kv", ctypes.c_int32)]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512_vnni, amx_int8, ...); empty if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(isa: str) -> Path:
    flags = CFLAGS + ISAS[isa][1]
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"conveyor-cpu-{isa}-{digest}.so"
    if not target.is_file():
        compiler = shutil.which("cc") or shutil.which("gcc")

        def compile_to(tmp: Path) -> None:
            command = [compiler, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"]
            subprocess.run(command, check=True, capture_output=True, text=True)

        write_atomic(target, compile_to)
    return target


def supported_isas() -> list[str]:
    """The instruction sets of ``ISAS`` this CPU has, weakest first ([] on a CPU the kernels do not run on)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if needs <= flags]


def use_isa(name: str) -> None:
    """Run the kernels compiled for ``name`` (a key of ``ISAS``), or "auto": the best this CPU has. Call it
    before the first use (a model loaded earlier keeps its layout, which does not depend on it)."""
    if name != "auto" and name not in ISAS:
        raise ValueError(f"--cpu-isa must be auto or one of {', '.join(ISAS)}, got {name!r}")
    _chosen["isa"] = name


def isa() -> str:
    """The instruction set the kernels run with ("" when they cannot run here)."""
    return _library(_chosen["isa"])[2]


@cache
def _library(wanted: str = "auto") -> tuple[ctypes.CDLL | None, str, str]:
    """(the library, why not when it is None, its instruction set)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not an x86-64 CPU ({platform.machine()})", ""
    missing = ISAS["avx2"][0] - cpu_flags()
    if missing:
        return None, f"the CPU lacks {', '.join(sorted(missing))}", ""
    have = supported_isas()
    chosen = have[-1] if wanted == "auto" else wanted
    if chosen not in have:
        return None, f"--cpu-isa {chosen}: the CPU lacks {', '.join(sorted(ISAS[chosen][0] - cpu_flags()))}", ""
    if not (shutil.which("cc") or shutil.which("gcc")):
        return None, "no C compiler (cc) on PATH", ""
    try:
        lib = ctypes.CDLL(str(_build(chosen)))
    except subprocess.CalledProcessError as exc:
        return None, f"compiling the CPU kernels failed: {exc.stderr.strip()[:500]}", ""
    except OSError as exc:
        return None, f"loading the compiled kernel failed: {exc}", ""
    if chosen == "amx" and not lib.tile_amx_ready():  # the kernel did not grant the tiles' state (Linux < 5.16)
        if wanted == "auto":
            log.warning("the CPU has AMX but the kernel does not let this process use it; using avx512bf16")
            return _library("avx512bf16")
        return None, "--cpu-isa amx: the operating system does not let this process use AMX tiles", ""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qgemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.qgemm.restype = ctypes.c_int
    lib.tile_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ptr]
    lib.tile_gemm.restype = ctypes.c_int
    lib.tile_gemm_swiglu.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ptr]
    lib.tile_gemm_swiglu.restype = ctypes.c_int
    lib.tile_repack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.tile_repack.restype = ctypes.c_int
    lib.tile_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr]
    lib.tile_dequant_rows.restype = ctypes.c_int
    lib.tile_supported.argtypes = [ctypes.c_int]
    lib.tile_supported.restype = ctypes.c_int
    lib.tile_isa.restype = ctypes.c_int
    lib.tile_int8_max_rows.argtypes = [ctypes.c_int]
    lib.tile_int8_max_rows.restype = ctypes.c_int
    lib.decoder_scratch.argtypes = [ctypes.POINTER(Dims), i64]
    lib.decoder_scratch.restype = i64
    lib.decoder_forward.argtypes = [ctypes.POINTER(Layer), i64, ctypes.POINTER(Dims), ptr, i64, ptr, ptr, i64, ptr,
                                    ptr, ptr, ptr, ptr]
    lib.decoder_forward.restype = ctypes.c_int
    lib.decoder_profile.argtypes = [ctypes.c_int, ptr]
    lib.decoder_profile.restype = None
    lib.qdequant_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr]
    lib.qdequant_rows.restype = ctypes.c_int
    lib.qrepack.argtypes = [ctypes.c_int, ptr, i64, i64]
    lib.qrepack.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.paged_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr,
                                    ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    lib.rope_store.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.rope_store.restype = None
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ptr]
    lib.add_rms_norm.restype = None
    lib.silu_mul.argtypes = [ptr, i64, i64, ptr]
    lib.silu_mul.restype = None
    lib.argmax_rows.argtypes = [ptr, i64, i64, ptr]
    lib.argmax_rows.restype = None
    return lib, "", chosen


def available() -> tuple[bool, str]:
    """(True, "") when the kernels can run here, else (False, the reason)."""
    lib, reason, _ = _library(_chosen["isa"])
    return lib is not None, reason


def problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run a model held on ``device`` in ``dtype`` (None: they can). They run fp32 on a
    CPU that has them; the device is asked first, so a GPU machine never compiles them."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "they run fp32 on the CPU only"
    ok, reason = available()
    return None if ok else reason


def _lib() -> ctypes.CDLL:
    lib, reason, _ = _library(_chosen["isa"])
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {reason}")
    return lib


def int8_max_rows(passes: int) -> int:
    """Most rows of x a tiled quantized weight multiplies with integer dots in ``passes`` passes of x; more take
    the fp32 product of its dequantized values (AVX2 with two passes, from 17 rows: as fast or faster there
    without vpdpbusd). Unbounded with VNNI, and with one pass."""
    return _lib().tile_int8_max_rows(passes)


def bf16_dots() -> bool:
    """Whether the CPU multiplies bf16 pairs in one instruction (AVX512-BF16), which the fast numerics then use
    for bf16 weights."""
    return _lib().tile_isa() >= 513


def tiled(qtype: int, numerics: str) -> bool:
    """Whether a weight of ``qtype`` is kept in tiles (``tiles.c``) under ``numerics``: quantized weights under
    every numerics but exact, and bf16 weights where the CPU has bf16 dot products; else rows (the exact product)."""
    return NUMERICS[numerics] > 0 and (qtype in QUANTIZED or (qtype == DENSE[torch.bfloat16] and bf16_dots()))


def dense_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A dense (N, K) weight as the kernels read it: its bytes, (N, K * itemsize) uint8, and the type id."""
    return weight.contiguous().view(torch.uint8), DENSE[weight.dtype]


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A dense (N, K) weight quantized to GGUF blocks, (N, K/32 * block bytes) uint8, as llama.cpp's
    quantizer writes them: Q8_0 d = max|x| / 127, q = round(x / d); Q4_0 d = -m / 8 for m the value of the
    largest magnitude, q = min(15, floor(x / d + 8.5)), weights j and j + 16 sharing byte j."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"quantize: K={k} is not a multiple of {QK}")
    x = weight.detach().float().reshape(n, k // QK, QK)
    if qtype == 8:
        d = x.abs().amax(-1, keepdim=True) / 127
        q = torch.round(x * torch.where(d > 0, 1 / d, 0)).to(torch.int8).view(torch.uint8)
    elif qtype == 2:
        peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        d = peak / -8
        q = torch.floor(x * torch.where(d != 0, 1 / d, 0) + 8.5).clamp(0, 15).to(torch.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
    else:
        raise ValueError(f"quantize: type {qtype} is not one of {sorted(QUANTIZE.values())}")
    scale = d.to(torch.float16).view(torch.uint8)  # (n, nb, 2)
    return torch.cat([scale, q], dim=-1).reshape(n, -1).contiguous()


def kernel_layout(blocks: torch.Tensor, qtype: int, in_features: int, tiles: bool = False) -> torch.Tensor:
    """GGUF blocks, (N, K/32 * block bytes) uint8, rearranged the way the kernels read them: within each row
    (see quant.h: a row's scales, mins and quants each together; a new tensor of the same shape; dense rows
    (``dense_rows``) are copied as they are), or with ``tiles`` in tiles of 16 rows (see tiles.c; Q4_0, Q4_1,
    Q8_0 and BF16; (ceil(N / 16) * 16, K/32 * block bytes), the last tile padded with zero rows). Every
    ``qweight`` given to the functions below is in one of these layouts, and ``tiles`` says which."""
    if qtype not in BLOCK_BYTES or in_features % QK:
        raise ValueError(f"qrepack: unsupported type {qtype} or K={in_features}")
    row_bytes = in_features // QK * BLOCK_BYTES[qtype]
    if blocks.dtype != torch.uint8 or blocks.numel() % row_bytes:
        raise ValueError(f"qrepack: {blocks.numel()} {blocks.dtype} values are not rows of {row_bytes} bytes")
    if tiles:
        n = blocks.numel() // row_bytes
        out = torch.empty(-(-n // TILE) * TILE, row_bytes, dtype=torch.uint8)
        if _lib().tile_repack(qtype, blocks.contiguous().data_ptr(), n, in_features, out.data_ptr()) != 0:
            raise ValueError(f"tile_repack: type {TYPE_NAMES.get(qtype, qtype)} is not kept in tiles")
        return out
    out = blocks.contiguous().clone()
    if _lib().qrepack(qtype, out.data_ptr(), out.numel() // row_bytes, in_features) != 0:
        raise ValueError(f"qrepack: unsupported type {qtype} or K={in_features}")
    return out


def qgemm(x: torch.Tensor, qweight: torch.Tensor, qtype: int, out_features: int, passes: int = 0) -> torch.Tensor:
    """x: (M, K) fp32 -> (M, N) fp32, with qweight GGUF blocks (or dense rows) in the kernels' layout
    (``kernel_layout``): ``passes`` 0, rows, the exact fp32 product; 1 or 2, tiles, the fast numerics (x
    quantized to that many int8 blocks, each the rest of the one before, and integer dots; for bf16, x in that
    many bf16 parts and bf16 dots); with ``config.WIDE`` added, from 16 rows of x quantized weights widened to
    bf16 and multiplied with x rounded to bf16 in AMX tiles or with AVX512-BF16's dots, where the CPU has either
    (the bf16 numerics)."""
    lib = _lib()
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    if passes:
        code = lib.tile_gemm(qtype, x.data_ptr(), m, k, qweight.data_ptr(), out_features, y.data_ptr(), passes, None)
    else:
        code = lib.qgemm(qtype, x.data_ptr(), m, k, qweight.data_ptr(), out_features, y.data_ptr())
    if code != 0:
        raise ValueError(f"qgemm: unsupported type {qtype}, K={k} or passes={passes}")
    return y


def swiglu_gemm(x: torch.Tensor, qweight: torch.Tensor, qtype: int, intermediate: int, passes: int) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) for a fused gate/up weight in tiles ([gate; up], 2 * intermediate rows) in
    one pass (what the decoder stack does where AMX's bf16 tiles multiply it), or None where that does not
    apply (then: ``silu_mul(qgemm(...))``, the same bits)."""
    x = x.contiguous()
    m, k = x.shape
    act = torch.empty(m, intermediate, dtype=torch.float32)
    code = _lib().tile_gemm_swiglu(qtype, x.data_ptr(), m, k, qweight.data_ptr(), intermediate, act.data_ptr(), passes,
                                   None)
    if code < 0:
        raise ValueError(f"swiglu_gemm: unsupported type {qtype}, K={k} or passes={passes}")
    return act if code == 0 else None


def dequantize_rows(qweight: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor,
                    tiles: bool = False) -> torch.Tensor:
    """fp32 values of the given rows: (len(rows), K) (``tiles``: qweight is in tiles)."""
    lib = _lib()
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), in_features, dtype=torch.float32)
    expand = lib.tile_dequant_rows if tiles else lib.qdequant_rows
    if expand(qtype, qweight.data_ptr(), in_features, rows.data_ptr(), rows.numel(), out.data_ptr()) != 0:
        raise ValueError(f"qdequant_rows: unsupported type {qtype} or K={in_features}")
    return out


def attention(
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    token_prompt: torch.Tensor | None = None,
) -> torch.Tensor:
    """Everything between the qkv and output projections, for a flat batch of T new tokens.

    qkv: (T, (H + 2 Hkv) * D) fp32, modified in place (RoPE on q and k); cos, sin: (P, D) tables;
    caches: (num_blocks, block_size, Hkv, kv_width) of a dtype of ``KV_DTYPES`` (``kv_width``: D, and an int8 row's
    scales), k and v of each token written at ``slot_mapping``;
    block_tables: (B, max_blocks) int32; token_seq, token_pos: (T,) int32; token_prompt: (T,) uint8, 1 for a
    token of its sequence's prompt (None: none is; see attention.c). Each token attends to its sequence's keys at
    positions 0..token_pos. Returns (T, H * D).
    """
    lib = _lib()
    _blocks, block_size, hkv, _width = k_cache.shape
    d = qkv.shape[1] // (num_heads + 2 * hkv)
    if k_cache.dtype == torch.int8 and d % I8_BLOCK:
        raise ValueError(f"an int8 KV cache needs a head dimension that is a multiple of {I8_BLOCK}, not {d}")
    t = qkv.shape[0]
    qkv = qkv.contiguous()
    kind = kv_kind(k_cache.dtype)
    lib.rope_store(qkv.data_ptr(), t, num_heads, hkv, d, token_pos.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                   slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kind)
    out = torch.empty(t, num_heads * d, dtype=torch.float32)
    code = lib.paged_attention(
        qkv.data_ptr(), qkv.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], token_seq.data_ptr(), token_pos.data_ptr(),
        None if token_prompt is None else token_prompt.data_ptr(), t, num_heads, hkv, d, block_size,
        d**-0.5, out.data_ptr(), kind,
    )
    if code != 0:
        raise ValueError(f"paged_attention: unsupported shapes H={num_heads} Hkv={hkv} D={d}")
    return out


# what the kernels' KV cache may hold, in attention.c's order (KV_F32, KV_F16, KV_BF16, KV_I8); a prompt's tokens
# attend to a bf16 or int8 cache in AMX-BF16 tiles where the CPU has them (q, an int8 cache's values and the
# softmax's weights rounded to bf16 too)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


I8_BLOCK = 32  # an int8 cache's values per scale (attention.c)


def kv_width(dtype: torch.dtype, head_dim: int) -> int:
    """The last dimension of a cache of ``dtype``: a head's D values, and for int8 their scales after them (fp32,
    one per block of I8_BLOCK values: D + D / 8 bytes)."""
    return head_dim + head_dim // I8_BLOCK * 4 if dtype == torch.int8 else head_dim


def kv_kind(dtype: torch.dtype) -> int:
    """The kernels' code for a KV cache of ``dtype``: 0 fp32, 1 fp16, 2 bf16, 3 int8 (any other: ValueError)."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"the CPU kernels' KV cache holds float32, float16, bfloat16 or int8, not {dtype}")
    return KV_DTYPES.index(dtype)


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += add (in place, when given); returns rms_norm(x) * weight. x: (rows, n) fp32 contiguous."""
    rows, n = x.shape
    out = torch.empty_like(x)
    add_ptr = add.contiguous().data_ptr() if add is not None else None
    _lib().add_rms_norm(x.data_ptr(), add_ptr, weight.data_ptr(), rows, n, eps, out.data_ptr())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2n) -> (rows, n): silu(gate) * up."""
    rows, n2 = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(rows, n2 // 2, dtype=torch.float32)
    _lib().silu_mul(gate_up.data_ptr(), rows, n2 // 2, out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, x: (rows, n) fp32: ``torch.max(x, dim=-1).indices`` (the first largest,
    a NaN counting as the largest) in one pass per row, without PyTorch's reduction (~45 us a row of 49,152 and
    ~0.34 ms for 8 rows on a 2-core Zen 4, against a few us a row here)."""
    x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    _lib().argmax_rows(x.data_ptr(), rows, n, out.data_ptr())
    return out


# decoder_forward's parts as ``decoder_profile`` names them (layers.c's PART_* order)
DECODER_PARTS = ("norms", "qkv", "rope + KV write", "attention", "o", "gate/up + SwiGLU", "down")


def decoder_profile(on: bool) -> dict[str, float]:
    """The seconds each part of ``DecoderStack.forward`` took (summed over layers and calls) since the last call,
    and the timers turned on or off from now (off: one branch a part). For benchmarks (``bench/worker_step.py
    --parts``), from the thread that runs the model."""
    out = (ctypes.c_double * len(DECODER_PARTS))()
    _lib().decoder_profile(int(on), out)
    return dict(zip(DECODER_PARTS, out))


class DecoderStack:
    """The decoder layers of a model whose linear layers are all quantized, run by one native call
    (``layers.c``): the same kernels in the same order as the module-by-module path, without its
    per-op Python. Built once per KV cache; the scratch buffer grows to the largest step seen."""

    def __init__(self, layers: list, dims: Dims, keep: list):
        self.layers = (Layer * len(layers))(*layers)
        self.dims = dims
        self._keep = keep  # the tensors whose memory the structures point into
        self.scratch = torch.empty(0)

    def forward(self, x: torch.Tensor, slot_mapping, block_tables, token_seq, token_pos, token_prompt) -> torch.Tensor:
        """x: (T, hidden) embedded tokens (overwritten: the residual stream). Returns the final norm (T, hidden)."""
        lib = _lib()
        t = x.shape[0]
        need = lib.decoder_scratch(ctypes.byref(self.dims), t)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty_like(x)
        code = lib.decoder_forward(self.layers, len(self.layers), ctypes.byref(self.dims), x.data_ptr(), t,
                                   slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                                   token_seq.data_ptr(), token_pos.data_ptr(), token_prompt.data_ptr(),
                                   self.scratch.data_ptr(), out.data_ptr())
        if code != 0:
            raise ValueError("decoder_forward: a kernel rejected the shapes")
        return out
