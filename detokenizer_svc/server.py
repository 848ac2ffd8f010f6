"""``conveyor serve detokenizer``: the Detokenizer gRPC service and the feeds to frontends and scheduler."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from conveyor import grpc_util
from conveyor.metrics import Metrics
from conveyor.state import RequestStore
from conveyor.tokenizer import load_tokenizer
from conveyor.v1 import conveyor_pb2, detokenizer_pb2, detokenizer_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from conveyor.wire import FINISH_FROM_PB, FINISH_TO_PB
from detokenizer_svc.config import DetokenizerConfig
from conveyor.messages import Delta
from detokenizer_svc.core import DetokenizerCore, TokenEntry

log = logging.getLogger("conveyor.detokenizer")
SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name


def entry_from_pb(pb: detokenizer_pb2.RequestTokens) -> TokenEntry:
    return TokenEntry(pb.request_id, pb.first_index, list(pb.token_ids), FINISH_FROM_PB[pb.finish_reason],
                      pb.stopped_by_token, list(pb.logprobs))


def delta_to_pb(d: Delta) -> frontend_pb2.Delta:
    logprobs = [lp if lp is not None else conveyor_pb2.TokenLogprobs(token_id=t)  # replayed: not kept
                for t, lp in zip(d.token_ids, d.logprobs)]
    return frontend_pb2.Delta(
        request_id=d.request_id, text_offset=d.text_offset, text=d.text, first_token_index=d.first_token_index,
        token_ids=d.token_ids, finish_reason=FINISH_TO_PB[d.finish_reason], prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens, logprobs=logprobs,
    )


class Channels:
    """One channel per peer address, made on first use."""

    def __init__(self):
        self._stubs: dict[str, frontend_pb2_grpc.FrontendStub] = {}
        self._lock = threading.Lock()

    def frontend(self, address: str) -> frontend_pb2_grpc.FrontendStub:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=grpc_util.channel_options())
                self._stubs[address] = frontend_pb2_grpc.FrontendStub(channel)
            return self._stubs[address]


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, core: DetokenizerCore, scheduler: scheduler_pb2_grpc.SchedulerStub, metrics: Metrics):
        self.core = core
        self.scheduler = scheduler
        self.metrics = metrics
        self.channels = Channels()

    def Push(self, request, context):
        start = time.perf_counter()
        by_frontend = self.core.push([entry_from_pb(e) for e in request.requests])
        for frontend, deltas in by_frontend.items():
            self._deliver(frontend, deltas)
        self.metrics.detokenizer_tokens.inc(sum(len(e.token_ids) for e in request.requests))
        self.metrics.detokenizer_push_seconds.observe(time.perf_counter() - start)
        return detokenizer_pb2.PushResponse()

    def _deliver(self, frontend: str, deltas: list[Delta]) -> None:
        try:
            reply = self.channels.frontend(frontend).Deliver(
                frontend_pb2.DeltaBatch(deltas=[delta_to_pb(d) for d in deltas]), timeout=10
            )
        except grpc.RpcError as exc:  # the frontend is gone: its clients are gone with it
            log.warning("frontend %s unreachable (%s); aborting its %d requests", frontend, exc.code(), len(deltas))
            gone = {d.request_id for d in deltas if d.finish_reason is None}
        else:
            gone = set(reply.unknown_request_ids)
        for request_id in gone:  # nobody is listening: stop generating
            self.core.forget(request_id)
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        try:
            self.scheduler.Abort(scheduler_pb2.SchedulerAbortRequest(request_id=request_id), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not abort %s at the scheduler: %s", request_id, exc.code())


def serve(cfg: DetokenizerConfig) -> None:
    tokenizer = load_tokenizer(cfg.model)
    store = RequestStore.from_url(cfg.redis_url, cfg.redis_prefix)
    scheduler = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(cfg.scheduler, options=grpc_util.channel_options()))

    metrics = Metrics("detokenizer")
    metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host)

    def on_stop(request_id: str, num_tokens: int) -> None:
        metrics.stop_string_matches.inc()
        try:
            scheduler.Finish(scheduler_pb2.FinishRequest(request_id=request_id, num_tokens=num_tokens), timeout=5)
        except grpc.RpcError as exc:
            log.warning("could not tell the scheduler that %s stopped: %s", request_id, exc.code())

    core = DetokenizerCore(tokenizer, store, on_stop)
    server = grpc_util.make_server(metrics=metrics)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(DetokenizerService(core, scheduler, metrics), server)
    port = grpc_util.bind(server, cfg.host, cfg.port)
    server.start()
    grpc_util.set_serving(health, [SERVICE_NAME], True, metrics)
    log.info("detokenizer serving on %s:%d (metrics on %s:%d)", cfg.host, port, cfg.metrics_host, metrics_port)
    grpc_util.wait_for_termination(server, on_stop=lambda: grpc_util.set_serving(health, [SERVICE_NAME], False, metrics))
