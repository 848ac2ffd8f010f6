"""Fault injection: each process is SIGKILLed in the middle of 32 concurrent greedy streams on the default
model, and every client must still receive exactly the text and tokens of an undisturbed run, with no token
missing or repeated and no request lost. Real processes, a real redis-server with AOF, `conveyor up`'s own
supervisor restarting what dies.

Each case prints one line of figures (run with ``-s`` to see them): requests sent, completed, lost,
tokens duplicated and missing, and requests whose text differs from the undisturbed run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import extra_frontend, scrape, stop, supervised_stack, value, wait_child

from conveyor import grpc_util
from conveyor.client import Client
from conveyor.errors import ConveyorError
from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from detokenizer_svc.server import Channels

TOPICS = ["the sea", "a mountain", "coffee", "a robot", "the moon", "a library", "rain", "a train"]
ASKS = ["Write one sentence about {}.", "Describe {} briefly.", "Tell me a fact about {}.", "Give a title for a story about {}."]
PROMPTS = [ask.format(topic) for ask in ASKS for topic in TOPICS]  # 32 different chats
MAX_TOKENS = 32
HUNG_AFTER = 240.0  # seconds: a stream not finished by then is counted as hung


@dataclass
class Received:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    duplicated: int = 0
    missing: int = 0
    finish_reason: str | None = None
    error: str | None = None
    resumed: bool = False


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # every stream may speculate (--spec-max-batch above the 32 streams): each fault also hits requests with drafts
    # in flight, and the undisturbed reference is what they produce
    with supervised_stack(tmp_path_factory.mktemp("faults"), kv_cache_bytes=256 << 20, speculative="ngram",
                          spec_max_batch=64) as s:
        yield s


def _take(received: Received, delta) -> None:
    """Append a delta, counting tokens that overlap what arrived (duplicated) or skip past it (missing)."""
    have = len(received.tokens)
    if delta.first_token_index < have:
        received.duplicated += min(have - delta.first_token_index, len(delta.token_ids))
    elif delta.first_token_index > have:
        received.missing += delta.first_token_index - have
    received.tokens += delta.token_ids
    received.text += delta.text
    if delta.finish_reason:
        received.finish_reason = delta.finish_reason


def run_load(endpoint: str, tag: str, fault=None, resume_at: str | None = None, prompts: list[str] = PROMPTS,
             **options) -> list[Received]:
    """A stream per prompt, all at once; ``fault()`` runs once a quarter of the expected tokens has arrived.
    With ``resume_at``, a stream that breaks is resumed there from what it has. ``options``: the streams'."""
    results = [Received() for _ in prompts]
    arrived = [0]
    lock = threading.Lock()
    fired = threading.Event()

    def tick(n: int) -> None:
        with lock:
            arrived[0] += n
            due = fault is not None and not fired.is_set() and arrived[0] >= len(prompts) * MAX_TOKENS // 4
            if due:
                fired.set()
        if due:
            threading.Thread(target=fault, daemon=True).start()

    def one(i: int) -> None:
        got = results[i]
        with Client(endpoint, timeout=HUNG_AFTER) as client:
            stream = client.stream(messages=[{"role": "user", "content": prompts[i]}], temperature=0,
                                   max_tokens=MAX_TOKENS, request_id=f"{tag}-{i}", **options)
            try:
                for delta in stream:
                    _take(got, delta)
                    tick(len(delta.token_ids))
                return
            except ConveyorError as exc:
                if resume_at is None:
                    got.error = f"{type(exc).__name__}: {exc}"
                    return
        got.resumed = True
        with Client(resume_at, timeout=HUNG_AFTER) as other:
            try:
                for delta in other.resume(stream.request_id, stream.token_index, stream.text_offset):
                    _take(got, delta)
            except ConveyorError as exc:
                got.error = f"{type(exc).__name__} after resuming: {exc}"

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, range(len(prompts))))
    if fault is not None:
        assert fired.is_set(), "the fault never fired"
    return results


