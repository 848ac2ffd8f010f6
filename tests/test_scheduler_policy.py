"""The block manager and the scheduling policy, as plain Python (no processes)."""

from __future__ import annotations

import pytest

from conveyor.errors import ResourceExhausted
from conveyor.params import RequestParams
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policy import Scheduler
from scheduler_svc.request import Request, Status

EOS = 2


def _request(rid: str, prompt_len: int, max_tokens: int = 100, **params) -> Request:
    p = RequestParams.of(max_tokens=max_tokens, **params)
    return Request(rid, list(range(10, 10 + prompt_len)), p, p.stop.stop_ids((EOS,)), arrival=0.0)


def _scheduler(num_blocks=64, block_size=4, budget=32, seqs=8, waiting=16, max_len=1000, prefix_cache=False) -> Scheduler:
    """The policy tests run without the prefix cache (recompute means recompute); its own tests turn it on."""
    return Scheduler(BlockManager(num_blocks, block_size, prefix_cache), max_len, budget, seqs, waiting)


def _run(s: Scheduler, token: int = 7):
    """One step: schedule, and answer every sampled chunk with ``token``."""
    plan = s.schedule()
    sampled = {c.request.request_id: (token, None) for c in plan.chunks if c.sample}
    return plan, s.update(plan, sampled)


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_rounds_up(tokens, blocks):
    bm = BlockManager(10, 4)
    assert bm.blocks_needed("a", tokens) == blocks


def test_grow_block_by_block_and_release_all():
    bm = BlockManager(4, 4)
    assert bm.grow("a", 3) == [0]
    assert bm.grow("a", 4) == []  # still fits in block 0
    assert bm.grow("a", 5) == [1]
    assert bm.num_free == 2 and not bm.can_grow("b", 9)
    assert bm.release("a") == 2 and bm.num_free == 4 and bm.table("a") == []


