"""The engine registry, the takeover of a dead engine's requests and the router, against a real Redis
(no services). Several engines end to end: ``test_multi_engine.py``."""

from __future__ import annotations

import time
import uuid

import pytest

from conveyor.engines import EngineInfo, Lease, Registry, Router, route_keys
from conveyor.params import RequestParams
from conveyor.state import RequestRecord, RequestStore


@pytest.fixture
def registry(redis_server) -> Registry:
    return Registry(RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}"))


def _request(registry: Registry, engine: str, finished: bool = False) -> str:
    record = RequestRecord(uuid.uuid4().hex, [1, 2, 3], RequestParams(), engine=engine)
    assert registry.store.create(record)
    if finished:
        writer = registry.store.writer()
        writer.finished(record.request_id, registry.store.alias_key("", record.client_id), "stop", 0, time.time())
        writer.execute()
    return record.request_id


def test_an_engine_is_live_while_its_heartbeat_is_fresh(registry):
    a = EngineInfo("a", "127.0.0.1:1", running=2, waiting=3)
    assert registry.heartbeat(a, ttl=0.3) is False  # first registration
    assert registry.heartbeat(a, ttl=0.3) is True
    (live,) = registry.live()
    assert (live.name, live.address, live.load, live.serving) == ("a", "127.0.0.1:1", 5, True)
    time.sleep(0.4)
    assert registry.live() == [] and registry.dead() == ["a"]
    assert registry.heartbeat(a, ttl=5) is False  # the lease had lapsed: the engine learns it


def test_a_dead_engines_unfinished_requests_move_to_one_taker(registry):
    registry.heartbeat(EngineInfo("dead", "x"), ttl=0.2)
    registry.heartbeat(EngineInfo("alive", "y"), ttl=30)
    mine = [_request(registry, "dead") for _ in range(3)]
    done = _request(registry, "dead", finished=True)
    other = _request(registry, "alive")
    assert registry.claim("dead", "alive") == []  # still registered: nothing moves
    time.sleep(0.3)
    moved = registry.claim("dead", "alive")
    assert sorted(moved) == sorted(mine)
    assert registry.engines_of(mine + [done, other]) == ["alive"] * 3 + ["dead", "alive"]
    assert registry.claim("dead", "third") == [] and registry.dead() == []  # claimed once; the name left the set


def test_reassign_only_from_the_engine_that_holds_it(registry):
    rid = _request(registry, "a")
    assert not registry.reassign(rid, "b", "c")
    assert registry.reassign(rid, "a", "b") and registry.engine_of(rid) == "b"


def test_the_lease_goes_stale_before_the_registration_expires():
    lease = Lease(ttl=0.4)
    assert not lease.fresh()
    lease.refreshed(time.monotonic())
    assert lease.fresh()
    time.sleep(0.31)  # 0.75 of the ttl
    assert not lease.fresh()


def test_the_router_keeps_a_prefix_on_its_engine_and_balances_the_rest(registry):
    for name in ("a", "b"):
        registry.heartbeat(EngineInfo(name, name), ttl=30)
    router = Router(registry, refresh=0.0)

    def routed(prompt, scope=""):  # chosen, then accepted by that engine
        route = router.choose(prompt, scope=scope)
        router.remember(prompt, route.engine.name, scope=scope)
        return route

    system = list(range(100, 164))  # 4 routing blocks
    first = routed(system + [1, 2, 3])
    again = routed(system + [7, 8, 9])
    assert (again.engine.name, again.reason, again.matched_blocks) == (first.engine.name, "prefix", 4)
    other = routed(list(range(500, 564)))  # no shared prefix: the least loaded
    assert other.reason == "balance"
    assert router.choose(system + [1], scope="key:bob").reason == "balance"  # another scope's prefixes are not seen
    busy = first.engine.name
    registry.heartbeat(EngineInfo(busy, busy, running=40), ttl=30)  # overloaded next to the other
    moved = routed(system + [4, 5, 6])
    assert moved.engine.name != busy and moved.reason == "balance"
    assert routed(system + [4, 5, 6]).engine.name == moved.engine.name  # the prefix followed it there


def test_a_burst_sharing_a_prefix_spreads_while_the_heartbeats_do_not_show_it_yet(registry):
    """32 chats with one system prompt, routed while both engines' heartbeats still say idle and the registry is
    read again before every one: what the router sent recently counts toward each engine's load, so the prefix
    holds only up to the imbalance bound and the burst lands on both engines (counting only since the last
    read, every request followed the prefix to the first engine)."""
    for name in ("a", "b"):
        registry.heartbeat(EngineInfo(name, name), ttl=30)
    router = Router(registry, refresh=0.0)
    system = list(range(100, 164))
    engines = []
    for i in range(32):
        route = router.choose(system + [1000 + i])
        router.remember(system + [1000 + i], route.engine.name)
        engines.append(route.engine.name)
    counts = sorted(engines.count(name) for name in ("a", "b"))
    assert counts[0] >= 8, counts  # at most 2 x the other's + 8 on the prefix's engine
    assert counts[1] > counts[0]  # and the prefix still keeps most of them together