@pytest.fixture(scope="module")
def reference(stack) -> list[Received]:
    results = run_load(stack.endpoint, "undisturbed")
    assert all(r.error is None and r.finish_reason for r in results)
    assert _counter(stack, "scheduler", "conveyor_spec_accepted_tokens_total") > 0  # the streams did speculate
    return results


def _counter(stack, service: str, name: str) -> float:
    return value(scrape(stack.child(service).metrics), name)


def recovery_counters(stack) -> str:
    """What the recovery machinery did, from the processes' own metrics (counts since each (re)start)."""
    return (f"Redis records repaired {_counter(stack, 'scheduler', 'conveyor_redis_repairs_total'):.0f}, "
            f"replays {_counter(stack, 'detokenizer', 'conveyor_replays_total'):.0f}, "
            f"stalled streams {_counter(stack, 'frontend', 'conveyor_stalled_streams_total'):.0f}")


def check(name: str, results: list[Received], reference: list[Received], prompts: list[str] = PROMPTS) -> None:
    completed = sum(1 for r in results if r.finish_reason and r.error is None)
    lost = len(results) - completed
    duplicated = sum(r.duplicated for r in results)
    missing = sum(r.missing for r in results)
    differ = [i for i, (r, ref) in enumerate(zip(results, reference)) if (r.text, r.tokens) != (ref.text, ref.tokens)]
    tokens = sum(len(r.tokens) for r in results)
    print(f"\nFAULT {name}: sent {len(results)}, completed {completed}, lost {lost}, tokens {tokens}, "
          f"duplicated {duplicated}, missing {missing}, differing from undisturbed {len(differ)}, "
          f"resumed {sum(r.resumed for r in results)}")
    errors = [r.error for r in results if r.error]
    assert lost == 0, errors[:3]
    assert duplicated == 0 and missing == 0
    assert not differ, [(prompts[i], results[i].text, reference[i].text) for i in differ[:2]]


def _health(address: str, tls_dir: str | None = None) -> int:
    """A health check of a public (``tls_dir`` None) or internal address."""
    try:
        with (grpc_util.internal_channel(address, tls_dir) if tls_dir else grpc.insecure_channel(address)) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return -1


def _wait_all_serving(stack, timeout: float = 120.0) -> None:
    for child in stack.children:
        if child.health:
            wait_child(stack, child, timeout)


def _kill(stack, name: str, when: dict) -> None:
    when["t"] = time.monotonic()
    os.kill(stack.child(name).process.pid, signal.SIGKILL)


