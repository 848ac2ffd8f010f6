"""Our model code against Hugging Face transformers on the same weights (fp32).

Two compute paths are checked: the CPU-kernel path the worker uses on this machine (quantized
weights, kernels for attention and element-wise ops: same arithmetic, another summation order,
so a tight tolerance) and the pure PyTorch path that CUDA runs (bit-for-bit here, tolerance kept
for other BLAS builds).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from helpers import ROOT, hf_logits, make_runner, needs_kernels, save_hf, tiny_llama, tiny_qwen2, word_tokenizer

from conveyor.model_files import ModelFileError
from worker_svc.loader import load_model

PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):\n    ",
    "안녕하세요! 오늘 날씨는",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
KERNEL_ATOL = 5e-4  # logits are O(10-30); the kernel path sums in another order (seen: 8e-5)
TORCH_ATOL = 1e-4



def _score(loaded, ids: list[int], block_size: int = 16, **options) -> torch.Tensor:
    """Logits at every position, computed in blocks handed out last first (a table that runs backwards)."""
    num_blocks = len(ids) // block_size + 2
    runner = make_runner(loaded, block_size=block_size, num_blocks=num_blocks, **options)
    return runner.score(ids, list(range(num_blocks - 1, 0, -1)))


FLEX = {"attention": "flex", "compile_attention": True}  # the GPU's attention, fused here by the CPU's compiler


@needs_kernels
def test_default_model_uses_the_cpu_kernels(default_model):
    assert default_model.packed and make_runner(default_model, num_blocks=4).attention == "native"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_default_logits_match_transformers(default_model, dense_model, hf_model, prompt):
    ids = default_model.tokenizer.encode(prompt)
    expected = hf_logits(hf_model, ids)
    torch.testing.assert_close(_score(dense_model, ids), expected, atol=TORCH_ATOL, rtol=0)
    if prompt == PROMPTS[0]:  # one shape is enough for the fused kernel (each new one is compiled: ~20 s here)
        torch.testing.assert_close(_score(dense_model, ids, **FLEX), expected, atol=TORCH_ATOL, rtol=0)
    torch.testing.assert_close(_score(default_model, ids), expected, atol=KERNEL_ATOL, rtol=0)


# ---------------------------------------------------------------- tiny models made in the test


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama3-rope-untied", "qwen2-bias-tied"])
@pytest.mark.parametrize("path", [pytest.param("native", marks=needs_kernels), "sdpa", "flex"])
def test_tiny_hf_folder_matches_transformers(tmp_path, build, path):
    """150 tokens: two tiles of flex attention's block mask, in 4-token blocks."""
    reference = build()
    save_hf(reference, tmp_path)
    ours = load_model(tmp_path, attention=path)
    assert ours.config.architecture == reference.config.model_type
    ids = torch.randint(0, reference.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_logits(reference, ids)
    options = FLEX if path == "flex" else {"attention": path}
    torch.testing.assert_close(_score(ours, ids, block_size=4, **options), expected, atol=1e-4, rtol=1e-4)


_PEAK_HOST_MEMORY = """
import sys, threading, time
import torch
from worker_svc.loader import load_model

def anon() -> int:  # private memory of this process (file-backed mmaps of the checkpoint excluded)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

torch.cat([torch.empty(2, 2, device="meta")] * 2)  # meta ops import torch's decompositions: before the baseline
peak, done = [anon()], threading.Event()
base = peak[0]
def sample() -> None:
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)
threading.Thread(target=sample, daemon=True).start()
loaded = load_model(sys.argv[1], device=sys.argv[2], dtype=getattr(torch, sys.argv[3]))
done.set()
time.sleep(0.01)
print(peak[0] - base, sum(p.numel() for p in loaded.model.parameters()))
"""


def test_a_hf_folder_streams_onto_its_device_with_no_host_copy_of_the_model(tmp_path):
    """Loaded onto the ``meta`` device (which keeps no data, as a GPU keeps it off the host), a ~120 MB bf16
    checkpoint never has more than a few tensors in host memory at once; onto the CPU, the measure sees all
    of it (the CPU kernels keep the bf16 weights as stored)."""
    import os
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    word_tokenizer(tmp_path, cfg.vocab_size)
    size = sum(p.numel() * 2 for p in model.parameters())
    del model
    grew = {}
    for device, dtype in (("meta", "bfloat16"), ("cpu", "float32")):
        # every large allocation its own mapping, returned when freed: RSS then follows live tensors, not what
        # malloc keeps for reuse (glibc raises its mmap threshold after the first frees otherwise)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        done = subprocess.run([sys.executable, "-c", _PEAK_HOST_MEMORY, str(tmp_path), device, dtype], capture_output=True,
                              text=True, cwd=ROOT, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        peak, params = map(int, done.stdout.split())
        if device == "meta":  # every weight a dense parameter (on the CPU they are the kernels' packed buffers)
            assert params * 2 == size
        grew[device] = peak
    assert grew["meta"] < 0.2 * size, f"host memory grew by {grew['meta'] / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"
    assert grew["cpu"] > 0.9 * size  # the measure sees a model that does land in host memory (bf16 kept as stored)


def test_hf_folder_with_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    word_tokenizer(tmp_path, 10)
    with pytest.raises(ModelFileError, match="model_type 'gpt2' is not supported"):
        load_model(tmp_path)


def test_hf_folder_without_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    word_tokenizer(tmp_path, 10)
    with pytest.raises(ModelFileError, match="no \\*.safetensors"):
        load_model(tmp_path)


# ---------------------------------------------------------------- GGUF quant types


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the loader must undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["<s>", "</s>"]


QUANT_PLAN = {  # tensor -> GGUF type, covering every type the issue names
    "token_embd": gguf.GGMLQuantizationType.Q8_0,
    "output": gguf.GGMLQuantizationType.Q4_0,
    "attn_q": gguf.GGMLQuantizationType.Q4_1,
    "attn_k": gguf.GGMLQuantizationType.Q4_0,
    "attn_v": gguf.GGMLQuantizationType.Q8_0,
    "attn_output": gguf.GGMLQuantizationType.F16,
    "ffn_gate": gguf.GGMLQuantizationType.BF16,
    "ffn_up": gguf.GGMLQuantizationType.Q4_1,
    "ffn_down": gguf.GGMLQuantizationType.F32,
}


def _write_tiny_gguf(path, quant_plan=QUANT_PLAN, arch: str = "llama") -> None:
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    vocab = _byte_vocab()
    rng = np.random.default_rng(7)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.15).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_merges([])
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)

    def add(name: str, kind: str, w: np.ndarray) -> None:
        qtype = quant_plan[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.Q8_1:  # a type gguf-py cannot dequantize
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor(name, np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", rand(len(vocab), hidden))
    add("output.weight", "output", rand(len(vocab), hidden))
    writer.add_tensor("output_norm.weight", 1 + rand(hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", "attn_q", _llama_cpp_permute(rand(hidden, hidden), heads))
        add(f"blk.{i}.attn_k.weight", "attn_k", _llama_cpp_permute(rand(hidden // 2, hidden), kv_heads))
        add(f"blk.{i}.attn_v.weight", "attn_v", rand(hidden // 2, hidden))
        add(f"blk.{i}.attn_output.weight", "attn_output", rand(hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", "ffn_gate", rand(inter, hidden))
        add(f"blk.{i}.ffn_up.weight", "ffn_up", rand(inter, hidden))
        add(f"blk.{i}.ffn_down.weight", "ffn_down", rand(hidden, inter))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("attention", [pytest.param("native", marks=needs_kernels), "sdpa"])
def test_tiny_gguf_with_every_quant_type_matches_transformers(tmp_path, monkeypatch, attention):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_model(path, attention=attention)
    ids = torch.randint(0, 258, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(_score(ours, ids, block_size=8, attention=attention), hf_logits(reference, ids), atol=1e-4, rtol=1e-4)
    again = load_model(path, attention=attention)  # from the on-disk cache this time
    torch.testing.assert_close(_score(again, ids, block_size=8), _score(ours, ids, block_size=8), atol=0, rtol=0)


def test_gguf_with_unreadable_quant_type_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q8_1.gguf"
    _write_tiny_gguf(path, dict(QUANT_PLAN, ffn_up=gguf.GGMLQuantizationType.Q8_1))  # gguf cannot dequantize it
    with pytest.raises(ModelFileError, match="Q8_1"):
        load_model(path, attention="sdpa")


def test_gguf_of_unsupported_architecture_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "falcon.gguf"
    _write_tiny_gguf(path, arch="falcon")
    with pytest.raises(ModelFileError, match="architecture 'falcon' is not supported"):
        load_model(path)
