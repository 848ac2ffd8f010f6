"""Sampling: truncation never leaves its support, penalties follow vLLM's formulas, seeds are per request."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyScheduler, make_runner

from conveyor.params import SamplingParams, StopParams
from worker_svc.sampling import SampleRow, apply_bias_and_min_tokens, apply_penalties, sample

VOCAB = 512


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def _draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    """Tokens drawn over ``n`` seeds, one batch of ``n`` identical rows with distinct seeds."""
    rows = [SampleRow(SamplingParams(**{**params.__dict__, "seed": s}), []) for s in range(n)]
    return {r.token_id for r in sample(logits.expand(n, -1).clone(), rows)}


def _probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def test_top_k_never_samples_outside_the_k_best():
    logits = _logits(1)
    support = set(torch.topk(logits, 5).indices.tolist())
    drawn = _draws(logits, SamplingParams(temperature=1.0, top_k=5))
    assert drawn <= support and len(drawn) > 1


def test_top_p_never_samples_outside_the_nucleus():
    logits = _logits(2)
    probs = _probs(logits)
    order = torch.argsort(probs, descending=True)
    mass = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((mass < 0.6).sum()) + 1].tolist())  # smallest prefix reaching 0.6
    drawn = _draws(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert drawn <= nucleus and len(drawn) > 1


def test_min_p_never_samples_below_the_threshold():
    logits = _logits(3)
    probs = _probs(logits, 1.5)
    support = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    drawn = _draws(logits, SamplingParams(temperature=1.5, min_p=0.1))
    assert drawn <= support and len(drawn) > 1


def test_combined_truncations_intersect():
    logits = _logits(4)
    top10 = set(torch.topk(logits, 10).indices.tolist())
    probs = _probs(logits)
    above = set(torch.nonzero(probs >= 0.05 * probs.max()).flatten().tolist())
    drawn = _draws(logits, SamplingParams(temperature=1.0, top_k=10, min_p=0.05, top_p=0.95))
    assert drawn <= top10 & above


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_distribution(temperature):
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.full((VOCAB,), -1e9)
    logits[:4] = base.log()
    n = 4000
    rows = [SampleRow(SamplingParams(temperature=temperature, seed=s), []) for s in range(n)]
    counts = torch.bincount(torch.tensor([r.token_id for r in sample(logits.expand(n, -1).clone(), rows)]), minlength=4)
    expected = base ** (1 / temperature) / (base ** (1 / temperature)).sum()
    assert torch.allclose(counts[:4].float() / n, expected, atol=0.03)


def test_greedy_takes_the_argmax_and_reports_logprobs():
    logits = _logits(5).unsqueeze(0)
    (result,) = sample(logits.clone(), [SampleRow(SamplingParams(temperature=0.0, logprobs=3), [])])
    logprobs = torch.log_softmax(logits[0], dim=-1)
    assert result.token_id == int(logits.argmax())
    assert result.logprob == pytest.approx(logprobs.max().item(), abs=1e-6)
    best = torch.topk(logprobs, 3)
    assert [t for t, _ in result.top_logprobs] == best.indices.tolist()
    assert [lp for _, lp in result.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-6)


def test_greedy_takes_the_first_of_tied_largest_logits_in_every_row():
    """As torch.argmax: ties go to the lowest token id, a row of -inf to token 0, each row on its own."""
    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 40]] = 2.0
    logits[1] = float("-inf")
    logits[2, [49, 12]] = 5.0
    rows = [SampleRow(SamplingParams(temperature=0.0), []) for _ in range(3)]
    assert [r.token_id for r in sample(logits, rows)] == [3, 0, 12]


# ---------------------------------------------------------------- penalties: exact values

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
PROMPT, OUTPUT = [0, 1], [2, 2, 4]  # token 5 appears nowhere


@pytest.mark.parametrize(
    "params, expected",
    [
        # repetition 2: tokens 0, 1 (prompt) and 2, 4 (output): positive / 2, negative * 2
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, 3.0, -4.0, 1.0]),
        # frequency 0.5: token 2 seen twice, token 4 once (prompt tokens do not count)
        (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, -0.5, 3.0, -2.5, 1.0]),
        # presence 0.3: once per token seen in the output
        (SamplingParams(presence_penalty=0.3), [2.0, -1.0, 0.2, 3.0, -2.3, 1.0]),
        # all three, in vLLM's order: repetition, then frequency, then presence
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
            [1.0, -2.0, 0.25 - 1.0 - 0.3, 3.0, -4.0 - 0.5 - 0.3, 1.0],
        ),
        # negative presence/frequency encourage repetition
        (SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.25), [2.0, -1.0, 2.0, 3.0, -0.75, 1.0]),
    ],
)
def test_penalties_change_logits_exactly_as_specified(params, expected):
    logits = torch.tensor([LOGITS])
    apply_penalties(logits, [SampleRow(params, PROMPT + OUTPUT, len(PROMPT))])
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_logit_bias_and_min_tokens():
    logits = torch.tensor([LOGITS, LOGITS, LOGITS])
    rows = [
        SampleRow(SamplingParams(logit_bias={5: 2.5, 3: -10.0}), []),
        SampleRow(SamplingParams(), [1, 1], stop=StopParams(min_tokens=3, stop_token_ids=(3,))),  # 2 < 3: token 3 masked
        SampleRow(SamplingParams(), [1, 1, 1], stop=StopParams(min_tokens=3, stop_token_ids=(3,))),  # 3 generated: allowed
    ]
    apply_bias_and_min_tokens(logits, rows)
    assert logits[0].tolist() == pytest.approx([2.0, -1.0, 0.5, -7.0, -2.0, 3.5])
    assert logits[1, 3] == float("-inf") and logits[2, 3] == 3.0


def test_penalty_steers_greedy_away_from_a_repeated_token():
    logits = torch.tensor([LOGITS])
    plain = sample(logits.clone(), [SampleRow(SamplingParams(temperature=0.0), [3])])[0].token_id
    penalised = sample(logits.clone(), [SampleRow(SamplingParams(temperature=0.0, presence_penalty=5.0), [3])])
    assert plain == 3 and penalised[0].token_id == 0


# ---------------------------------------------------------------- seeds on the real model

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def chat_prompts(default_model):
    tok = default_model.tokenizer
    texts = ["Tell me a story about a fox.", "What is 7 times 8?", "Name a fruit.", "Describe the sea."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def test_seeded_request_does_not_depend_on_its_batch_mates(default_model, chat_prompts):
    alone, _ = TinyScheduler(make_runner(default_model, seed=1)).run([chat_prompts[0]], 24, [SEEDED])
    mates = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.2, top_k=50), SamplingParams(seed=99)]
    crowded, _ = TinyScheduler(make_runner(default_model, seed=2), chunk_sizes=[5, 8]).run(
        chat_prompts, 24, [SEEDED, *mates]
    )
    assert crowded[0] == alone[0]
    other_seed, _ = TinyScheduler(make_runner(default_model)).run(
        [chat_prompts[0]], 24, [SamplingParams(**{**SEEDED.__dict__, "seed": 4321})]
    )
    assert other_seed[0] != alone[0]  # the seed, not luck, fixed the draws


def test_seeded_draws_survive_a_recompute(default_model, chat_prompts):
    """Preempted after 10 tokens and recomputed from prompt + those tokens: the rest is unchanged."""
    from worker_svc.runner import SeqChunk, StepInput

    prompt = chat_prompts[0]
    full, _ = TinyScheduler(make_runner(default_model)).run([prompt], 20, [SEEDED])
    runner = make_runner(default_model, num_blocks=64)
    tokens = prompt + full[0][:10]
    step = StepInput([SeqChunk("r", tokens, 0, new_block_ids=list(range(4)), sample=True, sampling=SEEDED,
                               num_prompt_tokens=len(prompt))])
    resumed = [runner.step(step)[0].sampled.token_id]
    while len(resumed) < 10:
        pos = len(tokens) + len(resumed) - 1
        resumed.append(runner.step(StepInput([SeqChunk("r", [resumed[-1]], pos, new_block_ids=[], sample=True)]))[0].sampled.token_id)
    assert resumed == full[0][10:]


def test_logprobs_are_computed_only_for_the_rows_that_ask():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    rows = [SampleRow(SamplingParams(temperature=0.0), []),
            SampleRow(SamplingParams(temperature=0.0, logprobs=0), []),
            SampleRow(SamplingParams(temperature=0.0, logprobs=2), [])]
    results = sample(logits.clone(), rows)
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, dim=-1).max(-1).values.tolist()
    assert results[0].logprob == 0.0 and results[0].top_logprobs == []  # not asked: no vocabulary-wide softmax
    assert results[1].logprob == pytest.approx(expected[1], abs=1e-6) and results[1].top_logprobs == []
    assert results[2].logprob == pytest.approx(expected[2], abs=1e-6) and len(results[2].top_logprobs) == 2


def test_a_rows_logprobs_do_not_depend_on_how_many_rows_ask_for_them():
    """The log-probabilities of a row asked alone are bit for bit those of the same row among others that ask (a
    vocabulary as large as the default model's, where PyTorch's reductions split a lone row over threads)."""
    generator = torch.Generator().manual_seed(5)
    differs = 0
    for _ in range(100):
        logits = torch.randn(3, 49152, generator=generator) * 3.0
        rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=2), []) for _ in range(3)]
        alone = sample(logits[:1].clone(), rows[:1])[0]
        together = sample(logits.clone(), rows)[0]
        assert alone.token_id == together.token_id
        differs += (alone.logprob, alone.top_logprobs) != (together.logprob, together.top_logprobs)
    assert differs == 0


def _truncate_by_definition(logits, top_k, top_p, min_p):
    """The filters as defined, one after another over the whole vocabulary (the oracle)."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs >= top_p
        drop[0] = False
        logits = logits.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return logits