def test_worker_killed(stack, reference):
    when: dict = {}
    seen: dict = {}

    def fault() -> None:
        _kill(stack, "worker", when)
        scheduler = stack.child("scheduler").health
        while time.monotonic() - when["t"] < 5 and "scheduler" not in seen:  # it notices the worker is gone
            if _health(scheduler, stack.internal_tls_dir) == health_pb2.HealthCheckResponse.NOT_SERVING:
                seen["scheduler"] = time.monotonic() - when["t"]
            time.sleep(0.02)
        while time.monotonic() - when["t"] < 8 and "frontend" not in seen:  # and the public health follows
            if _health(stack.endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING:
                seen["frontend"] = time.monotonic() - when["t"]
            time.sleep(0.05)

    results = run_load(stack.endpoint, "worker", fault)
    check("worker", results, reference)
    assert seen.get("scheduler", 99) < 1.0, seen  # the scheduler marked the worker down within a second
    assert "frontend" in seen, seen
    _wait_all_serving(stack)
    assert _health(stack.endpoint) == health_pb2.HealthCheckResponse.SERVING


def test_scheduler_killed(stack, reference):
    results = run_load(stack.endpoint, "scheduler", lambda: _kill(stack, "scheduler", {}))
    check("scheduler", results, reference)
    _wait_all_serving(stack)
    print(f"after the scheduler restart: {recovery_counters(stack)}")


def test_detokenizer_killed(stack, reference):
    results = run_load(stack.endpoint, "detokenizer", lambda: _kill(stack, "detokenizer", {}))
    check("detokenizer", results, reference)
    _wait_all_serving(stack)
    print(f"after the detokenizer restart: {recovery_counters(stack)}")


def test_redis_killed_and_restarted_from_its_append_only_file(stack, reference):
    results = run_load(stack.endpoint, "redis", lambda: _kill(stack, "redis", {}))
    check("redis", results, reference)
    _wait_all_serving(stack)
    print(f"after the Redis restart: {recovery_counters(stack)}")


def test_frontend_killed_clients_resume_on_another_frontend(stack, reference):
    second, address = extra_frontend(stack)
    try:
        results = run_load(stack.endpoint, "frontend", lambda: _kill(stack, "frontend", {}), resume_at=address)
        check("frontend", results, reference)
        assert any(r.resumed for r in results)
    finally:
        stop(second)
    _wait_all_serving(stack)


def test_redis_that_lost_everything_gets_every_record_back_from_the_scheduler(stack, reference):
    """A Redis restarted without its data (FLUSHALL mid-load): the scheduler's next writes find the records
    missing and rewrite them whole from memory; clients notice nothing."""
    import redis as redis_py

    from conveyor.state import RequestStore

    store = RequestStore(redis_py.Redis.from_url(stack.redis_url))
    before = _counter(stack, "scheduler", "conveyor_redis_repairs_total")
    results = run_load(stack.endpoint, "flushed", lambda: store.redis.flushall())
    check("redis flushed", results, reference)
    repaired = _counter(stack, "scheduler", "conveyor_redis_repairs_total") - before
    print(f"records rewritten after the flush: {repaired:.0f}")
    assert repaired > 0
    for i, got in enumerate(results):  # the rewritten records are whole: the tokens every client received
        record = store.find(f"flushed-{i}")
        if record is not None:  # finished before the flush: gone with it, and nobody needs it
            assert record.status == "finished" and record.output_ids == got.tokens and record.prompt_ids
    assert sum(store.find(f"flushed-{i}") is not None for i in range(len(results))) > len(results) // 2


def test_deltas_a_stalled_frontend_missed_reach_it_after_redis_lost_everything(stack, reference):
    """The frontend stops answering (SIGSTOP) while its streams finish, then Redis loses everything: the
    detokenizer holds what it could not deliver and sends it once the frontend answers again, so every client
    gets its whole answer although Redis has nothing left to replay (the finished records went with it)."""
    import redis as redis_py

    frontend = stack.child("frontend").process
    stopped: dict = {}

    def fault() -> None:
        gave_up = time.monotonic() + Channels.ANSWER_SECONDS + Channels.DOWN_SECONDS + 0.5
        os.kill(frontend.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            with stack.channel("scheduler") as s:
                stub = scheduler_pb2_grpc.SchedulerStub(s)
                while time.monotonic() < deadline:  # every request finishes meanwhile; the frontend hears none
                    stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=10)
                    if not (stats.running or stats.waiting):
                        break
                    time.sleep(0.1)
            # the detokenizer gave up waiting for an answer, and the deltas after it found the frontend down
            time.sleep(max(0.0, gave_up - time.monotonic()))
            redis_py.Redis.from_url(stack.redis_url).flushall()
            stopped["finished"] = not (stats.running or stats.waiting)
        finally:
            os.kill(frontend.pid, signal.SIGCONT)

    results = run_load(stack.endpoint, "stalled", fault)
    assert stopped["finished"]
    check("frontend stalled, then redis flushed", results, reference)
    _wait_all_serving(stack)
    deadline = time.monotonic() + 30
    while True:  # the flush took the engine's registration too: it registers again at its next heartbeat
        try:
            with Client(stack.endpoint, timeout=30) as client:
                assert client.generate("Hi", max_tokens=1, temperature=0).completion_tokens == 1
            break
        except ConveyorError:
            assert time.monotonic() < deadline, "no engine serves again after the flush"
            time.sleep(0.2)


def test_worker_restarted_with_a_smaller_cache_is_adopted(stack, reference):
    """The worker comes back with another memory budget: the scheduler re-reads its capacity."""
    from conveyor.v1 import worker_pb2, worker_pb2_grpc

    def stats():
        with stack.channel("scheduler") as s:
            return scheduler_pb2_grpc.SchedulerStub(s).Stats(scheduler_pb2.StatsRequest(), timeout=10)

    worker = stack.child("worker")
    old_blocks = stats().num_blocks
    flag = worker.argv.index("--kv-cache-bytes")
    worker.argv[flag + 1] = str(int(worker.argv[flag + 1]) // 2)  # what the supervisor will start next
    results = run_load(stack.endpoint, "resized", lambda: _kill(stack, "worker", {}))
    check("worker with half the cache", results, reference)
    with stack.channel("worker") as w:
        blocks = worker_pb2_grpc.WorkerStub(w).Info(worker_pb2.InfoRequest(), timeout=10).num_blocks
    after = stats()
    assert blocks < old_blocks
    assert after.num_blocks == blocks and after.free_blocks == blocks  # adopted, and all given back


def test_a_cancel_while_the_scheduler_is_down_still_aborts_the_request(stack):
    """The frontend keeps retrying the abort, so the restarted scheduler drops the request at once (not
    after the detokenizer's orphan timeout of 30 s)."""
    import redis as redis_py

    from conveyor.state import RequestStore

    store = RequestStore(redis_py.Redis.from_url(stack.redis_url))
    with Client(stack.endpoint, timeout=120) as client:
        stream = client.stream(messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=2000,
                               ignore_eos=True, request_id="cancelled-while-down")
        next(iter(stream))  # running
        _kill(stack, "scheduler", {})
        stream.cancel()
        killed = time.monotonic()
        while True:
            record = store.find("cancelled-while-down")
            if record.status == "finished":
                break
            assert time.monotonic() - killed < 25, "not aborted before the orphan timeout"
            time.sleep(0.2)
    assert record.finish_reason == "abort" and len(record.output_ids) < 2000
    _wait_all_serving(stack)


SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "maxItems": 4}},
          "required": ["title", "words"], "additionalProperties": False}