def test_decodes_first_then_prefills_in_chunks_under_the_budget():
    s = _scheduler(budget=10)
    s.add(_request("long", 25))
    plan, _ = _run(s)
    assert [(c.request.request_id, len(c.token_ids), c.sample) for c in plan.chunks] == [("long", 10, False)]
    s.add(_request("short", 3))
    plan, _ = _run(s)  # the running prompt continues first; the new one gets nothing (budget spent)
    assert [(c.request.request_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("long", 10, 10)]
    plan, outputs = _run(s)  # last 5 of the long prompt (sampled) + the short prompt in the rest of the budget
    assert [(c.request.request_id, len(c.token_ids), c.sample) for c in plan.chunks] == [("long", 5, True), ("short", 3, True)]
    assert [o.request.request_id for o in outputs] == ["long", "short"]
    plan, _ = _run(s)  # now both decode: one token each, the sampled token fed back
    assert [(c.request.request_id, c.token_ids, c.start_pos) for c in plan.chunks] == [("long", [7], 25), ("short", [7], 3)]


def test_admission_waits_until_blocks_fit():
    s = _scheduler(num_blocks=4, block_size=4, budget=100)
    s.add(_request("a", 12))  # 3 blocks
    s.add(_request("b", 8))  # 2 blocks: does not fit next to a
    plan, _ = _run(s)
    assert [c.request.request_id for c in plan.chunks] == ["a"]
    assert s.waiting[0].request_id == "b"


def test_exhaustion_preempts_the_newest_and_it_is_recomputed():
    s = _scheduler(num_blocks=4, block_size=4, budget=100)
    s.add(_request("old", 7, ignore_eos=True))
    s.add(_request("new", 7, ignore_eos=True))
    _run(s)  # both prefilled: 2 blocks each, all 4 used
    _run(s)  # position 7 still fits in block 1 for both
    plan, _ = _run(s)  # position 8 needs a third block for "old": "new" is preempted
    assert [c.request.request_id for c in plan.chunks] == ["old"]
    assert plan.free_ids == ["new"] and s.counters.preemptions == 1
    new = s.requests["new"]
    assert new.status is Status.WAITING and new.num_computed == 0 and len(new.output_ids) == 2
    s.abort("old")
    plan, _ = _run(s)  # readmitted: prompt + the 2 tokens it had, as one chunk from position 0
    (chunk,) = plan.chunks
    assert chunk.request is new and chunk.start_pos == 0 and chunk.token_ids == new.prompt_ids + [7, 7] and chunk.sample


def test_request_that_cannot_grow_preempts_itself_when_newest():
    s = _scheduler(num_blocks=2, block_size=4, budget=100)
    s.add(_request("a", 8, ignore_eos=True))
    _run(s)
    plan, _ = _run(s)  # needs a third block, none free, it is the newest: it preempts itself
    assert plan.chunks == [] and plan.free_ids == ["a"] and s.waiting[0].request_id == "a"


def test_finish_by_eos_respects_min_tokens_and_ignore_eos():
    s = _scheduler()
    s.add(_request("eos", 3))
    _run(s, token=EOS)
    assert "eos" not in s.requests and s.counters.finished == 1
    s.add(_request("ignore", 3, ignore_eos=True, max_tokens=2))
    _, outputs = _run(s, token=EOS)
    assert outputs[0].finish_reason is None
    _, outputs = _run(s, token=EOS)
    assert outputs[0].finish_reason == "length"
    s.add(_request("custom", 3, stop_token_ids=(99,)))
    _, outputs = _run(s, token=99)
    assert outputs[0].finish_reason == "stop" and outputs[0].request.stopped_by_token


def test_max_tokens_and_max_model_length():
    s = _scheduler(max_len=6)
    s.add(_request("len", 4, max_tokens=100))
    _run(s)
    _, outputs = _run(s)
    assert outputs[0].finish_reason == "length" and len(outputs[0].request.output_ids) == 2


def test_abort_frees_blocks_at_once_and_drops_the_step_result():
    s = _scheduler()
    s.add(_request("a", 9))
    plan = s.schedule()
    used = s.blocks.num_used
    assert used == 3
    output = s.abort("a")  # while the step is "running"
    assert output.finish_reason == "abort" and s.blocks.num_used == 0
    assert s.update(plan, {"a": (7, None)}) == []  # the late result is dropped
    assert s.schedule().free_ids == ["a"]  # the worker is told to forget it


def test_stop_string_finish_trims_the_output():
    s = _scheduler()
    s.add(_request("a", 3))
    for _ in range(4):
        _run(s)
    output = s.finish_at("a", 2)
    assert output.trim and output.request.output_ids == [7, 7] and output.finish_reason == "stop"


def test_waiting_queue_is_bounded():
    s = _scheduler(waiting=2)
    s.add(_request("a", 3))
    s.add(_request("b", 3))
    with pytest.raises(ResourceExhausted, match="--max-waiting"):
        s.add(_request("c", 3))
    assert [r.request_id for r in s.waiting] == ["a", "b"]


def test_sequence_cap():
    s = _scheduler(seqs=2)
    for rid in "abc":
        s.add(_request(rid, 2))
    plan, _ = _run(s)
    assert [c.request.request_id for c in plan.chunks] == ["a", "b"] and len(s.waiting) == 1


def test_reset_worker_requeues_everything_running():
    s = _scheduler()
    s.add(_request("a", 3))
    s.add(_request("b", 3))
    _run(s)
    s.reset_worker()
    plan = s.schedule()
    assert plan.free_all and [c.start_pos for c in plan.chunks] == [0, 0]


# ---------------------------------------------------------------- steps scheduled ahead of their answers


def test_next_step_decodes_the_token_still_in_flight():
    s = _scheduler(budget=64)
    s.add(_request("a", 5))
    first = s.schedule()  # the prompt, sampled
    second = s.schedule()  # sent before the first is answered
    (chunk,) = second.chunks
    assert chunk.decode_last and chunk.token_ids == [] and chunk.start_pos == 5 and chunk.sample
    s.update(first, {"a": (7, None)})
    s.update(second, {"a": (8, None)})
    assert s.requests["a"].output_ids == [7, 8]
    (third,) = s.schedule().chunks  # both answers are back: the last token is known and fed as usual
    assert third.decode_last is False and third.token_ids == [8] and third.start_pos == 6


def test_results_of_a_request_that_finished_meanwhile_are_dropped():
    s = _scheduler(budget=64)
    s.add(_request("a", 5))
    first, second = s.schedule(), s.schedule()
    outputs = s.update(first, {"a": (EOS, None)})  # eos: finished while the second step was on its way
    assert outputs[0].finish_reason == "stop"
    assert s.update(second, {"a": (9, None)}) == []
    assert s.schedule().free_ids == ["a"] and s.blocks.num_used == 0


def test_results_from_before_a_preemption_are_dropped():
    s = _scheduler(num_blocks=4, block_size=4, budget=64)
    s.add(_request("old", 7, ignore_eos=True))
    s.add(_request("new", 7, ignore_eos=True))
    s.update(s.schedule(), {"old": (1, None), "new": (1, None)})
    in_flight = s.schedule()  # both decode position 7 (fits); their answers are still out
    preempting = s.schedule()  # position 8 of "old" needs a block: "new" is preempted
    assert [c.request.request_id for c in preempting.chunks] == ["old"] and "new" in preempting.free_ids
    outputs = s.update(in_flight, {"old": (2, None), "new": (2, None)})
    assert [o.request.request_id for o in outputs] == ["old"]  # "new"'s answer belongs to its old epoch
    assert s.requests["new"].output_ids == [1] and s.requests["new"].num_computed == 0


def test_no_decode_beyond_max_tokens_while_the_last_is_in_flight():
    s = _scheduler(budget=64)
    s.add(_request("a", 3, max_tokens=1))
    s.schedule()
    assert s.schedule().chunks == []  # its one token is in flight: nothing more to compute


def test_resize_to_a_smaller_worker_ends_the_requests_that_no_longer_fit():
    s = _scheduler(num_blocks=64, block_size=4, max_len=256)
    long, short = _request("long", 40), _request("short", 5)
    s.add(long), s.add(short)
    for _ in range(3):
        _run(s)
    s.reset_worker()  # the worker died: everything is waiting again, no blocks held
    ended = s.resize(BlockManager(8, 4), 32)  # it came back with 8 blocks of 4 tokens
    assert [(o.request.request_id, o.finish_reason) for o in ended] == [("long", "length")]
    assert s.blocks.num_blocks == 8 and s.max_model_len == 32 and "long" not in s.requests
    plan, _ = _run(s)
    assert [c.request.request_id for c in plan.chunks] == ["short"]


def _answer(s: Scheduler, plan, token: int = 7):
    return s.update(plan, {c.request.request_id: (token, None) for c in plan.chunks if c.sample})


def test_an_unattributed_failure_runs_each_suspect_alone_until_it_gets_a_token():
    s = _scheduler()
    for rid in "abc":
        s.add(_request(rid, 3))
    _run(s)
    failed = s.schedule()  # the worker fails this step and cannot say who caused it
    assert s.step_failed(failed, None, "kernel error") == []  # nobody is blamed: three were in it
    s.reset_worker()
    alone, batched = set(), []
    for _ in range(12):
        suspects = {r for r in "abc" if s.requests[r].suspect}
        plan = s.schedule()
        ids = [c.request.request_id for c in plan.chunks]
        if set(ids) & suspects:
            assert len(ids) == 1  # a suspect never shares a step
            alone.add(ids[0])
        batched.append(ids)
        _answer(s, plan)
    assert alone == {"a", "b", "c"} and not any(s.requests[r].suspect for r in "abc")
    assert sorted(batched[-1]) == ["a", "b", "c"]  # then batched together again


def test_a_request_that_keeps_failing_alone_ends_with_an_error_and_frees_its_blocks():
    s = _scheduler()
    for rid in "ab":
        s.add(_request(rid, 3, max_tokens=30))
    _run(s)
    ended, alone_failures, b_tokens = [], 0, 0
    for _ in range(40):  # the worker fails every step that computes "a" (a poison request)
        plan = s.schedule()
        ids = [c.request.request_id for c in plan.chunks]
        if "a" in ids:
            alone_failures += ids == ["a"]
            ended += s.step_failed(plan, None, "boom")
            s.reset_worker()
        else:
            b_tokens += sum(len(o.token_ids) for o in _answer(s, plan))
        if ended and b_tokens >= 5:
            break
    assert [o.finish_reason for o in ended] == ["error"] and "max-step-failures" in ended[0].request.error
    assert alone_failures == 3  # blamed only for the steps it failed alone
    assert "a" not in s.requests and s.blocks.table("a") == [] and b_tokens >= 5  # the other one went on


def test_a_culprit_the_worker_names_is_blamed_alone():
    s = _scheduler()
    for rid in "ab":
        s.add(_request(rid, 3))
    _run(s)
    plan = s.schedule()
    assert s.step_failed(plan, "b", "bad block") == []
    assert (s.requests["a"].suspect, s.requests["b"].suspect, s.requests["b"].failures) == (False, True, 1)
