"""Writing steps to Redis: one pipeline per step, before anything of it is published.

A client must never see a token that a restarted process could not find, so the step loop publishes a
step only once ``Persister.write`` returns. Meanwhile it waits out a Redis outage (retrying with backoff),
rewrites whole a record Redis lost, and writes only while this engine's lease is fresh; what another
engine took over meanwhile is left out, and a record Redis keeps refusing is given up, alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import WatchError

from conveyor.engines import Lease, Registry
from conveyor.metrics import Metrics
from conveyor.state import REDIS_DOWN, Fenced, RequestStore
from scheduler_svc.observe import Health
from scheduler_svc.policy import Output, StepPlan
from scheduler_svc.request import Request

log = logging.getLogger("conveyor.scheduler")
MAX_REWRITES = 3  # times a step rewrites a record Redis refuses before that request ends with an error


@dataclass
class Written:
    """What a step's write left out. ``taken``: held by another engine now (nothing written; forget them,
    publish nothing). ``refused``: Redis refused their record even rewritten whole (end them with an error)."""

    taken: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)

    @property
    def left_out(self) -> set[str]:
        return self.taken | self.refused


class Persister:
    """Writes each step of one engine. ``name`` and ``lease``: the engine's (None: an engine alone with its
    Redis, which writes without a fence); ``stopped`` tells when to stop waiting for the lease."""

    def __init__(self, store: RequestStore, health: Health, metrics: Metrics, name: str = "",
                 lease: Lease | None = None, stopped: Callable[[], bool] = lambda: False):
        self.store, self.health, self.metrics = store, health, metrics
        self.name, self.lease, self.stopped = name, lease, stopped

    def write(self, plan: StepPlan, outputs: list[Output], decided: list[Output]) -> Written:
        """Persist a step: its registrations and preemptions, its outputs (the first token's time and the
        prompt's logprobs with the first output), and the finishes it and the decisions since (aborts, stop
        strings) made."""
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
        return self._persist(writer, touched)

    def taken(self, request_ids: list[str]) -> set[str]:
        """Of ``request_ids``, those whose record names another engine now."""
        if not self.name or not request_ids:
            return set()
        owners = Registry(self.store).engines_of(request_ids)
        return {rid for rid, owner in zip(request_ids, owners) if owner not in (None, self.name)}

    def _persist(self, writer, requests: dict[str, Request]) -> Written:
        """Send the writes. A record Redis lost (it restarted) is rewritten whole from memory; while Redis is
        unreachable, retry until it is back."""
        attempt = 0
        rewrites: dict[str, int] = {}
        written = Written()
        check = False  # the lease lapsed meanwhile: write only what is still ours, once that is known
        while True:
            try:
                check |= self._wait_for_lease()
                if check:
                    check = False
                    if taken := self.taken(list(requests)):
                        written.taken |= taken
                        requests = {rid: r for rid, r in requests.items() if rid not in taken}
                        writer = self._rewrite(requests)
                lost = writer.execute(self.name if self.lease is not None else "")
                if not self.health.redis_up:
                    log.info("Redis is back after %d attempts", attempt)
                    self.health.set(redis_up=True)
                if not lost:
                    return written
                log.warning("Redis lost or refused the records of %d requests; rewriting them", len(lost))
                self.metrics.redis_repairs.inc(len(lost))
                for rid in lost:
                    rewrites[rid] = rewrites.get(rid, 0) + 1
                hopeless = {rid for rid in lost if rewrites[rid] > MAX_REWRITES}
                written.refused |= hopeless & requests.keys()
                requests = {rid: requests[rid] for rid in lost - hopeless if rid in requests}
                if not requests:
                    return written
            except Fenced as exc:  # taken over while this engine was paused past its lease check: never written
                log.warning("%s; their step is dropped here", exc)
                written.taken |= set(exc.taken)
                requests = {rid: r for rid, r in requests.items() if rid not in exc.taken}
                if not requests:
                    return written
            except WatchError:  # a record changed while the step was being written: write again, checked anew
                pass
            except REDIS_DOWN as exc:
                if attempt % 20 == 0:
                    log.warning("Redis write failed (%s); retrying", exc)
                self.health.set(redis_up=False)
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
        while self.lease is not None and not self.lease.fresh() and not self.stopped():
            if waited % 100 == 0:
                log.warning("this engine's lease in Redis is not fresh; steps wait for the heartbeat")
            if waited == 50:  # a second without a heartbeat getting through: Redis is out of reach
                self.health.set(redis_up=False)
            time.sleep(0.02)
            waited += 1
        return waited > 0
