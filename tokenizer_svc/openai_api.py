"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``.

It is a second listener of the frontend (Starlette on uvicorn, on the same event loop as the gRPC API),
not a gateway process in front of it: a token reaches an HTTP client with one SSE write on the loop
that already holds its stream, where a gateway would add a gRPC message and a process per token. It
uses the same core as ``conveyor.v1.Conveyor``: the same validation and limits, the same API keys
(``Authorization: Bearer``) and per-key stream limit, the same request ownership.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status
of the gRPC code the core raised (400 a bad field, named; 401; 404; 429; 503; 504). Unknown fields are
ignored, as OpenAI ignores them; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from importlib.metadata import version as package_version

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conveyor import grpc_util
from conveyor.errors import ConveyorError, InvalidArgument, NotFound
from conveyor.metrics import Metrics
from tokenizer_svc.frontend import ClientDelta, ClientStream, Frontend
from tokenizer_svc.streaming import Blocking, RequestTimer, follow
from tokenizer_svc.validation import SEED_RANGE, GenerateInput, seed_from_int64

log = logging.getLogger("conveyor.frontend")
MAX_BODY_BYTES = 8 << 20
MAX_N = 16
STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
          "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable", 504: "timeout"}
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
ROUTES = ("/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
          "/tokenizer_info")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _from_conveyor(exc: ConveyorError) -> HttpError:
    """The core's error as HTTP: the field it names (validation messages start with it) becomes ``param``,
    without the gRPC message's prefixes (``sampling.``, ``stop.``); a token-id prompt is ``prompt`` here."""
    message = str(exc)
    for prefix in ("sampling.", "stop.", "chat."):
        message = message.removeprefix(prefix)
    if message.startswith("prompt_ids "):
        message = "prompt" + message.removeprefix("prompt_ids")
    status = STATUS.get(exc.code, 500)
    param = message.split(" ", 1)[0] if status == 400 else None
    return HttpError(status, message, param, exc.code.lower())


