"""The step loop: schedule, run the worker, apply results, write Redis, publish tokens.

One engine thread owns the loop and is the only writer of request state to Redis (one pipeline
per step). gRPC handlers (submit, abort, finish) change the scheduler under the lock and wake the
loop; what they decide is written by the loop's next step, so writes stay in order. The worker
call runs outside the lock, so an abort during a step frees its blocks at once and the step's
result for that request is dropped.

``transport`` and ``publish`` are plain objects (the gRPC server supplies them), so this
module imports no gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import WatchError

from conveyor.engines import Lease, Registry
from conveyor.errors import InvalidArgument, NotFound, Unavailable
from conveyor.state import REDIS_DOWN, Fenced, RequestStore
from conveyor.metrics import Metrics
from scheduler_svc.policy import Answer, Counters, Output, Scheduler, StepPlan
from scheduler_svc.request import Request

log = logging.getLogger("conveyor.scheduler")
MAX_REWRITES = 3  # times a step rewrites a record Redis refuses before that request ends with an error


class StepFailed(Exception):
    """A step failed and the worker is not to blame for being down: it answered with an error (a request may
    have caused it), or the step could not even be built or sent because of one request's data.
    ``culprit``: the sequence at fault, when known. ``fatal``: the culprit's own data is at fault (retrying
    it alone cannot help): it ends at once with "error"."""

    def __init__(self, message: str, culprit: str | None = None, fatal: bool = False):
        super().__init__(message)
        self.culprit = culprit
        self.fatal = fatal


class StepTransport(Protocol):
    """How steps reach the worker: sent in order, answered in order."""

    def send(self, plan: StepPlan) -> None:
        """Queue a step on the worker (returns at once). Raises ``StepFailed`` with ``fatal`` when one
        request's data cannot be put on the wire (nothing of the step is sent then)."""

    def receive(self, plan: StepPlan) -> Answer:
        """Wait for the answer to the oldest unanswered step (``plan``).
        Raises ``StepFailed`` when the worker refused or failed the step, ``TimeoutError`` when it did not
        answer within the step timeout, anything else when the connection broke."""

    def reset(self) -> None:
        """After a failure: forget unanswered steps and reconnect."""

    def capacity(self) -> tuple[int, int, int]:
        """The worker's (KV blocks, block size, max model length); raises while it does not answer."""


Publish = Callable[[int, list[Output]], None]


