"""What a scheduler says about itself: the health it reports (``Health``), and the step metrics
(``StepMetrics``), exported from a ``Snapshot`` of the engine so that the exporters, ``Stats`` and the
heartbeat read the engine without taking its lock or walking its block manager."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.metrics import Metrics
from scheduler_svc.policy import Counters, Output, StepPlan


@dataclass(frozen=True)
class HeldRequest:
    """One request an engine holds, as ``Stats`` lists it."""

    request_id: str
    client_id: str
    owner: str
    status: str
    num_blocks: int
    num_output_tokens: int


@dataclass(frozen=True)
class Snapshot:
    """An engine's queues, cache and health at one moment (``Engine.snapshot``)."""

    running: int
    waiting: int
    block_size: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    counters: Counters
    prefix_queries: int
    prefix_hits: int
    worker_up: bool
    redis_up: bool
    requests: tuple[HeldRequest, ...] = ()  # filled only when asked for (``Stats``)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / max(1, self.num_blocks)

    @property
    def serving(self) -> bool:
        return self.worker_up and self.redis_up


class Health:
    """What is down, written by the engine thread alone. The gRPC health says NOT_SERVING while the worker or
    Redis is; ``on_change`` hears each change of that (the server supplies it)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.worker_up = True
        self.redis_up = True
        self.on_change: Callable[[bool], None] = lambda serving: None

    @property
    def serving(self) -> bool:
        return self.worker_up and self.redis_up

    def set(self, worker_up: bool | None = None, redis_up: bool | None = None) -> None:
        """Record what is up now (None: as it was); ``on_change`` hears it when serving changes."""
        before = self.serving
        if worker_up is not None:
            self.worker_up = worker_up
            self.metrics.worker_up.set(1 if worker_up else 0)
        if redis_up is not None:
            self.redis_up = redis_up
        if self.serving != before:
            self.on_change(self.serving)


def step_phase(plan: StepPlan) -> str:
    """``prefill``, ``decode`` or ``mixed``: what a step's chunks compute."""
    decodes = sum(1 for c in plan.chunks
                  if c.decode_last or (len(c.token_ids) == 1 and c.start_pos >= len(c.request.prompt_ids)))
    return "prefill" if decodes == 0 else "decode" if decodes == len(plan.chunks) else "mixed"


class StepMetrics:
    """The scheduler's Prometheus series: a step's duration and batch when it is answered, per-request
    latencies, the scheduler's counters as increments since the last export, and the gauges."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._sent_at: dict[int, float] = {}
        self._last_answer = 0.0
        self._counted = Counters()
        self._prefix_counted = (0, 0)  # prefix cache (queries, hits) as last exported
        self._gauges: tuple | None = None  # the gauges' values as last exported

    def sent(self, step: int) -> None:
        self._sent_at[step] = time.perf_counter()

    def answered(self, plan: StepPlan, outputs: list[Output], snapshot: Snapshot) -> None:
        """One answered step: its duration (from when the worker could start it), its batch, the latencies of
        the requests it admitted or answered, then the counters and gauges."""
        m = self.metrics
        now = time.perf_counter()
        started = max(self._sent_at.pop(plan.step, now), self._last_answer)  # queued behind the previous step
        self._last_answer = now
        m.step_duration_seconds.labels(phase=step_phase(plan)).observe(now - started)
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
        self.export(snapshot)

    def forget_sent(self) -> None:
        """The worker failed: the steps it had are not answered."""
        self._sent_at.clear()

    def export(self, s: Snapshot) -> None:
        """Counters as increments since the last export, and the gauges; only what changed (an export follows every
        step, and most of its series stay as they were)."""
        m, c, done = self.metrics, s.counters, self._counted
        for counter, now, before in ((m.steps, c.steps, done.steps), (m.preemptions, c.preemptions, done.preemptions),
                                     (m.aborts, c.aborts, done.aborts), (m.spec_draft_tokens, c.drafted, done.drafted),
                                     (m.spec_accepted_tokens, c.accepted, done.accepted),
                                     (m.spec_verify_steps, c.verifies, done.verifies),
                                     (m.prefix_cache_queries, s.prefix_queries, self._prefix_counted[0]),
                                     (m.prefix_cache_hits, s.prefix_hits, self._prefix_counted[1])):
            if now != before:
                counter.inc(now - before)
        for reason, count in c.spec_skipped.items():
            if count != done.spec_skipped[reason]:
                m.spec_skipped.labels(reason).inc(count - done.spec_skipped[reason])
        self._counted = c
        self._prefix_counted = (s.prefix_queries, s.prefix_hits)
        gauges = (s.running, s.waiting, s.used_blocks, s.num_blocks, s.kv_usage, s.cached_blocks, int(s.worker_up))
        if gauges != self._gauges:
            self._gauges = gauges
            for gauge, value in zip((m.requests_running, m.requests_waiting, m.kv_blocks_used, m.kv_blocks_total,
                                     m.kv_cache_usage_ratio, m.prefix_cache_blocks, m.worker_up), gauges):
                gauge.set(value)
