"""gRPC plumbing shared by the services: error mapping, health, reflection, server start/stop."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conveyor.errors import ConveyorError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


class _Malformed:
    """Stands in for a request whose bytes did not parse (e.g. a string that is not UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error


def _status(exc: Exception, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ConveyorError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    log.exception("unhandled error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


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
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the client's malformed input
                return _Malformed(exc)

        def check(request, context) -> None:
            if isinstance(request, _Malformed):
                self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT,
                            f"malformed request for {method}: {request.error} (strings must be valid UTF-8)")

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


def channel_options() -> list[tuple[str, int]]:
    """Options for channels between our services (message size limits to match the servers')."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def make_server(max_workers: int = 8, metrics=None) -> grpc.Server:
    """A gRPC server with the error-mapping interceptor; errors are counted in ``metrics`` when given."""
    on_error = None
    if metrics is not None:
        errors = metrics.get("conveyor_grpc_errors_total")
        on_error = lambda method, code: errors.labels(method=method, code=code).inc()  # noqa: E731
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[ErrorMappingInterceptor(on_error)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Register grpc.health.v1 (initially NOT_SERVING) and server reflection for ``service_names``."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: list[str], serving: bool,
                metrics=None) -> None:
    """Set the health of the process and its services (and ``conveyor_process_up`` when given)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)
    if metrics is not None:
        metrics.get("conveyor_process_up").set(1 if serving else 0)


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Listen on host:port (port 0 picks a free one); returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
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
