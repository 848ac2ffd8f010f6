"""An engine's membership among the engines sharing a Redis (``conveyor.engines``): its heartbeat, which is
also its lease on its requests, and the takeover of the requests of engines that died."""

from __future__ import annotations

import logging
import threading
import time

from conveyor.engines import EngineInfo, Registry
from conveyor.metrics import Metrics
from scheduler_svc.engine import Engine

log = logging.getLogger("conveyor.scheduler")


class Membership:
    """Keeps this engine registered in Redis (its lease on its requests, ``conveyor.engines``) and takes
    over the requests of engines whose lease expired. Beats on a thread of its own, and only there once
    started (``soon`` asks it for a beat now: the frontends route around an engine that stops serving)."""

    def __init__(self, engine: Engine, registry: Registry, address: str, model: str, metrics: Metrics):
        self.engine, self.registry, self.metrics = engine, registry, metrics
        self.address, self.model = address, model
        self.lease = engine.lease
        self.ttl = self.lease.ttl
        self._registered = False
        self._stop = threading.Event()
        self._wake = threading.Event()

    def info(self) -> EngineInfo:
        s = self.engine.snapshot()
        return EngineInfo(self.engine.name, self.address, self.model, s.running, s.waiting, s.kv_usage, s.serving,
                          s.block_size)

    def beat(self) -> None:
        """One heartbeat. When the lease had lapsed, first drop what other engines took meanwhile: the
        lease counts as fresh again only after that."""
        sent = time.monotonic()
        existed = self.registry.heartbeat(self.info(), self.ttl)
        if self._registered and not existed:
            self.engine.drop_taken(self.engine.held())
            log.warning("this engine's registration had expired (no heartbeat for %.1f s); registered again",
                        self.ttl)
        self._registered = True
        self.lease.refreshed(sent)

    def take_over(self) -> None:
        """Move the requests of dead engines here (one claim per dead engine; another engine may win it)."""
        for dead in self.registry.dead():
            if dead == self.engine.name or not self.lease.fresh():
                continue
            moved = self.registry.claim(dead, self.engine.name)
            if moved:
                adopted = self.engine.adopt(moved)
                self.metrics.engine_takeovers.inc(adopted)
                log.warning("engine %s is gone; took over its %d requests", dead, adopted)

    def start(self) -> None:
        threading.Thread(target=self._run, name="membership", daemon=True).start()

    def soon(self) -> None:
        """Beat now rather than at the next period (from any thread)."""
        self._wake.set()

    def _run(self) -> None:
        failures = 0
        while True:
            self._wake.wait(self.ttl / 6)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.beat()
                self.take_over()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - Redis down: the lease goes stale, steps wait
                if failures % 20 == 0:
                    log.warning("engine heartbeat failed: %s", exc)
                failures += 1

    def stop(self) -> None:
        """A clean stop: leave at once, so that another engine takes the requests over without waiting."""
        self._stop.set()
        self._wake.set()
        try:
            self.registry.leave(self.engine.name)
        except Exception:  # noqa: BLE001 - Redis down: the registration expires by itself
            pass