class RequestIds:
    """Every response carries ``x-request-id``: the client's own when it sent one, else a new one (vLLM)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")[:128]
        request_id = given if given and given.isascii() else uuid.uuid4().hex.encode()

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, tagged)


# ---------------------------------------------------------------- request bodies


def _get(body: dict, name: str, kinds: tuple[type, ...], default=None):
    """``body[name]`` when present and not null, checked against ``kinds`` (bool is not a number here)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                             list: "an array", dict: "an object"}[k] for k in kinds)
        raise HttpError(400, f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HttpError(400, "stop must be a string or an array of strings", "stop")
    return stop


def _int_list(body: dict, name: str) -> list[int]:
    values = _get(body, name, (list,), [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HttpError(400, f"{name} must be an array of integers", name)
    return values


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _get(body, "logit_bias", (dict,), {})
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise HttpError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HttpError(400, f"logit_bias[{key}] must be a number", "logit_bias")
        out[token] = float(value)
    return out


def sampling_input(body: dict, chat: bool) -> GenerateInput:
    """The fields both endpoints share (OpenAI's and vLLM's extensions), as the core's input."""
    max_tokens = _get(body, "max_completion_tokens", (int,)) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,))
    if chat:
        logprobs = _get(body, "top_logprobs", (int,), 0) if _get(body, "logprobs", (bool,), False) else None
    else:
        logprobs = _get(body, "logprobs", (int,))
    # vLLM's prompt_logprobs; on completions, echo with logprobs scores the echoed prompt too (OpenAI, vLLM)
    prompt_logprobs = _get(body, "prompt_logprobs", (int,))
    if prompt_logprobs is None and not chat and logprobs is not None and _get(body, "echo", (bool,), False):
        prompt_logprobs = logprobs
    return GenerateInput(
        temperature=_float(body, "temperature"),
        top_p=_float(body, "top_p"), top_k=_get(body, "top_k", (int,)), min_p=_float(body, "min_p"),
        repetition_penalty=_float(body, "repetition_penalty"), presence_penalty=_float(body, "presence_penalty"),
        frequency_penalty=_float(body, "frequency_penalty"), logit_bias=_logit_bias(body),
        seed=_seed(body), logprobs=logprobs, prompt_logprobs=prompt_logprobs, max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", (int,), 0), stop=_stop_strings(body),
        stop_token_ids=_int_list(body, "stop_token_ids"), ignore_eos=_get(body, "ignore_eos", (bool,), False),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
        priority=_get(body, "priority", (int,), 0), cache_salt=_get(body, "cache_salt", (str,)),
    )


def _float(body: dict, name: str) -> float | None:
    value = _get(body, name, (int, float))
    try:
        return float(value) if value is not None else None
    except OverflowError:  # an integer past any float
        raise HttpError(400, f"{name} must be a finite number, got an integer of {len(str(value))} digits",
                        name) from None


def _seed(body: dict) -> int | None:
    """vLLM's and llama.cpp's seed: any signed 64-bit integer, -1 meaning random."""
    try:
        return seed_from_int64(_get(body, "seed", (int,)))
    except InvalidArgument as exc:
        raise HttpError(400, str(exc), "seed") from None


# Structured output and tools (the structured-output issue implements them). Until then a request that asks for
# them is refused, never answered with free text as if they had been honoured.
UNSUPPORTED = ("tools", "functions", "function_call", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "grammar",
               "json_schema")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def refuse_unsupported(body: dict) -> None:
    """A 400 naming the first structured-output or tool field that asks for something (null, an empty list
    of tools and ``tool_choice: "none"`` ask for nothing)."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise HttpError(400, f"{name} is not supported yet: this server cannot constrain its output", name)
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise HttpError(400, f"tool_choice {json.dumps(choice)[:80]} is not supported yet: this server has no "
                        "tool calling", "tool_choice")
    fmt = _get(body, "response_format", (dict,))
    if fmt is not None:
        kind = fmt.get("type")
        if kind not in RESPONSE_FORMATS:
            raise HttpError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got "
                            f"{json.dumps(kind)[:80]}", "response_format")
        if kind != "text":
            raise HttpError(400, f"response_format.type {kind!r} is not supported yet: this server cannot "
                            "constrain its output", "response_format")


def _messages(body: dict) -> list[dict]:
    messages = _get(body, "messages", (list,))
    if not messages:
        raise HttpError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HttpError(400, f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise HttpError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise HttpError(400, f"messages[{i}].content must be a string or an array of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either (one choice set per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_N and prompt and isinstance(prompt[0], (str, list)):
        raise HttpError(400, f"prompt has {len(prompt)} prompts; at most {MAX_N} are allowed", "prompt")
    if isinstance(prompt, str) or _ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p) for p in prompt):
        return prompt
    raise HttpError(400, "prompt must be a string, an array of token ids, or a non-empty array of either", "prompt")


# ---------------------------------------------------------------- the app


class OpenAIApi:
    def __init__(self, frontend: Frontend, io: Blocking, metrics: Metrics, model_name: str,
                 auth: grpc_util.AioAuthInterceptor, request_timeout: float = 0.0, allowed_origins: str = "*"):
        """``allowed_origins``: the CORS origins, comma-separated ("*": any, "": none)."""
        self.allowed_origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
        self.frontend = frontend
        self.io = io
        self.metrics = metrics
        self.model = model_name
        self.auth = auth
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.serving = True  # follows the scheduler's health (``/health``)
        for route in ROUTES:  # every series from the start: a dashboard shows 0, not "no data"
            metrics.http_requests.labels(route=route, status="200")
            metrics.http_request_seconds.labels(route=route)

    def app(self) -> Starlette:
        api = [("/models", self.models, "GET"), ("/models/{model:path}", self.model_info, "GET"),
               ("/completions", self.completions, "POST"), ("/chat/completions", self.chat_completions, "POST")]
        # OpenAI's routes under /v1 and, as llama.cpp serves them, without it (clients given a bare base URL)
        routes = [Route(prefix + path, call, methods=[method]) for prefix in ("/v1", "") for path, call, method in api]
        routes += [Route("/health", self.health, methods=["GET"]),
                   Route("/version", self.version, methods=["GET"]),
                   Route("/metrics", self.metrics_page, methods=["GET"]),  # vLLM's scrape path, on the API port
                   Route("/tokenize", self.tokenize, methods=["POST"]),
                   Route("/detokenize", self.detokenize, methods=["POST"]),
                   Route("/tokenizer_info", self.tokenizer_info, methods=["GET"])]

        async def not_found(request: Request, exc) -> Response:
            status = getattr(exc, "status_code", 404)
            return error_response(status, f"{request.method} {request.url.path}: no such route" if status == 404
                                  else str(getattr(exc, "detail", "")) or "bad request")

        middleware = [Middleware(RequestIds)]
        if self.allowed_origins:  # outermost: a browser's preflight is answered before anything else
            middleware.insert(0, Middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["*"],
                                            allow_headers=["*"], expose_headers=["x-request-id"]))
        return Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: not_found})

    # ------------------------------------------------------------ plumbing

    def _owner(self, request: Request) -> str:
        return self.auth.identify(request.headers.items())

    def _observe(self, route: str, status: int, started: float) -> None:
        self.metrics.http_requests.labels(route=route, status=str(status)).inc()
        self.metrics.http_request_seconds.labels(route=route).observe(time.perf_counter() - started)

    async def _body(self, request: Request) -> dict:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise HttpError(400, "the body must be JSON (Content-Type: application/json)")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise HttpError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise HttpError(400, f"the body is not valid JSON in UTF-8: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise HttpError(404, f"model {model!r} does not exist; this server serves {self.model!r}", "model",
                            "model_not_found")
        return body

    async def _handle(self, route: str, request: Request, work) -> Response:
        started = time.perf_counter()
        try:
            owner = self._owner(request)
            response = await work(request, owner)
            status = response.status_code
        except HttpError as exc:
            status, response = exc.status, error_response(exc.status, str(exc), exc.param, exc.code)
        except ConveyorError as exc:
            err = _from_conveyor(exc)
            if err.status in (400, 429, 409, 503):
                self.metrics.requests_rejected.labels(reason=exc.code.lower()).inc()
            status, response = err.status, error_response(err.status, str(err), err.param, err.code)
        except Exception as exc:  # noqa: BLE001 - a bug or an unexpected error: still OpenAI's JSON shape
            log.exception("%s failed", route)
            status, response = 500, error_response(500, f"internal error: {type(exc).__name__}: {exc}")
        self._observe(route, status, started)
        return response

    # ------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.serving else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": package_version("conveyor")})

    async def metrics_page(self, request: Request) -> Response:
        """The frontend's Prometheus metrics (also on its --metrics-port)."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "conveyor"}

    async def models(self, request: Request) -> Response:
        async def work(request, owner):
            return JSONResponse({"object": "list", "data": [self._model_card()]})
        return await self._handle("/v1/models", request, work)

    async def model_info(self, request: Request) -> Response:
        async def work(request, owner):
            if request.path_params["model"] != self.model:
                raise NotFound(f"model {request.path_params['model']!r} does not exist")
            return JSONResponse(self._model_card())
        return await self._handle("/v1/models/{model}", request, work)

    async def completions(self, request: Request) -> Response:
        return await self._handle("/v1/completions", request, lambda r, o: self._generate(r, o, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("/v1/chat/completions", request, lambda r, o: self._generate(r, o, chat=True))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a prompt, or chat messages rendered with the model's template, as token ids."""
        async def work(request, owner):
            body = await self._body(request)
            inp = GenerateInput()
            if "messages" in body:
                inp.messages = _messages(body)
                inp.add_generation_prompt = _get(body, "add_generation_prompt", (bool,), True)
            else:
                inp.prompt = _get(body, "prompt", (str,))
                if inp.prompt is None:
                    raise HttpError(400, "prompt (a string) or messages is required", "prompt")
            inp.add_special_tokens = _get(body, "add_special_tokens", (bool,), True)
            _, ids = await self.io.run(self.frontend.render, inp)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.frontend.limits.max_model_len})
        return await self._handle("/tokenize", request, work)

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``/tokenizer_info``: what a client needs to tokenize as the server does (lm-eval's remote
        tokenizer reads it, then calls ``/tokenize`` and ``/detokenize``)."""
        async def work(request, owner):
            t = self.frontend.tokenizer
            special = t.special_tokens
            return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": special.get("eos_token"),
                                 "bos_token": special.get("bos_token"), "pad_token": special.get("pad_token"),
                                 "chat_template": t.chat_template, "model_max_length": self.frontend.limits.max_model_len,
                                 "vocab_size": t.vocab_size})
        return await self._handle("/tokenizer_info", request, work)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: token ids back to text."""
        async def work(request, owner):
            body = await self._body(request)
            tokens = _int_list(body, "tokens")
            vocab = self.frontend.limits.vocab_size
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise HttpError(400, f"tokens: id {bad[0]} is not below the vocabulary size {vocab}", "tokens")
            return JSONResponse({"prompt": await self.io.run(self.frontend.tokenizer.decode, tokens)})
        return await self._handle("/detokenize", request, work)

    async def _generate(self, request: Request, owner: str, chat: bool) -> Response:
        body = await self._body(request)
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise HttpError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
        stream = _get(body, "stream", (bool,), False)
        options = _get(body, "stream_options", (dict,))
        if options is not None and not stream:  # as OpenAI and vLLM
            raise HttpError(400, "stream_options is only allowed when stream is true", "stream_options")
        include_usage = stream and bool(_get(options or {}, "include_usage", (bool,), False))
        echo = not chat and _get(body, "echo", (bool,), False)
        refuse_unsupported(body)
        common = sampling_input(body, chat)
        messages = _messages(body) if chat else None
        prompts = [None] if chat else _prompts(body)
        if len(prompts) * n > MAX_N:  # counted before anything is expanded, decoded or tokenized
            raise HttpError(400, f"prompts x n must be at most {MAX_N}, got {len(prompts) * n}", "n")
        inputs = []
        for prompt in prompts:
            for i in range(n):
                inputs.append(dataclasses.replace(
                    common, messages=messages, prompt=prompt if isinstance(prompt, str) else None,
                    prompt_ids=prompt if isinstance(prompt, list) else None,
                    # n seeded choices differ, and reproduce
                    seed=(common.seed + i) % SEED_RANGE if common.seed is not None else None))
        self.auth.open_stream(owner, len(inputs))  # each choice is a stream, as a gRPC stream is
        opened: list[ClientStream] = []
        try:
            for inp in inputs:
                opened.append(await self.io.open(self.frontend.open, inp, owner))
            # each choice's text starts with its prompt (token ids: their text)
            echoed = [(i.prompt if i.prompt is not None else self.frontend.tokenizer.decode(i.prompt_ids)) if echo
                      else "" for i in inputs]
            reply = Reply(self, opened, chat, include_usage, echoed, inputs[0].logprobs is not None, n,
                          _get(body, "prompt_logprobs", (int,)) is not None)
            if stream:
                return StreamingResponse(reply.events(owner), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
        except BaseException:
            for s in opened:
                self.io.close(s)
            self.auth.close_stream(owner, len(inputs))
            raise
        try:
            return JSONResponse(await reply.whole(request))
        finally:
            self.auth.close_stream(owner, len(inputs))


class Reply:
    """One response: its choices (one stream each, index order), as SSE events or as one JSON body."""

    def __init__(self, api: OpenAIApi, streams: list[ClientStream], chat: bool, include_usage: bool,
                 echoed: list[str], logprobs: bool, n: int = 1, vllm_prompt_logprobs: bool = False):
        self.api = api
        self.streams = streams
        self.logprobs = logprobs  # the request asked for them
        self.vllm_prompt_logprobs = vllm_prompt_logprobs  # vLLM's prompt_logprobs field: returned in its shape
        self.echoed = echoed  # per choice: the prompt its text starts with (``echo``), or ""
        self.chat = chat
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n = n
        self.prompt_tokens = sum(s.prompt_tokens for s in streams[::n])  # each prompt once, whatever n (OpenAI)

    def _deltas(self, index: int) -> AsyncIterator[ClientDelta]:
        api = self.api
        return follow(self.streams[index], api.io, RequestTimer(api.metrics), api.metrics, api.request_timeout)

    def _choice(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        if self.chat:
            return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _role(self, index: int) -> dict:
        """A chat stream's first chunk of a choice: the role alone, with empty content (OpenAI, vLLM, llama.cpp)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def _text(self, token_id: int) -> str:
        return self.api.frontend.tokenizer.decode([token_id])

    def _echoed_logprobs(self, index: int, scored: list) -> dict:
        """Completions' logprobs of an echoed prompt: every prompt token, the first with none (OpenAI's shape)."""
        text = self._text
        tokens = [text(t) for t in self.streams[index].prompt_ids]
        return {"tokens": tokens, "token_logprobs": [None] + [lp for _, lp, _, _ in scored],
                "top_logprobs": [None] + [{text(a): v for a, v in top} for _, _, _, top in scored],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]}

    def _vllm_prompt_logprobs(self, index: int, scored: list) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then {token id: {logprob, rank,
        decoded_token}} over the token itself and its alternatives."""
        out: list = [None]
        for token, logprob, rank, top in scored:
            entry = {str(a): {"logprob": v, "rank": r, "decoded_token": self._text(a)} for r, (a, v) in
                     enumerate(top, 1)}
            entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": self._text(token)}
            out.append(entry)
        return out[: len(self.streams[index].prompt_ids)]

    def _logprobs(self, delta: ClientDelta, offset: int, index: int = 0) -> dict | None:
        """A delta's tokens' log-probabilities in the endpoint's shape (None when not asked). ``offset``: where
        the delta's text starts in the choice's text (completions' ``text_offset``). With ``echo``, the first
        delta's come after the prompt's."""
        if not self.logprobs:
            return None
        out = self._token_logprobs(delta, offset)
        if not self.chat and self.echoed[index] and delta.prompt_logprobs is not None:
            echoed = self._echoed_logprobs(index, delta.prompt_logprobs)
            out = {key: echoed[key] + value for key, value in out.items()}
        return out

    def _token_logprobs(self, delta: ClientDelta, offset: int) -> dict:
        text = self._text

        if self.chat:
            def entry(token_id: int, logprob: float) -> dict:
                raw = self.api.frontend.tokenizer.token_bytes(token_id)  # a character's part: its own bytes
                return {"token": text(token_id), "logprob": logprob, "bytes": list(raw)}

            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(a.token_id, a.logprob) for a in lp.top]}
                                for lp in delta.logprobs]}
        tokens = [text(lp.token_id) for lp in delta.logprobs]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in delta.logprobs],
                "top_logprobs": [{text(a.token_id): a.logprob for a in lp.top} for lp in delta.logprobs],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]}

    async def _usage(self, completion: int) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache held (each prompt once, whatever n)."""
        cached = 0
        for stream in self.streams[:: self.n]:
            cached += await self.api.io.run(self.api.frontend.cached_tokens, stream)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body = {"id": self.id, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.api.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    async def events(self, owner: str) -> AsyncIterator[bytes]:
        """SSE: the choices' deltas as they come (interleaved), each choice's role first (chat), exactly one
        finish_reason per choice, the usage chunk when asked, then ``[DONE]``. A client that disconnects
        cancels this generator, which closes every stream (their requests are aborted)."""
        queue: asyncio.Queue = asyncio.Queue()
        completion = [0] * len(self.streams)

        async def pump(index: int) -> None:
            try:
                async for delta in self._deltas(index):
                    await queue.put((index, delta))
                await queue.put((index, None))
            except ConveyorError as exc:
                await queue.put((index, exc))
            except Exception as exc:  # noqa: BLE001 - any reader error (a Redis error, a bug) ends this choice, said
                log.exception("choice %d of %s failed", index, self.id)
                await queue.put((index, ConveyorError(f"internal error: {type(exc).__name__}: {exc}")))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            if self.chat:
                for index in range(len(self.streams)):
                    yield self._chunk([self._role(index)])
            first = [True] * len(self.streams)
            written = [0] * len(self.streams)  # characters of each choice's text sent
            done = 0
            while done < len(self.streams):
                index, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, ConveyorError):
                    err = _from_conveyor(item)
                    yield b"data: " + json.dumps(error_body(err.status, str(err), None, err.code)).encode() + b"\n\n"
                    done += 1
                    continue
                completion[index] += len(item.token_ids)
                finish = FINISH.get(item.finish_reason) if item.finish_reason else None
                if item.text or finish or first[index] or item.token_ids:
                    text = self.echoed[index] + item.text if first[index] else item.text
                    logprobs = self._logprobs(item, written[index] + len(text) - len(item.text), index)
                    choice = self._choice(index, text, finish, logprobs)
                    if self.vllm_prompt_logprobs and item.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self._vllm_prompt_logprobs(index, item.prompt_logprobs)
                    yield self._chunk([choice])
                    written[index] += len(text)
                    first[index] = False
            if self.include_usage:
                yield self._chunk([], await self._usage(sum(completion)))
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            self.api.auth.close_stream(owner, len(self.streams))

    async def whole(self, request: Request) -> dict:
        """The full response; a client that disconnects meanwhile aborts every choice."""
        texts, finishes, completion = list(self.echoed), [None] * len(self.streams), 0
        logprobs: list[dict | None] = [None] * len(self.streams)
        scored: list[list | None] = [None] * len(self.streams)

        async def collect(index: int) -> int:
            count = 0
            async for delta in self._deltas(index):
                if delta.prompt_logprobs is not None:
                    scored[index] = self._vllm_prompt_logprobs(index, delta.prompt_logprobs)
                more = self._logprobs(delta, len(texts[index]), index)
                if more is not None:
                    logprobs[index] = more if logprobs[index] is None else {
                        key: logprobs[index][key] + value for key, value in more.items()}
                texts[index] += delta.text
                count += len(delta.token_ids)
                if delta.finish_reason:
                    finishes[index] = FINISH.get(delta.finish_reason)
            return count

        tasks = [asyncio.create_task(collect(i)) for i in range(len(self.streams))]
        gathered = asyncio.gather(*tasks)
        # once done, its outcome counts as seen: a client that left cancels it, and an unseen CancelledError would
        # log "exception was never retrieved" with a traceback
        gathered.add_done_callback(lambda done: done.cancelled() or done.exception())
        watch = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait([watch, gathered], return_when=asyncio.FIRST_COMPLETED)
            if watch in done:
                raise HttpError(499, "the client closed the connection")
            completion = sum(gathered.result())
        finally:
            watch.cancel()
            for task in tasks:
                task.cancel()
            gathered.cancel()
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": f} for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs))]
        else:
            choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                       for i, (t, f, lp) in enumerate(zip(texts, finishes, logprobs))]
        if self.vllm_prompt_logprobs:
            for choice, entries in zip(choices, scored):
                choice["prompt_logprobs"] = entries
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.api.model,
                "choices": choices, "usage": await self._usage(completion)}


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)

