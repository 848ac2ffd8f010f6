"""The step loop: schedule, run the worker, apply results, write Redis, publish tokens.

One engine thread owns the loop and is the only writer of request state to Redis (one pipeline
per step). gRPC handlers (submit, abort, finish) change the scheduler under the lock and wake the
loop; what they decide is written by the loop's next step, so writes stay in order. The worker
call runs outside the lock, so an abort during a step frees its blocks at once and the step's
result for that request is dropped.

``start_step`` and ``publish`` are plain callables (the gRPC server supplies them), so this
module imports no gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from conveyor.errors import NotFound
from conveyor.state import RequestStore
from scheduler_svc.policy import Output, Scheduler, StepPlan
from scheduler_svc.request import Request

log = logging.getLogger("conveyor.scheduler")

# start_step(plan) sends the step and returns a function that waits for its sampled tokens
StartStep = Callable[[StepPlan], Callable[[], dict[str, tuple[int, object]]]]
Publish = Callable[[int, list[Output]], None]


class Engine:
    def __init__(self, scheduler: Scheduler, store: RequestStore, start_step: StartStep, publish: Publish,
                 eos_token_ids: tuple[int, ...]):
        self.scheduler = scheduler
        self.store = store
        self.start_step = start_step
        self.publish = publish
        self.eos_token_ids = eos_token_ids
        self.cond = threading.Condition()
        self.decided: list[Output] = []  # aborts and stop-string finishes, written by the next step
        self.worker_up = True
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
        with self.cond:
            self.scheduler.add(Request.from_record(record, self.eos_token_ids))
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

    def recover(self) -> int:
        """Requeue every request Redis says is in flight (after a restart); the worker forgets all."""
        count = 0
        for request_id in self.store.inflight():
            record = self.store.get(request_id)
            if record is None or record.status == "finished":
                continue
            with self.cond:
                count += self.scheduler.add(Request.from_record(record, self.eos_token_ids), force=True)
        with self.cond:
            self.scheduler.free_all = True
        if count:
            log.info("recovered %d in-flight requests from Redis", count)
        return count

    # ------------------------------------------------------------ the loop

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        """Each iteration: schedule step N, start it on the worker, and while it computes, write and
        publish step N-1's results (so Redis and the detokenizer never hold up the worker)."""
        backoff = 0.1
        previous = None  # (plan, outputs, decided) not yet written to Redis nor published
        while True:
            with self.cond:
                while not self._stopped and not self.decided and not self.scheduler.has_work:
                    if previous is not None:
                        break
                    self.cond.wait()
                if self._stopped:
                    return
                idle = not self.decided and not self.scheduler.has_work
                plan = self.scheduler.schedule() if not idle else None
                decided, self.decided = self.decided, []
            if plan is None or plan.empty:
                if previous is not None:
                    self._write_and_publish(*previous)
                    previous = None
                if plan is not None:
                    self._write_and_publish(plan, [], decided)
                    self._wait_for_change()
                continue
            try:
                wait = self.start_step(plan)
                if previous is not None:  # overlapped with the worker computing this step
                    self._write_and_publish(*previous)
                    previous = None
                sampled = wait()
            except Exception as exc:  # noqa: BLE001 - any failure of the step means the worker's state is unknown
                if previous is not None:
                    self._write_and_publish(*previous)
                    previous = None
                self._worker_failed(plan, exc, backoff)
                self._write_and_publish(plan, [], decided)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self.worker_up = True
            with self.cond:
                outputs = self.scheduler.update(plan, sampled)
            previous = (plan, outputs, decided)

    def _wait_for_change(self) -> None:
        """Nothing could be scheduled (no blocks for the queue head): wait for an arrival or a departure."""
        with self.cond:
            self.cond.wait(timeout=0.5)

    def _worker_failed(self, plan: StepPlan, exc: Exception, backoff: float) -> None:
        if self.worker_up:
            log.error("worker step %d failed (%s); requeueing %d running requests for recompute",
                      plan.step, exc, len(self.scheduler.running))
        self.worker_up = False
        with self.cond:
            self.scheduler.reset_worker()
        time.sleep(backoff)

    def _execute(self, writer, attempts: int = 20) -> None:
        """Send the step's Redis writes, retrying while Redis is unreachable (it may be restarting)."""
        for attempt in range(attempts):
            try:
                writer.execute()
                return
            except RedisError as exc:
                if attempt == 0:
                    log.warning("Redis write failed (%s); retrying", exc)
                time.sleep(min(0.05 * 2**attempt, 2.0))
        log.error("giving up on one step's Redis writes after %d attempts", attempts)

    def _write_and_publish(self, plan: StepPlan, outputs: list[Output], decided: list[Output]) -> None:
        now = time.time()
        writer = self.store.writer()
        for chunk in plan.chunks:
            if chunk.registers:
                writer.status(chunk.request.request_id, "running")
        for request in plan.preempted:
            writer.status(request.request_id, "waiting")
        for output in outputs:
            request = output.request
            first = request.first_token_time if output.first_index == 0 else None
            writer.tokens(request.request_id, output.token_ids, len(request.output_ids), first)
        for output in [*outputs, *decided]:
            if output.finish_reason is not None:
                writer.finished(output.request.request_id, output.finish_reason, len(output.request.output_ids),
                                now, trim=output.trim)
        self._execute(writer)
        published = outputs + [o for o in decided if o.finish_reason == "abort"]
        if published:
            self.publish(plan.step, published)
