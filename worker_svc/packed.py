"""Drop-in ``nn.Linear`` / ``nn.Embedding`` replacements that keep GGUF quantized blocks or dense rows as
stored (CPU only).

The loader swaps them in for the layers the CPU kernels run. The model code does not change: it calls
``self.qkv_proj(x)`` either way. With ``passes`` 0 (the exact numerics) values are exactly the dequantized
fp32 weights, only the summation order differs from a dense fp32 matmul; with 1 or 2 (the fast numerics)
the weights are in tiles and x is quantized (``worker_svc/cpu_kernels/tiles.c``).
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc import cpu_kernels


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W as (out_features, in_features / 32 * block bytes) uint8 GGUF blocks or dense
    rows, in the CPU kernels' layout (``cpu_kernels.kernel_layout``): rows for ``passes`` 0 (the exact
    product), tiles for 1 or 2 (the fast numerics' passes of x)."""

    def __init__(self, qweight: torch.Tensor, qtype: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, passes: int = 0):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("bias", bias)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = out_features  # tiles pad qweight's rows to a multiple of 16
        self.passes = passes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = cpu_kernels.qgemm(x.reshape(-1, self.in_features).float(), self.qweight, self.qtype, self.out_features,
                              self.passes)
        if self.bias is not None:
            y += self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, passes={self.passes}"


class PackedEmbedding(nn.Module):
    """Row lookup that expands only the rows asked for (``tiles``: qweight is in tiles, shared with a tied
    output layer of the fast numerics)."""

    def __init__(self, qweight: torch.Tensor, qtype: int, embedding_dim: int, tiles: bool = False):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype = qtype
        self.embedding_dim = embedding_dim
        self.tiles = tiles

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_kernels.dequantize_rows(self.qweight, self.qtype, self.embedding_dim, ids.reshape(-1), self.tiles)
        return rows.view(*ids.shape, self.embedding_dim)
