"""gRPC plumbing shared by the services: error mapping, health, reflection, server start/stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.errors import ConfigError, ConveyorError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


class _Malformed:
    """Stands in for a request whose bytes did not parse (e.g. a string that is not UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error


def _status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ConveyorError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):  # restarting: the caller may retry
        return grpc.StatusCode.UNAVAILABLE, f"Redis is unreachable: {exc}"
    log.exception("unhandled error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _tolerant(parse):
    """A request deserializer that returns ``_Malformed`` instead of raising (the interceptor answers it)."""

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's malformed input
            return _Malformed(exc)

    return deserialize


def _malformed(request: _Malformed, method: str) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INVALID_ARGUMENT, f"malformed request for {method}: {request.error} (strings must be valid UTF-8)"


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """The one place where typed errors become gRPC statuses: ``ConveyorError`` subclasses map to
    their code, a request that does not parse to INVALID_ARGUMENT, anything else to INTERNAL
    (logged with its traceback). Servicers raise; they never call ``context.abort`` themselves.
    ``on_error(method, code_name)`` counts each error (the ``conveyor_grpc_errors_total`` metric)."""

    def __init__(self, on_error=None):
        self.on_error = on_error or (lambda method, code: None)

    def _abort(self, context, method: str, code: grpc.StatusCode, details: str):
        self.on_error(method, code.name)
        context.abort(code, details)

    def intercept_service(self, continuation, handler_call_details):
        """The handler, wrapped so that its errors and a request that does not parse become statuses."""
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserialize = _tolerant(handler.request_deserializer)

        def check(request, context) -> None:
            if isinstance(request, _Malformed):
                self._abort(context, method, *_malformed(request, method))

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            def streamed(request, context):
                check(request, context)
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:  # noqa: BLE001
                    self._abort(context, method, *_status(exc, method))

            return grpc.unary_stream_rpc_method_handler(
                streamed, request_deserializer=deserialize, response_serializer=handler.response_serializer
            )
        inner = handler.unary_unary

        def unary(request, context):
            check(request, context)
            try:
                return inner(request, context)
            except Exception as exc:  # noqa: BLE001
                self._abort(context, method, *_status(exc, method))

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )


class AioErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """``ErrorMappingInterceptor`` for an asyncio server (the frontend's public API): the same statuses
    for the same errors, raised by coroutines and async generators."""

    def __init__(self, on_error=None):
        self.on_error = on_error or (lambda method, code: None)

    async def _abort(self, context, method: str, code: grpc.StatusCode, details: str):
        self.on_error(method, code.name)
        await context.abort(code, details)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserialize = _tolerant(handler.request_deserializer)

        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def streamed(request, context):
                if isinstance(request, _Malformed):
                    await self._abort(context, method, *_malformed(request, method))
                try:
                    async for response in inner_stream(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await self._abort(context, method, *_status(exc, method))

            return grpc.unary_stream_rpc_method_handler(
                streamed, request_deserializer=deserialize, response_serializer=handler.response_serializer
            )
        inner = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, _Malformed):
                await self._abort(context, method, *_malformed(request, method))
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await self._abort(context, method, *_status(exc, method))

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )


def channel_options() -> list[tuple[str, int]]:
    """Options for channels between our services (message size limits to match the servers')."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # a peer that restarts is reachable again within a second, not after gRPC's default backoff (up to 2 min)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


INTERNAL_TLS_ENV = "CONVEYOR_INTERNAL_TLS_DIR"
INTERNAL_TLS_NAME = "conveyor-internal"  # the name internal certificates carry (subjectAltName DNS)


def internal_tls_folder() -> str | None:
    """The folder of the internal certificates (``CONVEYOR_INTERNAL_TLS_DIR``: ca.pem, cert.pem, key.pem), or
    None: then internal services talk in plain text (on localhost by default)."""
    return os.environ.get(INTERNAL_TLS_ENV) or None


def _internal_tls(folder: str | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(ca, cert, key) PEMs from ``folder`` or ``internal_tls_folder()``, or None."""
    folder = folder or internal_tls_folder()
    if not folder:
        return None
    try:
        return tuple(Path(folder, name).read_bytes() for name in ("ca.pem", "cert.pem", "key.pem"))  # type: ignore[return-value]
    except OSError as exc:
        raise ConfigError(f"{INTERNAL_TLS_ENV}={folder}: {exc}") from exc


