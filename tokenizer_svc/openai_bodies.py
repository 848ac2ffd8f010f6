"""OpenAI request bodies as the core's input, and OpenAI's error shape (the HTTP API's two ends of a field).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status of the
gRPC code the core raised (400 a bad field, named; 401; 404; 429; 503; 504). Unknown fields are ignored, as
OpenAI ignores them; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from conveyor.errors import ConveyorError, InvalidArgument
from tokenizer_svc.validation import GenerateInput, seed_from_int64

MAX_N = 16  # choices of one request (prompts x n)
STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
          "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable", 504: "timeout"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def http_name(field: str) -> str:
    """A core field path (gRPC's names: ``sampling.top_p``, ``stop.stop[0]``, ``prompt_ids``) as the HTTP API
    names it (``top_p``, ``stop[0]``, ``prompt``)."""
    for prefix in ("sampling.", "stop.", "chat."):
        field = field.removeprefix(prefix)
    return "prompt" + field.removeprefix("prompt_ids") if field.startswith("prompt_ids") else field


def from_conveyor(exc: ConveyorError) -> HttpError:
    """The core's error as HTTP: the field an ``InvalidArgument`` names becomes ``param``, in the HTTP API's
    names. A 400 from another process (its field did not cross gRPC) names the message's first word."""
    status = STATUS.get(exc.code, 500)
    field = getattr(exc, "field", None)
    if status == 400 and field:
        param = http_name(field)
        return HttpError(400, f"{param} {exc.reason}", param, exc.code.lower())
    message = str(exc)
    return HttpError(status, message, message.split(" ", 1)[0] if status == 400 else None, exc.code.lower())


# ---------------------------------------------------------------- request bodies


def body_field(body: dict, name: str, kinds: tuple[type, ...], default=None):
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
    stop = body_field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HttpError(400, "stop must be a string or an array of strings", "stop")
    return stop


def int_list(body: dict, name: str) -> list[int]:
    values = body_field(body, name, (list,), [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HttpError(400, f"{name} must be an array of integers", name)
    return values


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body_field(body, "logit_bias", (dict,), {})
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
    max_tokens = body_field(body, "max_completion_tokens", (int,)) if chat else None
    if max_tokens is None:
        max_tokens = body_field(body, "max_tokens", (int,))
    if chat:
        logprobs = body_field(body, "top_logprobs", (int,), 0) if body_field(body, "logprobs", (bool,), False) else None
    else:
        logprobs = body_field(body, "logprobs", (int,))
    # vLLM's prompt_logprobs; on completions, echo with logprobs scores the echoed prompt too (OpenAI, vLLM)
    prompt_logprobs = body_field(body, "prompt_logprobs", (int,))
    if prompt_logprobs is None and not chat and logprobs is not None and body_field(body, "echo", (bool,), False):
        prompt_logprobs = logprobs
    sampling = {
        "temperature": _float(body, "temperature"), "top_p": _float(body, "top_p"),
        "top_k": body_field(body, "top_k", (int,)), "min_p": _float(body, "min_p"),
        "repetition_penalty": _float(body, "repetition_penalty"),
        "presence_penalty": _float(body, "presence_penalty"), "frequency_penalty": _float(body, "frequency_penalty"),
        "logit_bias": _logit_bias(body), "seed": _seed(body), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
    }
    stop = {
        "max_tokens": max_tokens, "min_tokens": body_field(body, "min_tokens", (int,)), "stop": _stop_strings(body),
        "stop_token_ids": int_list(body, "stop_token_ids"), "ignore_eos": body_field(body, "ignore_eos", (bool,)),
        "include_stop_str_in_output": body_field(body, "include_stop_str_in_output", (bool,)),
    }
    return GenerateInput(sampling={k: v for k, v in sampling.items() if v is not None},
                         stop={k: v for k, v in stop.items() if v is not None},
                         priority=body_field(body, "priority", (int,), 0), cache_salt=body_field(body, "cache_salt", (str,)))


def _float(body: dict, name: str) -> float | None:
    value = body_field(body, name, (int, float))
    try:
        return float(value) if value is not None else None
    except OverflowError:  # an integer past any float
        raise HttpError(400, f"{name} must be a finite number, got an integer of {len(str(value))} digits",
                        name) from None


def _seed(body: dict) -> int | None:
    """vLLM's and llama.cpp's seed: any signed 64-bit integer, -1 meaning random."""
    try:
        return seed_from_int64(body_field(body, "seed", (int,)))
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
    fmt = body_field(body, "response_format", (dict,))
    if fmt is not None:
        kind = fmt.get("type")
        if kind not in RESPONSE_FORMATS:
            raise HttpError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got "
                            f"{json.dumps(kind)[:80]}", "response_format")
        if kind != "text":
            raise HttpError(400, f"response_format.type {kind!r} is not supported yet: this server cannot "
                            "constrain its output", "response_format")


def chat_messages(body: dict) -> list[dict]:
    messages = body_field(body, "messages", (list,))
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


def prompts_of(body: dict) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either (one choice set per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_N and prompt and isinstance(prompt[0], (str, list)):
        raise HttpError(400, f"prompt has {len(prompt)} prompts; at most {MAX_N} are allowed", "prompt")
    if isinstance(prompt, str) or _ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p) for p in prompt):
        return prompt
    raise HttpError(400, "prompt must be a string, an array of token ids, or a non-empty array of either", "prompt")
