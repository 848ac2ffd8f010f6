"""``conveyor serve scheduler``: the Scheduler gRPC service, the worker client and the detokenizer feed.

Protobuf is converted to the engine's dataclasses here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import replace

import grpc

from conveyor import grpc_util
from conveyor.engines import Lease, Registry
from conveyor.errors import Unavailable
from conveyor.metrics import Metrics
from conveyor.params import to_pb
from conveyor.state import RequestStore
from conveyor.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from conveyor.v1 import worker_pb2, worker_pb2_grpc
from conveyor.link import LinkError, Peer
from conveyor.wire import FINISH_TO_PB, logprobs_to_pb
from conveyor.prefix import root_key
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine, StepFailed
from scheduler_svc.membership import Membership
from scheduler_svc.policy import Answer, Output, Scheduler, StepPlan
from scheduler_svc.request import Request

log = logging.getLogger("conveyor.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


# ---------------------------------------------------------------- protobuf <-> dataclasses


def registration_pb(request: Request, chunk: worker_pb2.SequenceChunk | None = None) -> worker_pb2.SequenceChunk:
    """What the worker needs to register ``request``'s sequence: its sampling parameters (prompt_logprobs only
    while the prompt is still to be scored), its stop ids (the model's eos included) and its constraint.
    Raises for data that does not fit the wire."""
    chunk = chunk if chunk is not None else worker_pb2.SequenceChunk()
    p = request.params
    to_pb(replace(p.sampling, prompt_logprobs=p.sampling.prompt_logprobs if request.scores_prompt else None),
          chunk.sampling)
    to_pb(replace(p.stop, stop=(), stop_token_ids=request.stop_ids), chunk.stop)
    if p.structured is not None:
        p.structured.to_pb(chunk.structured)
    chunk.num_prompt_tokens = len(request.prompt_ids)
    return chunk


def chunk_pb(c, chunk: worker_pb2.SequenceChunk) -> None:
    """Fill ``chunk`` (added to its step in place) with ``c``: only the fields that are set, since a decode's chunk
    holds little more than its id, and building one is most of a step's message at a few hundred requests."""
    chunk.seq_id, chunk.start_pos, chunk.sample, chunk.decode_last = (c.request.request_id, c.start_pos, c.sample,
                                                                     c.decode_last)
    if c.token_ids:
        chunk.token_ids.extend(c.token_ids)
    if c.new_blocks:
        chunk.new_block_ids.extend(c.new_blocks)
    if c.max_drafts:
        chunk.max_drafts = c.max_drafts
    if c.registers:
        registration_pb(c.request, chunk)
        chunk.cached_token_ids.extend(c.cached_ids)


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepRequest:
    """The step on the wire. A chunk whose request's data does not fit the wire (a value out of a field's
    range: a bug upstream, or a record written by an older frontend) fails that request alone
    (``StepFailed`` with ``fatal``), never the worker's health or the other requests."""
    step = worker_pb2.StepRequest(step_id=plan.step, free_seq_ids=plan.free_ids, free_all=plan.free_all)
    add = step.chunks.add
    for c in plan.chunks:
        try:
            chunk_pb(c, add())
        except Exception as exc:  # noqa: BLE001 - whatever this request's data raised, it is this request's
            raise StepFailed(f"{type(exc).__name__}: {exc}", c.request.request_id, fatal=True) from exc
    return step


def _alternatives(t: worker_pb2.SampledToken) -> list[tuple[int, float]]:
    return [(a.token_id, a.logprob) for a in t.top_logprobs]


def sampled_from_pb(plan: StepPlan, reply: worker_pb2.StepResponse) -> Answer:
    """The worker's answer, in one pass over its tokens (a step's few hundred are most of the scheduler's reading)."""
    wants = {c.request.request_id for c in plan.chunks if c.request.params.sampling.logprobs is not None}

    def token(t: worker_pb2.SampledToken, seq_id: str) -> tuple[int, object]:
        return t.token_id, (t.logprob, _alternatives(t)) if seq_id in wants else None

    answer = Answer({})
    sampled = answer.sampled
    for t in reply.tokens:
        seq_id = t.seq_id
        if t.error:
            answer.failed[seq_id] = t.error
            continue
        sampled[seq_id] = token(t, seq_id)
        if t.accepted:
            answer.accepted[seq_id] = [token(a, seq_id) for a in t.accepted]
        if t.drafted:
            answer.drafted[seq_id] = t.drafted
    answer.scored = {p.seq_id: (p.first_position, [(t.token_id, t.logprob, rank, _alternatives(t))
                                                   for t, rank in zip(p.tokens, p.ranks)])
                     for p in reply.prompt_logprobs}
    return answer


def outputs_to_pb(step: int, outputs: list[Output]) -> detokenizer_pb2.TokenBatch:
    """A step's outputs for the detokenizer, each entry added in place with only the fields that are set (one
    token and no finish, most of them)."""
    batch = detokenizer_pb2.TokenBatch(step=step)
    add = batch.requests.add
    for o in outputs:
        entry = add(request_id=o.request.request_id, first_index=o.first_index)
        entry.token_ids.extend(o.token_ids)
        if o.finish_reason is not None:
            entry.finish_reason = FINISH_TO_PB[o.finish_reason]
            entry.stopped_by_token = o.finish_reason == "stop" and o.request.stopped_by_token
        if o.logprobs:
            entry.logprobs.extend(logprobs_to_pb(t, lp) for t, lp in zip(o.token_ids, o.logprobs))
    return batch


# ---------------------------------------------------------------- the worker feed


class StepChannel:
    """Steps to the worker over its step link (``conveyor.link``): sent in order, answered in order, both on the
    engine's thread (no hand-off per step), so ``receive`` can give up on a worker that stopped answering (hung,
    or its host gone without a reset) after ``step_timeout`` seconds. The link's port comes from the worker's
    ``Link`` call; it is opened at the first step and after every ``reset``."""

    REFUSED = ("INVALID_ARGUMENT", "INTERNAL", "UNKNOWN", "RESOURCE_EXHAUSTED")  # the worker is alive, failed it

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, address: str, step_timeout: float = 0.0):
        self.stub = stub
        self.worker = Peer(stub.Link, address)
        self.step_timeout = step_timeout or None

    def send(self, plan: StepPlan) -> None:
        step = plan_to_pb(plan)  # a request's data that does not fit the wire fails before anything is sent
        self.worker.open().send(step)

    def receive(self, plan: StepPlan) -> Answer:
        try:
            reply = self.worker.link.receive(worker_pb2.StepResponse.FromString, self.step_timeout)
        except TimeoutError:
            raise TimeoutError(f"the worker did not answer step {plan.step} within {self.step_timeout:g} s "
                               "(--step-timeout)") from None
        except LinkError as exc:
            if exc.code not in self.REFUSED:
                raise ConnectionError(str(exc)) from None
            raise StepFailed(str(exc), exc.culprit) from None
        if reply.step_id != plan.step:
            raise ConnectionError(f"the worker answered step {reply.step_id}, expected {plan.step}")
        return sampled_from_pb(plan, reply)

    def reset(self) -> None:
        self.worker.drop()

    def capacity(self) -> tuple[int, int, int]:
        info = self.stub.Info(worker_pb2.InfoRequest(), timeout=2)
        return info.num_blocks, info.block_size, info.max_model_len