def internal_channel(address: str, tls_dir: str | None = None, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel to another Conveyor service: mutual TLS with the certificates in ``tls_dir``, or in
    ``CONVEYOR_INTERNAL_TLS_DIR`` when that is set. Every service's certificate names ``conveyor-internal``, so
    any address (IP, compose name) works. ``aio``: a channel for the running event loop (``grpc.aio``)."""
    kind = grpc.aio if aio else grpc
    tls = _internal_tls(tls_dir)
    if tls is None:
        return kind.insecure_channel(address, options=channel_options())
    ca, cert, key = tls
    options = [*channel_options(), ("grpc.ssl_target_name_override", INTERNAL_TLS_NAME)]
    return kind.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=options)


def internal_aio_channel(address: str) -> grpc.aio.Channel:
    """``internal_channel`` on the running event loop."""
    return internal_channel(address, aio=True)


def bind_internal(server: grpc.Server, host: str, port: int) -> int:
    """``bind`` for an internal service: with ``CONVEYOR_INTERNAL_TLS_DIR``, only peers holding a
    certificate from its CA get in (mutual TLS)."""
    folder = internal_tls_folder()
    credentials = None
    if folder:
        credentials = server_credentials(str(Path(folder, "cert.pem")), str(Path(folder, "key.pem")),
                                         str(Path(folder, "ca.pem")), source=f"{INTERNAL_TLS_ENV}={folder}")
    return bind(server, host, port, credentials)


# Keepalive of the public server: it pings each client connection every 20 s and closes one that does not
# answer within 10 s, so a half-open connection (a client host that vanished) ends its streams, and
# their requests are aborted, in half a minute instead of at TCP's hours-long timeout. Clients may
# ping too, but not more often than every 10 s.
PUBLIC_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def _error_counter(metrics):
    """``on_error(method, code)`` counting into ``conveyor_grpc_errors_total`` (None without metrics)."""
    if metrics is None:
        return None
    errors = metrics.get("conveyor_grpc_errors_total")
    return lambda method, code: errors.labels(method=method, code=code).inc()


def _server_options(max_message_bytes: int, options) -> list:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        *options,
    ]


def make_server(max_workers: int = 8, metrics=None, interceptors=(), max_message_bytes: int = MAX_MESSAGE_BYTES,
                max_concurrent_rpcs: int | None = None, options=()) -> grpc.Server:
    """A gRPC server with the error-mapping interceptor (then ``interceptors``); errors are counted in
    ``metrics`` when given. A request larger than ``max_message_bytes`` gets RESOURCE_EXHAUSTED from gRPC;
    beyond ``max_concurrent_rpcs`` calls at once, new ones get RESOURCE_EXHAUSTED instead of queueing.
    ``options``: more channel arguments (``PUBLIC_KEEPALIVE`` for the public API)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[ErrorMappingInterceptor(_error_counter(metrics)), *interceptors],
        options=_server_options(max_message_bytes, options),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def make_aio_server(metrics=None, interceptors=(), max_message_bytes: int = MAX_MESSAGE_BYTES,
                    max_concurrent_rpcs: int | None = None, options=()) -> grpc.aio.Server:
    """``make_server`` for asyncio: every call is a coroutine on one event loop, so a stream costs no
    thread and a message no thread switch (the frontend's public API: one message per client per token)."""
    return grpc.aio.server(
        interceptors=[AioErrorMappingInterceptor(_error_counter(metrics)), *interceptors],
        options=_server_options(max_message_bytes, options),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def _reflected(service_names: list[str]) -> list[str]:
    return [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]


def _health_status(serving: bool):
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


ERROR_CODES = ("INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL")


def _process_up(metrics, serving: bool, service_names: list[str] = ()) -> None:
    """``conveyor_process_up``, and every error series of the services' methods at 0 (a dashboard shows 0
    errors from the start, not "no data" until the first one)."""
    if metrics is None:
        return
    metrics.get("conveyor_process_up").set(1 if serving else 0)
    errors = metrics.get("conveyor_grpc_errors_total")
    for name in service_names:
        for method in descriptor_pool.Default().FindServiceByName(name).methods:
            for code in ERROR_CODES:
                errors.labels(method=f"/{name}/{method.name}", code=code)


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Register grpc.health.v1 (initially NOT_SERVING) and server reflection for ``service_names``."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    set_serving(health_servicer, service_names, False)
    reflection.enable_server_reflection(_reflected(service_names), server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: list[str], serving: bool,
                metrics=None) -> None:
    """Set the health of the process and its services (and ``conveyor_process_up`` when given)."""
    for name in ["", *service_names]:
        health_servicer.set(name, _health_status(serving))
    _process_up(metrics, serving, service_names)


async def add_aio_health_and_reflection(server: grpc.aio.Server, service_names: list[str]):
    """``add_health_and_reflection`` for an asyncio server."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_aio_serving(health_servicer, service_names, False)
    reflection.enable_server_reflection(_reflected(service_names), server)
    return health_servicer


async def set_aio_serving(health_servicer, service_names: list[str], serving: bool, metrics=None) -> None:
    """``set_serving`` for the health of an asyncio server."""
    for name in ["", *service_names]:
        await health_servicer.set(name, _health_status(serving))
    _process_up(metrics, serving, service_names)


def server_credentials(cert: str, key: str, client_ca: str = "",
                       source: str = "--tls-cert / --tls-key / --tls-client-ca") -> grpc.ServerCredentials:
    """TLS from PEM files; with ``client_ca``, clients must present a certificate it signed (mutual TLS).
    ``source``: where the paths came from, for the error when one cannot be read."""
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
        ca = Path(client_ca).read_bytes() if client_ca else None
    except OSError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on host:port (port 0 picks a free one), with TLS when ``credentials``; returns the port."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (is the port in use?)")
    return bound


def wait_for_termination(server: grpc.Server, on_stop=None, grace: float = 5.0) -> None:
    """Block until SIGINT/SIGTERM, then stop the server, letting calls in flight finish for ``grace`` s."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    if on_stop:
        on_stop()
    server.stop(grace).wait()


async def aio_wait_for_termination(server: grpc.aio.Server, on_stop=None, grace: float = 5.0) -> None:
    """``wait_for_termination`` for an asyncio server; ``on_stop`` is a coroutine function."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    if on_stop:
        await on_stop()
    await server.stop(grace)
