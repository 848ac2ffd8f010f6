"""Engine steps on the real default model: batching, chunking and paging never change the tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyScheduler, hf_logits, make_runner

from conveyor.params import SamplingParams
from worker_svc import cpu_kernels
from worker_svc.runner import InvalidStep, SeqChunk, StepInput

MAX_TOKENS = 40
CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "안녕하세요! 자기소개를 해 주세요.",
    "List three colors.",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish and German.",
]
RAW = ["Once upon a time, in a land far away,", "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    return chats + [tok.encode(r) for r in RAW]


@pytest.fixture(scope="module")
def alone(default_model, prompts):
    """The reference: each prompt on its own, whole prompt in one step, 16-token blocks."""
    return TinyScheduler(make_runner(default_model)).run(prompts, MAX_TOKENS, together=False)


def test_alone_matches_transformers_greedy(alone, prompts, hf_model):
    """Teacher-forced: at every generated position, our token is transformers' argmax (ties
    within 1e-3 excepted) and our logprob is transformers' log-softmax of it."""
    tokens, logprobs = alone
    for prompt, out, lps in zip(prompts, tokens, logprobs):
        assert len(out) == MAX_TOKENS
        logits = hf_logits(hf_model, prompt + out[:-1])[len(prompt) - 1 :]
        ref_lp = torch.log_softmax(logits, dim=-1)
        for i, token in enumerate(out):
            assert logits[i, token] >= logits[i].max() - 1e-3, f"token {i} is not the greedy choice"
            assert lps[i] == pytest.approx(ref_lp[i, token].item(), abs=1e-3)


def test_all_together_in_one_batch(default_model, prompts, alone):
    tokens, _ = TinyScheduler(make_runner(default_model)).run(prompts, MAX_TOKENS, together=True)
    assert tokens == alone[0]


def test_prompts_in_odd_sized_chunks_mixed_with_decodes(default_model, prompts, alone):
    # Different chunk sizes per sequence and turn: prefill chunks and decodes share steps.
    scheduler = TinyScheduler(make_runner(default_model), chunk_sizes=[7, 3, 11, 5, 13])
    tokens, _ = scheduler.run(prompts, MAX_TOKENS, together=True)
    assert tokens == alone[0]


def test_small_blocks_spanning_many_blocks(default_model, prompts, alone):
    runner = make_runner(default_model, block_size=2, num_blocks=4096)
    scheduler = TinyScheduler(runner, chunk_sizes=[5, 9])
    scheduler.free_blocks.reverse()  # hand out blocks in descending order: tables are not contiguous
    tokens, _ = scheduler.run(prompts, MAX_TOKENS, together=True)
    assert tokens == alone[0]


@pytest.mark.skipif(not cpu_kernels.available()[0], reason="no CPU kernels here (the native decoder stack)")
def test_timing_the_native_stack_by_part_times_every_part_and_changes_no_token(default_model, prompts, alone):
    """``bench/worker_step.py --parts``: while on, the timers around each part of the native decoder stack
    (``cpu_kernels.decoder_profile``) count time in every part, off they count none, and the tokens are those
    of a run without them."""
    try:
        cpu_kernels.decoder_profile(True)
        tokens, _ = TinyScheduler(make_runner(default_model)).run(prompts[:2], MAX_TOKENS, together=True)
        on = cpu_kernels.decoder_profile(False)
        TinyScheduler(make_runner(default_model)).run(prompts[:1], 2, together=True)
        off = cpu_kernels.decoder_profile(False)
    finally:
        cpu_kernels.decoder_profile(False)
    assert tokens == alone[0][:2]
    assert set(on) == set(cpu_kernels.DECODER_PARTS) and all(seconds > 0 for seconds in on.values()), on
    assert not any(off.values()), off


def test_pytorch_path_generates_the_same_tokens(dense_model, prompts, alone):
    """The dense PyTorch path (dense weights, each context gathered for SDPA: a CPU's off the kernels), batched
    and chunked."""
    scheduler = TinyScheduler(make_runner(dense_model, block_size=4, num_blocks=2048), chunk_sizes=[6, 17])
    tokens, _ = scheduler.run(prompts[:4], 24, together=True)
    assert tokens == [t[:24] for t in alone[0][:4]]


# The GPU's paged flex attention, unfused: the masks, tables and scratch handling are one code path whether
# torch.compile fuses them or not. The fused one is checked against transformers in test_model_vs_hf.py (the
# default model and the tiny folders, through the CPU's compiler) and in decode on a GPU (test_cuda.py, run by
# bench/gpu_check.sh); compiling it here for every step shape of a decode run took ~80 s of the suite when
# the compiler's cache was cold.
FLEX_EAGER = {"attention": "flex", "compile_attention": False}


