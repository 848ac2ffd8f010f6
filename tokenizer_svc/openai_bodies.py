"""OpenAI request bodies as the core's input, and OpenAI's error shape (the HTTP API's two ends of a field).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status of the
gRPC code the core raised (400 a bad field, named; 401; 404; 429; 503; 504). Unknown fields are ignored, as
OpenAI ignores them; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import json
from dataclasses import replace

from starlette.responses import JSONResponse

from conveyor.errors import ConveyorError, InvalidArgument
from conveyor.params import Structured, compact_json
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
                         priority=body_field(body, "priority", (int,), 0), cache_salt=body_field(body, "cache_salt", (str,)),
                         speculative=body_field(body, "speculative", (bool,), True))


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


# ---------------------------------------------------------------- structured output

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs kinds
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _schema(value, name: str) -> str:
    """A JSON schema given as an object or as JSON text, as the compact text the spec stores."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise HttpError(400, f"{name} is not valid JSON: {exc}", name) from None
    if not isinstance(value, (dict, bool)):
        raise HttpError(400, f"{name} must be a JSON schema (an object)", name)
    return compact_json(value)


def _grammar_kind(text: str) -> str:
    """vLLM's ``grammar`` is GBNF or Lark, told apart by its syntax (as its llguidance backend does)."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    return "lark" if is_lark_syntax(text) else "gbnf"


def _one_kind(spec: dict, kind: str, name: str) -> Structured:
    """A vLLM-style constraint (``structured_outputs``' kinds, the ``guided_*`` fields) as a ``Structured``."""
    value = spec[kind]
    if kind == "json":
        return Structured("json_schema", _schema(value, name))
    if kind == "json_object":
        if value is not True:
            raise HttpError(400, f"{name} must be true", name)
        return Structured("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise HttpError(400, f"{name} must be a non-empty array of strings", name)
        return Structured("choice", compact_json(value))
    if not isinstance(value, str) or not value:
        raise HttpError(400, f"{name} must be a non-empty string", name)
    return Structured("regex", value) if kind == "regex" else Structured(_grammar_kind(value), value)


def _whitespace(s: Structured, pattern, compact, where: str) -> Structured:
    if pattern is not None and not isinstance(pattern, str):
        raise HttpError(400, f"{where}whitespace_pattern must be a string", f"{where}whitespace_pattern")
    if compact is not None and not isinstance(compact, bool):
        raise HttpError(400, f"{where}disable_any_whitespace must be a boolean", f"{where}disable_any_whitespace")
    pattern = "" if compact else pattern
    return replace(s, whitespace_pattern=pattern) if pattern is not None and s.kind in ("json_schema", "json_object") \
        else s


def _response_format(fmt: dict) -> Structured | None:
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMATS:
        raise HttpError(400, f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got "
                        f"{json.dumps(kind)[:80]}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json_object")
    spec = body_field(fmt, "json_schema", (dict,))
    if spec is None:
        raise HttpError(400, "response_format.json_schema must be an object with the schema", "response_format.json_schema")
    if "schema" not in spec or spec["schema"] is None:  # OpenAI's schema is optional: any JSON object then
        return Structured("json_object")
    return Structured("json_schema", _schema(spec["schema"], "response_format.json_schema.schema"))


def structured_input(body: dict) -> tuple[Structured | None, str]:
    """The request's constraint, from whichever field gave it (OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` and its older ``guided_*`` fields, llama.cpp's ``json_schema`` and ``grammar``), and
    that field's name (errors about the spec name it). Two constraints at once are a 400."""
    found: list[tuple[Structured, str]] = []
    fmt = body_field(body, "response_format", (dict,))
    if fmt is not None and (s := _response_format(fmt)) is not None:
        found.append((s, "response_format.json_schema.schema" if s.kind == "json_schema" else "response_format"))
    outputs = body_field(body, "structured_outputs", (dict,))
    if outputs is not None:
        kinds = [k for k in STRUCTURED_OUTPUTS if outputs.get(k) not in (None, False)]
        if len(kinds) != 1:
            raise HttpError(400, f"structured_outputs must have exactly one of {', '.join(STRUCTURED_OUTPUTS)}, got "
                            f"{len(kinds)}", "structured_outputs")
        s = _one_kind(outputs, kinds[0], f"structured_outputs.{kinds[0]}")
        s = _whitespace(s, outputs.get("whitespace_pattern"), outputs.get("disable_any_whitespace"), "structured_outputs.")
        found.append((s, f"structured_outputs.{kinds[0]}"))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            s = _whitespace(_one_kind({kind: body[name]}, kind, name), body.get("guided_whitespace_pattern"), None, "guided_")
            found.append((s, name))
    if body.get("json_schema") is not None:  # llama.cpp's
        found.append((Structured("json_schema", _schema(body["json_schema"], "json_schema")), "json_schema"))
    if body.get("grammar") is not None:  # llama.cpp's: GBNF
        grammar = body_field(body, "grammar", (str,))
        found.append((Structured("gbnf", grammar), "grammar"))
    if len(found) > 1:
        raise HttpError(400, f"{found[1][1]}: only one constraint per request; {found[0][1]} already gives one",
                        found[1][1])
    return found[0] if found else (None, "structured")


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as the chat template takes them: text content (content parts joined), an assistant's
    ``tool_calls`` (each ``{"id", "type": "function", "function": {"name", "arguments"}}``) and a tool message's
    ``tool_call_id`` kept."""
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
        message = {"role": m["role"], "content": content}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise HttpError(400, f"messages[{i}].tool_call_id must be the id of the call this answers",
                                f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), (str, dict))
        for c in calls)
    if not ok:
        raise HttpError(400, f'{where} must be an array of {{"id", "type": "function", "function": {{"name", '
                        '"arguments"}}}}', where)
    return [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]}} for c in calls]


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
