"""The Python client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for a Conveyor server.

    from conveyor.client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for delta in client.stream("Tell me a story", max_tokens=64):
            print(delta.text, end="", flush=True)

Options (keyword arguments of ``generate``, ``stream`` and ``chat``): ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` ({token id: bias}), ``seed``, ``logprobs`` (alternatives per token), ``prompt_logprobs``
(score the prompt: each token's logprob after the first, with this many alternatives), ``max_tokens``,
``min_tokens``, ``stop`` (strings), ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``request_id``, ``priority``, ``cache_salt`` (vLLM's: only requests with the
same salt share cached prefixes), ``speculative`` (False: no speculative decoding for this request),
``structured`` (constrain the output: ``{"json_schema": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
``{"lark": ...}``, ``{"gbnf": ...}`` or ``{"json_object": True}``), ``timeout`` (seconds, the call's deadline) and, for chat,
``add_generation_prompt``. Server errors are raised as the ``conveyor.errors`` class of
their status code (``InvalidArgument``, ``ResourceExhausted``, ``DeadlineExceeded``, ...).

Security: ``Client(target, api_key="...")`` sends ``authorization: Bearer <key>``; ``tls=True`` (or
``ca_cert=`` a PEM path for a private CA, ``client_cert=``/``client_key=`` for mutual TLS) makes the
channel TLS.

Resuming: every stream has a request id (the SDK makes one when you give none). If the frontend
streaming it dies, carry on from another one with what you already have:

    stream = client_a.stream("Tell me a story", max_tokens=200)
    try:
        for delta in stream: ...
    except Unavailable:
        for delta in client_b.resume(stream.request_id, stream.token_index, stream.text_offset): ...
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from conveyor.errors import ConveyorError, error_for_code
from conveyor.params import GROUPS, STRUCTURED_KINDS, field_names, to_pb
from conveyor.v1 import conveyor_pb2, conveyor_pb2_grpc
from conveyor.wire import FINISH_FROM_PB



@dataclass
class TokenLogprob:
    """A token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), most likely first


@dataclass
class Delta:
    """One piece of a streamed answer. ``finish_reason`` ("stop", "length", "abort") is set on the last."""

    request_id: str
    text: str
    token_ids: list[int]
    first_token_index: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # on the first delta: prompt tokens 1, 2, ...


