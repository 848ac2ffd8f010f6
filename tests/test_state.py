"""The Redis record's self-healing writes, against a real redis-server."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid

import pytest
from helpers import free_port

from conveyor.params import RequestParams
from conveyor.state import REDIS_DOWN, AsyncRequestStore, RequestRecord, RequestStore


def _store(redis_server) -> RequestStore:
    return RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")


def _append(store: RequestStore, rid: str, tokens: list[int], num_output: int) -> set[str]:
    writer = store.writer()
    writer.tokens(rid, tokens, num_output, None)
    return writer.execute()


def test_the_frontends_store_takes_more_operations_at_once_than_it_has_connections(redis_server):
    """A burst of coroutines wider than the event loop's connections (many streams looking at Redis on one tick):
    each waits for a connection, none fails (redis-py's own pool raised past its 100)."""
    async def run():
        store = AsyncRequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
        try:
            return await asyncio.gather(*(store.progress(f"missing-{i}") for i in range(300)))
        finally:
            await store.redis.aclose()

    assert asyncio.run(run()) == [None] * 300


def test_a_retried_append_does_not_add_the_tokens_twice(redis_server):
    store = _store(redis_server)
    rid = uuid.uuid4().hex
    assert store.create(RequestRecord(rid, [1, 2, 3], RequestParams()))
    assert _append(store, rid, [7], 1) == set()
    assert _append(store, rid, [8, 9], 3) == set()
    assert _append(store, rid, [8, 9], 3) == set()  # the same step's write again (a retry after a failure)
    assert store.get(rid).output_ids == [7, 8, 9]


def test_a_lost_record_is_reported_and_restored_whole(redis_server):
    store = _store(redis_server)
    rid = uuid.uuid4().hex
    record = RequestRecord(rid, [1, 2, 3], RequestParams.of(max_tokens=9), frontend="fe:1", owner="alice")
    assert store.create(record)
    assert _append(store, rid, [7, 8], 2) == set()
    store.redis.delete(store.key(rid), store.out_key(rid))  # Redis restarted and lost it
    assert _append(store, rid, [9], 3) == {rid}  # the next write notices
    record.output_ids, record.num_output, record.status = [7, 8, 9], 3, "running"
    writer = store.writer()
    writer.restore(record)
    assert writer.execute() == set()
    back = store.get(rid)
    assert (back.output_ids, back.prompt_ids, back.frontend, back.owner, back.params.stop.max_tokens) == \
        ([7, 8, 9], [1, 2, 3], "fe:1", "alice", 9)
    assert rid in store.inflight()


def test_a_command_redis_refuses_is_that_requests_alone_and_the_rewrite_heals_it(redis_server):
    store = _store(redis_server)
    good, bad = (RequestRecord(uuid.uuid4().hex, [1, 2], RequestParams()) for _ in range(2))
    assert store.create(good) and store.create(bad)
    store.redis.delete(store.key(bad.request_id))
    store.redis.set(store.key(bad.request_id), "not a hash")  # WRONGTYPE for the HSET below
    writer = store.writer()
    writer.tokens(good.request_id, [5], 1, None)
    writer.tokens(bad.request_id, [6], 1, None)
    assert writer.execute() == {bad.request_id}  # reported for a rewrite; no exception, nothing else affected
    assert store.get(good.request_id).output_ids == [5]
    bad.output_ids, bad.num_output, bad.status = [6], 1, "running"
    writer = store.writer()
    writer.restore(bad)
    assert writer.execute() == set() and store.get(bad.request_id).output_ids == [6]


def test_a_step_too_long_for_the_script_appends_and_checks_the_same(redis_server):
    """A restore longer than a script's arguments sends the step as a pipeline: the decode appends in it land
    the same, and one whose record Redis lost is still reported for a rewrite."""
    store = _store(redis_server)
    long, kept, lost = (RequestRecord(uuid.uuid4().hex, [1, 2], RequestParams()) for _ in range(3))
    assert store.create(long) and store.create(kept) and store.create(lost)
    assert _append(store, kept.request_id, [4], 1) == set()
    store.redis.delete(store.key(lost.request_id))  # Redis restarted and lost it
    long.output_ids, long.num_output, long.status = list(range(5000)), 5000, "running"
    writer = store.writer()
    writer.restore(long)
    writer.tokens(kept.request_id, [5, 6], 3, None)
    writer.tokens(kept.request_id, [5, 6], 3, None)  # twice in one step: still added once
    writer.tokens(lost.request_id, [7], 1, None)
    assert writer.execute() == {lost.request_id}
    assert store.get(long.request_id).output_ids == list(range(5000))
    back = store.get(kept.request_id)
    assert (back.output_ids, back.num_output, back.status) == ([4, 5, 6], 3, "running")


def test_a_step_write_while_redis_is_out_of_reach_raises_its_outage_then_lands_once_it_is_back(tmp_path):
    """The step script's own connection: a Redis out of reach at the very first write raises the outage the
    Persister waits out (not any other error), and the same store writes once Redis is up."""
    port = free_port()
    store = RequestStore.from_url(f"redis://127.0.0.1:{port}/0")
    writer = store.writer()
    writer.tokens("r1", [7], 1, None)
    with pytest.raises(REDIS_DOWN):
        writer.execute(owner="engine-a")
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(tmp_path), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                store.redis.ping()
                break
            except REDIS_DOWN:
                time.sleep(0.05)
        assert store.create(RequestRecord("r1", [1, 2], RequestParams()))
        assert writer.execute(owner="engine-a") == set()
        assert store.get("r1").output_ids == [7]
    finally:
        proc.terminate()
        proc.wait()


def test_claiming_an_expired_record_does_not_bring_back_a_hash_without_a_ttl(redis_server):
    store = RequestStore.from_url(redis_server, prefix=f"state-{uuid.uuid4().hex[:8]}")
    record = RequestRecord(uuid.uuid4().hex, [1, 2], RequestParams())
    assert store.create(record)
    assert store.set_frontend(record.request_id, "10.0.0.1:1")
    assert store.get(record.request_id).frontend == "10.0.0.1:1"
    store.redis.delete(store.key(record.request_id))  # it expired (finished --finished-ttl ago)
    assert not store.set_frontend(record.request_id, "10.0.0.2:2")
    assert not store.redis.exists(store.key(record.request_id))