@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.95, 0.05), (40, 0.5, 0.0), (0, 0.9, 0.0), (5, 1.0, 0.2),
                                               (1, 0.9, 0.0), (3000, 0.8, 0.01), (-1, 1.0, 0.0)])
def test_truncation_keeps_exactly_the_support_the_filters_define(top_k, top_p, min_p):
    """top-p over the top-k alone (no sort of the whole vocabulary) keeps the same tokens at the same values."""
    from worker_svc.sampling import truncate

    g = torch.Generator().manual_seed(top_k + 7)
    for scale in (0.5, 3.0, 10.0):
        row = torch.randn(5000, generator=g) * scale
        got, want = truncate(row[None], [top_k], [top_p], [min_p])[0], _truncate_by_definition(row, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_truncation_batched_over_rows_keeps_each_rows_own_support():
    """One call over rows with different settings (other k, no top-k, no truncation at all): each row keeps
    exactly the support its own settings define, whatever its neighbours ask."""
    from worker_svc.sampling import truncate

    settings = [(40, 0.95, 0.05), (0, 0.9, 0.0), (5, 1.0, 0.2), (3000, 0.8, 0.01), (-1, 1.0, 0.0), (1, 0.9, 0.0),
                (40, 1.0, 0.0), (0, 1.0, 0.1)]
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(len(settings), 5000, generator=g) * torch.tensor([0.5, 3.0, 10.0, 1.0] * 2).unsqueeze(1)
    got = truncate(rows.clone(), *map(list, zip(*settings)))
    for row, out, (top_k, top_p, min_p) in zip(rows, got, settings):
        want = _truncate_by_definition(row, top_k, top_p, min_p)
        assert torch.equal(torch.isfinite(out), torch.isfinite(want)), (top_k, top_p, min_p)
        assert torch.equal(out[torch.isfinite(out)], want[torch.isfinite(want)])


def _bitmask(vocab: int, allowed: list[int]) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t >> 5] |= 1 << (t & 31)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits as int32 words


