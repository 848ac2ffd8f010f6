"""The paged KV cache: fixed-size blocks, one K and one V tensor per layer.

The scheduler decides which blocks a sequence owns; the worker only holds the memory. Token at
position ``p`` of a sequence whose block table is ``bt`` lives in slot
``bt[p // block_size] * block_size + p % block_size`` of every layer's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.errors import ConfigError
from worker_svc import cpu_kernels
from worker_svc.model import ModelConfig

CPU_DEFAULT_FRACTION = 0.25  # of available RAM when --kv-cache-bytes is not given
CPU_DEFAULT_CAP = 2 << 30


def kv_dtype(setting: str, backend: str, numerics: str, dtype: torch.dtype, head_dim: int) -> torch.dtype:
    """The cache's dtype under ``--kv-cache-dtype setting`` for a model computing in ``dtype`` with ``backend``
    (``backends.choose``'s name). auto, with the native backend: fp16 under fast and int8 (half the bytes a
    decode's attention reads, and twice the tokens in the same memory; llama.cpp's default too), bf16 under bf16
    where the kernels have AMX (vLLM's cache; a prompt's attention products then run in AMX-BF16 tiles; without
    AMX fp16: the same bytes, and a prompt attends in fp32 either way), ``dtype`` under exact (fp32: its
    logits match transformers'). int8 only when asked (a head's row in int8, a scale per 32 values: 9/16 of fp16's
    bytes, so 1.78x the tokens, at a cost in accuracy; a prompt's attention in AMX-BF16 tiles where the kernels
    have AMX). The PyTorch backends attend in ``dtype`` only."""
    if setting == "auto":
        if backend != "native" or numerics == "exact":
            return dtype
        return torch.bfloat16 if numerics == "bf16" and cpu_kernels.isa() == "amx" else torch.float16
    chosen = getattr(torch, setting)
    if chosen == torch.int8 and head_dim % cpu_kernels.I8_BLOCK:
        raise ConfigError(f"--kv-cache-dtype int8: the model's head dimension ({head_dim}) is not a multiple of "
                         f"{cpu_kernels.I8_BLOCK}, the values an int8 row's scale covers")
    if backend != "native" and chosen != dtype:
        raise ConfigError(f"--kv-cache-dtype {setting}: the {backend} backend keeps its KV cache in the compute dtype "
                         f"({str(dtype).removeprefix('torch.')}); other cache dtypes need --attention native")
    return chosen


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens (an int8 row's scales included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cpu_kernels.kv_width(dtype, cfg.head_dim) * itemsize


def available_cpu_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


@dataclass(frozen=True)
class GpuMemory:
    """What a GPU holds once the weights are loaded and a profile step of the largest batch has run."""

    total: int  # the device's memory
    free: int  # free now (other processes and this one's CUDA context already taken)
    peak: int  # the most PyTorch held at once during the profile step: weights plus activations
    current: int  # what PyTorch holds now (the weights)


def gpu_kv_budget(memory: GpuMemory, utilization: float) -> int:
    """vLLM's ``--gpu-memory-utilization``: this worker may use ``utilization`` of the device's total memory;
    the KV cache gets what the peak of a step (weights and activations) leaves of it, and never more than
    is free with the activations' headroom kept."""
    headroom = memory.peak - memory.current  # the activations of the largest step, allocated again every step
    return max(0, min(int(memory.total * utilization) - memory.peak, memory.free - headroom))


def kv_budget_bytes(device: torch.device, kv_cache_bytes: int | None, gpu_memory_utilization: float,
                    memory: GpuMemory | None = None) -> int:
    """How many bytes the cache may take: the explicit budget; on a GPU the share ``gpu_kv_budget`` gives
    (``memory``: measured after the profile step); on a CPU a quarter of the available RAM up to 2 GiB."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        if memory is None:
            raise ValueError("a GPU's KV budget needs its memory measured after a profile step")
        return gpu_kv_budget(memory, gpu_memory_utilization)
    return min(CPU_DEFAULT_CAP, int(available_cpu_bytes() * CPU_DEFAULT_FRACTION))


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer: (num_blocks + 1, block_size, Hkv, D), the last the scratch block
    v: list[torch.Tensor]
    block_size: int
    num_blocks: int

    @property
    def scratch_block(self) -> int:
        """One block past the ``num_blocks`` the scheduler hands out: padding writes its K/V there."""
        return self.num_blocks

    @classmethod
    def allocate(cls, cfg: ModelConfig, block_size: int, num_blocks: int, device, dtype) -> KVCache:
        # Uninitialised on purpose (zeroing GiBs costs seconds on a CPU): the CPU kernels and SDPA only
        # ever read slots written earlier, padding included (the runner points padding at real slots).
        # Flex attention does touch unwritten slots (with a zero weight): its runner zeroes the cache.
        shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cpu_kernels.kv_width(dtype, cfg.head_dim))
        k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        return cls(k, v, block_size, num_blocks)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v))