NUM_BLOCKS = 48  # 4-token blocks: the three prompts and their 12 tokens fit (flex attention spans the whole cache)


def test_flex_path_generates_the_same_tokens(dense_model, prompts, alone):
    """Paged flex attention on the default model, driven by the runner: prompts in odd chunks sharing steps with
    decodes, tables running backwards through the cache; the tokens are the reference's and the log-probabilities
    SDPA's. (Shared prefix blocks and never-written memory: tests/test_attention_backends.py.)"""
    assert sum(-(-(len(p) + 12) // 4) for p in prompts[:3]) <= NUM_BLOCKS
    runs = {}
    for name, options in (("flex", FLEX_EAGER), ("sdpa", {"attention": "sdpa"})):
        scheduler = TinyScheduler(make_runner(dense_model, block_size=4, num_blocks=NUM_BLOCKS, **options),
                                  chunk_sizes=[6, 17])
        scheduler.free_blocks.reverse()
        runs[name] = scheduler.run(prompts[:3], 12, together=True)
    assert runs["flex"][0] == [t[:12] for t in alone[0][:3]]
    for flex, sdpa in zip(runs["flex"][1], runs["sdpa"][1]):
        assert flex == pytest.approx(sdpa, abs=1e-4)


# ---------------------------------------------------------------- malformed steps


def _start(runner, seq_id, prompt, blocks):
    out = runner.step(StepInput([SeqChunk(seq_id, prompt, 0, new_block_ids=blocks, sample=True,
                                          sampling=SamplingParams(temperature=0.0), num_prompt_tokens=len(prompt))]))
    return out[0].sampled.token_id


def _continue(runner, seq_id, token, pos, steps):
    tokens = []
    for i in range(steps):
        token = runner.step(StepInput([SeqChunk(seq_id, [token], pos + i, new_block_ids=[], sample=True)]))[0].sampled.token_id
        tokens.append(token)
    return tokens


BAD_STEPS = {
    "block id out of range": (SeqChunk("x", [1, 2], 0, new_block_ids=[10**6], sample=True, sampling=SamplingParams(),
                                       num_prompt_tokens=2), "block id 1000000"),
    "position past max model length": (
        SeqChunk("x", [7] * 8193, 0, new_block_ids=[0], sample=True, sampling=SamplingParams(), num_prompt_tokens=8193), "position 8192 is past the max model length 8192"
    ),
    "unknown sequence": (SeqChunk("nobody", [1], 5, new_block_ids=[], sample=True), "unknown sequence"),
    "token outside vocabulary": (SeqChunk("x", [49152], 0, new_block_ids=[0], sample=True, sampling=SamplingParams(),
                                          num_prompt_tokens=1), "outside the vocabulary"),
    "no sampling parameters": (SeqChunk("x", [1], 0, new_block_ids=[0], sample=True, sampling=None, num_prompt_tokens=1), "sampling parameters"),
    "too few blocks": (SeqChunk("x", list(range(40)), 0, new_block_ids=[0], sample=True, sampling=SamplingParams(),
                                num_prompt_tokens=40), "blocks hold 16 tokens"),
    "wrong start position": (SeqChunk("a", [5], 3, new_block_ids=[], sample=True), "start_pos 3"),
    "empty chunk": (SeqChunk("x", [], 0, new_block_ids=[0], sample=True, sampling=SamplingParams(), num_prompt_tokens=1), "token_ids is empty"),
}


@pytest.mark.parametrize("name", list(BAD_STEPS))
def test_malformed_step_is_rejected_and_leaves_others_intact(default_model, prompts, name):
    bad, message = BAD_STEPS[name]
    runner = make_runner(default_model, num_blocks=64)
    reference = make_runner(default_model, num_blocks=64)
    prompt = prompts[0]
    first = _start(runner, "a", prompt, [1, 2, 3, 4, 5])
    assert first == _start(reference, "a", prompt, [1, 2, 3, 4, 5])
    pos = len(prompt)
    good = SeqChunk("a", [first], pos, new_block_ids=[], sample=True)  # a valid chunk in the same step must not run either
    with pytest.raises(InvalidStep, match=message):
        runner.step(StepInput([good, bad] if bad.seq_id != "a" else [bad]))
    assert _continue(runner, "a", first, pos, 8) == _continue(reference, "a", first, pos, 8)


def test_a_step_that_fails_in_its_forward_or_its_staging_leaves_every_sequence_as_it_was(default_model, prompts, monkeypatch):
    runner = make_runner(default_model, num_blocks=64)
    reference = make_runner(default_model, num_blocks=64)
    first = _start(runner, "a", prompts[0], [1, 2, 3, 4, 5])
    assert first == _start(reference, "a", prompts[0], [1, 2, 3, 4, 5])
    pos = len(prompts[0])
    run = runner.backend.run

    def broken(batch):  # the injected fault: the forward itself fails, after the step was staged
        raise RuntimeError("injected fault in the forward")

    def step():
        return runner.step(StepInput([SeqChunk("a", [first], pos, new_block_ids=[6], sample=True),
                                      SeqChunk("new", [1, 2], 0, new_block_ids=[7], sample=True,
                                               sampling=SamplingParams(), num_prompt_tokens=2)]))

    monkeypatch.setattr(runner.backend, "run", broken)
    with pytest.raises(RuntimeError, match="injected fault"):
        step()
    monkeypatch.setattr(runner.backend, "run", run)
    staged = runner._staged_state

    def staging_breaks(c, undo):  # the injected fault: "a" is staged, then the registration's state fails to build
        if c.seq_id == "new":
            raise RuntimeError("injected fault in staging")
        return staged(c, undo)

    monkeypatch.setattr(runner, "_staged_state", staging_breaks)
    with pytest.raises(RuntimeError, match="injected fault"):
        step()
    monkeypatch.setattr(runner, "_staged_state", staged)
    assert "new" not in runner.seqs  # a registration joins only with a step that succeeds
    table = runner.seqs["a"].block_table
    assert table.ids == table.row().tolist() == [1, 2, 3, 4, 5] and len(runner.seqs["a"].tokens) == pos
    assert _continue(runner, "a", first, pos, 8) == _continue(reference, "a", first, pos, 8)


def test_duplicate_sequence_in_one_step_is_rejected(default_model):
    runner = make_runner(default_model, num_blocks=8)
    chunk = SeqChunk("d", [1, 2], 0, new_block_ids=[0], sample=True, sampling=SamplingParams(), num_prompt_tokens=2)
    with pytest.raises(InvalidStep, match="twice"):
        runner.step(StepInput([chunk, chunk]))


def test_freed_sequence_is_forgotten_and_its_blocks_reusable(default_model, prompts, alone):
    runner = make_runner(default_model, num_blocks=16)
    _start(runner, "a", prompts[1], list(range(8)))
    runner.step(StepInput([], free_seq_ids=["a"]))
    with pytest.raises(InvalidStep, match="unknown sequence"):
        runner.step(StepInput([SeqChunk("a", [1], len(prompts[1]), new_block_ids=[], sample=True)]))
    # the same blocks, now owned by another sequence, give that sequence's own answer
    first = _start(runner, "b", prompts[0], list(range(8)))
    assert [first, *_continue(runner, "b", first, len(prompts[0]), 5)] == alone[0][0][:6]


def test_decode_last_feeds_the_token_sampled_in_the_previous_step(default_model, prompts, alone):
    runner = make_runner(default_model, num_blocks=16)
    prompt = prompts[0]
    tokens = [_start(runner, "a", prompt, list(range(8)))]
    for i in range(7):  # the scheduler never tells the worker which token it sampled
        out = runner.step(StepInput([SeqChunk("a", [], len(prompt) + i, new_block_ids=[], sample=True, decode_last=True)]))
        tokens.append(out[0].sampled.token_id)
    assert tokens == alone[0][0][:8]
    runner.step(StepInput([SeqChunk("b", prompt, 0, new_block_ids=[9, 10, 11], sample=False, sampling=SamplingParams(),
                                    num_prompt_tokens=len(prompt))]))
    with pytest.raises(InvalidStep, match="nothing was sampled"):
        runner.step(StepInput([SeqChunk("b", [], len(prompt), new_block_ids=[], sample=True, decode_last=True)]))


def test_a_step_of_one_token_runs_on_the_small_step_threads(default_model, prompts, alone):
    """--small-step-threads: a lone stream's decode leaves cores to the pipeline; bigger steps take all
    threads again. The tokens are the same either way."""
    before = torch.get_num_threads()
    try:
        runner = make_runner(default_model, num_blocks=16, threads=(2, 1))
        prompt = prompts[0]
        tokens = [_start(runner, "a", prompt, list(range(8)))]
        assert torch.get_num_threads() == 2  # the prompt: many tokens
        out = runner.step(StepInput([SeqChunk("a", [], len(prompt), new_block_ids=[], sample=True, decode_last=True)]))
        tokens.append(out[0].sampled.token_id)
        assert torch.get_num_threads() == 1
        _start(runner, "b", prompts[1], list(range(8, 16)))
        assert torch.get_num_threads() == 2
        tokens.append(runner.step(StepInput([SeqChunk("a", [], len(prompt) + 1, new_block_ids=[], sample=True,
                                                      decode_last=True)]))[0]
                      .sampled.token_id)
        assert torch.get_num_threads() == 1
        assert tokens == alone[0][0][:3]
    finally:
        torch.set_num_threads(before)