def test_a_request_writes_a_bounded_number_of_route_keys_and_only_once_accepted(registry):
    for name in ("a", "b"):
        registry.heartbeat(EngineInfo(name, name), ttl=30)
    router = Router(registry, refresh=0.0)
    prompt = list(range(16 * 300 + 1))  # 300 full blocks (the first 256 route)
    pattern = f"{registry.prefix}:route:*"
    route = router.choose(prompt)
    assert list(registry.store.redis.scan_iter(pattern)) == []  # chosen, not yet accepted: nothing written
    router.remember(prompt, route.engine.name)
    assert len(list(registry.store.redis.scan_iter(pattern))) == 9  # depths 1, 2, 4, ..., 256
    deep = router.choose(prompt[: 16 * 200 + 1])  # shares 200 blocks: found at depth 128
    assert (deep.engine.name, deep.reason, deep.matched_blocks) == (route.engine.name, "prefix", 128)


def test_route_keys_cover_full_blocks_without_the_last_token():
    assert len(route_keys(list(range(32)), 16)) == 1 and len(route_keys(list(range(33)), 16)) == 2
    assert route_keys(list(range(40)), 16)[:1] == route_keys(list(range(20)), 16)  # chained: a shared head, one key
    assert len(route_keys(list(range(65)), 32)) == 2 and route_keys(list(range(65)), 32)[0] != route_keys(
        list(range(65)), 16)[1]  # 32-token blocks are other keys than two 16-token ones


def test_the_router_keys_prompts_by_the_engines_block_size(registry):
    """Engines that cache 32-token blocks register that size: a prompt is routed by the prefixes their caches
    can hold (a 40-token shared head is one full 32-token block), not by a fixed 16."""
    for name in ("a", "b"):
        registry.heartbeat(EngineInfo(name, name, block_size=32), ttl=30)
    router = Router(registry, refresh=0.0)
    head = list(range(1000, 1040))
    first = router.choose(head + [1, 2, 3])
    router.remember(head + [1, 2, 3], first.engine.name)
    assert router.block_size == 32
    assert len(list(registry.store.redis.scan_iter(f"{registry.prefix}:route:*"))) == 1  # one full block of 32
    again = router.choose(head + [7, 8, 9])
    assert (again.engine.name, again.reason, again.matched_blocks) == (first.engine.name, "prefix", 1)


def test_an_engine_whose_lease_lapsed_drops_what_another_took_and_keeps_the_rest(registry):
    """A scheduler cut off from Redis for longer than its TTL (alive all along): another engine may take its
    requests meanwhile. Its steps wait while the lease is stale; when its heartbeat gets through again it
    drops exactly the requests that moved, and keeps the others."""
    from conveyor.metrics import Metrics
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.engine import Engine
    from scheduler_svc.policy import Scheduler
    from scheduler_svc.membership import Membership

    taken, kept = _request(registry, "a"), _request(registry, "a")
    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), registry.store, transport=None,
                    publish=lambda *a: None, eos_token_ids=(2,), name="a", lease=Lease(ttl=0.5))
    membership = Membership(engine, registry, "127.0.0.1:1", "m", Metrics("scheduler"))
    membership.beat()
    assert engine.adopt([taken, kept]) == 2 and engine.lease.fresh()
    time.sleep(0.6)  # no heartbeat: the registration expires
    assert not engine.lease.fresh()  # steps wait from here on
    registry.heartbeat(EngineInfo("b", "y"), ttl=30)
    assert sorted(registry.claim("a", "b")) == sorted([taken, kept])
    assert registry.reassign(kept, "b", "a")  # say b handed one back: only the other moved for good
    membership.beat()  # the heartbeat gets through again
    assert engine.held() == [kept] and engine.lease.fresh()
    assert sorted(n.name for n in registry.live()) == ["a", "b"]


def test_a_submit_for_a_request_another_engine_holds_is_refused(registry):
    from conveyor.errors import Unavailable
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.engine import Engine
    from scheduler_svc.policy import Scheduler

    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), registry.store, transport=None,
                    publish=lambda *a: None, eos_token_ids=(2,), name="a")
    with pytest.raises(Unavailable, match="held by engine 'b'"):
        engine.submit(_request(registry, "b"))
    assert engine.submit(_request(registry, "a")) == 1


