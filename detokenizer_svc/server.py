"""``conveyor serve detokenizer``: the Detokenizer gRPC service and the feeds to frontends and schedulers
(one detokenizer serves every engine; a Finish or an orphan's Abort goes to the engine holding the request)."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from conveyor import grpc_util
from conveyor.engines import Registry
from conveyor.schedulers import Schedulers
from conveyor.errors import ConveyorError, InvalidArgument
from conveyor.link import Link, LinkServer, LinkService, Peer
from conveyor.metrics import Metrics
from conveyor.state import REDIS_DOWN, RequestStore
from conveyor.tokenizer import load_tokenizer
from conveyor.v1 import conveyor_pb2, detokenizer_pb2, detokenizer_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from conveyor.v1 import scheduler_pb2
from conveyor.wire import FINISH_FROM_PB, FINISH_TO_PB
from detokenizer_svc.config import DetokenizerConfig
from conveyor.messages import Delta
from detokenizer_svc.core import DetokenizerCore, TokenEntry

log = logging.getLogger("conveyor.detokenizer")
SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name


def entry_from_pb(pb: detokenizer_pb2.RequestTokens) -> TokenEntry:
    return TokenEntry(pb.request_id, pb.first_index, pb.token_ids[:], FINISH_FROM_PB[pb.finish_reason],
                      pb.stopped_by_token, pb.logprobs[:])


def deltas_pb(deltas: list[Delta], into) -> None:
    """Add ``deltas`` to ``into`` (a message's repeated ``deltas``) in place, each with only the fields that are set
    (a token's text and id, most of them): 1.5 against 3.1 us a delta built whole from keywords."""
    add = into.add
    for d in deltas:
        pb = add(request_id=d.request_id, text_offset=d.text_offset, text=d.text, first_token_index=d.first_token_index)
        pb.token_ids.extend(d.token_ids)
        if d.finish_reason is not None:
            pb.finish_reason = FINISH_TO_PB[d.finish_reason]
        if d.prompt_tokens or d.completion_tokens:
            pb.prompt_tokens, pb.completion_tokens = d.prompt_tokens, d.completion_tokens
        if d.logprobs:
            pb.logprobs.extend(lp if lp is not None else conveyor_pb2.TokenLogprobs(token_id=t)  # replayed: not kept
                               for t, lp in zip(d.token_ids, d.logprobs))


class Channels:
    """One ``Peer`` per frontend address (its gRPC channel for the ``Link`` call, and the link, dialled on first
    use and again after a failure). A frontend that just failed is left alone for ``DOWN_SECONDS`` (a
    host that drops packets would otherwise hold every step for the answer's timeout).

    What a frontend could not take is held here (``hold``) and sent again before anything newer (``held``):
    Redis may no longer have it to replay (it lost its data, or a finished record expired), so a frontend that
    was only stalled or restarting still gets every delta. Deltas carry their offsets, so one it already had
    is dropped there. What is held for longer than ``keep_for`` seconds is dropped (its requests are orphans by
    then: ``Orphans``)."""

    DOWN_SECONDS = 1.0
    ANSWER_SECONDS = 5.0  # a frontend that does not answer a batch within this is taken as down

    def __init__(self, keep_for: float = 30.0):
        self.keep_for = keep_for
        self._peers: dict[str, Peer] = {}  # one per address, kept (with its gRPC channel)
        self._down_until: dict[str, float] = {}
        self._held: dict[str, tuple[float, list[Delta]]] = {}  # address -> (since, deltas not delivered)
        # address -> (since or None, deltas, how many of them were held): sent, the frontend's answer not read yet
        self._sent: dict[str, tuple[float | None, list[Delta], int]] = {}
        self._sending: dict[str, threading.Lock] = {}  # one batch in flight per frontend: answers stay paired
        self._lock = threading.Lock()

    def is_down(self, address: str) -> bool:
        return time.monotonic() < self._down_until.get(address, 0.0)

    def failed(self, address: str) -> None:
        """A call to ``address`` failed (which dropped its link): leave it alone for ``DOWN_SECONDS``."""
        self._down_until[address] = time.monotonic() + self.DOWN_SECONDS

    def frontend(self, address: str) -> Peer:
        """The frontend at ``address`` (its link used under ``sending(address)``)."""
        with self._lock:
            if address not in self._peers:
                stub = frontend_pb2_grpc.FrontendStub(grpc_util.internal_channel(address))
                self._peers[address] = Peer(stub.Link, address, timeout=self.ANSWER_SECONDS)
            return self._peers[address]

    def sending(self, address: str) -> threading.Lock:
        """Held while a batch goes to ``address`` and its answer comes back (the schedulers' link threads and the
        resender)."""
        with self._lock:
            return self._sending.setdefault(address, threading.Lock())

    def hold(self, address: str, deltas: list[Delta], since: float | None = None) -> None:
        """Keep deltas ``address`` could not take (``since``: when the oldest of them first failed), in place of
        what ``held`` took: call both under ``sending(address)``."""
        now = time.monotonic()
        since = now if since is None else since
        if now - since > self.keep_for:
            log.warning("dropped %d deltas frontend %s could not take for %.0f s", len(deltas), address, now - since)
            return
        with self._lock:
            self._held[address] = (since, deltas)

    def held(self, address: str) -> tuple[float | None, list[Delta]]:
        """Take what is held for ``address``: (since when, the deltas), oldest first."""
        with self._lock:
            return self._held.pop(address, (None, []))

    def holding(self) -> list[str]:
        """The addresses with deltas held, that may be tried again now, or with an answer not read yet."""
        with self._lock:
            return [*{a for a in self._held if not self.is_down(a)} | set(self._sent)]

    def sent(self, address: str, since: float | None, deltas: list[Delta], held: int) -> None:
        """``deltas`` went to ``address`` (``since``: when the oldest first failed; ``held``: how many were held):
        its answer is read before its next batch (``unanswered``). Under ``sending(address)``."""
        with self._lock:
            self._sent[address] = (since, deltas, held)

    def unanswered(self, address: str) -> tuple[float | None, list[Delta], int] | None:
        """Take what went to ``address`` and is not answered yet (``sent``'s), or None. Under ``sending(address)``."""
        with self._lock:
            return self._sent.pop(address, None)


class Orphans:
    """Requests whose frontend is unreachable or no longer holds their stream, since when.

    They keep generating for ``timeout`` seconds (a client may resume on another frontend, which
    then claims them by Replay); after that they are aborted, so nothing decodes for nobody."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.since: dict[str, float] = {}
        self.lock = threading.Lock()

    def lost(self, request_ids) -> list[str]:
        """Mark these ids as without a frontend; returns the ids orphaned for longer than the timeout."""
        now = time.monotonic()
        with self.lock:
            for request_id in request_ids:
                self.since.setdefault(request_id, now)
            expired = [r for r, t in self.since.items() if now - t >= self.timeout]
            for request_id in expired:
                del self.since[request_id]
        return expired

    def found(self, request_ids) -> None:
        with self.lock:
            for request_id in request_ids:
                self.since.pop(request_id, None)


class FinishSender:
    """Tells the engine holding a request about its stop-string match, from its own thread, retrying while it
    is down (a Finish lost in a scheduler restart would let the request run on to max_tokens); a request
    that moved to another engine meanwhile is told there."""

    def __init__(self, schedulers: Schedulers, give_up_after: float = 300.0):
        self.schedulers = schedulers
        self.give_up_after = give_up_after
        self.queue: queue.Queue[tuple[str, int, float]] = queue.Queue()
        threading.Thread(target=self._run, name="finish", daemon=True).start()

    def __call__(self, request_id: str, num_tokens: int) -> None:
        self.queue.put((request_id, num_tokens, time.monotonic()))

    def _run(self) -> None:
        while True:
            request_id, num_tokens, queued = self.queue.get()
            backoff = 0.05
            while time.monotonic() - queued < self.give_up_after:
                try:
                    scheduler = self.schedulers.of_request(request_id)
                    if scheduler is None:  # its record expired: nothing runs it any more
                        break
                    scheduler.Finish(scheduler_pb2.FinishRequest(request_id=request_id, num_tokens=num_tokens), timeout=5)
                    break
                except (grpc.RpcError, ConveyorError, *REDIS_DOWN) as exc:
                    code = exc.code() if isinstance(exc, grpc.RpcError) else exc
                    log.warning("could not tell the scheduler that %s stopped (%s); retrying", request_id, code)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)


class DetokenizerService(LinkService, detokenizer_pb2_grpc.DetokenizerServicer):
    """``Replay`` over gRPC, and each scheduler's token batches over a link of its own (``add_link``), read,
    decoded, delivered and answered on one thread per link."""

    def __init__(self, core: DetokenizerCore, schedulers: Schedulers, metrics: Metrics, orphan_timeout: float):
        self.core = core
        self.schedulers = schedulers
        self.metrics = metrics
        self.channels = Channels(keep_for=orphan_timeout)
        self.orphans = Orphans(orphan_timeout)
        threading.Thread(target=self.resend, name="resend", daemon=True).start()

    def add_link(self, link: Link) -> None:
        """A scheduler's link: its batches answered in order on a thread of its own until it goes away; one that
        does not parse or whose handling fails ends the link (the scheduler opens a new one and sends it again)."""
        threading.Thread(target=link.answer_each, args=("token batch", detokenizer_pb2.TokenBatch.FromString,
                                                        self._push, self._refusal), name="push", daemon=True).start()

    @staticmethod
    def _refusal(exc: Exception) -> tuple[str, str, None]:
        log.error("a step's tokens failed: %s", exc, exc_info=exc)
        return "INTERNAL", f"{type(exc).__name__}: {exc}", None

    def _push(self, batch: detokenizer_pb2.TokenBatch) -> detokenizer_pb2.PushResponse:
        start = time.perf_counter()
        by_frontend, failed = self.core.push([entry_from_pb(e) for e in batch.requests])
        for frontend, deltas in by_frontend.items():
            self._deliver(frontend, deltas)
        if failed:  # the scheduler sends the batch again; those requests start over from Redis
            log.warning("could not read %d requests of step %d from Redis; asked for the batch again", len(failed),
                        batch.step)
            return detokenizer_pb2.PushResponse(step=batch.step, retry=True)
        self.metrics.detokenizer_tokens.inc(sum(len(e.token_ids) for e in batch.requests))
        self.metrics.detokenizer_push_seconds.observe(time.perf_counter() - start)
        return detokenizer_pb2.PushResponse(step=batch.step)

    def Replay(self, request, context):
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        frontend, deltas = self.core.replay(request.request_id, request.frontend)
        self.orphans.found([request.request_id])
        self.metrics.replays.inc()
        log.info("replayed %s from Redis for %s", request.request_id, frontend)
        reply = detokenizer_pb2.ReplayResponse()
        deltas_pb(deltas, reply.deltas)
        return reply

    def _deliver(self, frontend: str, deltas: list[Delta]) -> None:
        """Send ``frontend`` its deltas, after any it could not take before; held again if it cannot now. Its answer
        (which requests it holds no stream for) is read before its next batch, where it is there already while the
        frontend keeps up (a wake of this thread fewer a step than waiting for it), or by ``resend`` within a second
        for the last batch of a burst; a batch it did not take is then held, ahead of anything newer."""
        judged = []
        with self.channels.sending(frontend):
            if (answered := self._settle(frontend)) is not None:
                judged.append(answered)
            since, held = self.channels.held(frontend)
            deltas = held + deltas
            if deltas and not self._send(frontend, deltas, since, len(held)):
                self.channels.hold(frontend, deltas, since)
                judged.append((deltas, None))
        for delivered, gone in judged:
            if gone is None:  # the frontend could not take them (its clients may resume elsewhere)
                gone = {d.request_id for d in delivered if d.finish_reason is None}
            self.orphans.found({d.request_id for d in delivered} - gone)
            for request_id in self.orphans.lost(gone):  # nobody listened for too long: stop generating
                self.metrics.orphan_aborts.inc()
                self.core.forget(request_id)
                self._abort(request_id)

    def resend(self, every: float = Channels.DOWN_SECONDS) -> None:
        """Try the frontends holding deltas again, every ``every`` seconds (from a daemon thread): the last
        deltas of a stream (its finish) may have no newer ones to follow them."""
        while True:
            time.sleep(every)
            for frontend in self.channels.holding():
                try:
                    self._deliver(frontend, [])
                except Exception:  # noqa: BLE001 - the next round tries again
                    log.exception("resending held deltas to %s failed", frontend)

    def _send(self, frontend: str, deltas: list[Delta], since: float | None, held: int) -> bool:
        """Send the deltas (``since``: when the oldest of them first failed, None if never; ``held``: how many were
        held); False when the frontend cannot be reached (now or just before). Under ``sending(frontend)``."""
        if self.channels.is_down(frontend):
            return False
        batch = frontend_pb2.DeltaBatch()
        deltas_pb(deltas, batch.deltas)
        peer = self.channels.frontend(frontend)
        try:
            peer.open().send(batch)
        except Exception as exc:  # noqa: BLE001 - down or restarting
            peer.drop()
            self._failed(frontend, exc, len(deltas), quiet=since is not None)
            return False
        self.channels.sent(frontend, since, deltas, held)
        return True

    def _settle(self, frontend: str) -> tuple[list[Delta], set[str] | None] | None:
        """Read the frontend's answer to the batch sent to it last (waiting for it, ``Channels.ANSWER_SECONDS`` at
        most): (its deltas, the ids it holds no stream for, or None when it did not take them: they are held again),
        or None when nothing waits for an answer. Under ``sending(frontend)``."""
        if (sent := self.channels.unanswered(frontend)) is None:
            return None
        since, deltas, held = sent
        peer = self.channels.frontend(frontend)
        try:
            if peer.link is None:
                raise ConnectionError("the link broke")
            reply = peer.link.receive(frontend_pb2.DeliverResponse.FromString, self.channels.ANSWER_SECONDS)
        except Exception as exc:  # noqa: BLE001 - down, restarting, stalled, or it refused the batch
            peer.drop()
            self._failed(frontend, exc, len(deltas), quiet=since is not None)
            self.channels.hold(frontend, deltas, since)
            return deltas, None
        if held:
            log.info("delivered %d held deltas to frontend %s", held, frontend)
        return deltas, set(reply.unknown_request_ids)

    def _failed(self, frontend: str, exc: Exception, count: int, quiet: bool) -> None:
        """A frontend could not take a batch: left alone for a while (``quiet``: it failed before, already logged)."""
        self.channels.failed(frontend)
        if not quiet:
            why = exc.code() if isinstance(exc, grpc.RpcError) else str(exc) or type(exc).__name__
            log.warning("frontend %s unreachable (%s) for %d requests", frontend, why, count)

    def _abort(self, request_id: str) -> None:
        try:
            scheduler = self.schedulers.of_request(request_id)
            if scheduler is not None:
                scheduler.Abort(scheduler_pb2.SchedulerAbortRequest(request_id=request_id), timeout=5)
        except (grpc.RpcError, ConveyorError, *REDIS_DOWN) as exc:
            log.warning("could not abort %s at its engine: %s", request_id, exc)


def serve(cfg: DetokenizerConfig) -> None:
    tokenizer = load_tokenizer(cfg.model)
    store = RequestStore.from_url(cfg.redis_url, cfg.redis_prefix)
    schedulers = Schedulers(Registry(store))

    metrics = Metrics("detokenizer")
    metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host)

    finish = FinishSender(schedulers)

    def on_stop(request_id: str, num_tokens: int, repeat: bool = False) -> None:
        if not repeat:
            metrics.stop_string_matches.inc()
        finish(request_id, num_tokens)

    core = DetokenizerCore(tokenizer, store, on_stop)
    server = grpc_util.make_server(metrics=metrics)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    service = DetokenizerService(core, schedulers, metrics, cfg.orphan_timeout)
    service.listening(LinkServer(cfg.host, cfg.link_port, service.add_link, "push"))
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(service, server)
    port = grpc_util.bind_internal(server, cfg.host, cfg.port)
    server.start()
    grpc_util.set_serving(health, [SERVICE_NAME], True, metrics)
    log.info("detokenizer serving on %s:%d, token batches on link port %d (metrics on %s:%d)", cfg.host, port,
             service.link_port, cfg.metrics_host, metrics_port)
    grpc_util.wait_for_termination(server, on_stop=lambda: grpc_util.set_serving(health, [SERVICE_NAME], False, metrics))
