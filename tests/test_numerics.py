"""The worker's ``--numerics fast``: integer dot products with activations quantized to int8 blocks.

Checked two ways: each block format's product against the exact one (random weights, every type),
and the whole default model decoding teacher-forced, one token at a time (the decode path the
fast kernel serves), against transformers: top-1 agreement and the log-probability error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT, hf_logits, make_runner

from worker_svc import cpu_kernels
from worker_svc.loader import load_model
from worker_svc.packed import PackedLinear
from worker_svc.runner import SeqChunk, StepInput
from worker_svc.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available()[0], reason="CPU kernels need x86-64 AVX2 and cc")

# Varied text from this repository: prose and tables, C, Python, and test strings in Korean, Chinese, emoji.
TEXTS = ["README.md", "worker_svc/cpu_kernels/qgemm.c", "conveyor/state.py", "tests/test_detokenizer.py"]
POSITIONS = 512  # per text: 2,044 predictions in all


def _random_blocks(qtype: int, rows: int, k: int, seed: int) -> torch.Tensor:
    """(rows, k / 32 * block bytes) uint8: random quants with plausible fp16 scales (and mins)."""
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
    return cpu_kernels.kernel_layout(torch.from_numpy(np.ascontiguousarray(blocks.reshape(rows, -1))), qtype, k)


@pytest.mark.parametrize("qtype", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2])
def test_integer_dots_match_the_exact_product(qtype, rows):
    n, k = 200, 1536
    weights = _random_blocks(qtype, n, k, seed=qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    dense = cpu_kernels.dequantize_rows(weights, qtype, k, torch.arange(n))
    exact = x @ dense.T
    assert torch.allclose(cpu_kernels.qgemm(x, weights, qtype, n), exact, rtol=1e-4, atol=1e-3)

    def error(passes: int) -> float:
        return float((cpu_kernels.qgemm(x, weights, qtype, n, passes) - exact).norm() / exact.norm())

    assert 1e-4 < error(1) < 2e-2  # one int8 pass: x rounded to 8 bits per block
    assert 0 < error(2) < 2e-4  # the fast mode's two passes: ~15 bits


@pytest.fixture(scope="module")
def fast_model():
    return load_model("default", numerics="fast")


def _teacher_forced(loaded, texts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Feed each text one token per step (all texts in one batch); the greedy token and its log-probability
    after every prefix."""
    runner = make_runner(loaded, num_blocks=len(texts) * (POSITIONS // 16 + 1))
    params = SamplingParams(temperature=0.0, top_logprobs=1)
    per = POSITIONS // 16 + 1
    preds, logprobs = [[] for _ in texts], [[] for _ in texts]
    for pos in range(POSITIONS - 1):
        chunks = [SeqChunk(f"t{i}", [ids[pos]], pos, list(range(i * per, (i + 1) * per)) if pos == 0 else [], True,
                           params if pos == 0 else None, 1) for i, ids in enumerate(texts)]
        for result in runner.step(StepInput(chunks)):
            i = int(result.seq_id[1:])
            preds[i].append(result.sampled.token_id)
            logprobs[i].append(result.sampled.logprob)
    return preds, logprobs


def test_fast_numerics_agree_with_transformers_teacher_forced(fast_model, hf_model):
    linears = [m for m in fast_model.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.passes == 2 for m in linears)
    tok = fast_model.tokenizer
    texts = [tok.encode((ROOT / name).read_text())[:POSITIONS] for name in TEXTS]
    agree, total, errors = 0, 0, []
    for pair in (texts[:2], texts[2:]):  # 2 rows a step: the fast kernel's decode batch
        assert len(pair) <= cpu_kernels.fast_max_rows()
        preds, logprobs = _teacher_forced(fast_model, pair)
        for ids, pred, lp in zip(pair, preds, logprobs):
            reference = torch.log_softmax(hf_logits(hf_model, ids[:-1]), dim=-1)
            agree += sum(int(a == b) for a, b in zip(reference.argmax(-1).tolist(), pred))
            total += len(pred)
            errors += [abs(reference[j, t].item() - lp[j]) for j, t in enumerate(pred)]
    errors = torch.tensor(errors)
    print(f"fast numerics, teacher-forced: top-1 agreement {agree}/{total} = {agree / total:.4f}; "
          f"|log p error| mean {errors.mean():.5f}, max {errors.max():.5f}")
    assert total >= 2000 and agree / total >= 0.98
    assert 0 < errors.max() < 0.05 and errors.mean() < 0.005  # not the exact path, and close to it