def test_a_step_written_after_the_lease_lapsed_leaves_out_what_another_engine_took(registry):
    """The step loop was blocked on a stale lease with a token for a request that another engine took over
    meanwhile: once the heartbeat gets through, nothing of that token is written or published."""
    import threading

    from conveyor.metrics import Metrics
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.engine import Engine
    from scheduler_svc.membership import Membership
    from scheduler_svc.policy import Output, Scheduler, StepPlan

    taken, kept = _request(registry, "a"), _request(registry, "a")
    published = []
    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), registry.store, transport=None,
                    publish=lambda step, outputs: published.extend(o.request.request_id for o in outputs),
                    eos_token_ids=(2,), name="a", lease=Lease(ttl=0.5))
    membership = Membership(engine, registry, "127.0.0.1:1", "m", Metrics("scheduler"))
    membership.beat()
    engine.adopt([taken, kept])
    outputs = []
    for rid in (taken, kept):  # a step's result, as Scheduler.update makes it
        engine.scheduler.requests[rid].output_ids.append(5)
        outputs.append(Output(engine.scheduler.requests[rid], 0, [5]))
    time.sleep(0.6)  # the lease lapses; engine b takes one of the two
    registry.heartbeat(EngineInfo("b", "y"), ttl=30)
    registry.claim("a", "b")
    assert registry.reassign(kept, "b", "a")
    writing = threading.Thread(target=engine._write_and_publish, args=(StepPlan(1, [], []), outputs, []))
    writing.start()
    time.sleep(0.2)
    assert writing.is_alive() and published == []  # blocked on the stale lease
    membership.beat()
    writing.join(timeout=10)
    assert not writing.is_alive()
    assert published == [kept]
    assert registry.store.get(taken).output_ids == [] and registry.store.get(kept).output_ids == [5]
    assert engine.held() == [kept]


def test_a_write_that_lands_after_a_takeover_is_refused_by_the_fence(registry):
    """The step loop checked its lease and was then paused (a GC pause, a stopped VM) past the TTL: another
    engine took a request meanwhile. The lease check passed, so only the write itself can tell: it is fenced
    on the record still naming this engine, and nothing of it lands; the other request's write does."""
    from conveyor.metrics import Metrics
    from conveyor.state import Fenced
    from scheduler_svc.block_manager import BlockManager
    from scheduler_svc.engine import Engine
    from scheduler_svc.membership import Membership
    from scheduler_svc.policy import Output, Scheduler, StepPlan

    taken, kept = _request(registry, "a"), _request(registry, "a")
    published = []
    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), registry.store, transport=None,
                    publish=lambda step, outputs: published.extend(o.request.request_id for o in outputs),
                    eos_token_ids=(2,), name="a", lease=Lease(ttl=30))
    Membership(engine, registry, "127.0.0.1:1", "m", Metrics("scheduler")).beat()
    engine.adopt([taken, kept])
    registry.heartbeat(EngineInfo("b", "y"), ttl=30)
    assert registry.reassign(taken, "a", "b")  # taken over while "a" was paused after its lease check
    assert engine.lease.fresh()  # so the check before the write passes
    writer = registry.store.writer()
    writer.tokens(taken, [5], 1, None)
    with pytest.raises(Fenced) as fenced:
        writer.execute(owner="a")
    assert fenced.value.taken == {taken} and registry.store.get(taken).output_ids == []
    outputs = []
    for rid in (taken, kept):  # the step's result, through the engine's own write path
        engine.scheduler.requests[rid].output_ids.append(5)
        outputs.append(Output(engine.scheduler.requests[rid], 0, [5]))
    engine._write_and_publish(StepPlan(1, [], []), outputs, [])
    assert registry.store.get(taken).output_ids == [] and registry.store.get(kept).output_ids == [5]
    assert published == [kept] and engine.held() == [kept]


def test_a_fenced_write_fails_a_refused_record_alone_and_restores_a_long_output(registry):
    """The fenced step write is one script: a command Redis refuses (this record is not a hash any more) is
    that record's alone, reported for a rewrite, and the other record's write lands with it; a restore
    longer than a script's arguments may hold takes the WATCH form and lands whole."""
    good, bad = _request(registry, "a"), _request(registry, "a")
    registry.store.redis.delete(registry.store.key(bad))
    registry.store.redis.set(registry.store.key(bad), "not a hash")
    writer = registry.store.writer()
    writer.tokens(good, [5], 1, None)
    writer.tokens(bad, [6], 1, None)
    assert writer.execute(owner="a") == {bad}
    record = registry.store.get(good)
    assert record.output_ids == [5] and record.status == "running"
    record.output_ids = list(range(5000))
    writer = registry.store.writer()
    writer.restore(record)
    assert writer.execute(owner="a") == set()
    assert registry.store.get(good).output_ids == list(range(5000))
