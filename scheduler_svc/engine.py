"""The step loop: schedule, run the worker, apply results, write Redis, publish tokens.

One engine thread owns the loop and is the only writer of request state to Redis (one pipeline
per step, ``persist.Persister``). gRPC handlers (submit, abort, finish) change the scheduler under
the lock and wake the loop; what they decide is written by the loop's next step, so writes stay in
order. The worker call runs outside the lock, so an abort during a step frees its blocks at once and
the step's result for that request is dropped. Everything else reads the engine through
``snapshot()``; what it reports is in ``observe``.

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

from conveyor.engines import Lease
from conveyor.errors import ConveyorError, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from conveyor.metrics import Metrics
from conveyor.state import REDIS_DOWN, RequestStore
from scheduler_svc.observe import Health, HeldRequest, Snapshot, StepMetrics
from scheduler_svc.persist import Persister
from scheduler_svc.policy import Answer, Output, Scheduler, StepPlan
from scheduler_svc.request import Request, Status

log = logging.getLogger("conveyor.scheduler")


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
    """One engine's scheduler loop: the thread-safe facade the gRPC handlers call (``submit``, ``abort``,
    ``finish``, ``adopt``, ``drop_taken``), the step loop on its own thread, its recovery from worker failures,
    and ``snapshot`` for everything that reports on it."""

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
        self.observed = StepMetrics(self.metrics)
        self.health = Health(self.metrics)  # its on_change: the server's, health follows worker and Redis
        self.persister = Persister(store, self.health, self.metrics, name, lease, stopped=lambda: self._stopped)
        self.publish = publish
        self.eos_token_ids = eos_token_ids
        self.cond = threading.Condition()
        self.decided: list[Output] = []  # aborts and stop-string finishes, written by the next step
        # the loop died of an unexpected error: the server goes NOT_SERVING and exits non-zero
        self.on_crash: Callable[[BaseException], None] = lambda exc: None
        # raises when a request's data cannot go on the wire to the worker (the server supplies it): such a
        # request is refused at submission instead of failing a step later
        self.check_request: Callable[[Request], None] = lambda request: None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ------------------------------------------------------------ called from gRPC threads

    def submit(self, request_id: str) -> int:
        """``submit_many`` of one request: the queue length, or its refusal raised."""
        waiting, refused = self.submit_many([request_id])
        if refused:
            raise refused[request_id]
        return waiting

    def submit_many(self, request_ids: list[str]) -> tuple[int, dict[str, ConveyorError]]:
        """Queue requests recorded in Redis (read in one round trip, queued under one hold of the lock); returns
        the queue length and the ids refused, each with its error (the others are queued). Idempotent. Redis out
        of reach raises for all."""
        refused: dict[str, ConveyorError] = {}
        requests = []
        for request_id, record in self._records(request_ids).items():
            try:
                request = self._admissible(request_id, record)
            except ConveyorError as exc:
                refused[request_id] = exc
                continue
            if request is not None:
                requests.append(request)
        with self.cond:
            for request in requests:
                try:
                    self.scheduler.add(request)
                except ResourceExhausted as exc:
                    refused[request.request_id] = exc
            self.cond.notify()
            return len(self.scheduler.waiting), refused

    def _records(self, request_ids: list[str]) -> dict:
        """Their records, in one round trip; when one cannot be read, each alone (an unreadable one is None)."""
        try:
            return self.store.get_many(request_ids)
        except REDIS_DOWN:
            raise
        except Exception:  # noqa: BLE001 - one record's data broke the read: the others must not fail with it
            records = {}
            for request_id in request_ids:
                try:
                    records[request_id] = self.store.get(request_id)
                except REDIS_DOWN:
                    raise
                except Exception:  # noqa: BLE001
                    log.exception("the record of %s cannot be read", request_id)
                    records[request_id] = None
            return records

    def _admissible(self, request_id: str, record) -> Request | None:
        """The request to queue from its record (None: it is finished already); raises why it cannot be."""
        if record is None:
            raise NotFound(f"request {request_id!r} is not recorded in Redis (or its record cannot be read)")
        if record.status == "finished":
            return None
        if not self._mine(record):  # it moved (this engine's lease lapsed, or the frontend chose again)
            raise Unavailable(f"request {request_id!r} is held by engine {record.engine!r}, not {self.name!r}")
        request = Request.from_record(record, self.eos_token_ids)
        try:
            self.check_request(request)
        except Exception as exc:  # noqa: BLE001 - whatever its data raised: this request is refused, alone
            raise InvalidArgument(f"request {request_id!r} cannot be computed: {type(exc).__name__}: {exc}") from exc
        return request

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
        taken = self.persister.taken(request_ids)
        if taken:
            self._forget(taken)
        return taken

    def _forget(self, taken: set[str]) -> None:
        with self.cond:
            for request_id in taken:
                self.scheduler.forget(request_id)
            self.cond.notify()
        log.warning("%d requests were taken over by other engines while this one's lease had lapsed; dropped them "
                    "here", len(taken))

    def snapshot(self, requests: bool = False) -> Snapshot:
        """The queues, the cache and the health now (``requests``: with each request held, for ``Stats``)."""
        with self.cond:
            s, b = self.scheduler, self.scheduler.blocks
            held = tuple(HeldRequest(r.request_id, r.client_id, r.owner, r.status.value, len(b.table(r.request_id)),
                                     len(r.output_ids))
                         for r in (*s.waiting, *s.running) if r.status is not Status.FINISHED) if requests else ()
            return Snapshot(len(s.running), len(s.waiting), b.block_size, b.num_blocks, b.num_free, b.num_cached,
                            s.counters.copy(), b.stats.queries, b.stats.hits, self.health.worker_up,
                            self.health.redis_up, held)

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
            self.health.set(worker_up=False)
            self.on_crash(exc)

    def _steps(self) -> None:
        """Keep up to ``depth`` steps on the worker: schedule and send while there is room, then take
        the oldest answer, apply it, write Redis and publish (the worker meanwhile computes the next)."""
        backoff = 0.1
        in_flight: deque[tuple[StepPlan, list[Output]]] = deque()
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
                self.observed.sent(plan.step)
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
            if not self.health.worker_up:
                log.info("the worker answers again; continuing")
                self.health.set(worker_up=True)
            with self.cond:
                outputs = self.scheduler.update(sent, answer.sampled, scored=answer.scored, failed=answer.failed,
                                                accepted=answer.accepted, drafted=answer.drafted)
                snapshot = self.snapshot()  # the same hold of the lock (a Condition's lock is re-entrant)
            self.observed.answered(sent, outputs, snapshot)
            self._write_and_publish(sent, outputs, sent_decided)

    def _recover(self, plan: StepPlan, exc: Exception, backoff: float, dropped) -> float:
        """The worker failed: blame what caused it, requeue everything for recompute, write what was
        decided, reconnect."""
        if isinstance(exc, StepFailed):  # the worker is alive and said no, or a request's data broke the step
            with self.cond:
                self.decided += self.scheduler.step_failed(plan, exc.culprit, str(exc), exc.fatal)
        self._worker_failed(plan, exc, backoff)
        self.observed.forget_sent()
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
        self.observed.export(self.snapshot())

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
        elif self.health.worker_up:
            log.error("worker step %d failed (%s); requeueing %d running requests for recompute",
                      plan.step, str(exc) or type(exc).__name__, len(self.scheduler.running))
        if not refused:
            self.health.set(worker_up=False)
        with self.cond:
            self.scheduler.reset_worker()
        if not refused:
            time.sleep(backoff)


    def _write_and_publish(self, plan: StepPlan, outputs: list[Output], decided: list[Output]) -> None:
        """Persist a step, then publish it: what another engine took is dropped here and published nowhere; a
        request whose record Redis keeps refusing ends with an error, alone."""
        written = self.persister.write(plan, outputs, decided)
        if written.taken:
            self._forget(written.taken)
        published = outputs + [o for o in decided if o.finish_reason != "stop"]  # the detokenizer knows its stops
        published = [o for o in published if o.request.request_id not in written.left_out]
        if written.refused:
            kept = {o.request.request_id: o.first_index for o in outputs}  # what Redis holds of a refused one
            published += [o for rid in written.refused if (o := self._give_up(rid, kept.get(rid))) is not None]
        if published:
            self.publish(plan.step, published)

    def _give_up(self, request_id: str, kept: int | None) -> Output | None:
        """A record Redis refuses even when rewritten whole: end that request after the ``kept`` tokens Redis
        took (its own error, not an outage: health stays as it is and the other requests go on)."""
        log.error("Redis refuses the record of %s; ending it", request_id)
        with self.cond:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                return None
            if kept is not None:
                del request.output_ids[kept:]
                del request.logprobs[kept:]
            output = self.scheduler.abort(request_id)
        request.error = "Redis refused this request's record"
        output.finish_reason = request.finish_reason = "error"
        return output
