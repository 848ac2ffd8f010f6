"""Who may call the frontend's public APIs, and how many streams each may hold: API keys, the caller's
identity from gRPC metadata or HTTP headers, and the per-key and per-frontend stream counts. The gRPC API
reaches it through ``AuthInterceptor``; the HTTP API calls ``Access`` itself."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections import Counter
from pathlib import Path

import grpc

from conveyor.errors import ConfigError, ResourceExhausted, Unauthenticated

class ApiKeys:
    """The API keys a public server accepts, by name. Only SHA-256 digests are kept, and a presented
    key is compared with every one of them in constant time (no early exit, no length leak)."""

    def __init__(self, keys: dict[str, str]):
        self.digests = {name: hashlib.sha256(key.encode()).digest() for name, key in keys.items()}

    @classmethod
    def load(cls, path: str = "", listed: str = "") -> ApiKeys:
        """Keys from a file (one per line, ``name:key`` or just ``key``; ``#`` comments) and from a
        comma-separated list (an environment variable). A key without a name is named by its position."""
        lines = Path(path).read_text().splitlines() if path else []
        lines += listed.split(",") if listed else []
        keys: dict[str, str] = {}
        for line in (raw.strip() for raw in lines):
            if not line or line.startswith("#"):
                continue
            name, _, key = line.rpartition(":")
            name = name or f"key{len(keys) + 1}"
            if len(key) < 16:
                raise ConfigError(f"--api-keys-file / --api-keys: the key named {name!r} is shorter than 16 characters")
            if name in keys:
                raise ConfigError(f"--api-keys-file / --api-keys: the name {name!r} is used twice")
            keys[name] = key
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def identify(self, presented: str) -> str | None:
        """The name of the key presented, or None."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for name, known in self.digests.items():
            if hmac.compare_digest(digest, known):
                found = name
        return found


def presented_key(metadata) -> str:
    """The key a client sent: ``authorization: Bearer <key>`` or ``x-api-key: <key>``."""
    headers = {k.lower(): v for k, v in metadata}
    bearer = headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    return headers.get("x-api-key", "")


OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("conveyor_owner", default="")


class Access:
    """API keys and stream limits, for both public APIs (on the event loop: its counts take no lock)."""

    def __init__(self, keys: ApiKeys, max_streams_per_key: int = 0, max_streams: int = 0):
        """``max_streams``: the frontend's own limit over every key and both APIs (0: none)."""
        self.keys = keys
        self.max_streams = max_streams_per_key
        self.max_total = max_streams
        self.streams: Counter[str] = Counter()  # touched only on the event loop: no lock
        self.total = 0

    def identify(self, metadata) -> str:
        """The name of the key in ``metadata`` (gRPC metadata or HTTP headers: pairs), "" when keys are off."""
        if not self.keys:
            return ""
        presented = presented_key(metadata or ())
        if not presented:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        name = self.keys.identify(presented)
        if name is None:
            raise Unauthenticated("invalid API key")
        return name

    def open_stream(self, owner: str, count: int = 1) -> None:
        """Count ``count`` streams of ``owner``'s (an HTTP request's choices count one each), or refuse them
        beyond --max-streams-per-key or this frontend's --max-streams (call on the event loop)."""
        if self.max_streams and self.streams[owner] + count > self.max_streams:
            who = f"API key {owner!r}" if owner else "this server"
            raise ResourceExhausted(f"{who} already has {self.streams[owner]} streams open and asks for {count} more; "
                                    f"the limit is {self.max_streams} (--max-streams-per-key)")
        if self.max_total and self.total + count > self.max_total:
            raise ResourceExhausted(f"this frontend already serves {self.total} streams; the limit is {self.max_total} "
                                    "(--max-streams)")
        self.streams[owner] += count
        self.total += count

    def close_stream(self, owner: str, count: int = 1) -> None:
        self.streams[owner] -= count
        self.total -= count


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """``Access`` for the public gRPC service (an asyncio server). Health and reflection stay open (for
    probes). The key's name is set in ``OWNER`` for the call's handler: it owns the requests the call
    creates. Put it after ``AioErrorMappingInterceptor``, which turns its errors into statuses."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, access: Access):
        self.access = access

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler_call_details.method.startswith(self.OPEN):
            return handler
        if handler.response_streaming:
            inner_stream = handler.unary_stream

            async def streamed(request, context):
                owner = self.access.identify(context.invocation_metadata())
                OWNER.set(owner)
                self.access.open_stream(owner)
                try:
                    async for response in inner_stream(request, context):
                        yield response
                finally:
                    self.access.close_stream(owner)

            return grpc.unary_stream_rpc_method_handler(
                streamed, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        inner = handler.unary_unary

        async def unary(request, context):
            OWNER.set(self.access.identify(context.invocation_metadata()))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
