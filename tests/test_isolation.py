"""One request never hurts another: its id cannot take another's, its failing steps end it alone, a hung
worker loses nothing, its per-token work is bounded, and a stale stream cannot take its delivery back.

One real stack whose worker has a fault injected (``--fail-on-token``: every step that computes one rare
token fails, as a kernel or device error would) and a short step timeout, plus an API-keyed frontend and a
second frontend. The same behaviours below the stack: ``test_engine_loop.py`` (the step loop alone),
``test_detokenizer.py`` (bounded decoding), ``test_security.py`` (secrets).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import drained, extra_frontend, scheduler_stats, start_stack, stop

from conveyor.client import Client
from conveyor.errors import AlreadyExists, ConveyorError, InvalidArgument
from conveyor.state import RequestStore
from conveyor.tokenizer import load_tokenizer

POISON_WORD = " xylophone"  # its first token is the injected fault: no other prompt or answer here has it
STEP_TIMEOUT = 3.0
FINISHED_TTL = 2.0
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-fedcba9876543210"}
CHAT = [{"role": "user", "content": "Count from one to twenty in words."}]


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short poem about the number {i}."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def poison_token(tokenizer) -> int:
    return tokenizer.encode(POISON_WORD, add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, poison_token):
    with pytest.MonkeyPatch.context() as env:  # the children keep the environment they started with
        env.setenv("CONVEYOR_WORKER_FAIL_ON_TOKEN", str(poison_token))
        env.setenv("CONVEYOR_SCHEDULER_STEP_TIMEOUT", str(STEP_TIMEOUT))
        s = start_stack(tmp_path_factory.mktemp("isolation"), kv_cache_bytes=128 << 20, finished_ttl=FINISHED_TTL)
    yield s
    s.stop()


def _store(stack) -> RequestStore:
    return RequestStore.from_url(stack.redis_url)


def _stub(stack, name: str):
    channel = stack.channel(name)
    return channel, health_pb2_grpc.HealthStub(channel)


def _serving(stack, name: str) -> bool:
    channel, stub = _stub(stack, name)
    with channel:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


# ---------------------------------------------------------------- ids name one request, within one API key


def test_ids_shaped_like_another_requests_keys_do_not_collide(stack):
    ids = ["x", "x:out", "x:out:out", "inflight", "conveyor:inflight"]
    with Client(stack.endpoint, timeout=90) as client:
        streams = [client.stream(messages=CHAT, temperature=0, max_tokens=16, ignore_eos=True, request_id=i)
                   for i in ids]  # all in flight together
        results = [list(s) for s in streams]
    for rid, deltas in zip(ids, results):
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 16
        assert {d.request_id for d in deltas} == {rid}
    assert len({"".join(d.text for d in deltas) for deltas in results}) == 1  # the same greedy answer each
    store = _store(stack)
    records = [store.find(rid) for rid in ids]
    assert [r.client_id for r in records] == ids and len({r.request_id for r in records}) == len(ids)
    assert all(len(r.output_ids) == 16 and r.status == "finished" for r in records)
    assert _serving(stack, "scheduler")


def test_request_ids_belong_to_their_api_key(keyed):
    alice = Client(keyed, timeout=90, api_key=KEYS["alice"])
    bob = Client(keyed, timeout=90, api_key=KEYS["bob"])
    with alice, bob:
        mine = alice.stream(messages=CHAT, temperature=0, max_tokens=300, ignore_eos=True, request_id="shared-1")
        deltas = iter(mine)
        first = next(deltas)  # running
        theirs = bob.generate(messages=CHAT, temperature=0, max_tokens=4, request_id="shared-1")
        assert theirs.completion_tokens == 4  # the same id, another key: another request
        with pytest.raises(AlreadyExists, match="this API key"):
            alice.generate("Hello", max_tokens=2, request_id="shared-1")  # unique per key while it lives
        assert not bob.abort("shared-1")  # bob's own (finished) request, not alice's
        assert alice.abort("shared-1")
        rest = list(deltas)
        assert rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 300


def test_an_id_used_again_after_its_record_expired_is_a_new_request(stack):
    with Client(stack.endpoint, timeout=90) as client:
        reference = client.generate(messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True)
        stop = reference.text.split()[2]  # ends the first use early, with a stop string
        first = client.generate(messages=CHAT, temperature=0, max_tokens=24, stop=[stop], request_id="again-1")
        assert first.finish_reason == "stop" and first.completion_tokens < 24
        store = _store(stack)
        deadline = time.monotonic() + FINISHED_TTL + 10
        while store.lookup("", "again-1") is not None:  # its record (and the name) expire
            assert time.monotonic() < deadline
            time.sleep(0.1)
        again = client.generate(messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True, request_id="again-1")
    assert again.finish_reason == "length" and again.token_ids == reference.token_ids and again.text == reference.text


# ---------------------------------------------------------------- a request whose steps fail, a worker that hangs


def test_a_request_that_fails_every_step_ends_alone_and_the_others_finish(stack, tokenizer, poison_token):
    prompts = [_chat(i) for i in range(6)]
    with Client(stack.endpoint, timeout=120) as client:
        undisturbed = [client.stream(messages=p, temperature=0, max_tokens=16, ignore_eos=True) for p in prompts]
        reference = [[t for d in s for t in d.token_ids] for s in undisturbed]
        poison = [{"role": "user", "content": f"Tell me about the{POISON_WORD}."}]
        assert poison_token in client.tokenize(messages=poison)
        started = time.monotonic()
        bad = client.stream(messages=poison, temperature=0, max_tokens=16, request_id="poison-1")
        good = [client.stream(messages=p, temperature=0, max_tokens=16, ignore_eos=True) for p in prompts]
        with pytest.raises(ConveyorError, match="max-step-failures") as failed:
            list(bad)
        assert failed.value.code == "INTERNAL"
        got = [[t for d in s for t in d.token_ids] for s in good]
        elapsed = time.monotonic() - started
    assert got == reference  # every other request finished, exactly as undisturbed
    assert elapsed < 60
    record = _store(stack).find("poison-1")
    assert record.finish_reason == "error" and "injected fault" in record.error
    assert drained(stack).free_blocks == scheduler_stats(stack).num_blocks  # nothing left holding blocks


def test_a_worker_that_stops_answering_is_declared_dead_and_no_request_is_lost(stack):
    worker = stack.child("worker").process
    with Client(stack.endpoint, timeout=120) as client:
        # long enough to be still generating when the worker is stopped (a worker with no step in flight
        # cannot be seen to hang)
        with ThreadPoolExecutor(3) as pool:  # the undisturbed run, batched as the disturbed one will be
            reference = list(pool.map(lambda i: client.generate(messages=_chat(i), temperature=0, max_tokens=200,
                                                                ignore_eos=True).token_ids, range(3)))
        streams = [client.stream(messages=_chat(i), temperature=0, max_tokens=200, ignore_eos=True) for i in range(3)]
        iterators = [iter(s) for s in streams]
        firsts = [next(it) for it in iterators]
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while _serving(stack, "scheduler"):
                assert time.monotonic() - stopped < STEP_TIMEOUT + 5, "a hung worker was never declared dead"
                time.sleep(0.1)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        got = [f.token_ids + [t for d in it for t in d.token_ids] for f, it in zip(firsts, iterators)]
    assert got == reference
    deadline = time.monotonic() + 20
    while not _serving(stack, "scheduler"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ---------------------------------------------------------------- per-token work is bounded


def test_per_token_work_has_limits_that_name_their_flag(stack):
    with Client(stack.endpoint, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="max-stop-token-ids"):
            client.generate("Hi", max_tokens=2, stop_token_ids=list(range(100, 165)))
        with pytest.raises(InvalidArgument, match="max-logit-bias"):
            client.generate("Hi", max_tokens=2, logit_bias={i: 1.0 for i in range(100, 401)})
        assert client.generate("Hi", max_tokens=2, stop_token_ids=list(range(100, 164)),
                               logit_bias={i: 1.0 for i in range(100, 400)}).completion_tokens >= 1


# ---------------------------------------------------------------- only the owner moves delivery


def test_a_stale_stream_does_not_take_delivery_back_from_where_the_client_resumed(stack):
    """A stream whose client went away unnoticed (never read again) sees Redis get ahead of it and replays;
    that must not move delivery back to its frontend: before, it did, the resumed stream then heard nothing
    until its own stall check (2 s) replayed it back, and the two frontends took turns."""
    proc, other = extra_frontend(stack)
    try:
        with Client(stack.endpoint, timeout=120) as first, Client(other, timeout=120) as second:
            # long enough (~4 s) for the stale stream to see Redis ahead twice (1 s apart) and replay
            stale = first.stream(messages=CHAT, temperature=0, max_tokens=400, ignore_eos=True)
            head = next(iter(stale))  # the first stream stays open but is never read again (half-open)
            resumed = second.resume(stale.request_id, len(head.token_ids), len(head.text))
            arrivals, count = [], len(head.token_ids)
            for delta in resumed:
                count += len(delta.token_ids)
                arrivals.append(time.monotonic())
            stale.cancel()
    finally:
        stop(proc)
    assert count == 400 and delta.finish_reason == "length"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[-1] - arrivals[0] > 2.5  # the stale stream had time to replay (it does, every ~2 s)
    assert max(gaps) < 1.0, f"the resumed stream stalled for {max(gaps):.1f} s: delivery went elsewhere"
