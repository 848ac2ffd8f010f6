"""Prompt-lookup speculation in the worker: drafts from a sequence's own n-grams, verified in the same forward,
and the tokens emitted exactly those of plain decoding (greedy and seeded, under the exact numerics)."""

from __future__ import annotations

import random
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import KV_BLOCK_BYTES, TinyScheduler, make_runner, scrape, start_stack, value

from conveyor.bench import speculation_prompts
from conveyor.client import Client
from conveyor.params import RequestParams, SamplingParams, Structured
from conveyor.state import RequestStore
from conveyor.structured import Constraints
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policy import Scheduler, best_drafts, extend_cost
from scheduler_svc.request import Request
from worker_svc.runner import SeqChunk, StepInput
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


def test_constrained_speculation_emits_exactly_the_tokens_of_plain_decoding(default_model, prompts):
    """A constrained sequence drafts too: row r of its verify chunk is masked by its grammar after the first r
    drafts. Under a regex the passage fits, and one without its capitals and punctuation (so drafts copied from
    the prompt are refused by the grammar, not only by the model), each of bounded length (the rows near its end
    allow less than the rows before), the tokens are plain constrained decoding's and drafts were confirmed."""
    tok = default_model.tokenizer

    def runner():
        return make_runner(default_model, constraints=Constraints(tok.tokenizer.to_str(), default_model.config.vocab_size,
                                                                  tok.eos_token_ids))

    # both end within the 32 tokens (after 60 and 80 characters): a row's mask depends on the drafts before it
    for spec in ("[A-Za-z .,]{1,60}", "[a-z ]{1,80}"):
        structured = [Structured("regex", spec)] * 2
        plain, _ = TinyScheduler(runner()).run(prompts[:2], MAX_TOKENS, structured=structured)
        speculating = TinyScheduler(runner())
        tokens, _ = speculating.run(prompts[:2], MAX_TOKENS, max_drafts=4, structured=structured)
        assert tokens == plain, spec
        assert speculating.accepted >= 4, spec


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


def test_the_verify_cost_is_measured_on_scratch_and_leaves_nothing_behind(default_model, prompts):
    """The start-up measurement: a decode verifying none costs 1, more drafts never less, as many entries as asked;
    the scratch sequence is forgotten (the runner then decodes as a fresh one); it refuses to run over sequences
    it would overwrite, and a cache too small to measure in gives no table."""
    runner = make_runner(default_model, num_blocks=16)
    cost = runner.verify_cost(4)
    assert len(cost) == 5 and cost[0] == 1.0 and cost == sorted(cost) and cost[-1] < 10
    assert not runner.seqs
    assert TinyScheduler(runner).run(prompts[:1], 8)[0] == TinyScheduler(make_runner(default_model)).run(prompts[:1], 8)[0]
    runner.step(StepInput([SeqChunk("held", prompts[0], 0, new_block_ids=list(range(8)), sampling=SamplingParams(),
                                    num_prompt_tokens=len(prompts[0]))]))
    with pytest.raises(RuntimeError, match="free cache"):
        runner.verify_cost(4)
    assert make_runner(default_model, num_blocks=2).verify_cost(4) == []


# ---------------------------------------------------------------- the scheduler's side (plain Python)

EOS = 2


def _request(rid: str, prompt_len: int, max_tokens: int = 100, **params):
    p = RequestParams.of(max_tokens=max_tokens, **params)
    return Request(rid, list(range(10, 10 + prompt_len)), p, p.stop.stop_ids((EOS,)), arrival=0.0)


def _scheduler(num_blocks=64, block_size=4, max_len=1000, spec_tokens=4, seqs=8, verify_cost=None):
    return Scheduler(BlockManager(num_blocks, block_size, False), max_len, 64, seqs, 2000, spec_tokens=spec_tokens,
                     verify_cost=verify_cost)


def _answer(s, plan, tokens: list[int]):
    """Answer every sampling chunk of ``plan`` with ``tokens``: the first sampled, the rest confirmed drafts
    (as many as the chunk allowed)."""
    sampled = {c.request.request_id: (tokens[0], None) for c in plan.chunks if c.sample}
    accepted = {c.request.request_id: [(t, None) for t in tokens[1 : 1 + c.max_drafts]] for c in plan.chunks if c.sample}
    drafted = {c.request.request_id: c.max_drafts for c in plan.chunks if c.sample}
    return s.update(plan, sampled, accepted=accepted, drafted=drafted)


