"""The ways a step's forward can run, one object each: ``native``, ``flex`` and ``sdpa``.

Every backend takes the same ``StepBatch`` (the step's flat batch on the host, built once by the
runner) and has two methods: ``prepare(batch)`` turns it into what its forward needs (tensors on the
device, attention metadata), ``forward(prepared)`` returns the hidden states ``(T, hidden)`` after
the final norm. ``--attention`` picks one at start-up (``choose``); the model (``worker_svc.model``)
knows none of them.

- ``native``: the CPU kernels (``worker_svc/cpu_kernels``). The whole decoder stack in one native
  call over packed weights: GGUF Q4_0/Q4_1/Q8_0 blocks, or dense F32/F16/BF16 rows (a Hugging Face
  folder as stored, or ``--quantize``d at load); attention reads the paged cache in place through the
  block tables.
- ``flex``: the model's modules in PyTorch, attention through ``flex_attention`` and a block mask made
  of the block tables (``worker_svc.attention``): in place, fused by ``torch.compile`` on a GPU, and
  decode steps replayed from CUDA graphs (``worker_svc.graphs``).
- ``sdpa``: the model's modules in PyTorch, each context gathered for
  ``scaled_dot_product_attention`` (decodes in one padded call, each prefill chunk in its own).

A batch holds the decodes first (one token each), then the prefill chunks one after another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from worker_svc import cpu_kernels
from worker_svc.attention import PagedAttention, Rows, decode_rows, decode_size, padded_tables, paged_attention, prefill_rows
from worker_svc.config import ATTENTION
from worker_svc.graphs import DecodeGraphs, Graph
from worker_svc.kv_cache import KVCache
from worker_svc.model import LlamaModel
from worker_svc.packed import PackedLinear

def slot(table: list[int], position: int, block_size: int) -> int:
    """The cache slot of ``position`` in a sequence whose block table is ``table``."""
    return table[position // block_size] * block_size + position % block_size


@dataclass
class StepBatch:
    """One step's flat batch on the host: sequence ``i`` computes ``lengths[i]`` tokens from position
    ``starts[i]``, its KV in the blocks of ``tables[i]``, its prompt the positions before ``prompt_ends[i]``;
    the first ``num_decodes`` sequences decode (one token each)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's cache slot
    starts: list[int]
    lengths: list[int]
    tables: list[list[int]]
    num_decodes: int
    prompt_ends: list[int]

    @classmethod
    def of(cls, chunks: list[tuple[list[int], int, list[int], int]], block_size: int) -> StepBatch:
        """From (token ids, start position, block table, prompt length) per sequence, decodes first. Python ints
        only: at a few hundred sequences a step, tensors built per sequence cost more than a small model's forward."""
        ids, pos, slots = [], [], []
        for tokens, start, table, _ in chunks:
            span = range(start, start + len(tokens))
            ids += tokens
            pos += span
            slots += [slot(table, p, block_size) for p in span]
        lengths = [len(c[0]) for c in chunks]
        return cls(ids, pos, slots, [c[1] for c in chunks], lengths, [c[2] for c in chunks],
                   sum(1 for n in lengths if n == 1), [c[3] for c in chunks])

    def last_rows(self) -> list[int]:
        """Each sequence's last token's row in the flat batch."""
        return [end - 1 for end in accumulate(self.lengths)]