# ---------------------------------------------------------------- the detokenizer feed


class Publisher:
    """Sends token batches to the detokenizer in order, over its link: each batch is answered before the next goes,
    and is sent again while the detokenizer is down or asks for it (it could not read some of its requests from
    Redis). The step loop never waits for the detokenizer.

    The step loop sends a batch itself when the link is open and the batch before it is answered, that answer read
    without waiting (the detokenizer answers within a millisecond, a step takes longer); otherwise the batch goes to
    the publisher's thread, which waits for answers, sends again what was refused, and gives the link back once
    everything it held is answered. A batch the step loop sent and then never came back to settle (the last of a
    burst) is settled by the thread after ``SETTLE_SECONDS``. A step's batch thus costs no wake of another thread
    and no blocked read while the detokenizer keeps up: at one stream the scheduler's CPU a token went from
    0.44 to 0.38 ms with it (``bench/pipeline_ceiling.py``, three alternating runs)."""

    SETTLE_SECONDS = 0.05

    def __init__(self, stub: detokenizer_pb2_grpc.DetokenizerStub, address: str, timeout: float = 30.0):
        self.detokenizer = Peer(stub.Link, address)
        self.timeout = timeout
        self.cond = threading.Condition()
        self.sent: detokenizer_pb2.TokenBatch | None = None  # sent, its answer not read yet
        self.sent_at = 0.0
        self.backlog: deque[detokenizer_pb2.TokenBatch] = deque()  # the thread's to send, in order
        self.threaded = False  # the thread has the link (and ``sent``): the step loop only adds to the backlog
        self.asleep = False  # the thread waits with no deadline (nothing sent is unanswered)
        threading.Thread(target=self._run, name="publisher", daemon=True).start()

    def __call__(self, step: int, outputs: list[Output]) -> None:
        batch = outputs_to_pb(step, outputs)
        with self.cond:
            link = None if self.threaded else self.detokenizer.link
            if link is not None and self.sent is not None and link.ready():
                sent, self.sent = self.sent, None
                self._taken(sent, self._answer(sent))  # a no hands the link to the thread
            if not self.threaded and self.sent is None and link is not None and self.detokenizer.link is link:
                try:
                    link.send(batch)
                except Exception as exc:  # noqa: BLE001 - the thread dials again and sends it
                    self.detokenizer.drop()
                    self._taken(batch, str(exc) or type(exc).__name__)
                    self.cond.notify()
                    return
                self.sent, self.sent_at = batch, time.monotonic()
                if self.asleep:  # its wait has no deadline: give it one
                    self.cond.notify()
                return
            self.backlog.append(batch)
            self.threaded = True
            self.cond.notify()

    def _taken(self, batch: detokenizer_pb2.TokenBatch, why: str | None) -> None:
        """(Under the lock.) ``batch``'s answer was read (``why``: None, or why it was not taken): one not taken goes
        back to the head of the backlog, and the thread has the link until it is."""
        if why is not None:
            log.warning("detokenizer push of step %d failed (%s); retrying", batch.step, why)
            self.backlog.appendleft(batch)
            self.threaded = True

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self.cond:
                while not self.threaded:
                    if self.sent is not None and time.monotonic() - self.sent_at >= self.SETTLE_SECONDS:
                        self.threaded = True  # the step loop has not come back for its answer: take it
                        break
                    self.asleep = self.sent is None
                    self.cond.wait(None if self.asleep else self.SETTLE_SECONDS)
                    self.asleep = False
                batch, self.sent = self.sent, None
                if batch is None and not self.backlog:
                    self.threaded = False  # all answered: the link goes back to the step loop
                    continue
                waiting = batch is not None  # sent already: only its answer is to be read
                if not waiting:
                    batch = self.backlog.popleft()
            # the link is the thread's now: used outside the lock, so the step loop never waits on it
            why = self._answer(batch) if waiting else self._push(batch)
            with self.cond:
                self._taken(batch, why)
            if why is None:
                backoff = 0.05
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.5)

    def _push(self, batch: detokenizer_pb2.TokenBatch) -> str | None:
        """None once the detokenizer took ``batch``, else why not (the link is then opened anew)."""
        try:
            self.detokenizer.open().send(batch)
        except grpc.RpcError as exc:  # its Link call: the detokenizer is down
            self.detokenizer.drop()
            return exc.code().name
        except Exception as exc:  # noqa: BLE001 - the link broke
            self.detokenizer.drop()
            return str(exc) or type(exc).__name__
        return self._answer(batch)

    def _answer(self, batch: detokenizer_pb2.TokenBatch) -> str | None:
        """Read the detokenizer's answer to ``batch``: None when it took it, else why not (a broken link or a wrong
        answer drops the link)."""
        link = self.detokenizer.link
        if link is None:
            return "the link broke"
        try:
            reply = link.receive(detokenizer_pb2.PushResponse.FromString, self.timeout)
        except Exception as exc:  # noqa: BLE001 - the link broke, timed out or was refused
            self.detokenizer.drop()
            return str(exc) or type(exc).__name__
        if reply.step != batch.step:
            self.detokenizer.drop()
            return f"it answered step {reply.step}"
        return "it could not read some requests from Redis" if reply.retry else None