@pytest.mark.parametrize("case", ["max_tokens", "eos", "stop_token", "max_model_len"])
def test_a_stop_inside_an_accepted_run_drops_what_follows(case):
    """Every decode has all 4 drafts confirmed; the request ends exactly where plain decoding would have:
    max_tokens=7 gives exactly 7 tokens, an eos or a stop token id ends it there, and the max model length caps
    it, and nothing after the stop is emitted."""
    s = _scheduler(max_len=12 if case == "max_model_len" else 1000)
    options = {"stop_token_ids": (50,)} if case == "stop_token" else {}
    s.add(_request("r", 3, max_tokens=7 if case == "max_tokens" else 100, **options))
    _answer(s, s.schedule(), [7])  # the prompt: one token
    run = {"eos": [8, EOS, 9, 9, 9], "stop_token": [8, 9, 50, 9, 9]}.get(case, [8, 9, 9, 9, 9])
    outputs, allowed = [], []
    while "r" in s.requests:
        plan = s.schedule()
        allowed += [c.max_drafts for c in plan.chunks]
        outputs += _answer(s, plan, run)
    assert allowed[0] == 4  # the first decode may draft all 4
    emitted = [7] + [t for o in outputs for t in o.token_ids]
    want = {"max_tokens": 7, "eos": 3, "stop_token": 4, "max_model_len": 12 - 3}[case]
    assert len(emitted) == want
    assert emitted[1:] == (run * 3)[: want - 1]
    assert outputs[-1].finish_reason == ("length" if case in ("max_tokens", "max_model_len") else "stop")
    assert s.blocks.num_used == 0


class _Worker:
    """The worker's bookkeeping of positions and blocks, as ``ModelRunner`` keeps it, with drafts confirmed at
    random instead of by a model: it fails on any chunk whose position or blocks the runner would refuse."""

    def __init__(self, block_size: int, max_len: int, rng):
        self.block_size, self.max_len, self.rng = block_size, max_len, rng
        self.seqs: dict[str, dict] = {}

    def step(self, plan):
        if plan.free_all:
            self.seqs.clear()
        for rid in plan.free_ids:
            self.seqs.pop(rid, None)
        sampled, accepted, drafted = {}, {}, {}
        for c in plan.chunks:
            rid = c.request.request_id
            if c.registers:
                assert c.start_pos == len(c.cached_ids)
                self.seqs[rid] = {"computed": c.start_pos, "table": [], "last": None, "accepted": 0}
            seq = self.seqs[rid]
            start, n = c.start_pos, len(c.token_ids)
            if c.decode_last:
                assert seq["last"] is not None and n == 0
                start, n = start + seq["accepted"], 1
            assert start == seq["computed"], (rid, start, seq)
            seq["table"] += c.new_blocks
            end = start + n
            capacity = len(seq["table"]) * self.block_size
            assert end <= min(capacity, self.max_len), (rid, end, capacity)
            seq.update(computed=end, last=None, accepted=0)
            if c.sample:
                room = min(c.max_drafts, capacity - end, self.max_len - end) if n == 1 else 0
                drafts = self.rng.randint(0, max(room, 0))
                kept = self.rng.randint(0, drafts)
                tokens = [self.rng.choice([7, 8, 9, 9, 9, EOS]) if self.rng.random() < 0.05 else 9
                          for _ in range(kept + 1)]
                seq.update(computed=end + kept, last=tokens[-1], accepted=kept)
                sampled[rid] = (tokens[0], None)
                accepted[rid] = [(t, None) for t in tokens[1:]]
                drafted[rid] = drafts
        return sampled, accepted, drafted


