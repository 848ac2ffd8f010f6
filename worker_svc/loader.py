"""``load_model(path)``: a Llama-family model from a GGUF file or a Hugging Face folder.

Both paths end in the same place: a ``ModelConfig`` and a state dict in *our* parameter names
(q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``), loaded into ``LlamaModel``.
A GGUF file is dequantized once and the result cached on disk (``conveyor.cache``), so the
next start of any process takes well under a second instead of seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conveyor.cache import cache_dir_for, write_atomic
from conveyor.gguf_file import GGUFFile
from conveyor.model_files import ModelFileError, resolve_model
from conveyor.tokenizer import ModelTokenizer, load_tokenizer
from worker_svc import backends, cpu_kernels
from worker_svc.config import ATTENTION, NUMERICS
from worker_svc.cpu_kernels import QUANTIZE, QUANTIZED
from worker_svc.kv_cache import kv_dtype
from worker_svc.model import LlamaModel, ModelConfig
from worker_svc.packed import PackedEmbedding, PackedLinear

log = logging.getLogger(__name__)

SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")
# GGUF quant types we promise to read (gguf.quants can dequantize more; those are accepted too).
GGUF_BASE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: ModelTokenizer
    name: str
    max_model_len: int
    packed: bool  # linear layers run on the CPU kernels from packed weights (GGUF blocks or dense rows)
    numerics: str  # the --numerics they were packed for

    def kv_dtype(self, setting: str = "auto", attention: str = "auto") -> torch.dtype:
        """The KV cache's dtype under ``--kv-cache-dtype setting`` (``kv_cache.kv_dtype``) for this model, its
        numerics and the backend ``--attention attention`` picks for it."""
        return kv_dtype(setting, backends.choose(attention, self.model), self.numerics, self.model.norm.weight.dtype,
                        self.config.head_dim)

    def weight_formats(self) -> str:
        """The formats the packed layers keep their weights in, e.g. "Q4_1, Q8_0" or "BF16"."""
        types = {m.qtype for m in self.model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
        return ", ".join(sorted(cpu_kernels.TYPE_NAMES[t] for t in types))


def load_model(
    path: str | Path | None = "default",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    attention: str = "auto",
    numerics: str = "exact",
    quantize: str = "none",
) -> LoadedModel:
    """Load ``path`` (``"default"``, a ``.gguf`` file or a HF folder) onto ``device`` in ``dtype``.

    ``attention`` (the worker's ``--attention``, ``worker_svc.backends``): "auto" packs every linear layer
    for the native backend (the CPU kernels) when running fp32 on a CPU that has them: a GGUF model's
    Q4_0/Q4_1/Q8_0 blocks as they are, any other weight as dense rows in its stored dtype (a Hugging
    Face folder's bf16 stays bf16: half the memory traffic of fp32, the same products); "native"
    insists (error if it cannot); "flex" and "sdpa" dequantize to dense weights (the path CUDA takes).
    ``quantize``: "q8_0" or "q4_0" quantizes the dense linear weights at load to those GGUF blocks
    (as llama.cpp's quantizer does; q4_0 keeps the embedding and output layer at q8_0), so a Hugging
    Face model takes the integer-dot path; "none" keeps them as stored. Needs the CPU kernels.
    ``numerics``: "exact" computes the dequantized fp32 product (logits within 1e-4 of
    transformers); "fast" keeps quantized weights in tiles and multiplies them with integer dots, the activations
    quantized in two int8 passes per block of 32, and bf16 weights with bf16 dots where the CPU has them
    (``worker_svc/cpu_kernels/tiles.c``); "int8" as fast, the activations in one int8 pass (as llama.cpp); "bf16"
    as fast below 16 rows of x, and from 16 rows quantized weights widened to bf16 and multiplied with bf16 dots
    (AMX-BF16 tiles, or AVX512-BF16's vdpbf16ps; without either it is fast).
    """
    if numerics not in NUMERICS:
        raise ValueError(f"--numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if quantize != "none" and quantize not in QUANTIZE:
        raise ValueError(f"--quantize must be none or one of {', '.join(QUANTIZE)}, got {quantize!r}")
    source = resolve_model(path)
    device = torch.device(device)
    packed = _use_packed("native" if quantize != "none" and attention == "auto" else attention, quantize, device,
                         dtype)
    if source.kind == "gguf":
        config, state = gguf_weights(source.path, packed)
    else:  # straight to the device in the run dtype (fp32 norms and all: as the GGUF path, then model.to)
        config, state = hf_weights(source.path, device, None if packed else dtype)  # packed: as stored
    if packed:
        _pack_dense(state, config, quantize)
    limit = config.max_position_embeddings if max_model_len is None else max_model_len
    if limit > config.max_position_embeddings:
        raise ModelFileError(
            f"--max-model-len {limit} exceeds the model's max_position_embeddings {config.max_position_embeddings}"
        )
    with torch.device("meta"):  # no memory and no random init; the loaded tensors are assigned
        model = LlamaModel(config, max_positions=limit)
    _install_packed(model, state, config, numerics)
    if config.tie_word_embeddings and "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = [k for k, t in model.state_dict().items() if t.is_meta and k not in state]
    if missing:
        raise ModelFileError(f"{source.path}: missing weights {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight = model.embed_tokens.weight
    model.to(device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model, config, load_tokenizer(source), source.name, limit, packed, numerics)


def _use_packed(attention: str, quantize: str, device: torch.device, dtype: torch.dtype) -> bool:
    if attention not in ATTENTION:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if attention in ("flex", "sdpa"):
        if quantize != "none":
            raise ModelFileError(f"--quantize {quantize} needs --attention native (or auto), got {attention}")
        return False
    reason = cpu_kernels.problem(device, dtype)
    if reason and attention == "native":
        raise ModelFileError(f"--attention native (or --quantize): cannot use the CPU kernels: {reason}")
    if reason and device.type == "cpu":
        log.info("CPU kernels not used (%s): dense fp32 weights", reason)
    return reason is None


_HEAD = ("embed_tokens", "lm_head")  # with each layer's linear layers (``_HF_LINEARS``): what packing changes


def _pack_dense(state: dict[str, torch.Tensor], config: ModelConfig, quantize: str) -> None:
    """Every dense linear weight in ``state`` (``<module>.weight``) -> ``<module>.qweight`` + ``.qtype``: GGUF
    blocks of the ``quantize`` type, else its rows as stored (fp32 for a GGUF's dequantized tensors). A
    weight whose row length is not a multiple of 32 stays dense (and the model then runs module by module)."""
    names = [f"layers.{i}.{m}" for i in range(config.num_layers) for m in _HF_LINEARS] + list(_HEAD)
    for name in names:
        weight = state.get(f"{name}.weight")
        if weight is None or weight.shape[-1] % cpu_kernels.QK:
            continue
        del state[f"{name}.weight"]
        if quantize != "none":
            qtype = cpu_kernels.QUANTIZE["q8_0" if name in _HEAD else quantize]
            state[f"{name}.qweight"] = cpu_kernels.quantize(weight, qtype)
        else:
            if weight.dtype not in cpu_kernels.DENSE:
                weight = weight.float()
            state[f"{name}.qweight"], qtype = cpu_kernels.dense_rows(weight)
        state[f"{name}.qtype"] = torch.tensor(qtype)


def _install_packed(model: LlamaModel, state: dict[str, torch.Tensor], config: ModelConfig, numerics: str) -> None:
    """Swap in PackedLinear / PackedEmbedding for every ``<module>.qweight`` in ``state`` (consumed), in the
    layout ``numerics`` multiplies them in (``cpu_kernels.tiled``)."""
    for key in [k for k in state if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight")
        qweight, qtype = state.pop(key), int(state.pop(f"{name}.qtype"))
        tiles = cpu_kernels.tiled(qtype, numerics)
        # the passes of x: NUMERICS' int8 blocks (fast: two, ~15 bits) for quantized weights; one bf16 for bf16
        # weights (what transformers and vLLM compute in bf16)
        passes = (NUMERICS[numerics] if qtype in QUANTIZED else 1) if tiles else 0
        if name == "embed_tokens":  # laid out once: lm_head may share it
            qweight = cpu_kernels.kernel_layout(qweight, qtype, config.hidden_size, tiles)
            model.embed_tokens = PackedEmbedding(qweight, qtype, config.hidden_size, tiles)
            if config.tie_word_embeddings:
                model.lm_head = PackedLinear(qweight, qtype, config.hidden_size, config.vocab_size, passes=passes)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        qweight = cpu_kernels.kernel_layout(qweight, qtype, dense.in_features, tiles)
        setattr(parent, child, PackedLinear(qweight, qtype, dense.in_features, dense.out_features,
                                            state.pop(f"{name}.bias", None), passes))


# ---------------------------------------------------------------- Hugging Face folders


def hf_config(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ModelFileError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_HF_TYPES)})")
    if raw.get("use_sliding_window"):
        raise ModelFileError("config.json asks for sliding-window attention, which is not supported")
    heads = raw["num_attention_heads"]
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    theta = raw.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0))
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        rope_scaling=scaling,
        architecture=model_type,
    )


# our module -> the HF tensors fused into it (in order)
_HF_LINEARS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
_HF_COPIED = ("input_layernorm.weight", "post_attention_layernorm.weight")


def hf_weights(folder: Path, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The folder's config and our state dict, on ``device`` in ``dtype`` (None: as stored).

    Streamed: each tensor is read from its memory-mapped file, converted and moved on its own, and a
    layer's q/k/v (gate/up) are fused where they land. Host memory holds a tensor or two at a time,
    never the model: an 8B-parameter checkpoint goes onto a GPU in bf16 with no full copy on the host."""
    config = hf_config(json.loads((folder / "config.json").read_text()))
    device = torch.device(device)
    with contextlib.ExitStack() as files:
        where = {}
        for file in sorted(folder.glob("*.safetensors")):
            handle = files.enter_context(safe_open(file, framework="pt"))
            where.update({key.removeprefix("model."): (handle, key) for key in handle.keys()})

        def need(name: str) -> torch.Tensor:
            if name not in where:
                raise ModelFileError(f"{folder}: missing weight {name}")
            handle, key = where[name]
            tensor = handle.get_tensor(key)
            return tensor.to(device=device, dtype=dtype or tensor.dtype)

        def fused(names: list[str]) -> torch.Tensor:
            parts = [need(n) for n in names]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        state = {}
        for i in range(config.num_layers):
            for target, sources in _HF_LINEARS.items():
                state[f"layers.{i}.{target}.weight"] = fused([f"layers.{i}.{s}.weight" for s in sources])
                if config.attention_bias and f"layers.{i}.{sources[0]}.bias" in where:
                    state[f"layers.{i}.{target}.bias"] = fused([f"layers.{i}.{s}.bias" for s in sources])
            for name in _HF_COPIED:
                state[f"layers.{i}.{name}"] = need(f"layers.{i}.{name}")
        state["embed_tokens.weight"] = need("embed_tokens.weight")
        state["norm.weight"] = need("norm.weight")
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = need("lm_head.weight")
    return config, state


# ---------------------------------------------------------------- GGUF files


def gguf_config(g: GGUFFile) -> ModelConfig:
    arch = g.architecture
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ModelFileError(
            f"{g.path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )
    heads = g.get(f"{arch}.attention.head_count")
    hidden = g.get(f"{arch}.embedding_length")
    scaling = None
    if g.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": g.get(f"{arch}.rope.scaling.factor")}
    elif g.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelFileError(f"{g.path.name}: rope scaling {g.get(f'{arch}.rope.scaling.type')!r} is not supported")
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1+: per-frequency divisors stored as a tensor
        factors = _dequantize(g.tensors["rope_freqs.weight"]).reshape(-1).tolist()
        scaling = {"rope_type": "freq_factors", "factors": factors}
    return ModelConfig(
        vocab_size=g.get(f"{arch}.vocab_size") or len(g.get("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=g.get(f"{arch}.feed_forward_length"),
        num_layers=g.get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=g.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=g.get(f"{arch}.attention.key_length") or g.get(f"{arch}.rope.dimension_count") or hidden // heads,
        rms_norm_eps=float(g.get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=g.get(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        rope_scaling=scaling,
        architecture=arch,
    )


def _dequantize(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in (rows, cols) order; unknown quant types are a clear error."""
    import gguf

    kind = tensor.tensor_type
    try:
        values = gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError as exc:
        raise ModelFileError(
            f"tensor {tensor.name}: GGUF quant type {kind.name} cannot be read (supported: {', '.join(GGUF_BASE_TYPES)} and others gguf can dequantize)"
        ) from exc
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
    return np.array(values, dtype=np.float32).reshape(shape)  # a writable copy, not the file mmap


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to the HF halves layout.

    Works on dense rows and on rows of quantized blocks alike: it only reorders whole rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: Path, packed: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights of a GGUF file, from the on-disk cache when it is there.

    Dense: every tensor as fp32. Packed: the linear layers (and the embedding) whose blocks the CPU
    kernels read stay quantized, as ``<module>.qweight`` (uint8 rows) + ``<module>.qtype``.
    """
    folder = cache_dir_for(path)
    cfg_file = folder / "model_config.json"
    weights_file = folder / ("weights-packed.safetensors" if packed else "weights-float32.safetensors")
    if cfg_file.is_file() and weights_file.is_file():
        return ModelConfig(**json.loads(cfg_file.read_text())), load_file(weights_file)
    g = GGUFFile(path)
    config = gguf_config(g)
    state = _gguf_state_dict(g, config, packed)
    write_atomic(weights_file, lambda tmp: save_file(state, str(tmp)))
    write_atomic(cfg_file, lambda tmp: tmp.write_text(json.dumps(asdict(config))))
    return config, state


# our module -> the GGUF tensors fused into it (in order)
_GGUF_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
_GGUF_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_state_dict(g: GGUFFile, config: ModelConfig, packed: bool) -> dict[str, torch.Tensor]:
    permute = config.architecture == "llama"  # llama.cpp reorders q/k rows only for Llama
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

    def tensor(name: str):
        if name not in g.tensors:
            raise ModelFileError(f"{g.path.name}: missing tensor {name}")
        return g.tensors[name]

    def rows(name: str, quantized: bool) -> torch.Tensor:
        t = tensor(name)
        if quantized:
            w = torch.from_numpy(np.array(t.data)).reshape(int(t.shape[-1]), -1)  # (N, blocks * bytes)
        else:
            w = torch.from_numpy(_dequantize(t))
        short = name.split(".")[-2]
        return _unpermute(w, heads[short]) if permute and short in heads else w

    def add(target: str, sources: list[str]) -> None:
        types = {int(tensor(f"{s}.weight").tensor_type) for s in sources}
        quantized = packed and len(types) == 1 and types <= set(cpu_kernels.QUANTIZED)
        w = torch.cat([rows(f"{s}.weight", quantized) for s in sources])
        state[f"{target}.qweight" if quantized else f"{target}.weight"] = w
        if quantized:
            state[f"{target}.qtype"] = torch.tensor(types.pop())
        if config.attention_bias and f"{sources[0]}.bias" in g.tensors:
            state[f"{target}.bias"] = torch.cat([rows(f"{s}.bias", False) for s in sources])

    state: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        for target, sources in _GGUF_LINEARS.items():
            add(f"layers.{i}.{target}", [f"blk.{i}.{s}" for s in sources])
        for target, source in _GGUF_NORMS.items():
            state[f"layers.{i}.{target}.weight"] = rows(f"blk.{i}.{source}.weight", False)
    add("embed_tokens", ["token_embd"])
    state["norm.weight"] = rows("output_norm.weight", False)
    if not config.tie_word_embeddings:
        add("lm_head", ["output"])
    return {k: v.contiguous() for k, v in state.items()}
