"""Captured decode steps, checked on the CPU with a stand-in for CUDA graphs.

``ReplayOnCpu`` does what a CUDA graph does to the code around it: ``capture`` runs the step once on
the static buffers and hands back its output tensor; ``replay`` recomputes from whatever the static
buffers hold *now* into that same tensor. Code that forgot to refresh a buffer, padded wrongly or let
padding write into a real block gives other tokens than the eager step. The real CUDA graphs run in
``test_cuda.py`` where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TinyScheduler, make_runner

from worker_svc.attention import decode_size
from worker_svc.graphs import DecodeGraphs

FLEX = {"attention": "flex", "compile_attention": False}  # the graph logic under test, not the compiler (test_runner compiles)
STEPS = 6  # tokens per sequence: the first step prefills, every one after replays the graph


class ReplayOnCpu:
    captured: list[int] = []  # sizes captured, in order (reset by each test)

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        ReplayOnCpu.captured.append(self.out.shape[0])
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


@pytest.fixture
def captured():
    ReplayOnCpu.captured = []
    return ReplayOnCpu.captured


@pytest.mark.parametrize(("n", "size"), [(1, 1), (2, 2), (3, 4), (5, 8), (17, 32), (32, 32), (33, 64), (64, 64),
                                         (65, 96), (250, 256), (256, 256)])
def test_a_batch_runs_at_the_smallest_size_that_holds_it(n, size):
    assert decode_size(n) == size


def test_the_sizes_a_bounded_batch_takes():
    graphs = DecodeGraphs(None, ReplayOnCpu, 100, 4, 0, 16, torch.device("cpu"))
    assert graphs.sizes() == [1, 2, 4, 8, 16, 32, 64, 96, 128]
    with pytest.raises(ValueError, match="1 to 100 sequences, got 101"):
        graphs.run([0] * 101, [0] * 101, [0] * 101, [[0]] * 101)


def _decoding(runner, prompts, max_tokens):
    for t in runner.cache.k + runner.cache.v:
        t.zero_()  # a slot nobody writes stays zero
    scheduler = TinyScheduler(runner)
    scheduler.free_blocks.reverse()
    return scheduler.run(prompts, max_tokens, together=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_folder):
    """A tiny random Llama in PyTorch (what a GPU runs): the bookkeeping around the graphs is under test, and the
    default model's size would only slow it (test_cuda.py captures the default model's graphs on a GPU)."""
    from worker_svc.loader import load_model

    return load_model(tiny_folder, attention="sdpa")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 4, 5, 7, 5)]


@pytest.fixture(scope="module")
def eager(tiny_model, prompts):
    """The same steps with no graph: tokens and log-probabilities, and the cache they leave."""
    runner = make_runner(tiny_model, num_blocks=64, **FLEX)
    return _decoding(runner, prompts[:3], STEPS), runner.cache


def test_replayed_decodes_equal_the_eager_steps(tiny_model, prompts, eager, captured):
    """Three sequences decode in the graph of 4 (one padding row): every step replays the one graph with new
    ids, positions, slots and tables, and the tokens and cache contents are the eager steps'."""
    runner = make_runner(tiny_model, num_blocks=64, graphs=ReplayOnCpu, max_graph_batch=8, **FLEX)
    tokens, logprobs = _decoding(runner, prompts[:3], STEPS)
    (want_tokens, want_logprobs), want_cache = eager
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-4)  # 4 rows multiply in another order than 3
    assert captured == [4]  # captured once, replayed for every decode step after it
    for layer in range(len(want_cache.k)):  # padding wrote its K/V to the scratch block only
        torch.testing.assert_close(runner.cache.k[layer][:64], want_cache.k[layer][:64], atol=1e-4, rtol=0)
        torch.testing.assert_close(runner.cache.v[layer][:64], want_cache.v[layer][:64], atol=1e-4, rtol=0)


def test_each_size_is_captured_once_and_big_batches_run_eager(tiny_model, prompts, captured):
    """Batches of 5, then 2, then 1 (sequences dropped as they go): 5 is past --max-graph-batch 4 and runs
    eager; the graphs of 2 and 1 are captured once each; the tokens are each sequence's eager tokens."""
    runner = make_runner(tiny_model, num_blocks=64, graphs=ReplayOnCpu, max_graph_batch=4, **FLEX)
    reference = make_runner(tiny_model, num_blocks=64, **FLEX)
    from worker_svc.runner import SeqChunk, StepInput
    from conveyor.params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    out = {}
    for r in (runner, reference):
        step = r.step(StepInput([SeqChunk(f"s{i}", p, 0, new_block_ids=[10 + i], sample=True, sampling=greedy,
                                          num_prompt_tokens=len(p)) for i, p in enumerate(prompts)]))
        tokens = {x.seq_id: [x.sampled.token_id] for x in step}
        live = list(tokens)
        for n in (5, 5, 2, 2, 2, 1, 1):
            dropped, live = live[n:], live[:n]
            chunks = [SeqChunk(s, [], len(prompts[int(s[1:])]) + len(tokens[s]) - 1, new_block_ids=[], sample=True,
                               decode_last=True)
                      for s in live]
            for x in r.step(StepInput(chunks, free_seq_ids=dropped)):
                tokens[x.seq_id].append(x.sampled.token_id)
        out[r] = tokens
    assert out[runner] == out[reference]
    assert captured == [2, 1]
    assert sorted(runner.graphs.graphs) == [1, 2]


def test_capturing_every_size_up_front_writes_only_the_scratch_block(tiny_model, prompts, eager, captured):
    """What the worker does before it serves: every size captured largest first, on padding alone; the real
    blocks stay untouched, and the steps that follow replay without capturing."""
    runner = make_runner(tiny_model, num_blocks=64, graphs=ReplayOnCpu, max_graph_batch=5, **FLEX)
    for t in runner.cache.k + runner.cache.v:
        t.zero_()
    with torch.inference_mode():
        runner.graphs.capture_all()
    assert captured == [8, 4, 2, 1]
    assert all(not t[:64].any() for t in runner.cache.k + runner.cache.v)
    tokens, _ = _decoding(runner, prompts[:3], STEPS)
    assert tokens == eager[0][0]
    assert captured == [8, 4, 2, 1]