def test_block_accounting_under_random_acceptance_aborts_and_preemptions():
    """1,000 requests through a small cache, two steps in flight as the engine keeps them, drafts confirmed at
    random, some requests aborted: every chunk is one the worker accepts (positions after the confirmed drafts,
    blocks that reach), no request holds more than one block above what its scheduled tokens need, and every
    block is back at the end."""
    rng = random.Random(0)
    block_size, max_len = 16, 200
    s = _scheduler(num_blocks=40, block_size=block_size, max_len=max_len, seqs=16)
    s.spec_max_batch = 16
    worker = _Worker(block_size, max_len, rng)
    added, in_flight, steps = 0, deque(), 0
    while added < 1000 or s.has_work or in_flight:
        steps += 1
        while added < 1000 and len(s.waiting) < 8:
            s.add(_request(f"r{added}", rng.randint(1, 60), max_tokens=rng.randint(1, 40)))
            added += 1
        if s.running and rng.random() < 0.02:
            s.abort(rng.choice(s.running).request_id)
        plan = s.schedule() if len(in_flight) < 2 else None
        if plan is not None and not plan.empty:
            in_flight.append((plan, worker.step(plan)))
            for r in s.running:
                held = len(s.blocks.table(r.request_id))
                assert held <= -(-r.num_computed // block_size) + 1, (r.request_id, held, r.num_computed)
            if len(in_flight) < 2:
                continue
        if in_flight:
            done, (sampled, accepted, drafted) = in_flight.popleft()
            s.update(done, sampled, accepted=accepted, drafted=drafted)
    assert s.counters.finished == 1000 and s.counters.preemptions > 0 and s.counters.accepted > 1000
    s.schedule()  # the last frees reach the worker
    assert s.blocks.num_free == s.blocks.num_blocks and not s.requests


# ---------------------------------------------------------------- served: the real stack, speculating

SERVED_TOKENS = 40
ASK = f"Repeat this text exactly: {PASSAGE}"


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    # 32 blocks of 16 tokens: 16 streams of ~60-150 tokens cannot all hold theirs, so requests are preempted and
    # recomputed mid-run (the prefix cache is on, as by default)
    s = start_stack(tmp_path_factory.mktemp("speculative"), kv_cache_bytes=32 * KV_BLOCK_BYTES, speculative="ngram",
                    spec_max_batch=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def spec_client(spec_stack):
    with Client(spec_stack.endpoint, timeout=300) as c:
        yield c


MIXED = [p for group in zip(*speculation_prompts(7).values()) for p in group][:32]  # the five kinds in turn
MIXED_TOKENS = 16
N_SEEDED = 5  # of them asked seeded, with n=4 (one of each kind)


def _drafted(stack) -> float:
    return value(scrape(stack.child("scheduler").metrics), "conveyor_spec_draft_tokens_total")


def test_speculation_on_and_off_give_the_same_tokens_for_mixed_prompts(spec_stack, spec_client):
    """32 prompts of the five kinds (``conveyor.bench.speculation_prompts``), each with speculation and with the
    request's opt-out, 16 streams at once in a cache too small for them all (preemptions; two steps in flight,
    decode_last after confirmed drafts), the prefix cache on: greedy through the SDK, the opted-out ones drafting
    nothing, Redis holding exactly the tokens emitted; then 8 of them seeded T=0.8 with n=4 through the openai
    SDK, both kinds of request at once. Every choice has the same tokens (and logprobs) either way, and drafts
    were confirmed."""
    import openai

    store = RequestStore.from_url(spec_stack.redis_url)

    def greedy(speculative: bool) -> list[list[int]]:
        def ask(job):
            i, text = job
            rid = f"greedy-{speculative}-{i}"
            tokens = spec_client.chat([{"role": "user", "content": text}], temperature=0.0, max_tokens=MIXED_TOKENS,
                                      speculative=speculative, request_id=rid).token_ids
            assert store.find(rid).output_ids == tokens  # Redis holds exactly what was emitted
            return tokens

        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(ask, enumerate(MIXED)))

    before = _drafted(spec_stack)
    off = greedy(False)
    assert _drafted(spec_stack) == before  # the opt-out drafted nothing
    assert greedy(True) == off
    assert _drafted(spec_stack) > before

    http = openai.OpenAI(base_url=spec_stack.http_endpoint + "/v1", api_key="none", max_retries=0, timeout=300)
    model = http.models.list().data[0].id

    def seeded(job: tuple[str, bool]) -> list[list[tuple[str, float]]]:
        ask, speculative = job
        reply = http.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}], n=4,
                                             temperature=0.8, seed=11, max_tokens=MIXED_TOKENS, logprobs=True,
                                             extra_body={"speculative": speculative})
        return [[(t.token, t.logprob) for t in c.logprobs.content] for c in sorted(reply.choices, key=lambda c: c.index)]

    accepted = value(scrape(spec_stack.child("scheduler").metrics), "conveyor_spec_accepted_tokens_total")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(seeded, [(ask, flag) for ask in MIXED[:N_SEEDED] for flag in (True, False)]))
    for i, ask in enumerate(MIXED[:N_SEEDED]):
        on, off = answers[2 * i], answers[2 * i + 1]
        assert on == off, ask
        assert len({tuple(c) for c in on}) > 1  # n=4 seeded choices differ
    samples = scrape(spec_stack.child("scheduler").metrics)
    assert value(samples, "conveyor_spec_accepted_tokens_total") > accepted
    assert value(samples, "conveyor_preemptions_total") > 0