def test_a_constraints_mask_holds_greedy_and_drawn_rows_to_its_tokens():
    """Greedy: the argmax when the constraint allows it (no mask applied), else the best allowed token. Drawn:
    only allowed tokens, whatever the noise. A row with nothing allowed reports a dead end, alone."""
    vocab = 100
    logits = torch.arange(vocab, dtype=torch.float32).repeat(4, 1)  # token 99 is every row's argmax
    rows = [SampleRow(SamplingParams(temperature=0.0), [], mask=_bitmask(vocab, [99, 3])),
            SampleRow(SamplingParams(temperature=0.0), [], mask=_bitmask(vocab, [3, 40, 64])),
            SampleRow(SamplingParams(temperature=1.0, seed=1), [], mask=_bitmask(vocab, [5, 7, 31, 32])),
            SampleRow(SamplingParams(temperature=0.0), [], mask=_bitmask(vocab, []))]
    out = sample(logits.clone(), rows)
    assert [out[0].token_id, out[1].token_id] == [99, 64] and out[2].token_id in (5, 7, 31, 32)
    assert out[3].error and "allows no token" in out[3].error and not any(o.error for o in out[:3])
    drawn = {sample(logits[2:3].clone(), [SampleRow(SamplingParams(temperature=1.0, seed=s), [],
                                                    mask=_bitmask(vocab, [5, 7, 31, 32]))])[0].token_id
             for s in range(40)}
    assert drawn <= {5, 7, 31, 32} and len(drawn) > 1
