"""The Llama family as pure ``nn.Module``s: Llama 2/3, SmolLM, Mistral (no sliding window), Qwen2.

Nothing here knows about requests. One forward runs over a *flat* batch of new tokens from many
sequences (prompt chunks and decode tokens mixed); where each token's K/V goes and what it may
attend to comes in an ``AttentionMetadata`` built by the runner for this step.

Shapes: ``T`` new tokens in the step, ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc import cpu_kernels
from worker_svc.attention import PagedAttention


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


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache and what they attend to.

    The runner orders the flat batch as: all decode tokens first (one per sequence), then the
    prefill chunks one after another. Three ways to attend, chosen by which fields are set:

    - CPU kernel (``block_tables`` set): each token reads its sequence's keys 0..its position in
      place through the block table (``worker_svc.cpu_kernels.paged_attention``);
    - flex attention (``paged`` set; the GPU's way): the same, through ``flex_attention`` and a
      block mask made of the block tables (``worker_svc.attention``);
    - SDPA (``--attention sdpa``): decodes gather their context into a padded batch for one SDPA
      call; each prefill chunk gets its own SDPA call.
    """

    slot_mapping: torch.Tensor  # (T,) flat cache slot = block_id * block_size + offset
    # CPU kernel
    block_tables: torch.Tensor | None = None  # (B, max_blocks) int32, one row per sequence
    token_seq: torch.Tensor | None = None  # (T,) int32: row of block_tables of each token
    token_pos: torch.Tensor | None = None  # (T,) int32: position of each token
    # flex attention
    paged: PagedAttention | None = None
    # SDPA
    num_decodes: int = 0  # decode tokens occupy rows [0, num_decodes)
    decode_kv_slots: torch.Tensor | None = None  # (Bd, Lmax) cache slots of each context, padded
    decode_mask: torch.Tensor | None = None  # (Bd, 1, 1, Lmax) True where the slot is real
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class PrefillChunk:
    """A run of ``end - start`` new tokens of one sequence, at rows ``[start, end)`` of the batch."""

    start: int
    end: int
    kv_slots: torch.Tensor | None  # (ctx,) slots of all tokens 0..last; None: chunk is the whole context
    mask: torch.Tensor | None  # (n, ctx) causal mask offset by earlier context; None with kv_slots None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.cpu_kernels = False  # set by LlamaModel.use_cpu_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the normed input and the new residual stream."""
        if self.cpu_kernels:  # one call; the residual stream is updated in place
            if residual is None:
                return cpu_kernels.add_rms_norm(x, None, self.weight, self.eps), x
            return cpu_kernels.add_rms_norm(residual, x, self.weight, self.eps), residual
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
        self.cpu_kernels = False  # set by LlamaModel.use_cpu_kernels

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """cos, sin: (T, 1, D) per token, or with the CPU kernels the (P, D) tables."""
        cfg = self.cfg
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.cpu_kernels:
            out = cpu_kernels.attention(qkv, cfg.num_heads, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                        meta.block_tables, meta.token_seq, meta.token_pos)
            return self.o_proj(out)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(T, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        # k_cache: (num_blocks, block_size, Hkv, D); flat view: (slots, Hkv, D)
        k_flat = k_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v_flat = v_cache.view(-1, cfg.num_kv_heads, cfg.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        if meta.paged is not None:
            return self.o_proj(meta.paged(q, k_flat, v_flat).reshape(T, cfg.q_size))
        out = torch.empty_like(q)  # (T, H, D)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_flat, v_flat, meta)
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, k_flat, v_flat, chunk)
        return self.o_proj(out.view(T, cfg.q_size))

    def _decode(self, q, k_flat, v_flat, meta: AttentionMetadata) -> torch.Tensor:
        # One query per sequence against its whole (padded) context, all sequences at once.
        keys = k_flat[meta.decode_kv_slots].transpose(1, 2)  # (Bd, Hkv, Lmax, D)
        values = v_flat[meta.decode_kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
        )  # (Bd, H, 1, D)
        return out.squeeze(2)

    def _prefill(self, q, k, v, k_flat, v_flat, chunk: PrefillChunk) -> torch.Tensor:
        q = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
        if chunk.kv_slots is None:  # the chunk is the sequence's whole context so far
            keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, n, D)
            values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            keys = k_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
            values = v_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=chunk.mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (n, H, D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.cpu_kernels = False  # set by LlamaModel.use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_kernels:
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """x: the previous layer's output (T, hidden); residual: the stream before it (None at layer 0)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, k_cache, v_cache, meta)
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
        self.cpu_kernels = False
        self._stack: tuple[tuple[int, ...], cpu_kernels.DecoderStack] | None = None  # (cache pointers, stack)

    def use_cpu_kernels(self, enabled: bool = True) -> None:
        """Run norms, RoPE, attention and SwiGLU with ``worker_svc.cpu_kernels`` (fp32 on a CPU)."""
        self.cpu_kernels = enabled
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.cpu_kernels = enabled

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,); kv_caches: per layer (k_cache, v_cache). Returns (T, hidden)."""
        x = self.embed_tokens(input_ids)
        stack = self._decoder_stack(kv_caches)
        if stack is not None:  # every layer in one native call (same kernels, same order)
            return stack.forward(x.contiguous(), meta.slot_mapping, meta.block_tables, meta.token_seq, meta.token_pos)
        if self.cpu_kernels:
            cos, sin = self.rotary.cos, self.rotary.sin  # whole tables; the kernel indexes them
        else:
            cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        return self.norm(x, residual)[0]

    def _decoder_stack(self, kv_caches) -> cpu_kernels.DecoderStack | None:
        """The native decoder stack, when the CPU kernels run and every linear layer is quantized."""
        if not self.cpu_kernels:
            return None
        key = tuple(k.data_ptr() for k, _ in kv_caches)
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, self._build_stack(kv_caches))
        return self._stack[1]

    def _build_stack(self, kv_caches) -> cpu_kernels.DecoderStack | None:
        from worker_svc.packed import PackedLinear

        cfg, keep = self.cfg, []

        def ptr(t: torch.Tensor | None) -> int | None:
            """The address of a tensor's memory, which the stack then reads (and the KV cache's, writes)."""
            if t is None:
                return None
            if not t.is_contiguous() or t.dtype not in (torch.float32, torch.uint8):
                raise ValueError(f"the native decoder stack needs contiguous fp32 or uint8 tensors, got {t.dtype}")
            keep.append(t)
            return t.data_ptr()

        def linear(m) -> cpu_kernels.QLinear:
            return cpu_kernels.QLinear(ptr(m.qweight), ptr(m.bias), m.in_features, m.out_features, m.qtype, m.passes)

        linears = [getattr(layer.self_attn, n) for layer in self.layers for n in ("qkv_proj", "o_proj")]
        linears += [getattr(layer.mlp, n) for layer in self.layers for n in ("gate_up_proj", "down_proj")]
        if not all(isinstance(m, PackedLinear) for m in linears):
            return None  # dense weights (a Hugging Face folder): the module path
        layers = [
            cpu_kernels.Layer(ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight),
                              linear(layer.self_attn.qkv_proj), linear(layer.self_attn.o_proj),
                              linear(layer.mlp.gate_up_proj), linear(layer.mlp.down_proj), ptr(k), ptr(v))
            for layer, (k, v) in zip(self.layers, kv_caches)
        ]
        dims = cpu_kernels.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                kv_caches[0][0].shape[1], cfg.rms_norm_eps, cfg.head_dim**-0.5, ptr(self.rotary.cos),
                                ptr(self.rotary.sin), ptr(self.norm.weight))
        return cpu_kernels.DecoderStack(layers, dims, keep)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) in fp32."""
        return self.lm_head(hidden).float()