@dataclass
class Completion:
    """A whole answer: the deltas of one request put together."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... (prompt_logprobs=)

    @classmethod
    def from_deltas(cls, deltas: list[Delta]) -> Completion:
        last = deltas[-1]
        return cls(
            last.request_id, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
            last.finish_reason, last.prompt_tokens, last.completion_tokens, [lp for d in deltas for lp in d.logprobs],
            [lp for d in deltas for lp in d.prompt_logprobs],
        )


def _chat_messages(messages: list[dict]) -> list[conveyor_pb2.ChatMessage]:
    return [conveyor_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def build_request(prompt: str | None = None, messages: list[dict] | None = None, *, prompt_ids: list[int] | None = None,
                  request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                  add_generation_prompt: bool | None = None, structured: dict | None = None,
                  speculative: bool | None = None, **options) -> conveyor_pb2.GenerateRequest:
    """The ``GenerateRequest`` for a prompt, chat ``messages`` or token ids, and the options above (the fields
    of ``conveyor.params.SamplingParams`` and ``StopParams``, by name; None leaves one unset). ``structured``:
    one kind of the proto's ``Structured`` (``{"json_schema": {...}}`` (a dict or JSON text), ``{"regex": ...}``,
    ``{"choice": [...]}``, ``{"lark": ...}``, ``{"gbnf": ...}``, ``{"json_object": True}``), optionally with
    ``"whitespace_pattern"``."""
    groups = {group: {name: options.pop(name) for name in list(options) if name in field_names(kind)}
              for group, kind in GROUPS.items()}
    if options:
        raise TypeError(f"unknown option(s): {', '.join(sorted(options))}")
    if isinstance(groups["stop"].get("stop"), str):
        groups["stop"]["stop"] = [groups["stop"]["stop"]]
    if groups["sampling"].get("logit_bias"):
        groups["sampling"]["logit_bias"] = {int(k): float(v) for k, v in groups["sampling"]["logit_bias"].items()}
    request = conveyor_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex, priority=priority,
                                           cache_salt=cache_salt, speculative=speculative)
    if prompt is not None:
        request.prompt = prompt
    if prompt_ids is not None:
        request.prompt_ids.ids.extend(prompt_ids)
    if messages is not None:
        request.chat.messages.extend(_chat_messages(messages))
        if add_generation_prompt is not None:
            request.chat.add_generation_prompt = add_generation_prompt
    to_pb(groups["sampling"], request.sampling)
    to_pb(groups["stop"], request.stop)
    if structured:
        _structured_pb(structured, request.structured)
    return request


def _structured_pb(spec: dict, message: conveyor_pb2.Structured) -> None:
    spec = dict(spec)
    if "whitespace_pattern" in spec:
        message.whitespace_pattern = spec.pop("whitespace_pattern")
    if len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        raise TypeError(f"structured takes one of {', '.join(STRUCTURED_KINDS)}, got {', '.join(spec) or 'none'}")
    ((kind, value),) = spec.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        message.choice.choices.extend(value)
    else:
        setattr(message, kind, value)


def build_tokenize_request(prompt: str | None, messages: list[dict] | None) -> conveyor_pb2.TokenizeRequest:
    """The Tokenize request for a prompt or chat messages."""
    request = conveyor_pb2.TokenizeRequest()
    if prompt is not None:
        request.prompt = prompt
    if messages is not None:
        request.chat.messages.extend(_chat_messages(messages))
    return request


def _logprobs(entries) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, [(a.token_id, a.logprob) for a in lp.top]) for lp in entries]


def _delta(pb: conveyor_pb2.GenerateResponse) -> Delta:
    return Delta(pb.request_id, pb.text, list(pb.token_ids), pb.first_token_index, FINISH_FROM_PB[pb.finish_reason],
                 pb.prompt_tokens, pb.completion_tokens, _logprobs(pb.logprobs), _logprobs(pb.prompt_logprobs))


def _error(exc: grpc.RpcError) -> ConveyorError:
    return error_for_code(exc.code().name)(exc.details() or exc.code().name)


class Stream:
    """An iterator of ``Delta``s; ``cancel()`` (or leaving a ``with`` block early) aborts the request.
    ``token_index`` and ``text_offset`` say how much output has arrived (what ``resume`` needs)."""

    def __init__(self, call, request_id: str, token_index: int = 0, text_offset: int = 0):
        self._call = call
        self.request_id = request_id
        self.token_index = token_index
        self.text_offset = text_offset

    def __iter__(self) -> Iterator[Delta]:
        try:
            for message in self._call:
                delta = _delta(message)
                self.token_index += len(delta.token_ids)
                self.text_offset += len(delta.text)
                yield delta
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def cancel(self) -> None:
        """Stop the stream; the server aborts the request and frees its cache within a step."""
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def _credentials(tls: bool, ca_cert: str | None, client_cert: str | None, client_key: str | None):
    if not (tls or ca_cert or client_cert):
        return None
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca_cert), read(client_key), read(client_cert))


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _channel(target: str, tls: bool, ca_cert, client_cert, client_key, aio: bool = False):
    module = grpc.aio if aio else grpc
    credentials = _credentials(tls, ca_cert, client_cert, client_key)
    return module.secure_channel(target, credentials) if credentials else module.insecure_channel(target)


class Client:
    """A blocking client. ``timeout`` is the default deadline of every call, in seconds (None: none);
    ``api_key``, ``tls``, ``ca_cert``, ``client_cert``, ``client_key`` as in the module doc."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, channel: grpc.Channel | None = None,
                 *, api_key: str | None = None, tls: bool = False, ca_cert: str | None = None,
                 client_cert: str | None = None, client_key: str | None = None):
        self.channel = channel or _channel(target, tls, ca_cert, client_cert, client_key)
        self.stub = conveyor_pb2_grpc.ConveyorStub(self.channel)
        self.timeout = timeout
        self.metadata = _auth_metadata(api_key)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               timeout: float | None = None, **options) -> Stream:
        """Start generating; iterate the result for ``Delta``s as they are produced."""
        request = build_request(prompt, messages, **options)
        call = self.stub.Generate(request, timeout=timeout or self.timeout, metadata=self.metadata)
        return Stream(call, request.request_id)

    def resume(self, request_id: str, token_index: int = 0, text_offset: int = 0,
               timeout: float | None = None) -> Stream:
        """Continue a request's stream (e.g. begun on a frontend that died) after the ``token_index``
        tokens and ``text_offset`` characters already received."""
        request = conveyor_pb2.ResumeRequest(request_id=request_id, token_index=token_index, text_offset=text_offset)
        call = self.stub.Resume(request, timeout=timeout or self.timeout, metadata=self.metadata)
        return Stream(call, request_id, token_index, text_offset)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None, **options) -> Completion:
        """Generate and wait for the whole answer."""
        return Completion.from_deltas(list(self.stream(prompt, messages=messages, timeout=timeout, **options)))

    def chat(self, messages: list[dict], *, timeout: float | None = None, **options) -> Completion:
        """Generate the assistant's reply to ``messages`` ([{"role": "user", "content": ...}, ...])."""
        return self.generate(messages=messages, timeout=timeout, **options)

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a request in flight by id (its stream ends with finish_reason "abort")."""
        return self._unary(self.stub.Abort, conveyor_pb2.AbortRequest(request_id=request_id), timeout).aborted

    def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None) -> list[int]:
        """The token ids the server would feed the model for a prompt or a chat."""
        request = build_tokenize_request(prompt, messages)
        return list(self._unary(self.stub.Tokenize, request, timeout).token_ids)

    def server_info(self, timeout: float | None = None) -> conveyor_pb2.ServerInfoResponse:
        """The served model and the server's limits."""
        return self._unary(self.stub.ServerInfo, conveyor_pb2.ServerInfoRequest(), timeout)

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    """An async iterator of ``Delta``s; ``cancel()`` aborts the request."""

    def __init__(self, call):
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for message in self._call:
                yield _delta(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def cancel(self) -> None:
        """Stop the stream; the server aborts the request."""
        self._call.cancel()


class AsyncClient:
    """The asyncio twin of ``Client`` (same methods, awaitable)."""

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None, *, api_key: str | None = None,
                 tls: bool = False, ca_cert: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None):
        self.channel = _channel(target, tls, ca_cert, client_cert, client_key, aio=True)
        self.stub = conveyor_pb2_grpc.ConveyorStub(self.channel)
        self.timeout = timeout
        self.metadata = _auth_metadata(api_key)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               timeout: float | None = None, **options) -> AsyncStream:
        """Start generating; ``async for`` over the result for ``Delta``s."""
        request = build_request(prompt, messages, **options)
        return AsyncStream(self.stub.Generate(request, timeout=timeout or self.timeout, metadata=self.metadata))

    async def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       timeout: float | None = None, **options) -> Completion:
        """Generate and wait for the whole answer."""
        deltas = [d async for d in self.stream(prompt, messages=messages, timeout=timeout, **options)]
        return Completion.from_deltas(deltas)

    async def chat(self, messages: list[dict], *, timeout: float | None = None, **options) -> Completion:
        """Generate the assistant's reply to ``messages``."""
        return await self.generate(messages=messages, timeout=timeout, **options)

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a request in flight by id."""
        return (await self._unary(self.stub.Abort, conveyor_pb2.AbortRequest(request_id=request_id), timeout)).aborted

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       timeout: float | None = None) -> list[int]:
        """The token ids the server would feed the model."""
        request = build_tokenize_request(prompt, messages)
        return list((await self._unary(self.stub.Tokenize, request, timeout)).token_ids)

    async def server_info(self, timeout: float | None = None) -> conveyor_pb2.ServerInfoResponse:
        """The served model and the server's limits."""
        return await self._unary(self.stub.ServerInfo, conveyor_pb2.ServerInfoRequest(), timeout)

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
