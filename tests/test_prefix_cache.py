"""The prefix cache in the block manager and the scheduler, as plain Python (no processes).

The end-to-end check (greedy outputs identical with the cache on and off, against the real worker)
is in ``test_pipeline.py``."""

from __future__ import annotations

from conveyor.params import RequestParams
from conveyor.prefix import chain, root_key
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.policy import Scheduler
from scheduler_svc.request import Request

EOS = 2


def _request(rid: str, prompt: list[int], max_tokens: int = 100) -> Request:
    p = RequestParams.of(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), p, p.stop.stop_ids((EOS,)), arrival=0.0)


def _scheduler(num_blocks=64, budget=64, seqs=8, prefix_cache=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, prefix_cache, root_key("m")), 1000, budget, seqs, 16)


def _run(s: Scheduler, token: int = 7):
    plan = s.schedule()
    sampled = {c.request.request_id: (token, None) for c in plan.chunks if c.sample}
    return plan, s.update(plan, sampled)


def _chunk(plan, rid):
    return next(c for c in plan.chunks if c.request.request_id == rid)


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] and 2 in a third


def test_a_second_request_reuses_the_full_blocks_of_the_same_prompt_and_computes_the_rest():
    s = _scheduler()
    s.add(_request("a", PROMPT))
    plan, _ = _run(s)
    a = _chunk(plan, "a")
    assert a.registers and a.start_pos == 0 and a.cached_ids == [] and len(a.new_blocks) == 3
    s.add(_request("b", PROMPT[:9] + [999]))  # differs in the last token only
    plan, _ = _run(s)
    b = _chunk(plan, "b")
    assert b.registers and b.start_pos == 8 and b.token_ids == [108, 999] and b.cached_ids == PROMPT[:8]
    assert b.new_blocks[:2] == a.new_blocks[:2] and b.new_blocks[2] != a.new_blocks[2]  # shared head, own tail
    assert s.blocks.stats.queries == 20 and s.blocks.stats.hits == 8


def test_a_block_aligned_prompt_leaves_its_last_block_to_compute():
    s = _scheduler()
    s.add(_request("a", PROMPT[:8]))
    _run(s)
    s.add(_request("b", PROMPT[:8]))
    plan, _ = _run(s)
    b = _chunk(plan, "b")
    # the last token must be computed to sample after it, and it lies in a block of b's own
    assert b.start_pos == 4 and b.token_ids == PROMPT[4:8] and b.sample
    assert b.new_blocks[0] == s.blocks.table("a")[0] and b.new_blocks[1] not in s.blocks.table("a")


def test_blocks_filled_in_the_step_being_built_are_not_reused_by_that_step():
    s = _scheduler()
    s.add(_request("a", PROMPT))
    s.add(_request("b", PROMPT))
    plan, _ = _run(s)  # both admitted in one step: b cannot read KV that a writes in the same step
    assert _chunk(plan, "b").start_pos == 0 and not set(s.blocks.table("a")) & set(s.blocks.table("b"))
    s.add(_request("c", PROMPT))
    plan, _ = _run(s)
    assert _chunk(plan, "c").start_pos == 8  # the next step may


def test_output_tokens_fill_blocks_too_and_a_follow_up_turn_reuses_them():
    s = _scheduler()
    s.add(_request("turn1", PROMPT, max_tokens=5))
    for _ in range(6):
        _run(s, token=5)
    assert "turn1" not in s.requests  # finished: 10 prompt + 5 output, the last never fed (15 tokens of KV: 3 full blocks)
    s.add(_request("turn2", PROMPT + [5] * 5 + [1, 2, 3]))
    plan, _ = _run(s)
    assert _chunk(plan, "turn2").start_pos == 12


def test_free_cached_blocks_stay_until_the_memory_is_needed_and_the_head_outlives_the_tail():
    s = _scheduler(num_blocks=4)
    s.add(_request("a", PROMPT + [1, 2, 3], max_tokens=1))  # 13 tokens: 3 full blocks + 1
    _run(s)
    assert "a" not in s.requests and s.blocks.num_free == 4 and s.blocks.num_cached == 3
    s.add(_request("filler", list(range(500, 508)), max_tokens=1))  # 2 blocks: the unkeyed one, then a's tail
    _run(s)
    s.add(_request("b", PROMPT + [1, 2, 3]))
    plan, _ = _run(s)
    assert _chunk(plan, "b").start_pos == 8  # a's third block was evicted, the first two were kept


def test_a_shared_block_stays_held_while_any_holder_runs():
    s = _scheduler(num_blocks=8)
    s.add(_request("a", PROMPT))
    _run(s)
    s.add(_request("b", PROMPT))
    _run(s)
    shared = s.blocks.table("a")[:2]
    assert s.blocks.num_used == 4  # 2 shared + a tail each
    s.abort("a")
    assert s.blocks.num_used == 3 and all(b in s.blocks.table("b") for b in shared)
    s.add(_request("c", list(range(300, 316)), max_tokens=1))  # wants 4 blocks: it must not get b's
    plan, _ = _run(s)
    assert not set(s.blocks.table("c")) & set(s.blocks.table("b"))


def test_a_preempted_request_finds_its_own_blocks_again():
    s = _scheduler(num_blocks=7, budget=100)
    s.add(_request("old", PROMPT))
    s.add(_request("new", PROMPT[::-1]))
    _run(s)
    for _ in range(3):
        _run(s)  # 12 computed + 1 in flight: old needs a 4th block at 12 tokens ... until blocks run out
    assert s.counters.preemptions == 1
    victim = next(r for r in s.requests.values() if r.num_computed == 0)
    s.abort(next(rid for rid in s.requests if rid != victim.request_id))
    plan, _ = _run(s)
    chunk = _chunk(plan, victim.request_id)
    assert chunk.registers and chunk.start_pos == 12 and chunk.cached_ids == victim.tokens(0, 12)


def test_a_worker_reset_empties_the_cache():
    s = _scheduler()
    s.add(_request("a", PROMPT))
    _run(s)
    s.reset_worker()
    assert s.blocks.num_cached == 0
    plan, _ = _run(s)  # a is readmitted from scratch
    assert _chunk(plan, "a").start_pos == 0
    s.add(_request("b", PROMPT))
    plan, _ = _run(s)
    assert _chunk(plan, "b").start_pos == 8  # the recompute filled the cache again


def test_without_the_prefix_cache_nothing_is_shared():
    s = _scheduler(prefix_cache=False)
    s.add(_request("a", PROMPT))
    _run(s)
    s.add(_request("b", PROMPT))
    plan, _ = _run(s)
    assert _chunk(plan, "b").start_pos == 0 and s.blocks.num_cached == 0 and s.blocks.stats.queries == 0


def test_keys_chain_the_whole_prefix_and_the_model():
    a = chain(root_key("m"), [1, 2, 3, 4])
    assert chain(a, [5, 6, 7, 8]) != chain(chain(root_key("m"), [0, 2, 3, 4]), [5, 6, 7, 8])  # same block, other head
    assert a != chain(root_key("other model"), [1, 2, 3, 4])
    bm = BlockManager(8, 4, root=root_key("m"))
    assert bm.can_allocate([], 32) and not bm.can_allocate([], 33)