class Backend:
    """``prepare(batch)`` then ``forward(prepared)``: hidden states (T, hidden). ``run`` does both."""

    name: str

    def __init__(self, model: LlamaModel, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = model.norm.weight.device
        self.graphs: DecodeGraphs | None = None

    def prepare(self, batch: StepBatch):
        raise NotImplementedError

    def forward(self, prepared) -> torch.Tensor:
        raise NotImplementedError

    def run(self, batch: StepBatch) -> torch.Tensor:
        return self.forward(self.prepare(batch))


# ---------------------------------------------------------------- native: the CPU kernels


def native_problem(model: LlamaModel) -> str | None:
    """Why the native backend cannot run ``model`` (None: it can)."""
    reason = cpu_kernels.problem(model.norm.weight.device, model.norm.weight.dtype)
    if reason:
        return reason
    linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(isinstance(m, PackedLinear) for m in linears):
        return "the weights are not packed for it (load the model with attention native or auto)"
    return None


@dataclass
class NativeStep:
    input_ids: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (T,) long
    block_tables: torch.Tensor  # (B, max_blocks) int32
    token_seq: torch.Tensor  # (T,) int32: each token's row of block_tables
    token_pos: torch.Tensor  # (T,) int32
    token_prompt: torch.Tensor  # (T,) uint8: 1 for a token of its sequence's prompt


class Native(Backend):
    """Every layer in one call of ``layers.c``'s ``decoder_forward``: norms, RoPE, the KV write, paged
    attention and SwiGLU by the CPU kernels, the linear layers by ``qgemm`` on the packed weights."""

    name = "native"

    def __init__(self, model: LlamaModel, cache: KVCache):
        super().__init__(model, cache)
        problem = native_problem(model)
        if problem:
            raise ValueError(f"--attention native: cannot run this model on the CPU kernels: {problem}")
        self.stack = self._build_stack()

    def prepare(self, batch: StepBatch) -> NativeStep:
        """Each tensor made once from Python lists: a lone decode's step is ~4 ms here, and building the per-token
        lists with PyTorch ops (repeat_interleave, a compare, casts) cost ~0.15 ms of it."""
        seq: list[int] = []
        prompt: list[int] = []
        for i, (start, n, end) in enumerate(zip(batch.starts, batch.lengths, batch.prompt_ends)):
            seq += [i] * n
            k = min(max(end - start, 0), n)  # the chunk's first k tokens are of its prompt
            prompt += [1] * k + [0] * (n - k)
        return NativeStep(torch.tensor(batch.token_ids), torch.tensor(batch.slots),
                          padded_tables(batch.tables, len(batch.tables), max(len(t) for t in batch.tables), 0),
                          torch.tensor(seq, dtype=torch.int32), torch.tensor(batch.positions, dtype=torch.int32),
                          torch.tensor(prompt, dtype=torch.uint8))

    def forward(self, step: NativeStep) -> torch.Tensor:
        x = self.model.embed_tokens(step.input_ids).contiguous()
        return self.stack.forward(x, step.slot_mapping, step.block_tables, step.token_seq, step.token_pos,
                                  step.token_prompt)

    def _build_stack(self) -> cpu_kernels.DecoderStack:
        model, cfg, keep = self.model, self.model.cfg, []

        def ptr(t: torch.Tensor | None) -> int | None:
            """The address of a tensor's memory, which the stack then reads (and the KV cache's, writes)."""
            if t is None:
                return None
            if not t.is_contiguous() or t.dtype not in (torch.float32, torch.uint8, torch.int8, torch.float16,
                                                        torch.bfloat16):
                raise ValueError(f"the native decoder stack needs contiguous fp32, fp16, bf16, uint8 or int8 tensors, "
                                 f"got {t.dtype}")
            keep.append(t)
            return t.data_ptr()

        def linear(m: PackedLinear) -> cpu_kernels.QLinear:
            return cpu_kernels.QLinear(ptr(m.qweight), ptr(m.bias), m.in_features, m.out_features, m.qtype, m.passes)

        layers = [
            cpu_kernels.Layer(ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight),
                              linear(layer.self_attn.qkv_proj), linear(layer.self_attn.o_proj),
                              linear(layer.mlp.gate_up_proj), linear(layer.mlp.down_proj), ptr(k), ptr(v))
            for layer, (k, v) in zip(model.layers, self.cache.layers())
        ]
        dims = cpu_kernels.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                self.cache.block_size, cfg.rms_norm_eps, cfg.head_dim**-0.5, ptr(model.rotary.cos),
                                ptr(model.rotary.sin), ptr(model.norm.weight), cpu_kernels.kv_kind(self.cache.k[0].dtype))
        return cpu_kernels.DecoderStack(layers, dims, keep)


# ---------------------------------------------------------------- the PyTorch module path: flex and sdpa