# ---------------------------------------------------------------- the service


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """Registered before the server starts; answers UNAVAILABLE until ``ready`` hands it the engine."""

    def __init__(self):
        self._engine: Engine | None = None
        self.info = scheduler_pb2.SchedulerInfoResponse()

    def ready(self, engine: Engine, info: scheduler_pb2.SchedulerInfoResponse) -> None:
        self.info, self._engine = info, engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable("the scheduler is still waiting for its worker")
        return self._engine

    def Submit(self, request, context):
        waiting, refused = self.engine.submit_many(list(request.request_ids))  # an id given twice is read and queued once
        return scheduler_pb2.SubmitResponse(waiting=waiting, refused=[
            scheduler_pb2.SubmitRefusal(request_id=rid, code=exc.code, details=str(exc)) for rid, exc in refused.items()])

    def Abort(self, request, context):
        return scheduler_pb2.SchedulerAbortResponse(aborted=self.engine.abort(request.request_id))

    def Finish(self, request, context):
        self.engine.finish(request.request_id, request.num_tokens)
        return scheduler_pb2.FinishResponse()

    def Info(self, request, context):
        self.engine  # noqa: B018 - raises Unavailable until ready
        return self.info

    def Stats(self, request, context):
        s = self.engine.snapshot(requests=True)
        c = s.counters
        return scheduler_pb2.StatsResponse(
            steps=c.steps, running=s.running, waiting=s.waiting, num_blocks=s.num_blocks, free_blocks=s.free_blocks,
            preemptions=c.preemptions, aborts=c.aborts, finished=c.finished, worker_up=s.worker_up,
            requests=[scheduler_pb2.RequestState(**vars(r)) for r in s.requests],
            prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits, cached_blocks=s.cached_blocks,
        )