JSON_PROMPTS = [f"{p} Answer in JSON." for p in PROMPTS[:16]]


def test_worker_then_scheduler_killed_under_constrained_streams(stack):
    """16 streams held to a JSON schema; the worker is killed, then (once it serves again) the scheduler.
    Each sequence's matcher is rebuilt by replaying its output on registration, so every client gets the
    undisturbed text exactly, and what finished with "stop" validates."""
    import json

    import jsonschema

    structured = {"json_schema": SCHEMA}
    reference = run_load(stack.endpoint, "json-undisturbed", prompts=JSON_PROMPTS, structured=structured)
    assert all(r.error is None and r.finish_reason for r in reference)

    fired = []

    def faults() -> None:
        worker = stack.child("worker")
        killed = worker.process
        _kill(stack, "worker", {})
        deadline = time.monotonic() + 60
        while worker.process is killed and time.monotonic() < deadline:  # the supervisor starts another
            time.sleep(0.05)
        wait_child(stack, worker)
        _kill(stack, "scheduler", {})
        fired.append("scheduler")

    results = run_load(stack.endpoint, "json-faults", faults, prompts=JSON_PROMPTS, structured=structured)
    assert fired == ["scheduler"]  # both faults happened while the streams ran
    check("worker then scheduler, constrained", results, reference, JSON_PROMPTS)
    stopped = [r for r in results if r.finish_reason == "stop"]
    for r in stopped:
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert stopped, [r.text for r in results][:2]
    _wait_all_serving(stack)
