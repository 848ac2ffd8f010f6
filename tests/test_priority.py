"""Priorities in the scheduling policy, as plain Python (no processes): lower first, arrival order within
a priority, the lowest-priority newest request preempted first. End to end: ``test_cache_and_priority.py``."""

from __future__ import annotations

import random

from conveyor.params import RequestParams
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policy import Scheduler
from scheduler_svc.request import Request, Status

EOS = 2


def _request(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 100, arrival: float = 0.0) -> Request:
    p = RequestParams.of(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    return Request(rid, list(range(10, 10 + prompt_len)), p, p.stop.stop_ids((EOS,)), arrival=arrival)


def _scheduler(num_blocks=64, budget=64, seqs=8, waiting=64) -> Scheduler:
    # the max length is what the cache holds, as the server sets it
    return Scheduler(BlockManager(num_blocks, 4, prefix_cache=False), num_blocks * 4, budget, seqs, waiting)


def _run(s: Scheduler, token: int = 7):
    plan = s.schedule()
    sampled = {c.request.request_id: (token, None) for c in plan.chunks if c.sample}
    return plan, s.update(plan, sampled)


def test_the_queue_orders_by_priority_then_arrival():
    s = _scheduler(seqs=1)
    s.add(_request("running", 4))
    _run(s)
    for rid, priority, arrival in [("low-early", 5, 1.0), ("high-late", -1, 3.0), ("mid", 0, 2.0), ("high-early", -1, 2.5)]:
        s.add(_request(rid, 4, priority, arrival=arrival))
    assert [r.request_id for r in s.waiting] == ["high-early", "high-late", "mid", "low-early"]


def test_a_high_priority_request_is_admitted_in_the_next_step_despite_a_burst_of_low_ones():
    s = _scheduler(num_blocks=16, seqs=4)
    for i in range(12):  # a burst: the running set and the blocks fill up, the rest waits
        s.add(_request(f"low{i}", 12, priority=10))
    for _ in range(3):
        _run(s)
    assert len(s.running) == 4 and len(s.waiting) == 8
    s.add(_request("urgent", 12, priority=0))
    plan, _ = _run(s)
    chunks = {c.request.request_id: c for c in plan.chunks}
    assert "urgent" in chunks and chunks["urgent"].registers  # admitted at once
    assert [r.request_id for r in s.preempted] == [] and s.counters.preemptions == 1  # told to Redis in the plan
    assert [r.request_id for r in plan.preempted] == ["low3"]  # the newest of the lowest priority made room
    assert s.requests["low3"].status is Status.WAITING and s.waiting[0].request_id == "low3"  # first of its class


def test_growth_preempts_the_lowest_priority_first_even_if_it_is_older():
    s = _scheduler(num_blocks=6, seqs=4)
    s.add(_request("low-old", 7, priority=5, arrival=1.0))
    s.add(_request("high-new", 7, priority=0, arrival=2.0))
    s.add(_request("high-newer", 7, priority=0, arrival=3.0))
    _run(s)  # three prompts of 7 tokens: 2 blocks each, all 6 used
    assert [r.request_id for r in s.running] == ["high-new", "high-newer", "low-old"]
    _run(s)
    plan, _ = _run(s)  # position 8 needs a third block for each: the lowest priority goes, not the newest
    assert [r.request_id for r in plan.preempted] == ["low-old"]
    assert [c.request.request_id for c in plan.chunks] == ["high-new", "high-newer"]  # its 2 blocks went to them


def test_a_low_priority_request_never_preempts_a_higher_one_to_be_admitted():
    s = _scheduler(num_blocks=4, seqs=4)
    s.add(_request("high", 14, priority=0))
    _run(s)
    s.add(_request("low", 4, priority=9))
    plan, _ = _run(s)
    assert [c.request.request_id for c in plan.chunks] == ["high"] and s.counters.preemptions == 0
    assert s.requests["low"].status is Status.WAITING


def test_equal_priorities_cannot_starve_random_load():
    """Random arrivals, prompt and output lengths on a cache too small for all: with one priority, no
    request is ever admitted while one that arrived before it waits (first come, first served,
    preempted ones back in their place), and every request finishes."""
    rng = random.Random(7)
    for trial in range(20):
        s = _scheduler(num_blocks=rng.randint(8, 24), budget=rng.choice([8, 16, 64]), seqs=rng.randint(1, 6))
        pending = [_request(f"t{trial}r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 24), arrival=float(i))
                   for i in range(30)]
        finished, steps = set(), 0
        while (pending or s.has_work) and steps < 5000:
            if pending and rng.random() < 0.4:
                s.add(pending.pop(0))
            plan, outputs = _run(s)
            steps += 1
            for r in plan.admitted:
                earlier = [w.request_id for w in s.waiting if w.arrival < r.arrival]
                assert not earlier, f"{r.request_id} admitted while {earlier} (arrived before it) wait"
            finished |= {o.request.request_id for o in outputs if o.finish_reason}
        assert len(finished) == 30, f"trial {trial}: {30 - len(finished)} never finished in {steps} steps"