def worker_info(stub: worker_pb2_grpc.WorkerStub, address: str) -> worker_pb2.InfoResponse:
    """The worker's Info, waiting (with a log line now and then) until it answers."""
    waited = 0.0
    while True:
        try:
            return stub.Info(worker_pb2.InfoRequest(), timeout=5)
        except grpc.RpcError as exc:
            if waited % 10 < 0.5:
                log.info("waiting for the worker at %s (%s)", address, exc.code())
            time.sleep(0.5)
            waited += 0.5


def watch_redis(store: RequestStore, metrics: Metrics, every: float = 5.0) -> None:
    """Export Redis's round-trip time every few seconds (from a daemon thread)."""

    def run() -> None:
        while True:
            try:
                start = time.perf_counter()
                store.redis.ping()
                metrics.redis_rtt_seconds.set(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - Redis down: the gauge keeps its last value, logged
                log.warning("Redis ping failed: %s", exc)
            time.sleep(every)

    threading.Thread(target=run, name="redis-rtt", daemon=True).start()


def build_engine(cfg: SchedulerConfig, metrics: Metrics, lease: Lease | None = None
                 ) -> tuple[Engine, scheduler_pb2.SchedulerInfoResponse, worker_pb2.InfoResponse, RequestStore]:
    worker = worker_pb2_grpc.WorkerStub(grpc_util.internal_channel(cfg.worker))
    info = worker_info(worker, cfg.worker)
    max_len = min(info.max_model_len, info.num_blocks * info.block_size)
    batched, seqs = cfg.limits(info.device)
    blocks = BlockManager(info.num_blocks, info.block_size, cfg.prefix_cache, root_key(info.model_name))
    scheduler = Scheduler(blocks, max_len, batched, seqs, cfg.max_waiting, cfg.max_step_failures,
                          spec_tokens=cfg.spec_tokens if cfg.speculative == "ngram" else 0,
                          spec_max_batch=cfg.spec_max_batch, verify_cost=list(info.verify_cost))
    for drafts, cost in enumerate(scheduler.verify_cost[1 : cfg.spec_tokens + 1], 1):
        metrics.spec_verify_cost.labels(str(drafts)).set(cost)
    store = RequestStore.from_url(cfg.redis_url, cfg.redis_prefix, cfg.finished_ttl)
    detokenizer = detokenizer_pb2_grpc.DetokenizerStub(
        grpc_util.internal_channel(cfg.detokenizer)
    )

    engine = Engine(scheduler, store, StepChannel(worker, cfg.worker, cfg.step_timeout),
                    Publisher(detokenizer, cfg.detokenizer),
                    tuple(info.eos_token_ids), metrics=metrics, name=cfg.engine, lease=lease)
    engine.check_request = registration_pb  # raises for data that cannot go on the wire: refused at submission
    watch_redis(store, metrics)
    public = scheduler_pb2.SchedulerInfoResponse(
        model_name=info.model_name, max_model_len=max_len, eos_token_ids=info.eos_token_ids,
        vocab_size=info.vocab_size, max_waiting=cfg.max_waiting, device=info.device, dtype=info.dtype,
    )
    log.info("engine %s, worker %s: %s on %s, %d blocks x %d tokens; max %d batched tokens, %d sequences, %d "
             "waiting; prefix cache %s", cfg.engine, cfg.worker, info.model_name, info.device, info.num_blocks,
             info.block_size, batched, seqs, cfg.max_waiting, "on" if cfg.prefix_cache else "off")
    return engine, public, info, store


def serve(cfg: SchedulerConfig) -> None:
    metrics = Metrics("scheduler")
    metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host)
    server = grpc_util.make_server(metrics=metrics)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    service = SchedulerService()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    port = grpc_util.bind_internal(server, cfg.host, cfg.port)
    server.start()  # health answers NOT_SERVING while we wait for the worker
    engine, info, winfo, store = build_engine(cfg, metrics, Lease(cfg.engine_ttl))
    membership = Membership(engine, Registry(store), cfg.advertised(port), winfo.model_name, metrics)

    def on_health(serving: bool) -> None:
        grpc_util.set_serving(health, [SERVICE_NAME], serving, metrics)
        membership.soon()  # the frontends route around an engine that is not serving at once

    engine.health.on_change = on_health

    def crashed(exc: BaseException) -> None:  # the engine loop is gone: stop so a supervisor restarts us
        grpc_util.set_serving(health, [SERVICE_NAME], False, metrics)
        server.stop(grace=1)
        os._exit(70)  # EX_SOFTWARE; the engine thread cannot unwind the main thread otherwise

    engine.on_crash = crashed
    _retry_redis(membership.beat)  # registered first: from now on no other engine takes over this one's requests
    engine.recover()
    service.ready(engine, info)
    engine.observed.export(engine.snapshot())
    engine.start()
    membership.start()
    grpc_util.set_serving(health, [SERVICE_NAME], True, metrics)
    log.info("scheduler of engine %s serving on %s:%d as %s (metrics on %s:%d)", cfg.engine, cfg.host, port,
             cfg.advertised(port), cfg.metrics_host, metrics_port)
    grpc_util.wait_for_termination(server, on_stop=lambda: (grpc_util.set_serving(health, [SERVICE_NAME], False, metrics),
                                                            engine.stop(), membership.stop()))


def _retry_redis(call) -> None:
    """Call until Redis answers (it may be starting too)."""
    delay = 0.1
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - Redis not there yet
            log.warning("Redis: %s; retrying", exc)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
