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
    system = list(range(100, 164))  # 4 routing blocks
    first = router.choose(system + [1, 2, 3])
    again = router.choose(system + [7, 8, 9])
    assert (again.engine.name, again.reason, again.matched_blocks) == (first.engine.name, "prefix", 4)
    other = router.choose(list(range(500, 564)))  # no shared prefix: the least loaded
    assert other.reason == "balance"
    busy = first.engine.name
    registry.heartbeat(EngineInfo(busy, busy, running=40), ttl=30)  # overloaded next to the other
    moved = router.choose(system + [4, 5, 6])
    assert moved.engine.name != busy and moved.reason == "balance"
    assert router.choose(system + [4, 5, 6]).engine.name == moved.engine.name  # the prefix followed it there


def test_route_keys_cover_full_blocks_without_the_last_token():
    assert len(route_keys(list(range(32)))) == 1 and len(route_keys(list(range(33)))) == 2
    assert route_keys(list(range(40)))[:1] == route_keys(list(range(20)))  # chained: a shared head, one key
