"""The worker's ``--numerics fast``: integer dot products with activations quantized to int8 blocks.

Checked two ways: each block format's product against the exact one (random weights, every type),
and the whole default model decoding teacher-forced, one token at a time (rows the integer dots
serve on every instruction set), against transformers: top-1 agreement and the log-probability error.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import ROOT, hf_logits, make_runner, needs_kernels

from conveyor.params import SamplingParams
from worker_svc import cpu_kernels
from worker_svc.config import WIDE
from worker_svc.loader import load_model
from worker_svc.packed import PackedLinear
from worker_svc.runner import SeqChunk, StepInput

pytestmark = needs_kernels

# Varied text from this repository: prose and tables, C, Python, and test strings in Korean, Chinese, emoji.
TEXTS = ["README.md", "worker_svc/cpu_kernels/qgemm.c", "conveyor/state.py", "tests/test_detokenizer.py"]
POSITIONS = 512  # per text: 2,044 predictions in all


def _random_blocks(qtype: int, rows: int, k: int, seed: int, tiles: bool = False) -> torch.Tensor:
    """(rows, k / 32 * block bytes) uint8: random quants with plausible fp16 scales (and mins), in rows or tiles."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    scale = rng.uniform(0.001, 0.05, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    if qtype == 8:
        quants = rng.integers(-127, 128, (rows, nb, 32)).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([scale, quants], axis=2)
    else:
        nibbles = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
        minimum = rng.uniform(-0.2, 0.0, (rows, nb, 1)).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([scale, minimum, nibbles] if qtype == 3 else [scale, nibbles], axis=2)
    blocks = torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1)))
    return cpu_kernels.kernel_layout(blocks, qtype, k, tiles)


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2])
def test_integer_dots_match_the_exact_product(qtype, rows):
    n, k = 200, 1536
    weights, tiles = _random_blocks(qtype, n, k, seed=qtype), _random_blocks(qtype, n, k, seed=qtype, tiles=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    dense = cpu_kernels.dequantize_rows(weights, qtype, k, torch.arange(n))
    assert torch.equal(cpu_kernels.dequantize_rows(tiles, qtype, k, torch.arange(n), tiles=True), dense)
    exact = x @ dense.T
    assert torch.allclose(cpu_kernels.qgemm(x, weights, qtype, n), exact, rtol=1e-4, atol=1e-3)

    def error(passes: int) -> float:
        return float((cpu_kernels.qgemm(x, tiles, qtype, n, passes) - exact).norm() / exact.norm())

    assert 1e-4 < error(1) < 2e-2  # one int8 pass: x rounded to 8 bits per block
    assert 0 < error(2) < 2e-4  # the fast mode's two passes: ~15 bits


@pytest.fixture(scope="module")
def fast_model():
    return load_model("default", numerics="fast")


def _teacher_forced(loaded, texts: list[list[int]], kv_cache_dtype: str = "auto") -> tuple[list[list[int]], list[list[float]]]:
    """Feed each text one token per step (all texts in one batch); the greedy token and its log-probability
    after every prefix."""
    runner = make_runner(loaded, num_blocks=len(texts) * (POSITIONS // 16 + 1), kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, logprobs=1)
    per = POSITIONS // 16 + 1
    preds, logprobs = [[] for _ in texts], [[] for _ in texts]
    for pos in range(POSITIONS - 1):
        chunks = [SeqChunk(f"t{i}", [ids[pos]], pos,
                           new_block_ids=list(range(i * per, (i + 1) * per)) if pos == 0 else [], sample=True,
                           sampling=params if pos == 0 else None, num_prompt_tokens=1) for i, ids in enumerate(texts)]
        for result in runner.step(StepInput(chunks)):
            i = int(result.seq_id[1:])
            preds[i].append(result.sampled.token_id)
            logprobs[i].append(result.sampled.logprob)
    return preds, logprobs


def _scored(loaded, hf_model, texts: list[list[int]], kv_cache_dtype: str = "auto") -> tuple[int, int, list[float]]:
    """``_teacher_forced`` against transformers: the greedy tokens that are its argmax too, of how many, and each
    greedy token's |log p error|."""
    preds, logprobs = _teacher_forced(loaded, texts, kv_cache_dtype)
    agree, total, errors = 0, 0, []
    for ids, pred, lp in zip(texts, preds, logprobs):
        reference = torch.log_softmax(hf_logits(hf_model, ids[:-1]), dim=-1)
        agree += sum(int(a == b) for a, b in zip(reference.argmax(-1).tolist(), pred))
        total += len(pred)
        errors += [abs(reference[j, t].item() - lp[j]) for j, t in enumerate(pred)]
    return agree, total, errors


def test_fast_numerics_agree_with_transformers_teacher_forced(fast_model, hf_model):
    linears = [m for m in fast_model.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.passes == 2 for m in linears)  # in tiles, x in two int8 passes
    tok = fast_model.tokenizer
    texts = [tok.encode((ROOT / name).read_text())[:POSITIONS] for name in TEXTS]
    agree, total, errors = 0, 0, []
    for pair in (texts[:2], texts[2:]):  # 2 rows a step: integer dots on every instruction set
        assert len(pair) <= cpu_kernels.int8_max_rows(2)
        a, t, e = _scored(fast_model, hf_model, pair)
        agree, total, errors = agree + a, total + t, errors + e
    errors = torch.tensor(errors)
    print(f"fast numerics, teacher-forced: top-1 agreement {agree}/{total} = {agree / total:.4f}; "
          f"|log p error| mean {errors.mean():.5f}, max {errors.max():.5f}")
    assert total >= 2000 and agree / total >= 0.98
    assert 0 < errors.max() < 0.05 and errors.mean() < 0.005  # not the exact path, and close to it


def test_an_int8_kv_cache_decodes_at_the_accuracy_the_readme_gives(fast_model, hf_model):
    """--kv-cache-dtype int8 (K and V in int8, a scale per 32 values, as llama.cpp's q8_0 cache): teacher-forced, a
    token a step, every decode's attention reads the int8 rows; a step below fp16's cache, most of it from K."""
    tok = fast_model.tokenizer
    pair = [tok.encode((ROOT / name).read_text())[:POSITIONS] for name in TEXTS[:2]]
    agree, total, errors = _scored(fast_model, hf_model, pair, kv_cache_dtype="int8")
    errors = torch.tensor(errors)
    print(f"int8 KV cache (fast numerics), teacher-forced: top-1 agreement {agree}/{total} = {agree / total:.4f}; "
          f"|log p error| mean {errors.mean():.5f}, max {errors.max():.5f}")
    assert total >= 1000 and 0.97 <= agree / total < 0.999  # README: 98.9 % (fp16's cache 99.95 %)
    assert 0.002 < errors.mean() < 0.03  # README: 0.015 (fp16's 0.0006)


def test_the_int8_numerics_take_x_in_one_pass_at_the_accuracy_the_readme_gives(hf_model):
    """--numerics int8: the activations in one int8 pass per block (llama.cpp's Q8 activations), a step below fast."""
    loaded = load_model("default", numerics="int8")
    assert {m.passes for m in loaded.model.modules() if isinstance(m, PackedLinear)} == {1}
    text = loaded.tokenizer.encode((ROOT / TEXTS[0]).read_text())[:POSITIONS]
    agreement = _prefill_agreement(loaded, hf_model, [text])
    print(f"int8 numerics ({cpu_kernels.isa()}): top-1 agreement with transformers {agreement:.4f} over {len(text)}")
    assert len(text) <= cpu_kernels.int8_max_rows(1)  # one prefill of every position: integer dots, any CPU
    assert 0.9 <= agreement < 0.99  # README: 96 % (fast: 99.9 %)


def test_the_bf16_numerics_widen_quantized_weights_from_16_rows_at_the_accuracy_the_readme_gives(fast_model, hf_model):
    """--numerics bf16: a prefill (every position in one step) multiplies the GGUF's weights rounded to bf16 with
    x rounded to bf16 where the CPU has bf16 dots (AMX tiles, or AVX512-BF16's vdpbf16ps), a step below fast;
    elsewhere it is fast."""
    loaded = load_model("default", numerics="bf16")
    assert {m.passes for m in loaded.model.modules() if isinstance(m, PackedLinear)} == {2 | WIDE}
    texts = [loaded.tokenizer.encode((ROOT / name).read_text())[:POSITIONS] for name in TEXTS[:2]]
    agreement, fast = _prefill_agreement(loaded, hf_model, texts), _prefill_agreement(fast_model, hf_model, texts)
    print(f"bf16 numerics ({cpu_kernels.isa()}): top-1 agreement with transformers {agreement:.4f} over "
          f"{sum(map(len, texts))} prefilled (fast {fast:.4f})")
    if cpu_kernels.bf16_dots():  # README: 98.4 % with AMX (a bf16 cache, attention in bf16 tiles too)
        assert 0.95 <= agreement < fast
    else:
        assert agreement == fast


# ---------------------------------------------------------------- a Hugging Face folder: as stored, or --quantize


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory, hf_model, hf_tokenizer):
    """The default model as the Hugging Face folder a user brings: bf16 safetensors written by transformers."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_model.config)
    config.__dict__.pop("quantization_config", None)  # read from a GGUF: a plain model of the same weights
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(hf_model.state_dict())
    folder = tmp_path_factory.mktemp("bf16-folder")
    plain.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bf16_reference(bf16_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.float32).eval()  # bf16 widened exactly


def _formats(loaded) -> dict[str, int]:
    return {name: m.qtype for name, m in loaded.model.named_modules() if hasattr(m, "qtype")}


def _prefill_agreement(loaded, reference, texts: list[list[int]]) -> float:
    """Top-1 agreement with ``reference`` at every position of each text, scored as one prefill."""
    agree = total = 0
    for ids in texts:
        runner = make_runner(loaded, num_blocks=len(ids) // 16 + 2)
        ours = runner.score(ids, list(range(len(ids) // 16 + 1, 0, -1)))
        agree += int((ours.argmax(-1) == hf_logits(reference, ids).argmax(-1)).sum())
        total += len(ids)
    return agree / total


def test_a_bf16_folder_runs_on_the_kernels_as_stored_and_matches_transformers(bf16_folder, bf16_reference):
    loaded = load_model(bf16_folder, numerics="exact")
    formats = _formats(loaded)
    assert loaded.packed and set(formats.values()) == {cpu_kernels.DENSE[torch.bfloat16]}
    assert "layers.0.mlp.down_proj" in formats and "lm_head" in formats  # every linear layer, the tied head too
    ids = loaded.tokenizer.encode((ROOT / TEXTS[0]).read_text())[:300]
    expected = hf_logits(bf16_reference, ids)
    runner = make_runner(loaded, num_blocks=len(ids) // 16 + 2)
    assert runner.attention == "native"  # the whole decoder in one native call
    torch.testing.assert_close(runner.score(ids, list(range(1, len(ids) // 16 + 2))), expected, atol=5e-4, rtol=0)  # seen: 1.1e-4


def test_a_bf16_folder_under_the_fast_numerics_takes_bf16_dots_where_the_cpu_has_them(bf16_folder, bf16_reference):
    """With AVX512-BF16 its weights go in tiles and x is rounded to bf16 (one pass), as transformers and vLLM
    compute in bf16: the README gives the agreement. Elsewhere fast is the exact product."""
    loaded = load_model(bf16_folder, numerics="fast")
    dots = cpu_kernels.bf16_dots()
    assert {m.passes for m in loaded.model.modules() if isinstance(m, PackedLinear)} == {1 if dots else 0}
    tok = loaded.tokenizer
    agreement = _prefill_agreement(loaded, bf16_reference, [tok.encode((ROOT / TEXTS[0]).read_text())[:POSITIONS]])
    print(f"bf16 folder, fast numerics ({cpu_kernels.isa()}): top-1 agreement with transformers {agreement:.4f}")
    assert 0.95 <= agreement < 1.0 if dots else agreement == 1.0


def test_quantize_at_load_takes_the_integer_path_at_the_accuracy_the_readme_gives(bf16_folder, bf16_reference):
    q8 = load_model(bf16_folder, quantize="q8_0", numerics="fast")
    q4 = load_model(bf16_folder, quantize="q4_0")
    assert set(_formats(q8).values()) == {8}
    assert _formats(q4)["layers.3.self_attn.qkv_proj"] == 2 and _formats(q4)["embed_tokens"] == 8  # head kept q8_0
    assert all(m.passes == 2 for m in q8.model.modules() if isinstance(m, PackedLinear))  # tiles, integer dots
    tok = q8.tokenizer
    texts = [tok.encode((ROOT / name).read_text())[:POSITIONS] for name in TEXTS[:1]]
    q8_agree, q4_agree = _prefill_agreement(q8, bf16_reference, texts), _prefill_agreement(q4, bf16_reference, texts)
    q8_int8 = load_model(bf16_folder, quantize="q8_0", numerics="int8")  # llama.cpp's way: x in one int8 pass
    assert all(m.passes == 1 for m in q8_int8.model.modules() if isinstance(m, PackedLinear))
    q8_int8_agree = _prefill_agreement(q8_int8, bf16_reference, texts)
    print(f"--quantize, top-1 agreement with transformers over {sum(map(len, texts))} positions: "
          f"q8_0 {q8_agree:.4f} (int8 numerics {q8_int8_agree:.4f}), q4_0 {q4_agree:.4f}")
    assert 0.95 <= q8_agree < 1.0  # README: 97 % (q8_0), 96 % (q8_0, int8), 70 % (q4_0), over 2,048 positions
    assert 0.9 <= q8_int8_agree < 1.0
    assert 0.55 <= q4_agree < q8_agree


def test_a_lone_decode_takes_every_thread_for_dense_weights_and_one_fewer_for_quantized(bf16_folder, default_model):
    """--small-step-threads -1: a bf16 folder as stored reads 2 bytes a weight a token, and one thread draws less
    memory bandwidth than two; quantized weights (the GGUF, or the folder --quantize'd) leave a core to the
    pipeline's other processes. 0 and n are taken as given."""
    from worker_svc.server import small_step_threads

    dense = load_model(bf16_folder, numerics="fast")
    quantized = load_model(bf16_folder, quantize="q8_0", numerics="fast")
    assert small_step_threads(-1, 2, dense.model) == 2
    assert small_step_threads(-1, 2, default_model.model) == small_step_threads(-1, 2, quantized.model) == 1
    assert small_step_threads(-1, 1, default_model.model) == 1  # never none
    assert small_step_threads(0, 2, default_model.model) == 2 and small_step_threads(3, 2, dense.model) == 3
