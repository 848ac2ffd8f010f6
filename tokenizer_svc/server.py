"""``conveyor serve frontend``: the public Conveyor API, the internal service, and the link deltas arrive on.

Two gRPC servers in one process: the public one (clients) and the internal one (the detokenizer),
so that the internal service can stay on localhost. Protobuf is converted here and nowhere else.

The whole process runs on one asyncio event loop: a client stream is a coroutine, not a thread, so the
token a client receives costs no thread switch (on the thread-per-stream server each token woke the
stream's thread and waited for gRPC's; ~85 against ~35 us of CPU per message). The internal server and the
deliver link run on the same loop: the link hands each delta to its stream there and wakes the stream's
coroutine, and a stream's state is only ever changed on the loop (``tokenizer_svc.frontend``). Redis (``redis.asyncio``),
the schedulers' Submit and Abort and the detokenizer's Replay are awaited on the loop too (``grpc.aio``
stubs); only tokenizing runs on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

import grpc

from conveyor import grpc_util
from conveyor.engines import Registry, Router
from conveyor.schedulers import Schedulers
from conveyor.errors import ConveyorError, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from conveyor.link import LinkService, serve_on_loop
from conveyor.messages import Delta
from conveyor.metrics import Metrics
from conveyor.params import Limits, SamplingParams, StopParams, Structured, given_from_pb, sampling_defaults
from conveyor.state import REDIS_DOWN, AsyncRequestStore, RequestRecord
from conveyor.tokenizer import load_tokenizer
from conveyor.v1 import conveyor_pb2, conveyor_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from conveyor.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2
from conveyor.wire import FINISH_FROM_PB, FINISH_TO_PB, logprobs_to_pb
from tokenizer_svc.access import OWNER, Access, ApiKeys, AuthInterceptor
from tokenizer_svc.config import FrontendConfig
from tokenizer_svc.frontend import ClientDelta, Frontend
from tokenizer_svc.openai_api import OpenAIApi
from tokenizer_svc.streaming import RequestTimer, follow
from tokenizer_svc.validation import GenerateInput

log = logging.getLogger("conveyor.frontend")
PUBLIC_SERVICE = conveyor_pb2.DESCRIPTOR.services_by_name["Conveyor"].full_name
INTERNAL_SERVICE = frontend_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name


# ---------------------------------------------------------------- protobuf <-> dataclasses


def _chat(chat: conveyor_pb2.Chat) -> tuple[list[dict], bool]:
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return messages, add


def input_from_pb(pb: conveyor_pb2.GenerateRequest) -> GenerateInput:
    inp = GenerateInput(
        request_id=pb.request_id, priority=pb.priority, cache_salt=pb.cache_salt if pb.HasField("cache_salt") else None,
        sampling=given_from_pb(pb.sampling, SamplingParams), stop=given_from_pb(pb.stop, StopParams),
        structured=Structured.from_pb(pb.structured),
        speculative=pb.speculative if pb.HasField("speculative") else True,
    )
    if inp.structured is not None:
        inp.structured_field = f"structured.{inp.structured.kind}"
    kind = pb.WhichOneof("input")
    if kind == "prompt":
        inp.prompt = pb.prompt
    elif kind == "chat":
        inp.messages, inp.add_generation_prompt = _chat(pb.chat)
    elif kind == "prompt_ids":
        inp.prompt_ids = list(pb.prompt_ids.ids)
    return inp


def delta_from_pb(d: frontend_pb2.Delta) -> Delta:
    return Delta(d.request_id, d.text_offset, text=d.text, first_token_index=d.first_token_index,
                 token_ids=d.token_ids[:], logprobs=d.logprobs[:], finish_reason=FINISH_FROM_PB[d.finish_reason],
                 prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens)


def client_delta_to_pb(d: ClientDelta) -> conveyor_pb2.GenerateResponse:
    """Only the fields that are set (a token's text and id, most of them): one of these goes per token."""
    pb = conveyor_pb2.GenerateResponse(request_id=d.request_id, text=d.text, token_ids=d.token_ids,
                                       first_token_index=d.first_token_index)
    if d.finish_reason is not None:
        pb.finish_reason = FINISH_TO_PB[d.finish_reason]
    if d.prompt_tokens or d.completion_tokens:
        pb.prompt_tokens, pb.completion_tokens = d.prompt_tokens, d.completion_tokens
    if d.logprobs:
        pb.logprobs.extend(d.logprobs)
    if d.prompt_logprobs:
        pb.prompt_logprobs.extend(logprobs_to_pb(t, (lp, top)) for t, lp, _rank, top in d.prompt_logprobs)
    return pb


# ---------------------------------------------------------------- the scheduler, as the core sees it


class Batched:
    """Calls ``send(items)`` with every item given while its previous call was in flight: the first goes at once,
    alone, and those that arrive meanwhile go together next (at most ``most``), so a busy frontend makes one call
    per batch of arrivals and an idle one adds no wait. ``send`` returns one error or None per item; when it
    raises, every item of that call gets its error."""

    def __init__(self, send: Callable[[list], Awaitable[list]], most: int = 256):
        self.send, self.most = send, most
        self.pending: list[tuple[object, asyncio.Future]] = []
        self.sending: asyncio.Task | None = None

    async def __call__(self, item) -> None:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
        if self.sending is None or self.sending.done():
            self.sending = asyncio.ensure_future(self._drain())
        await future

    async def _drain(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[: self.most], self.pending[self.most :]
            try:
                errors = await self.send([item for item, _ in batch])
            except Exception as exc:  # noqa: BLE001 - the call failed: so did each of its items
                errors = [exc] * len(batch)
            for (_, future), error in zip(batch, errors):
                if future.done():  # its caller went away
                    continue
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)


class EnginesClient:
    """The engines as the core sees them: routing, submit and abort as coroutines raising ``ConveyorError``s.

    A request goes to the engine ``Router`` picks (``conveyor.engines``); its record says which. A submit
    that finds its engine gone (not registered any more) moves the request to another live engine, unless
    one already took it over; the caller's retry then submits there."""

    # a scheduler's refusal the caller must not retry (any other: the scheduler is restarting, or the request moved)
    FINAL = {"RESOURCE_EXHAUSTED": ResourceExhausted, "INVALID_ARGUMENT": InvalidArgument}

    def __init__(self, registry: Registry, metrics: Metrics):
        self.registry = registry
        self.router = Router(registry)
        self.schedulers = Schedulers(registry, channel=grpc_util.internal_aio_channel)
        self.metrics = metrics
        self.model = ""  # the served model's name: part of the routing keys
        self._submits: dict[str, Batched] = {}  # per engine

    def _error(self, code: str, details: str) -> ConveyorError:
        return self.FINAL.get(code, Unavailable)(f"scheduler: {details}")

    async def _call(self, method, request, timeout: float = 10.0):
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self._error(exc.code().name, exc.details()) from exc

    async def _submit_batch(self, engine: str, request_ids: list[str]) -> list[ConveyorError | None]:
        stub = await self.schedulers.stub(engine)
        reply = await self._call(stub.Submit, scheduler_pb2.SubmitRequest(request_ids=request_ids))
        refused = {r.request_id: self._error(r.code, r.details) for r in reply.refused}
        return [refused.get(rid) for rid in request_ids]

    async def route(self, prompt_ids: list[int], scope: str = "") -> str:
        """The engine for a new request. With none serving, a registered one (the submit waits for it)."""
        route = await self.router.choose(prompt_ids, self.model, scope=scope)
        if route is not None:
            self.metrics.engine_routes.labels(route.engine.name, route.reason).inc()
            return route.engine.name
        names = await self.registry.names()
        if not names:
            raise Unavailable("no engine is registered in Redis (is a scheduler running with the same Redis and prefix?)")
        return names[0]

    async def submit(self, record: RequestRecord) -> None:
        """Hand a recorded request to its engine; once accepted, its prefixes route there."""
        engine = record.engine
        if engine not in self._submits:
            self._submits[engine] = Batched(lambda ids: self._submit_batch(engine, ids))
        try:
            await self._submits[engine](record.request_id)
        except Unavailable:
            await self._follow(record)
            raise
        if len(await self.router.engines()) > 1:
            await self.router.remember(record.prompt_ids, record.engine, self.model, record.params.cache_scope)

    async def _follow(self, record: RequestRecord) -> None:
        """After a failed submit: find where the request should go now (for the caller's retry)."""
        holder = await self.registry.engine_of(record.request_id)
        if holder is not None and holder != record.engine:  # taken over meanwhile
            record.engine = holder
            return
        if record.engine in {e.name for e in await self.registry.live()}:
            return  # registered: it is restarting or busy; try it again
        self.router.forget(record.engine)
        route = await self.router.choose(record.prompt_ids, self.model, exclude=record.engine,
                                         scope=record.params.cache_scope)
        if route is not None and await self.registry.reassign(record.request_id, record.engine, route.engine.name):
            self.metrics.engine_routes.labels(route.engine.name, "failover").inc()
            log.warning("engine %s is gone; request %s moves to %s", record.engine, record.client_id, route.engine.name)
            record.engine = route.engine.name

    async def abort(self, request_id: str) -> bool:
        scheduler = await self.schedulers.of_request(request_id)
        if scheduler is None:
            return False
        return (await self._call(scheduler.Abort, scheduler_pb2.SchedulerAbortRequest(request_id=request_id))).aborted

    async def serving(self) -> bool:
        """Whether some engine serves (its worker and Redis answer); exports each engine's state."""
        try:
            live = {e.name: e for e in await self.registry.live()}
            names = set(await self.registry.names()) | set(live)
        except REDIS_DOWN:
            return False
        for name in names:
            self.metrics.engine_up.labels(name).set(1 if name in live and live[name].serving else 0)
        return any(e.serving for e in live.values())

    async def info(self) -> scheduler_pb2.SchedulerInfoResponse:
        """A scheduler's Info, waiting until an engine registered and answers (it waits for its worker)."""
        waited = 0
        while True:
            try:
                for engine in await self.registry.live():
                    stub = await self.schedulers.stub(engine.name)
                    reply = await stub.Info(scheduler_pb2.SchedulerInfoRequest(), timeout=5)
                    self.model = reply.model_name
                    return reply
            except (grpc.RpcError, ConveyorError, *REDIS_DOWN):
                pass
            if waited % 20 == 0:
                log.info("waiting for an engine to register in Redis and answer")
            waited += 1
            await asyncio.sleep(0.5)


class DetokenizerClient:
    """Replay as a coroutine: the deltas of a request so far, rebuilt from Redis by the detokenizer."""

    def __init__(self, address: str):
        self.stub = detokenizer_pb2_grpc.DetokenizerStub(grpc_util.internal_aio_channel(address))

    async def replay(self, request_id: str, frontend: str) -> list[Delta]:
        try:
            reply = await self.stub.Replay(detokenizer_pb2.ReplayRequest(request_id=request_id, frontend=frontend),
                                           timeout=10)
        except grpc.RpcError as exc:
            kind = NotFound if exc.code() == grpc.StatusCode.NOT_FOUND else Unavailable
            raise kind(f"detokenizer: {exc.details()}") from exc
        return [delta_from_pb(d) for d in reply.deltas]


# ---------------------------------------------------------------- the services


class ConveyorService(conveyor_pb2_grpc.ConveyorServicer):
    """The public API on the event loop (see the module doc). The caller's API key name (its requests'
    owner) is in ``access.OWNER``, set by the auth interceptor."""

    def __init__(self, frontend: Frontend, info: conveyor_pb2.ServerInfoResponse, metrics: Metrics,
                 request_timeout: float = 0.0):
        self.frontend = frontend
        self.info = info
        self.metrics = metrics
        self.request_timeout = request_timeout

    async def Generate(self, request, context):
        timer = RequestTimer(self.metrics)
        try:
            stream = await self.frontend.open(input_from_pb(request), OWNER.get())
        except ConveyorError as exc:
            self.metrics.requests_rejected.labels(reason=exc.code.lower()).inc()
            raise
        async for delta in follow(stream, self.frontend, timer, self.metrics, self.request_timeout):
            yield client_delta_to_pb(delta)

    async def Resume(self, request, context):
        stream = await self.frontend.resume(request.request_id, request.token_index, request.text_offset, OWNER.get())
        self.metrics.resumed_streams.inc()
        async for delta in follow(stream, self.frontend, RequestTimer(self.metrics), self.metrics,
                                  self.request_timeout):
            yield client_delta_to_pb(delta)

    async def Abort(self, request, context):
        aborted = await self.frontend.abort(request.request_id, OWNER.get())
        return conveyor_pb2.AbortResponse(aborted=aborted)

    async def Tokenize(self, request, context):
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidArgument("input must be one of prompt or chat")
        inp = GenerateInput(prompt=request.prompt) if kind == "prompt" else GenerateInput()
        if kind == "chat":
            inp.messages, inp.add_generation_prompt = _chat(request.chat)
        text, ids = await self.frontend.tokenize(inp)
        return conveyor_pb2.TokenizeResponse(token_ids=ids, text=text)

    async def ServerInfo(self, request, context):
        return self.info


class FrontendService(LinkService, frontend_pb2_grpc.FrontendServicer):
    """The detokenizer's deltas, over links served on the same event loop as the public API (``deliver``:
    handing deltas to streams never blocks)."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Link(self, request, context):
        return LinkService.Link(self, request, context)

    def deliver(self, batch: frontend_pb2.DeltaBatch) -> frontend_pb2.DeliverResponse:
        return frontend_pb2.DeliverResponse(unknown_request_ids=self.frontend.deliver([delta_from_pb(d)
                                                                                        for d in batch.deltas]))


async def follow_engines(engines: EnginesClient, health, metrics: Metrics, http: OpenAIApi | None,
                         every: float = 0.5) -> None:
    """Keep the public health NOT_SERVING (and the HTTP API's ``/health`` 503) while no engine serves (their
    schedulers, workers or Redis are down). The first look is at once, so each engine's ``conveyor_engine_up``
    is exported from the start."""
    serving = True
    while True:
        now = await engines.serving()
        if now != serving:
            log.warning("%s", "an engine serves again" if now else "no engine serves; health is NOT_SERVING")
            await grpc_util.set_aio_serving(health, [PUBLIC_SERVICE], now, metrics)
            if http is not None:
                http.serving = now
            serving = now
        await asyncio.sleep(every)


class HttpServer:
    """uvicorn on the frontend's event loop (the loop's own SIGTERM handling stops it)."""

    def __init__(self, server: uvicorn.Server):
        self.server = server
        self.task = asyncio.create_task(server.serve())

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the frontend's loop handles SIGINT and SIGTERM for every listener
        yield


def guarded_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol with a deadline on a request's head: a connection that has not completed a
    request's headers ``header_timeout`` seconds after it opened (or after its last response) is closed, so
    half-sent requests (slowloris) cannot hold the frontend's file descriptors. uvicorn's own keep-alive
    timeout covers only connections that send nothing."""

    class Guarded(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._guard = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # between requests: a new head is coming
                self._arm()
            super().data_received(data)

        def _arm(self) -> None:
            if self._guard is None:
                self._guard = self.loop.call_later(header_timeout, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            self._guard = None
            if self.cycle is cycle and not self.transport.is_closing():  # no request began since: its head is late
                self.transport.close()

    return Guarded


async def serve_http(api: OpenAIApi, cfg: FrontendConfig) -> HttpServer:
    """Start the OpenAI HTTP API on --host:--http-port (with the public API's TLS certificate when it has one),
    with a deadline on request heads and a cap on connections."""
    config = uvicorn.Config(api.app(), host=cfg.host, port=cfg.http_port, log_level="warning", access_log=False,
                            lifespan="off", ssl_certfile=cfg.tls_cert or None, ssl_keyfile=cfg.tls_key or None,
                            ssl_ca_certs=cfg.tls_client_ca or None,
                            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_ca else ssl.CERT_NONE,
                            http=guarded_protocol(cfg.http_header_timeout), limit_concurrency=cfg.http_max_connections,
                            timeout_keep_alive=5)
    server = HttpServer(_Uvicorn(config))
    while not server.server.started:  # listening (or failed: then the task says why)
        if server.task.done():
            server.task.result()
            raise OSError(f"the HTTP API could not listen on {cfg.host}:{cfg.http_port}")
        await asyncio.sleep(0.01)
    return server


def serve(cfg: FrontendConfig) -> None:
    asyncio.run(_serve(cfg))


async def _serve(cfg: FrontendConfig) -> None:
    tokenizer = load_tokenizer(cfg.model)
    store = AsyncRequestStore.from_url(cfg.redis_url, cfg.redis_prefix)
    metrics = Metrics("frontend")
    engines = EnginesClient(Registry(store), metrics)
    metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host)
    access = Access(ApiKeys.load(cfg.api_keys_file, cfg.api_keys), cfg.max_streams_per_key, cfg.max_streams)
    sinfo = await engines.info()
    limits = Limits(sinfo.max_model_len, sinfo.vocab_size, max_stop_strings=cfg.max_stop_strings,
                    max_prompt_tokens=cfg.max_prompt_tokens, max_stop_token_ids=cfg.max_stop_token_ids,
                    max_logit_bias=cfg.max_logit_bias, max_grammar_bytes=cfg.max_grammar_bytes)
    detokenizer = DetokenizerClient(cfg.detokenizer)
    frontend = Frontend(tokenizer, store, limits, cfg.deliver_address, engines.submit, engines.abort,
                        detokenizer.replay, engines.route, cfg.shared_prefix_cache, cfg.stream_interval)
    frontend.on_stalled = metrics.stalled_streams.inc
    frontend.defaults = sampling_defaults(cfg.model)
    log.info("sampling defaults for unset fields: %s", frontend.defaults)
    info = conveyor_pb2.ServerInfoResponse(
        model_name=sinfo.model_name, max_model_len=sinfo.max_model_len, eos_token_ids=sinfo.eos_token_ids,
        max_stop_strings=cfg.max_stop_strings, max_waiting_requests=sinfo.max_waiting,
        has_chat_template=bool(tokenizer.chat_template), worker=f"{sinfo.device}/{sinfo.dtype}",
    )
    internal = grpc_util.make_aio_server(metrics=metrics)
    internal_health = await grpc_util.add_aio_health_and_reflection(internal, [INTERNAL_SERVICE])
    delivered = FrontendService(frontend)
    links = await serve_on_loop(cfg.internal_host, cfg.link_port, frontend_pb2.DeltaBatch.FromString,
                                delivered.deliver, "deliver")
    delivered.listening(links)
    frontend_pb2_grpc.add_FrontendServicer_to_server(delivered, internal)
    internal_port = grpc_util.bind_internal(internal, cfg.internal_host, cfg.internal_port)
    # beyond max_streams calls at once, gRPC answers RESOURCE_EXHAUSTED instead of queueing them unseen
    public = grpc_util.make_aio_server(metrics=metrics, interceptors=[AuthInterceptor(access)],
                                       max_message_bytes=cfg.max_message_bytes, max_concurrent_rpcs=cfg.max_streams + 8,
                                       options=grpc_util.PUBLIC_KEEPALIVE)
    public_health = await grpc_util.add_aio_health_and_reflection(public, [PUBLIC_SERVICE])
    conveyor_pb2_grpc.add_ConveyorServicer_to_server(ConveyorService(frontend, info, metrics, cfg.request_timeout), public)
    tls = grpc_util.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    port = grpc_util.bind(public, cfg.host, cfg.port, tls)
    http = OpenAIApi(frontend, metrics, sinfo.model_name, access, cfg.request_timeout,
                     cfg.allowed_origins) if cfg.http_port >= 0 else None
    await internal.start()
    await public.start()
    http_server = await serve_http(http, cfg) if http is not None else None
    await grpc_util.set_aio_serving(internal_health, [INTERNAL_SERVICE], True)
    await grpc_util.set_aio_serving(public_health, [PUBLIC_SERVICE], True, metrics)
    watch = asyncio.create_task(follow_engines(engines, public_health, metrics, http))
    log.info("frontend serving %s on %s:%d%s%s%s (deliveries on %s:%d, link port %d, metrics on %s:%d)", sinfo.model_name,
             cfg.host, port, " with TLS" if tls else "", f", {len(access.keys.digests)} API keys" if access.keys else "",
             f", OpenAI HTTP API on port {cfg.http_port}" if http else "", cfg.internal_host, internal_port,
             delivered.link_port, cfg.metrics_host, metrics_port)

    async def stop() -> None:
        watch.cancel()
        if http is not None:
            http.serving = False
        await grpc_util.set_aio_serving(public_health, [PUBLIC_SERVICE], False, metrics)
        if http_server is not None:
            await http_server.stop()
        await internal.stop(5)
        links.close()

    await grpc_util.aio_wait_for_termination(public, on_stop=stop)
    await store.redis.aclose()
