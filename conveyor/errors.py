"""Typed errors shared by every service. Core code raises these; one gRPC interceptor
(``conveyor.grpc_util.ErrorMappingInterceptor``) turns them into status codes, and the client
SDK raises the same classes back from status codes. Nothing here imports gRPC.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class; ``code`` is the name of the gRPC status code it maps to."""

    code = "INTERNAL"


class InvalidArgument(ConveyorError, ValueError):
    """A field of the request is malformed or out of range; the message names the field and limit.

    ``field`` is the field's path as the gRPC API names it (``sampling.top_p``), when one field is to blame;
    the message then starts with it, and ``reason`` is the rest (the HTTP API names the field its own way)."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(f"{field} {message}" if field else message)
        self.field, self.reason = field, message


class ResourceExhausted(ConveyorError):
    """A capacity limit (queue size, KV cache, concurrency) was reached; try again later."""

    code = "RESOURCE_EXHAUSTED"


class NotFound(ConveyorError):
    """The named request or resource does not exist."""

    code = "NOT_FOUND"


class Unavailable(ConveyorError):
    """A dependency (another service, Redis) cannot be reached right now."""

    code = "UNAVAILABLE"


class AlreadyExists(ConveyorError):
    """A request with this id is in flight (or finished recently)."""

    code = "ALREADY_EXISTS"


class DeadlineExceeded(ConveyorError):
    """The call's deadline passed before it finished."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(ConveyorError):
    """The call was cancelled."""

    code = "CANCELLED"


class Unauthenticated(ConveyorError):
    """No API key, or one the server does not know."""

    code = "UNAUTHENTICATED"


class ConfigError(ConveyorError, ValueError):
    """A command-line flag or environment variable has a bad value; the message names the flag."""

    code = "INVALID_ARGUMENT"


def error_for_code(code_name: str) -> type[ConveyorError]:
    """The exception class for a gRPC status code name (``ConveyorError`` for codes without one)."""
    for cls in (InvalidArgument, ResourceExhausted, NotFound, Unavailable, AlreadyExists, DeadlineExceeded, Cancelled,
                Unauthenticated):
        if cls.code == code_name:
            return cls
    return ConveyorError
