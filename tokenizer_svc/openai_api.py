"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``, ``/version`` and vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``.

It is a second listener of the frontend (Starlette on uvicorn, on the same event loop as the gRPC API),
not a gateway process in front of it: a token reaches an HTTP client with one SSE write on the loop
that already holds its stream, where a gateway would add a gRPC message and a process per token. It
uses the same core as ``conveyor.v1.Conveyor``: the same validation and limits, the same API keys
(``Authorization: Bearer``) and stream limits, the same request ownership. Request bodies and errors:
``tokenizer_svc.openai_bodies``; responses: ``tokenizer_svc.openai_reply``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from importlib.metadata import version as package_version

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conveyor.errors import ConveyorError, NotFound
from conveyor.metrics import Metrics
from conveyor.params import SEED_RANGE
from tokenizer_svc.access import Access
from tokenizer_svc.frontend import ClientStream, Frontend
from tokenizer_svc.openai_bodies import (MAX_N, HttpError, body_field, chat_messages, error_response, from_conveyor,
                                         int_list, prompts_of, sampling_input, structured_input)
from tokenizer_svc.openai_reply import Reply
from tokenizer_svc.tools import Tools, chat_with_tools, tools_input
from tokenizer_svc.validation import GenerateInput

log = logging.getLogger("conveyor.frontend")
MAX_BODY_BYTES = 8 << 20
ROUTES = ("/v1/models", "/v1/models/{model}", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
          "/tokenizer_info")


class RequestIds:
    """Every response carries ``x-request-id``: the client's own when it sent one, else a new one (vLLM)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")[:128]
        request_id = given if given and given.isascii() else uuid.uuid4().hex.encode()

        def tagged(message):  # send's own awaitable, not a coroutine around it: this runs for every chunk of a stream
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            return send(message)

        await self.app(scope, receive, tagged)


# ---------------------------------------------------------------- the app


class OpenAIApi:
    def __init__(self, frontend: Frontend, metrics: Metrics, model_name: str,
                 access: Access, request_timeout: float = 0.0, allowed_origins: str = "*"):
        """``allowed_origins``: the CORS origins, comma-separated ("*": any, "": none)."""
        self.allowed_origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
        self.frontend = frontend
        self.metrics = metrics
        self.model = model_name
        self.access = access
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
        return self.access.identify(request.headers.items())

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
            err = from_conveyor(exc)
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
                inp.messages = chat_messages(body)
                inp.add_generation_prompt = body_field(body, "add_generation_prompt", (bool,), True)
            else:
                inp.prompt = body_field(body, "prompt", (str,))
                if inp.prompt is None:
                    raise HttpError(400, "prompt (a string) or messages is required", "prompt")
            inp.add_special_tokens = body_field(body, "add_special_tokens", (bool,), True)
            _, ids = await self.frontend.tokenize(inp)
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
            tokens = int_list(body, "tokens")
            vocab = self.frontend.limits.vocab_size
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise HttpError(400, f"tokens: id {bad[0]} is not below the vocabulary size {vocab}", "tokens")
            return JSONResponse({"prompt": await asyncio.to_thread(self.frontend.tokenizer.decode, tokens)})
        return await self._handle("/detokenize", request, work)

    def _tools(self, body: dict, common: GenerateInput) -> Tools | None:
        """The request's tools; a forced choice becomes the request's constraint (one per request)."""
        tools = tools_input(body, self.frontend.tokenizer.chat_template)
        if tools is None or not tools.forced:
            return tools
        if common.structured is not None:
            raise HttpError(400, f"tool_choice {tools.choice!r} forces a tool call, and {common.structured_field} "
                            "constrains the output too: only one constraint per request", "tool_choice")
        common.structured, common.structured_field = tools.constraint(), "tools"
        return tools

    async def _generate(self, request: Request, owner: str, chat: bool) -> Response:
        body = await self._body(request)
        n = body_field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise HttpError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
        stream = body_field(body, "stream", (bool,), False)
        options = body_field(body, "stream_options", (dict,))
        if options is not None and not stream:  # as OpenAI and vLLM
            raise HttpError(400, "stream_options is only allowed when stream is true", "stream_options")
        include_usage = stream and bool(body_field(options or {}, "include_usage", (bool,), False))
        echo = not chat and body_field(body, "echo", (bool,), False)
        common = sampling_input(body, chat)
        common.structured, common.structured_field = structured_input(body)
        messages = chat_messages(body) if chat else None
        tools = self._tools(body, common) if chat else None
        if chat:
            native = self.frontend.tokenizer.supports_tools
            messages = chat_with_tools(messages, tools, native)
            common.tools = tools.template_tools() if tools is not None and native else None
        elif body.get("tools") not in (None, []):
            raise HttpError(400, "tools are for /v1/chat/completions", "tools")
        prompts = [None] if chat else prompts_of(body)
        if len(prompts) * n > MAX_N:  # counted before anything is expanded, decoded or tokenized
            raise HttpError(400, f"prompts x n must be at most {MAX_N}, got {len(prompts) * n}", "n")
        inputs = []
        for prompt in prompts:
            for i in range(n):
                seed = common.sampling.get("seed")
                inputs.append(dataclasses.replace(
                    common, messages=messages, prompt=prompt if isinstance(prompt, str) else None,
                    prompt_ids=prompt if isinstance(prompt, list) else None,
                    # n seeded choices differ, and reproduce
                    sampling={**common.sampling, "seed": (seed + i) % SEED_RANGE if seed is not None else None}))
        self.access.open_stream(owner, len(inputs))  # each choice is a stream, as a gRPC stream is
        opened: list[ClientStream] = []
        try:
            for inp in inputs:
                opened.append(await self.frontend.open(inp, owner))
            # each choice's text starts with its prompt (token ids: their text)
            echoed = [(i.prompt if i.prompt is not None else self.frontend.tokenizer.decode(i.prompt_ids)) if echo
                      else "" for i in inputs]
            reply = Reply(self, opened, chat, include_usage, echoed, common.sampling.get("logprobs") is not None, n,
                          body_field(body, "prompt_logprobs", (int,)) is not None, tools)
            if stream:
                return StreamingResponse(reply.events(owner), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
        except BaseException:
            for s in opened:
                self.frontend.close(s.request_id, s)
            self.access.close_stream(owner, len(inputs))
            raise
        try:
            return JSONResponse(await reply.whole(request))
        finally:
            self.access.close_stream(owner, len(inputs))
