"""Prompt-lookup speculation in the worker: drafts from a sequence's own n-grams, verified in the same forward,
and the tokens emitted exactly those of plain decoding (greedy and seeded, under the exact numerics)."""

from __future__ import annotations

import pytest
from helpers import TinyScheduler, make_runner

from conveyor.params import SamplingParams
from worker_svc.speculative import NgramIndex

MAX_TOKENS = 32
PASSAGE = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump.")


def test_the_latest_longest_match_proposes_what_followed_it():
    index = NgramIndex(min_n=2, max_n=3)
    history = [1, 2, 3, 9, 1, 2, 4, 7, 7, 5, 2, 3]
    # suffix (5, 2, 3) never came before; (2, 3) did, followed by 9, 1, 2
    assert index.propose(history, 3) == [9, 1, 2]
    history += [8, 1, 2]  # (8, 1, 2) is new; (1, 2) came twice: the latest, at 4, was followed by 4, 7
    assert index.propose(history, 2) == [4, 7]
    assert index.propose(history + [6], 4) == []  # (2, 6) never came
    fresh = NgramIndex(min_n=2, max_n=3)
    assert fresh.propose(history, 2) == [4, 7]  # built incrementally or at once: the same index


def test_a_draft_never_reaches_past_the_history():
    assert NgramIndex(min_n=1, max_n=2).propose([5, 6, 5], 4) == [6, 5]  # (5,) was followed by 6, 5, then nothing


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    asks = [f"Repeat this text exactly: {PASSAGE}", f"Here is a sentence: {PASSAGE} Write it again, word for word.",
            "Count from 1 to 30, separated by commas."]  # the last repeats nothing: it drafts little or nothing
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}])) for a in asks]
    return chats + [tok.encode(PASSAGE + " " + PASSAGE[:40])]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, logprobs=0),
                                      SamplingParams(temperature=0.8, seed=7, top_k=0, top_p=1.0, min_p=0.0,
                                                     logprobs=0)],
                         ids=["greedy", "seeded"])
def test_speculation_emits_exactly_the_tokens_of_plain_decoding(default_model, prompts, sampling):
    """Every sequence drafts up to 4 tokens per decode (as far as its blocks reach), batched with the others:
    the tokens and logprobs are plain decoding's, and drafts were confirmed (so the verify path ran)."""
    params = [sampling] * len(prompts)
    plain = TinyScheduler(make_runner(default_model)).run(prompts, MAX_TOKENS, params)
    speculating = TinyScheduler(make_runner(default_model))
    tokens, logprobs = speculating.run(prompts, MAX_TOKENS, params, max_drafts=4)
    assert tokens == plain[0]
    for ours, theirs in zip(logprobs, plain[1]):
        assert ours == pytest.approx(theirs, abs=1e-4)
    print(f"{speculating.accepted} of {len(prompts) * MAX_TOKENS} tokens came from confirmed drafts")
    assert speculating.accepted >= 8


def test_drafts_stop_at_the_blocks_the_sequence_holds(default_model, prompts):
    """Decodes that may draft 4 tokens but hold blocks (of 4 tokens) only for the token they compute draft at
    most what their last block has room for (never KV past their table), and emit plain decoding's tokens."""
    plain = TinyScheduler(make_runner(default_model, block_size=4)).run(prompts[:1], 20)
    runner = make_runner(default_model, block_size=4)
    drafted, step = [], runner.step

    def step_drafting(batch):
        for c in batch.chunks:
            c.max_drafts = 4 if c.sample and c.start_pos >= c.num_prompt_tokens else 0
        results = step(batch)
        drafted.extend(r.drafted for r in results)
        return results

    runner.step = step_drafting
    tokens, _ = TinyScheduler(runner).run(prompts[:1], 20)  # blocks reserved for no draft
    assert tokens == plain[0]
    assert 0 < max(drafted) <= 3
