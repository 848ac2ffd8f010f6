"""The Llama family as pure ``nn.Module``s: Llama 2/3, SmolLM, Mistral (no sliding window), Qwen2.

Nothing here knows about requests or devices. One forward runs over a *flat* batch of new tokens
from many sequences (prompt chunks and decode tokens mixed); where each token's K/V goes and what it
may attend to is the step's ``Attend``, which a backend (``worker_svc.backends``) prepares. The native
backend does not call these modules at all: it runs the same layers over the same weights in C.

Shapes: ``T`` new tokens in the step, ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn



@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one Llama-family checkpoint (HF ``config.json`` names in comments)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    architecture: str = "llama"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class Attend(Protocol):
    """A step's attention, the same for every layer: writes ``k, v (T, Hkv, D)`` (rotated) to the layer's
    cache at this step's slots, then attends ``q (T, H, D)`` to each token's context. -> (T, H, D)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the normed input and the new residual stream."""
        if residual is not None:
            x = x + residual
        # Normalise in fp32 whatever the run dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype), x


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), with Llama-3 style ``rope_scaling`` when the config has it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: one divisor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device=inv_freq.device)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the max model length, looked up per token."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        # built on the CPU even under a meta-device context (the loader's), then moved with the model
        with torch.device("cpu"):
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D), halves layout as in HF weights
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # (T, 1, D): broadcasts over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # q, k and v in one matmul: (T, hidden) -> (T, q_size + 2 * kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, attend: Attend) -> torch.Tensor:
        """cos, sin: (T, 1, D) per token; k_cache, v_cache: this layer's (num_blocks, block_size, Hkv, D)."""
        cfg = self.cfg
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(T, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        return self.o_proj(attend(q, k, v, k_cache, v_cache).reshape(T, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, attend: Attend):
        """x: the previous layer's output (T, hidden); residual: the stream before it (None at layer 0)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, attend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Decoder stack + head. ``forward`` returns hidden states; ``logits`` projects chosen rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg = cfg
        # _weight skips the random init (the loader overwrites it anyway, and init on meta is slow)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, attend: Attend) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches: per layer (k_cache, v_cache); ``attend``: the step's attention
        (a backend's, ``worker_svc.backends``). Returns the final norm (T, hidden)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, attend)
        return self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in fp32."""
        return self.lm_head(hidden).float()
