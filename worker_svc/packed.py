"""Drop-in ``nn.Linear`` / ``nn.Embedding`` replacements that keep GGUF quantized blocks (CPU only).

The loader swaps them in for the layers of a GGUF model whose weights are Q4_0, Q4_1 or Q8_0 when
the CPU kernels are available. The model code does not change: it calls ``self.qkv_proj(x)``
either way. Values are exactly the dequantized fp32 weights; only the summation order differs
from a dense fp32 matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_svc import cpu_kernels


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W as (out_features, in_features / 32 * block bytes) uint8 GGUF blocks, in the
    CPU kernels' layout (``cpu_kernels.kernel_layout``)."""

    def __init__(self, qweight: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("bias", bias)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = qweight.shape[0]
        self.passes = 0  # int8 passes of x for decode batches (``--numerics fast``); 0: exact

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
    """Row lookup that expands only the rows asked for."""

    def __init__(self, qweight: torch.Tensor, qtype: int, embedding_dim: int):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype = qtype
        self.embedding_dim = embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = cpu_kernels.dequantize_rows(self.qweight, self.qtype, self.embedding_dim, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)