def test_served_stops_inside_an_accepted_run(spec_client, default_model):
    """max_tokens=7 gives exactly plain decoding's first 7 tokens; a stop string spanning two tokens of a
    confirmed run ends the text right before it, as without speculation (the request's opt-out)."""
    want = spec_client.chat([{"role": "user", "content": ASK}], temperature=0.0, max_tokens=SERVED_TOKENS,
                            speculative=False).token_ids
    seven = spec_client.chat([{"role": "user", "content": ASK}], temperature=0.0, max_tokens=7)
    assert seven.token_ids == want[:7] and seven.finish_reason == "length"
    tok = default_model.tokenizer
    text = tok.decode(want, skip_special_tokens=True)
    cut = len(tok.decode(want[:12], skip_special_tokens=True))  # a token boundary deep in a repeated run
    stop = text[cut - 2 : cut + 2]
    assert text.find(stop) == cut - 2, "the stop string must first occur at the boundary"
    stopped = spec_client.chat([{"role": "user", "content": ASK}], temperature=0.0, max_tokens=SERVED_TOKENS,
                               stop=[stop])
    assert stopped.text == text[: cut - 2] and stopped.finish_reason == "stop"


def _decoding(s, steps: int, tokens: list[int]) -> list[int]:
    """Run ``steps`` decodes of the one request, each answered with ``tokens``; the drafts each could make."""
    allowed = []
    for _ in range(steps):
        plan = s.schedule()
        allowed.append(plan.chunks[0].max_drafts)
        _answer(s, plan, tokens)
    return allowed


def test_drafts_pay_for_their_rows_at_the_measured_cost():
    """The number of drafts is the one with the most tokens per unit of step time at the request's acceptance
    rate: every draft on a device where a verify costs about a decode (a GPU), none where each drafted row costs
    a decode (a compute-bound step gains nothing even from perfect guesses), and on this CPU's measured table
    more drafts as they get likelier; beyond the measured table the cost goes on along its last slope."""
    gpu, compute_bound = [1.0 + 0.01 * d for d in range(5)], [1.0 + d for d in range(5)]
    cpu = [1.0, 1.0, 1.23, 1.43, 1.63]  # the default model, --numerics fast, 1 + 1 threads (verify_cost)
    assert best_drafts(0.5, gpu, 4) == 4 and best_drafts(1.0, compute_bound, 4) == 0
    assert [best_drafts(rate, cpu, 4) for rate in (0.1, 0.5, 0.7, 0.95)] == [1, 1, 2, 4]
    assert best_drafts(0.95, cpu, 2) == 2  # never more than allowed
    assert best_drafts(0.0, gpu, 4) == 0  # drafts never confirmed never pay
    assert extend_cost([1.0, 1.5, 1.75], 4) == [1.0, 1.5, 1.75, 2.0, 2.25] and extend_cost(cpu, 2) == cpu


def _pattern(s, steps: int, tokens: list[int]) -> str:
    """"d": a decode that may draft, ".": one that may not."""
    return "".join("d" if n else "." for n in _decoding(s, steps, tokens))


def test_a_request_whose_drafts_do_not_pay_pauses_drafting():
    """Where each drafted row costs half a decode, a request whose drafts are all refused decodes 4 times
    without drafting, then drafts again on probation; refused again, it pauses 8 decodes, then 16; a step that
    confirms every draft ends the doubling. On a device where verifying is nearly free, confirming one draft of
    four still pays, and the request never pauses."""
    s = _scheduler(verify_cost=[1.0, 1.5, 2.0, 2.5, 3.0])
    s.add(_request("r", 3, max_tokens=1000))
    _answer(s, s.schedule(), [7])  # the prompt
    refused, confirmed, one = [8], [8, 9, 9, 9, 9], [8, 9]  # the sampled token alone, with every draft, with one
    assert _pattern(s, 15, refused) == "d" + "." * 4 + "d" + "." * 8 + "d"
    assert _pattern(s, 18, confirmed) == "." * 16 + "dd"
    # a few more refused steps before the rate falls low enough, then the first pause again
    assert re.fullmatch(r"d+\.{4}d", _pattern(s, 8, refused))
    assert s.counters.spec_skipped["paused"] == 4 + 8 + 16 + 4
    cheap = _scheduler(verify_cost=[1.0 + 0.01 * d for d in range(5)])
    cheap.add(_request("r", 3, max_tokens=1000))
    _answer(cheap, cheap.schedule(), [7])
    assert _pattern(cheap, 20, one) == "d" * 20 and cheap.counters.spec_skipped["paused"] == 0
    assert cheap.requests["r"].spec_rate == pytest.approx(0.5, abs=0.01)  # one confirmed, one refused per step


def test_a_request_that_opts_out_never_drafts():
    """speculative=False: the request decodes without drafts while one beside it drafts."""
    s = _scheduler()
    s.add(_request("on", 3))
    s.add(_request("off", 3, speculative=False))
    _answer(s, s.schedule(), [7])  # the prompts
    for _ in range(4):
        plan = s.schedule()
        assert {c.request.request_id: c.max_drafts for c in plan.chunks} == {"on": 4, "off": 0}
        _answer(s, plan, [8, 9, 9, 9, 9])
