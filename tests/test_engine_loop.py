"""The scheduler's step loop alone (``scheduler_svc.engine``), against a real Redis, with the worker played
by ``FakeWorker``: a ``StepTransport`` that answers like a worker (each sampled token a function of its
position, so the right output is known) and injects the faults a test names. No gRPC, no model: each test
runs in milliseconds to a second, where the same faults through a whole stack take tens of seconds."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import deque

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from conveyor.engines import EngineInfo, Lease, Registry
from conveyor.metrics import Metrics
from conveyor.params import RequestParams
from conveyor.state import RequestRecord, RequestStore
from conveyor.v1 import detokenizer_pb2
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine import Engine, StepFailed
from scheduler_svc.membership import Membership
from scheduler_svc.policy import Answer, Scheduler, StepPlan
from scheduler_svc.request import Request
from scheduler_svc.server import Publisher
from helpers import FlakyLink

BLOCKS, BLOCK_SIZE, MAX_LEN = 64, 4, 256


def token_at(position: int) -> int:
    """The token the fake worker samples at a sequence position (never an eos)."""
    return 100 + position % 50


def expected(prompt: list[int], n: int) -> list[int]:
    return [token_at(len(prompt) + i) for i in range(n)]


class FakeWorker:
    """Answers steps in order, as the worker does, and checks what a worker would: each chunk starts where its
    sequence stands (a ``decode_last`` chunk feeds the token it sampled in the step before). ``fault(plan)``
    may return an exception to raise instead of an answer."""

    def __init__(self):
        self.queue: deque[StepPlan] = deque()
        self.lengths: dict[str, int] = {}
        self.max_in_flight = 0
        self.decode_last = 0
        self.resets = 0
        self.answered: list[StepPlan] = []
        self.fault = lambda plan: None
        self.unreachable = 0  # capacity() raises this many more times (a worker restarting)

    def send(self, plan: StepPlan) -> None:
        self.queue.append(plan)
        self.max_in_flight = max(self.max_in_flight, len(self.queue))

    def receive(self, plan: StepPlan) -> Answer:
        sent = self.queue.popleft()
        assert sent is plan, "answers come in the order steps were sent"
        if (exc := self.fault(plan)) is not None:
            raise exc
        if plan.free_all:
            self.lengths.clear()
        for rid in plan.free_ids:
            self.lengths.pop(rid, None)
        sampled = {}
        for c in plan.chunks:
            rid = c.request.request_id
            if c.registers:
                self.lengths[rid] = len(c.cached_ids)
            if self.lengths.get(rid) != c.start_pos:
                raise StepFailed(f"{rid} starts at {c.start_pos}, its sequence has {self.lengths.get(rid)}", rid)
            self.decode_last += c.decode_last
            self.lengths[rid] += 1 if c.decode_last else len(c.token_ids)
            if c.sample:
                sampled[rid] = (token_at(self.lengths[rid]), None)
        self.answered.append(plan)
        return Answer(sampled)

    def reset(self) -> None:
        self.queue.clear()
        self.lengths.clear()
        self.resets += 1

    def capacity(self) -> tuple[int, int, int]:
        if self.unreachable > 0:
            self.unreachable -= 1
            raise ConnectionError("the worker is restarting")
        return BLOCKS, BLOCK_SIZE, MAX_LEN


class Stack:
    """An engine on a fresh Redis prefix with a fake worker; records what it publishes and its health."""

    def __init__(self, redis_url: str, name: str = "", lease: Lease | None = None, depth: int = 2, seqs: int = 8):
        self.store = RequestStore.from_url(redis_url, prefix=f"test-{uuid.uuid4().hex[:8]}")
        self.worker = FakeWorker()
        self.published: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.health: list[bool] = []
        self.disorder: list[str] = []  # what was published out of order or twice
        self.lock = threading.Lock()
        scheduler = Scheduler(BlockManager(BLOCKS, BLOCK_SIZE), MAX_LEN, 64, seqs, 64, max_step_failures=3)
        self.engine = Engine(scheduler, self.store, self.worker, self.publish, eos_token_ids=(2,), depth=depth,
                             name=name, lease=lease)
        self.engine.health.on_change = self.health.append

    def publish(self, step: int, outputs) -> None:
        with self.lock:
            for o in outputs:
                got = self.published.setdefault(o.request.request_id, [])
                if len(got) != o.first_index:
                    self.disorder.append(f"{o.request.request_id}: index {o.first_index} after {len(got)} tokens")
                got += o.token_ids
                if o.finish_reason is not None:
                    self.finished[o.request.request_id] = o.finish_reason

    def request(self, prompt: list[int], max_tokens: int, engine: str = "") -> str:
        record = RequestRecord(uuid.uuid4().hex, prompt, RequestParams.of(max_tokens=max_tokens), engine=engine)
        assert self.store.create(record)
        return record.request_id

    def wait(self, request_ids: list[str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(rid in self.finished for rid in request_ids):
            assert time.monotonic() < deadline, f"unfinished: {set(request_ids) - set(self.finished)}"
            time.sleep(0.005)

    def __enter__(self) -> Stack:
        self.engine.start()
        return self

    def __exit__(self, *exc) -> None:
        self.engine.stop()
        assert self.disorder == [], "published in order, each token once"


def held(gate: threading.Event, when: bool = True) -> None:
    """A fault that is no error: the worker takes until ``gate`` opens to answer (when ``when``)."""
    if when:
        gate.wait(5)


PROMPTS = [[5 + i, 6, 7, 8, 9, 10 + i][: 3 + i % 4] for i in range(6)]


def run_all(stack: Stack, max_tokens: int = 12, engine: str = "") -> list[str]:
    rids = [stack.request(p, max_tokens, engine) for p in PROMPTS]
    for rid in rids:
        stack.engine.submit(rid)
    return rids


def assert_exact(stack: Stack, rids: list[str], max_tokens: int = 12) -> None:
    """Every request published and recorded exactly the tokens an undisturbed run gives."""
    for rid, prompt in zip(rids, PROMPTS):
        want = expected(prompt, max_tokens)
        assert stack.published[rid] == want and stack.finished[rid] == "length"
        record = stack.store.get(rid)
        assert (record.output_ids, record.status, record.finish_reason) == (want, "finished", "length")


def test_two_steps_wait_on_the_worker_and_the_second_decodes_the_token_the_first_samples(redis_server):
    with Stack(redis_server) as stack:
        rids = run_all(stack)
        stack.wait(rids)
    assert stack.worker.max_in_flight == 2  # the next step was queued before the previous one was answered
    assert stack.worker.decode_last > 0  # ...so it fed "the token sampled last", unknown when it was sent
    assert_exact(stack, rids)
    assert stack.health == [] and stack.worker.resets == 0


def test_depth_one_waits_for_each_answer(redis_server):
    with Stack(redis_server, depth=1) as stack:
        rids = run_all(stack)
        stack.wait(rids)
    assert stack.worker.max_in_flight == 1 and stack.worker.decode_last == 0
    assert_exact(stack, rids)


def test_a_step_that_fails_without_a_culprit_finds_it_alone_and_the_others_finish(redis_server):
    """The worker fails every step that computes one request and names nobody: everyone in the step becomes
    a suspect and runs alone; the culprit is blamed in its own steps and ends with an error after
    ``max_step_failures``; the others finish with exactly their undisturbed tokens; the worker is up all along."""
    stack = Stack(redis_server)
    poison = stack.request([1, 2, 3], 12)
    failed: list[int] = []  # the size of each step that failed

    def fault(plan):
        if any(c.request.request_id == poison for c in plan.chunks):
            failed.append(len(plan.chunks))
            return StepFailed("INTERNAL: injected")

    stack.worker.fault = fault
    stack.engine.submit(poison)
    rids = run_all(stack)  # all queued before the first step: the poison is batched with the others
    with stack:
        stack.wait([poison, *rids])
    assert failed == [len(rids) + 1, 1, 1, 1]  # unnamed: no blame; then blamed in steps of its own, 3 times
    assert stack.finished[poison] == "error"
    record = stack.store.get(poison)
    assert record.finish_reason == "error" and "max-step-failures 3" in record.error and record.output_ids == []
    assert_exact(stack, rids)
    assert stack.health == []  # the worker answered: a refusal is not an outage


def test_a_worker_that_times_out_is_marked_down_reattached_and_nothing_is_lost(redis_server):
    with Stack(redis_server) as stack:
        faults = iter([None] * 3 + [TimeoutError("the worker did not answer step (injected)")])
        stack.worker.fault = lambda plan: next(faults, None)
        stack.worker.unreachable = 3  # it takes a few tries to come back
        rids = run_all(stack)
        stack.wait(rids)
    assert stack.health == [False, True]  # down at the timeout, up with the next answer
    assert stack.worker.resets == 1
    assert_exact(stack, rids)


class FlakyRedis:
    """Wraps a store's step writers: while ``down``, every write fails as if Redis were unreachable; a record
    in ``refused`` is reported back as refused by every write that touches it once that many have landed (as
    Redis does with a key that is not a hash), rewritten whole or not."""

    def __init__(self, store: RequestStore):
        self.writer, self.down, self.failed = store.writer, threading.Event(), 0
        self.refused: dict[str, int] = {}  # request id -> writes that land before the refusals
        store.writer = self.make

    def make(self):
        real, flaky, touched = self.writer(), self, set()

        class Writer:
            def __getattr__(self, name):
                method = getattr(real, name)

                def call(first, *args, **kwargs):  # every write names its request first (restore: its record)
                    rid = getattr(first, "request_id", first)
                    touched.add(rid)
                    if flaky.refused.get(rid, 1) > 0:  # a refused record's writes never land
                        method(first, *args, **kwargs)

                return call

            def execute(self, owner: str = ""):
                if flaky.down.is_set():
                    flaky.failed += 1
                    raise RedisConnectionError("Redis is unreachable (injected)")
                lost = real.execute(owner)
                for rid in flaky.refused.keys() & touched:
                    if flaky.refused[rid] > 0:
                        flaky.refused[rid] -= 1
                    else:
                        lost.add(rid)
                return lost

        return Writer()


def test_a_redis_outage_holds_the_step_back_until_redis_has_it(redis_server):
    """While Redis refuses writes, nothing is published (a client must never see a token Redis lacks) and the
    health says NOT_SERVING; once Redis is back the step is written whole, then published, and every
    request finishes with exactly its tokens."""
    with Stack(redis_server) as stack:
        flaky = FlakyRedis(stack.store)
        flaky.down.set()
        rids = run_all(stack)
        deadline = time.monotonic() + 5
        while stack.health != [False]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        assert stack.published == {} and flaky.failed >= 2  # retried, nothing published meanwhile
        flaky.down.clear()
        stack.wait(rids)
    assert stack.health == [False, True]
    assert_exact(stack, rids)


def test_steps_wait_while_the_lease_is_stale_and_leave_out_what_another_engine_took(redis_server):
    """An engine whose heartbeat stopped getting through writes nothing (its lease is stale) and publishes
    nothing; when the heartbeat is back, it drops the request another engine took meanwhile and finishes the
    others."""
    lease = Lease(ttl=0.4)
    with Stack(redis_server, name="a", lease=lease) as stack:
        registry = Registry(stack.store)
        membership = Membership(stack.engine, registry, "127.0.0.1:1", "m", Metrics("scheduler"))
        membership.beat()
        time.sleep(0.35)  # no heartbeat: the lease is stale (at 3/4 of the ttl); the registration expires
        assert not lease.fresh()
        rids = run_all(stack, engine="a")
        time.sleep(0.2)
        assert stack.published == {} and stack.worker.answered  # computed, but neither written nor published
        assert all(stack.store.get(rid).status == "waiting" for rid in rids)
        time.sleep(0.1)
        registry.heartbeat(EngineInfo("b", "y"), ttl=30)
        taken = rids[0]
        assert sorted(registry.claim("a", "b")) == sorted(rids)
        for rid in rids[1:]:
            assert registry.reassign(rid, "b", "a")  # b hands the others back: one moved for good
        membership.beat()
        stack.wait(rids[1:])
        time.sleep(0.1)
    assert taken not in stack.finished and taken not in stack.engine.held()
    assert stack.store.get(taken).output_ids == [] and taken not in stack.published  # nothing of it here
    for rid, prompt in zip(rids[1:], PROMPTS[1:]):
        assert stack.published[rid] == expected(prompt, 12) == stack.store.get(rid).output_ids


def test_a_record_redis_keeps_refusing_ends_that_request_alone(redis_server):
    """Redis refuses one request's record even rewritten whole: that request ends with an error (published
    once, after the tokens Redis took), and the others finish exactly, the health unchanged."""
    with Stack(redis_server) as stack:
        flaky = FlakyRedis(stack.store)
        bad = stack.request([1, 2, 3], 12)
        stack.engine.submit(bad)
        flaky.refused[bad] = 4  # its first four steps land (the first registers it and samples)
        rids = run_all(stack)
        stack.wait([bad, *rids])
    assert stack.finished[bad] == "error"
    assert stack.published[bad] == stack.store.get(bad).output_ids == expected([1, 2, 3], 4)  # nothing after
    assert_exact(stack, rids)
    assert stack.health == []


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_during_a_step_frees_its_blocks_and_drops_its_result(redis_server, depth):
    with Stack(redis_server, depth=depth) as stack:
        gate = threading.Event()
        stack.worker.fault = lambda plan: held(gate)
        rid = stack.request([1, 2, 3], 50)
        stack.engine.submit(rid)
        others = run_all(stack)
        time.sleep(0.05)
        assert stack.engine.abort(rid)
        gate.set()
        stack.wait([rid, *others])
    assert stack.finished[rid] == "abort"
    record = stack.store.get(rid)
    assert record.finish_reason == "abort" and len(record.output_ids) < 50
    assert_exact(stack, others)
    assert stack.engine.snapshot().free_blocks == BLOCKS


# ---------------------------------------------------------------- the loop's own failure, and what a step writes


def test_an_engine_loop_that_dies_says_so_and_goes_not_serving(redis_server):
    scheduler = Scheduler(BlockManager(8, 4), 32, 16, 4, 4)

    def broken():
        raise RuntimeError("a bug in the loop (injected)")

    scheduler.schedule = broken
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    engine = Engine(scheduler, store, transport=None, publish=lambda *a: None, eos_token_ids=(2,))
    crashed, health = [], []
    engine.on_crash, engine.health.on_change = crashed.append, health.append
    scheduler.free_all = True  # something to do: the loop calls schedule()
    engine.start()
    engine._thread.join(timeout=10)
    assert not engine._thread.is_alive()
    assert len(crashed) == 1 and "injected" in str(crashed[0]) and health == [False]


def test_a_stop_string_finish_during_a_step_does_not_move_the_steps_token(redis_server):
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    scheduler = Scheduler(BlockManager(64, 4), 1000, 32, 8, 16)
    record = RequestRecord(uuid.uuid4().hex, [10, 11, 12], RequestParams.of(max_tokens=50))
    assert store.create(record)
    rid = record.request_id
    scheduler.add(Request.from_record(record, (2,)))
    engine = Engine(scheduler, store, transport=None, publish=lambda *a: None, eos_token_ids=(2,))

    def step(token: int):
        plan = scheduler.schedule()
        return plan, scheduler.update(plan, {rid: (token, None)})

    for token in (20, 21, 22, 23):
        engine._write_and_publish(*step(token), [])
    plan, outputs = step(24)  # the step that samples output token 4 is answered...
    finish = scheduler.finish_at(rid, 2)  # ...and a stop string's Finish cuts the output before it is written
    engine._write_and_publish(plan, outputs, [])
    assert store.get(rid).output_ids == [20, 21, 22, 23, 24]  # token 4 at index 4, not at index 2
    engine._write_and_publish(StepPlan(0, [], []), [], [finish])  # the Finish's own write trims
    assert store.get(rid).output_ids == [20, 21] and store.get(rid).finish_reason == "stop"


@pytest.mark.parametrize("seed", [1, 2])
def test_the_detokenizer_takes_every_batch_once_in_order_when_it_answers_late_refuses_or_hangs_up(seed):
    """A detokenizer that answers late, refuses some batches and hangs up on some unanswered (``FlakyLink``). The
    step loop sends batches itself while their answers keep up and hands them to the publisher's thread when they
    do not: however the two trade the link, every batch is taken once, in order, including the last of a burst,
    which no later batch comes to settle: its detokenizer hung up on it, and the thread sends it again."""
    refusals, hang_up_on, taken = random.Random(seed), {40, 120, 201}, []

    def answer(batch):
        if batch.step in hang_up_on:  # the first time
            hang_up_on.discard(batch.step)
            return None
        retry = batch.step <= 180 and refusals.random() < 0.05  # as when it cannot read a request from Redis
        if not retry:
            taken.append(batch.step)
        return detokenizer_pb2.PushResponse(step=batch.step, retry=retry)

    detokenizer = FlakyLink(seed, detokenizer_pb2.TokenBatch.FromString, answer)
    publish = Publisher(detokenizer.stub(), "127.0.0.1:1", timeout=5.0)
    pace = random.Random(seed)
    for step in range(1, 201):
        publish(step, [])
        time.sleep(pace.choice((0, 0.0005, 0.002, 0.006)))
    deadline = time.monotonic() + 10
    while len(taken) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # all answered: the next batch goes from the step loop itself
    publish(201, [])  # the detokenizer hangs up on it, and no step comes after it
    while len(taken) < 201 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert taken == list(range(1, 202))
    assert detokenizer.links == 4  # the first, and one after each hang-up