class Engine:
    def __init__(self, scheduler: Scheduler, store: RequestStore, transport: StepTransport, publish: Publish,
                 eos_token_ids: tuple[int, ...], depth: int = 2, metrics: Metrics | None = None, name: str = "",
                 lease: Lease | None = None):
        """``depth``: steps sent to the worker ahead of their answers (2: the next one always waits there).
        ``name``: this engine's (it holds the requests whose record names it); ``lease``: steps are written
        only while it is fresh (None: always, for an engine alone with its Redis)."""
        self.name = name
        self.lease = lease
        self.scheduler = scheduler
        self.store = store
        self.transport = transport
        self.depth = depth
        self.metrics = metrics or Metrics("scheduler")
        self._counted = Counters()  # the scheduler's counters as last exported
        self._prefix_counted = (0, 0)  # prefix cache (queries, hits) as last exported
        self._last_answer = 0.0
        self.publish = publish
        self.eos_token_ids = eos_token_ids
        self.cond = threading.Condition()
        self.decided: list[Output] = []  # aborts and stop-string finishes, written by the next step
        self.worker_up = True
        self.redis_up = True
        self.on_health: Callable[[bool], None] = lambda serving: None  # health follows worker and Redis
        # the loop died of an unexpected error: the server goes NOT_SERVING and exits non-zero
        self.on_crash: Callable[[BaseException], None] = lambda exc: None
        # raises when a request's data cannot go on the wire to the worker (the server supplies it): such a
        # request is refused at submission instead of failing a step later
        self.check_request: Callable[[Request], None] = lambda request: None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ------------------------------------------------------------ called from gRPC threads

    def submit(self, request_id: str) -> int:
        """Queue a request recorded in Redis; returns the queue length. Idempotent."""
        record = self.store.get(request_id)
        if record is None:
            raise NotFound(f"request {request_id!r} is not recorded in Redis")
        if record.status == "finished":
            return len(self.scheduler.waiting)
        if not self._mine(record):  # it moved (this engine's lease lapsed, or the frontend chose again)
            raise Unavailable(f"request {request_id!r} is held by engine {record.engine!r}, not {self.name!r}")
        request = Request.from_record(record, self.eos_token_ids)
        try:
            self.check_request(request)
        except Exception as exc:  # noqa: BLE001 - whatever its data raised: this request is refused, alone
            raise InvalidArgument(f"request {request_id!r} cannot be computed: {type(exc).__name__}: {exc}") from exc
        with self.cond:
            self.scheduler.add(request)
            self.cond.notify()
            return len(self.scheduler.waiting)

    def abort(self, request_id: str) -> bool:
        with self.cond:
            output = self.scheduler.abort(request_id)
            if output is None:
                return False
            self.decided.append(output)
            self.cond.notify()
            return True

    def finish(self, request_id: str, num_tokens: int) -> None:
        with self.cond:
            output = self.scheduler.finish_at(request_id, num_tokens)
            if output is not None:
                self.decided.append(output)
                self.cond.notify()

    def _mine(self, record) -> bool:
        return not self.name or record.engine in (self.name, "")

    def recover(self) -> int:
        """Requeue every request Redis says is in flight and this engine holds (after a restart); the worker
        forgets all."""
        count = self.adopt(self.store.inflight())
        with self.cond:
            self.scheduler.free_all = True
        if count:
            log.info("recovered %d in-flight requests from Redis", count)
        return count

    def adopt(self, request_ids: list[str]) -> int:
        """Queue the unfinished requests among ``request_ids`` that this engine holds (recovered, or taken over
        from an engine that died: recomputed from their tokens so far); returns how many."""
        count = 0
        for request_id in request_ids:
            record = self.store.get(request_id)
            if record is None or record.status == "finished" or not self._mine(record):
                continue
            with self.cond:
                count += self.scheduler.add(Request.from_record(record, self.eos_token_ids), force=True)
                self.cond.notify()
        return count

    def held(self) -> list[str]:
        with self.cond:
            return list(self.scheduler.requests)

    def drop_taken(self, request_ids: list[str]) -> set[str]:
        """Of ``request_ids``, those whose record names another engine now (it took them over while this one's
        lease had lapsed): dropped here, without writing anything; returns them."""
        if not self.name or not request_ids:
            return set()
        owners = Registry(self.store).engines_of(request_ids)
        taken = {rid for rid, owner in zip(request_ids, owners) if owner not in (None, self.name)}
        with self.cond:
            for request_id in taken:
                self.scheduler.forget(request_id)
            self.cond.notify()
        if taken:
            log.warning("%d requests were taken over by other engines while this one's lease had lapsed; dropped "
                        "them here", len(taken))
        return taken

    # ------------------------------------------------------------ the loop

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        """The loop, and what happens when it breaks: a bug must not leave a dead thread behind a health
        that says SERVING. ``on_crash`` reports it (the server exits, its supervisor restarts it, and the
        new scheduler recovers every request from Redis)."""
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 - anything: the process must not serve without its loop
            log.critical("the engine loop failed; the scheduler stops", exc_info=True)
            self._set_health(worker_up=False)
            self.on_crash(exc)

    def _steps(self) -> None:
        """Keep up to ``depth`` steps on the worker: schedule and send while there is room, then take
        the oldest answer, apply it, write Redis and publish (the worker meanwhile computes the next)."""
        backoff = 0.1
        in_flight: deque[tuple[StepPlan, list[Output]]] = deque()
        self._sent_at: dict[int, float] = {}
        while True:
            with self.cond:
                while not (self._stopped or self.decided or self.scheduler.has_work or in_flight):
                    self.cond.wait()
                if self._stopped:
                    return
                plan = self.scheduler.schedule() if len(in_flight) < self.depth else None
                decided, self.decided = self.decided, []
            if plan is not None and not plan.empty:
                try:
                    self.transport.send(plan)
                except Exception as exc:  # noqa: BLE001 - the stream to the worker broke
                    backoff = self._recover(plan, exc, backoff, [(plan, decided), *in_flight])
                    in_flight.clear()
                    continue
                in_flight.append((plan, decided))
                self._sent_at[plan.step] = time.perf_counter()
                if len(in_flight) < self.depth:
                    continue  # fill the worker's queue first
            elif decided or (plan is not None and plan.preempted):
                self._write_and_publish(plan or StepPlan(0, [], []), [], decided)
            if not in_flight:
                self._wait_for_change()
                continue
            sent, sent_decided = in_flight.popleft()
            try:
                answer = self.transport.receive(sent)
            except Exception as exc:  # noqa: BLE001 - any failure means the worker's state is unknown
                backoff = self._recover(sent, exc, backoff, [(sent, sent_decided), *in_flight])
                in_flight.clear()
                continue
            backoff = 0.1
            if not self.worker_up:
                log.info("the worker answers again; continuing")
                self._set_health(worker_up=True)
            with self.cond:
                outputs = self.scheduler.update(sent, answer.sampled, scored=answer.scored, failed=answer.failed)
            self._observe(sent, outputs)
            self._write_and_publish(sent, outputs, sent_decided)

    def _observe(self, plan: StepPlan, outputs: list[Output]) -> None:
        """Export one answered step: its duration and batch, the gauges, and per-request latencies."""
        m, s = self.metrics, self.scheduler
        now = time.perf_counter()
        started = max(self._sent_at.pop(plan.step, now), self._last_answer)  # queued behind the previous step
        self._last_answer = now
        decodes = sum(1 for c in plan.chunks
                      if c.decode_last or (len(c.token_ids) == 1 and c.start_pos >= len(c.request.prompt_ids)))
        phase = "prefill" if decodes == 0 else "decode" if decodes == len(plan.chunks) else "mixed"
        m.step_duration_seconds.labels(phase=phase).observe(now - started)
        m.batch_size.observe(len(plan.chunks))
        m.batch_tokens.observe(sum(len(c.token_ids) or 1 for c in plan.chunks))
        mono = time.monotonic()
        for request in plan.admitted:
            m.queue_time_seconds.observe(max(0.0, mono - request.queued_at))
            if request.admitted_at is None:
                request.admitted_at = mono
        for output in outputs:
            request = output.request
            if output.first_index == 0 and request.admitted_at is not None:
                m.prefill_time_seconds.observe(request.first_token_at - request.admitted_at)
            if output.finish_reason is not None and request.first_token_at is not None:
                m.decode_time_seconds.observe(mono - request.first_token_at)
        with self.cond:
            counters = s.counters
            m.steps.inc(counters.steps - self._counted.steps)
            m.preemptions.inc(counters.preemptions - self._counted.preemptions)
            m.aborts.inc(counters.aborts - self._counted.aborts)
            self._counted = Counters(counters.steps, counters.preemptions, counters.aborts, counters.finished)
            prefix = s.blocks.stats
            m.prefix_cache_queries.inc(prefix.queries - self._prefix_counted[0])
            m.prefix_cache_hits.inc(prefix.hits - self._prefix_counted[1])
            self._prefix_counted = (prefix.queries, prefix.hits)
            self.export_gauges()

    def export_gauges(self) -> None:
        """Queue and cache gauges (call with the lock held)."""
        m, s = self.metrics, self.scheduler
        m.requests_running.set(len(s.running))
        m.requests_waiting.set(len(s.waiting))
        m.kv_blocks_used.set(s.blocks.num_used)
        m.kv_blocks_total.set(s.blocks.num_blocks)
        m.kv_cache_usage_ratio.set(s.blocks.num_used / max(1, s.blocks.num_blocks))
        m.prefix_cache_blocks.set(s.blocks.num_cached)
        m.worker_up.set(1 if self.worker_up else 0)

    def _recover(self, plan: StepPlan, exc: Exception, backoff: float, dropped) -> float:
        """The worker failed: blame what caused it, requeue everything for recompute, write what was
        decided, reconnect."""
        if isinstance(exc, StepFailed):  # the worker is alive and said no, or a request's data broke the step
            with self.cond:
                self.decided += self.scheduler.step_failed(plan, exc.culprit, str(exc), exc.fatal)
        self._worker_failed(plan, exc, backoff)
        for dropped_plan, dropped_decided in dropped:
            self._write_and_publish(dropped_plan, [], dropped_decided)
        self.transport.reset()
        self._reattach()
        return min(backoff * 2, 1.0)

    def _reattach(self) -> None:
        """Wait until the worker answers again and adopt its KV cache size: a worker restarted with another
        memory budget (or on another GPU) has a different number of blocks. Nothing holds blocks now."""
        delay = 0.05
        while not self._stopped:
            try:
                num_blocks, block_size, max_model_len = self.transport.capacity()
                break
            except Exception:  # noqa: BLE001 - still restarting
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        else:
            return
        with self.cond:
            s = self.scheduler
            max_len = min(max_model_len, num_blocks * block_size)
            if (num_blocks, block_size, max_len) != (s.blocks.num_blocks, s.blocks.block_size, s.max_model_len):
                log.warning("the worker came back with %d blocks x %d tokens (was %d x %d); adopting them",
                            num_blocks, block_size, s.blocks.num_blocks, s.blocks.block_size)
                self.decided += s.resize(s.blocks.resized(num_blocks, block_size), max_len)
                self.export_gauges()

    def _set_health(self, worker_up: bool | None = None, redis_up: bool | None = None) -> None:
        """Record what is down; the gRPC health says NOT_SERVING while the worker or Redis is."""
        before = self.worker_up and self.redis_up
        if worker_up is not None:
            self.worker_up = worker_up
            self.metrics.worker_up.set(1 if worker_up else 0)
        if redis_up is not None:
            self.redis_up = redis_up
        if (self.worker_up and self.redis_up) != before:
            self.on_health(self.worker_up and self.redis_up)

    def _wait_for_change(self) -> None:
        """Nothing could be scheduled (no blocks for the queue head): wait for an arrival or a departure."""
        with self.cond:
            self.cond.wait(timeout=0.5)

    def _worker_failed(self, plan: StepPlan, exc: Exception, backoff: float) -> None:
        refused = isinstance(exc, StepFailed)  # the worker answered (it is up), or a request's data was bad
        if refused and exc.fatal:
            log.warning("step %d could not be sent: request %s's data is bad (%s); it ends with an error, %d running "
                        "requests are recomputed", plan.step, exc.culprit, exc, len(self.scheduler.running))
        elif refused:
            log.warning("worker step %d failed (%s); requeueing %d running requests, suspects run alone",
                        plan.step, exc, len(self.scheduler.running))
        elif self.worker_up:
            log.error("worker step %d failed (%s); requeueing %d running requests for recompute",
                      plan.step, str(exc) or type(exc).__name__, len(self.scheduler.running))
        if not refused:
            self._set_health(worker_up=False)
        with self.cond:
            self.scheduler.reset_worker()
        if not refused:
            time.sleep(backoff)

    def _persist(self, writer, requests: dict[str, Request]) -> set[str]:
        """Send one step's Redis writes. A record Redis lost (it restarted) is rewritten whole from memory;
        while Redis is unreachable, retry (with backoff) until it is back: tokens are published only
        after Redis has them, so a client never sees a token a restarted process could not find.
        Returns the requests another engine took over while this one's lease had lapsed: nothing was written
        for them (the caller publishes nothing for them either)."""
        attempt = 0
        rewrites: dict[str, int] = {}
        gone: set[str] = set()
        check = False  # the lease lapsed meanwhile: write only what is still ours, once that is known
        while True:
            try:
                check |= self._wait_for_lease()
                if check:
                    taken = self.drop_taken(list(requests))
                    check = False
                    if taken:
                        gone |= taken
                        requests = {rid: r for rid, r in requests.items() if rid not in taken}
                        writer = self._rewrite(requests)
                lost = writer.execute(self.name if self.lease is not None else "")
                if not self.redis_up:
                    log.info("Redis is back after %d attempts", attempt)
                    self._set_health(redis_up=True)
                if not lost:
                    return gone
                log.warning("Redis lost or refused the records of %d requests; rewriting them", len(lost))
                self.metrics.redis_repairs.inc(len(lost))
                for rid in lost:
                    rewrites[rid] = rewrites.get(rid, 0) + 1
                hopeless = {rid for rid in lost if rewrites[rid] > MAX_REWRITES}
                for rid in hopeless & requests.keys():  # Redis keeps refusing this record: fail it alone
                    self._give_up(requests[rid])
                requests = {rid: requests[rid] for rid in lost - hopeless if rid in requests}
                if not requests:
                    return gone
            except Fenced as exc:  # taken over while this engine was paused past its lease check: never written
                log.warning("%s; their step is dropped here", exc)
                taken = self.drop_taken(list(exc.taken))
                gone |= taken
                requests = {rid: r for rid, r in requests.items() if rid not in taken}
                if not requests:
                    return gone
            except WatchError:  # a record changed while the step was being written: write again, checked anew
                pass
            except REDIS_DOWN as exc:
                if attempt % 20 == 0:
                    log.warning("Redis write failed (%s); retrying", exc)
                self._set_health(redis_up=False)
                time.sleep(min(0.05 * 2 ** min(attempt, 5), 1.0))
                attempt += 1
            writer = self._rewrite(requests)  # retry by rewriting the step's records whole: idempotent

    def _rewrite(self, requests: dict[str, Request]):
        """A writer that rewrites these requests' records whole from memory."""
        now = time.time()
        writer = self.store.writer()
        for request in requests.values():
            writer.restore(request.to_record(now))
        return writer

    def _wait_for_lease(self) -> bool:
        """Write only while this engine surely holds its requests: once its lease may have expired another
        engine may have taken them, and the heartbeat settles which are still ours. Returns whether it had
        to wait (then the caller checks what is still ours)."""
        waited = 0
        while self.lease is not None and not self.lease.fresh() and not self._stopped:
            if waited % 100 == 0:
                log.warning("this engine's lease in Redis is not fresh; steps wait for the heartbeat")
            if waited == 50:  # a second without a heartbeat getting through: Redis is out of reach
                self._set_health(redis_up=False)
            time.sleep(0.02)
            waited += 1
        return waited > 0

    def _give_up(self, request: Request) -> None:
        """A record Redis refuses even when rewritten whole: end that request (its own error, not an
        outage: health stays as it is and the other requests go on)."""
        log.error("Redis refuses the record of %s; ending it", request.request_id)
        with self.cond:
            output = self.scheduler.abort(request.request_id)
        if output is not None:
            request.error = "Redis refused this request's record"
            output.finish_reason = request.finish_reason = "error"
            self.publish(0, [output])

    def _write_and_publish(self, plan: StepPlan, outputs: list[Output], decided: list[Output]) -> None:
        now = time.time()
        writer = self.store.writer()
        touched: dict[str, Request] = {}
        for chunk in plan.chunks:
            if chunk.registers:
                writer.status(chunk.request.request_id, "running", chunk.request.cached_tokens)
                touched[chunk.request.request_id] = chunk.request
        for request in plan.preempted:
            writer.status(request.request_id, "waiting")
            touched[request.request_id] = request
        for output in outputs:
            request = output.request
            first = request.first_token_time if output.first_index == 0 else None
            prompt = request.prompt_logprobs if output.first_index == 0 else None  # with the first token, once
            writer.tokens(request.request_id, output.token_ids, output.end, first, prompt)
            touched[request.request_id] = request
        for output in [*outputs, *decided]:
            if output.finish_reason is not None:
                request = output.request
                writer.finished(request.request_id, self.store.alias_key(request.owner, request.client_id),
                                output.finish_reason, output.end, now, trim=output.trim,
                                stopped_by_token=output.finish_reason == "stop" and request.stopped_by_token,
                                error=request.error)
                touched[request.request_id] = request
        gone = self._persist(writer, touched)
        published = outputs + [o for o in decided if o.finish_reason != "stop"]  # the detokenizer knows its stops
        published = [o for o in published if o.request.request_id not in gone]
        if published:
            self.publish(plan.step, published)