@dataclass
class TorchStep:
    """A step of the model's modules: its inputs on the device and how each layer attends. The model calls it
    with each layer's rotated ``q (T, H, D)``, ``k, v (T, Hkv, D)`` and cache; it writes k and v to their
    slots, then attends."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # (T,) long
    attend: Callable[..., torch.Tensor]  # (q, k, v, k_flat, v_flat) -> (T, H, D)

    def __call__(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        hkv, d = k.shape[1], k.shape[2]
        k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)  # (slots, Hkv, D)
        k_flat.index_copy_(0, self.slot_mapping, k)
        v_flat.index_copy_(0, self.slot_mapping, v)
        return self.attend(q, k, v, k_flat, v_flat)


class TorchBackend(Backend):
    def forward(self, step: TorchStep) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, self.cache.layers(), step)

    def torch_step(self, batch: StepBatch, attend) -> TorchStep:
        move = lambda xs: torch.tensor(xs).to(self.device, non_blocking=True)  # noqa: E731
        return TorchStep(move(batch.token_ids), move(batch.positions), move(batch.slots), attend)


@dataclass
class PrefillChunk:
    """A run of ``end - start`` new tokens of one sequence, at rows ``[start, end)`` of the batch."""

    start: int
    end: int
    kv_slots: torch.Tensor | None  # (ctx,) slots of all tokens 0..last; None: the chunk is the whole context
    mask: torch.Tensor | None  # (n, ctx) causal mask offset by earlier context; None with kv_slots None


@dataclass
class SdpaAttention:
    num_decodes: int  # decode tokens occupy rows [0, num_decodes)
    decode_slots: torch.Tensor | None  # (Bd, Lmax) cache slots of each decode's context, padded
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) True where the slot is real
    prefills: list[PrefillChunk]

    def __call__(self, q, k, v, k_flat, v_flat) -> torch.Tensor:
        out = torch.empty_like(q)  # (T, H, D)
        if self.num_decodes:  # one query per sequence against its whole (padded) context, all at once
            keys = k_flat[self.decode_slots].transpose(1, 2)  # (Bd, Hkv, Lmax, D)
            values = v_flat[self.decode_slots].transpose(1, 2)
            out[: self.num_decodes] = F.scaled_dot_product_attention(
                q[: self.num_decodes].unsqueeze(2), keys, values, attn_mask=self.decode_mask, enable_gqa=True
            ).squeeze(2)
        for chunk in self.prefills:
            query = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, H, n, D)
            if chunk.kv_slots is None:  # the chunk is the sequence's whole context so far
                keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # (1, Hkv, n, D)
                values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
            else:
                keys = k_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, ctx, D)
                values = v_flat[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(query, keys, values, attn_mask=chunk.mask, enable_gqa=True)
            out[chunk.start : chunk.end] = o.squeeze(0).transpose(0, 1)
        return out


class Sdpa(TorchBackend):
    """Each context gathered out of the paged cache for ``scaled_dot_product_attention``."""

    name = "sdpa"

    def prepare(self, batch: StepBatch) -> TorchStep:
        bs, n_dec, device = self.cache.block_size, batch.num_decodes, self.device
        slots_of = lambda table, positions: torch.tensor([slot(table, p, bs) for p in positions])  # noqa: E731
        decode_slots = decode_mask = None
        if n_dec:
            ctx = [p + 1 for p in batch.starts[:n_dec]]
            width = max(ctx)
            decode_slots = torch.stack([slots_of(t, [min(p, n - 1) for p in range(width)])
                                        for t, n in zip(batch.tables, ctx)]).to(device)
            decode_mask = (torch.arange(width).unsqueeze(0) < torch.tensor(ctx).unsqueeze(1)).view(n_dec, 1, 1, width)
            decode_mask = decode_mask.to(device)
        prefills, row = [], n_dec
        for start, n, table in zip(batch.starts[n_dec:], batch.lengths[n_dec:], batch.tables[n_dec:]):
            if start == 0:
                prefills.append(PrefillChunk(row, row + n, None, None))
            else:
                end = start + n
                mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)  # (n, ctx)
                prefills.append(PrefillChunk(row, row + n, slots_of(table, range(end)).to(device), mask.to(device)))
            row += n
        return self.torch_step(batch, SdpaAttention(n_dec, decode_slots, decode_mask, prefills))


class Flex(TorchBackend):
    """``flex_attention`` through a block mask of the block tables, the cache read in place. ``compiled``: fused
    by ``torch.compile``; ``graphs``: makes the graph each padded decode size (up to ``max_graph_batch``
    sequences) is captured in (``CudaGraph.factory()`` on a GPU), None: every step eager."""

    name = "flex"

    def __init__(self, model: LlamaModel, cache: KVCache, max_model_len: int, compiled: bool,
                 graphs: Callable[[], Graph] | None = None, max_graph_batch: int = 256):
        super().__init__(model, cache)
        self.compiled = compiled
        self.max_graph_batch = max_graph_batch
        self.table_width = min(-(-max_model_len // cache.block_size), cache.num_blocks)  # most blocks of a sequence
        self.block_logical = torch.zeros(cache.num_blocks + 1, dtype=torch.int32, device=self.device)
        # Flex attention multiplies the masked slots of a partial block (a sequence's unwritten tail) by a zero
        # weight: memory never written could hold NaN bit patterns, and 0 * NaN is NaN. Written slots are
        # finite, so zeroing once suffices (on a GPU a memset of the cache takes milliseconds).
        for t in cache.k + cache.v:
            t.zero_()
        if graphs is not None:
            self.graphs = DecodeGraphs(self._captured_forward, graphs, max_graph_batch, self.table_width,
                                       cache.scratch_block, cache.block_size, self.device)

    def prepare(self, batch: StepBatch) -> TorchStep | StepBatch:
        """A batch of decodes a graph holds is replayed as it is; any other becomes an eager step."""
        n = len(batch.lengths)
        if self.graphs is not None and n <= self.graphs.max_batch and batch.num_decodes == n:
            return batch
        rows = []
        if batch.num_decodes:
            padded = torch.full((decode_size(batch.num_decodes),), -1)
            padded[: batch.num_decodes] = torch.tensor(batch.starts[: batch.num_decodes])
            rows.append(decode_rows(padded, batch.num_decodes))
        if batch.num_decodes < n:
            d = batch.num_decodes
            rows.append(prefill_rows(d, batch.starts[d:], batch.lengths[d:], d))
        # as many rows as the biggest decode batch (the tables are an input of the fused kernel: a shape that
        # changed with every step's sequence count would compile it anew)
        height = max(decode_size(self.max_graph_batch), decode_size(n))
        table = padded_tables(batch.tables, height, self.table_width, self.cache.scratch_block)
        paged = self.paged([r.to(self.device) for r in rows], table.to(self.device))
        return self.torch_step(batch, paged)

    def forward(self, step: TorchStep | StepBatch) -> torch.Tensor:
        if isinstance(step, StepBatch):
            return self.graphs.run(step.token_ids, step.positions, step.slots, step.tables)
        return super().forward(step)

    def paged(self, rows: list[Rows], tables: torch.Tensor) -> PagedAttention:
        """From device tensors only (a captured graph runs this). ``tables`` (R, table_width): every table padded
        to the longest a sequence can have, so that the fused kernel sees a few shapes only. The block lists
        span the whole cache on a CPU (its fused kernel asks for that)."""
        slots = (self.cache.num_blocks + 1) * self.cache.block_size
        width = self.cache.num_blocks + 1 if self.device.type == "cpu" else self.table_width
        return paged_attention(rows, tables, self.block_logical, self.cache.block_size, width, slots, self.compiled)

    def _captured_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                          tables: torch.Tensor) -> torch.Tensor:
        """The decode step a graph captures, on its static buffers (positions -1: padding rows)."""
        paged = self.paged([decode_rows(positions, len(positions))], tables)
        return self.forward(TorchStep(input_ids, positions.clamp(min=0), slots, paged))


def choose(attention: str, model: LlamaModel) -> str:
    """The backend ``--attention`` names for ``model``: auto is native when the CPU kernels can run it, else
    flex on a GPU and sdpa on a CPU (flex unfused materializes scores over the whole cache)."""
    if attention not in ATTENTION:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if attention != "auto":
        return attention
    if native_problem(model) is None:
        return "native"
    return "flex" if model.norm.weight.device.type == "cuda" else "sdpa"


def make(attention: str, model: LlamaModel, cache: KVCache, max_model_len: int, compile_attention: bool | None = None,
         graphs: Callable[[], Graph] | None = None, max_graph_batch: int = 256) -> Backend:
    """The backend ``choose`` picks, over ``cache``. ``compile_attention`` (flex): fuse with torch.compile
    (default: on a GPU); ``graphs``, ``max_graph_batch``: flex's captured decode steps."""
    name = choose(attention, model)
    if name == "native":
        return Native(model, cache)
    if name == "sdpa":
        return Sdpa(model, cache)
    compiled = model.norm.weight.device.type == "cuda" if compile_attention is None else compile_attention
    return Flex(model, cache, max_model_len, compiled, graphs, max_graph_batch)

