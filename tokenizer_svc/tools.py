"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice`` checked, the chat
rendered with them, the model's answer turned into ``tool_calls``.

- ``required`` and a named function are enforced: the output is held by a JSON schema to the envelope
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` (the function's own ``parameters`` schema inside;
  ``maxItems: 1`` without ``parallel_tool_calls``), so every forced call parses and validates.
- ``auto`` is parsed from the text, in the format the chat template teaches: Hermes ``<tool_call>`` blocks,
  Llama 3's bare ``{"name", "parameters"}`` object, or, for a template with no tool format (the default
  model's), the same JSON envelope, described in a system block added to the chat (llama.cpp's "generic").
- Tool call ids are derived from the request's id and the call's index, so a replayed stream repeats them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from conveyor.params import Structured, compact_json
from tokenizer_svc.openai_bodies import HttpError, body_field

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (letters, digits, _ and -; . allowed too)
HERMES, LLAMA3, GENERIC = "hermes", "llama3", "generic"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Tools:
    """A request's tools: ``functions`` by name (each ``{"name", "description", "parameters"}``), the choice
    ("auto", "required" or a function's name), whether several calls may come at once, and the format
    the answer is parsed in."""

    functions: dict[str, dict]
    choice: str
    parallel: bool
    format: str = GENERIC

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> Structured | None:
        """The schema a forced choice holds the output to (None for auto)."""
        if not self.forced:
            return None
        names = list(self.functions) if self.choice == "required" else [self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": _closed(self.functions[name]["parameters"])},
                  "required": ["name", "arguments"], "additionalProperties": False} for name in names]
        items = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel or self.choice != "required":
            items["maxItems"] = 1
        return Structured("json_schema", compact_json({"type": "object", "properties": {"tool_calls": items},
                                                       "required": ["tool_calls"], "additionalProperties": False}))

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (Hugging Face's ``tools=``)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def system_block(self) -> str:
        """For a template with no tool format: how to call the tools, in the envelope the parser reads."""
        listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions.values())
        must = ("You must call one of them." if self.choice == "required" else
                f"You must call {self.choice}." if self.forced else "Call them only when they help.")
        return (f"You can call these tools:\n{listed}\n{must} To call tools, answer with only this JSON and nothing "
                'else: {"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}')


def _closed(schema: dict) -> dict:
    """A function's parameters as a forced call generates them: an object schema that does not say whether
    other keys may appear gets none (a tool takes the arguments it declares; a small model left free copies
    the schema's own words in as keys until max_tokens). Every such call still validates against the schema."""
    if "additionalProperties" in schema or not (schema.get("type") == "object" or "properties" in schema):
        return schema
    return {**schema, "additionalProperties": False}


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template teaches: Hermes (``<tool_call>`` blocks: Qwen, Hermes, SmolLM3),
    Llama 3 (``<|python_tag|>`` / ipython), else the generic JSON envelope."""
    if template and CALL_OPEN in template:
        return HERMES
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3
    return GENERIC


def tools_input(body: dict, template: str | None) -> Tools | None:
    """The request's tools, checked (400s name the field); None without tools or with ``tool_choice: none``."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) not in (None, [], {}):
            raise HttpError(400, f"{legacy} is OpenAI's deprecated form; send tools and tool_choice", legacy)
    tools = body_field(body, "tools", (list,), [])
    choice = body.get("tool_choice")
    parallel = body_field(body, "parallel_tool_calls", (bool,), True)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise HttpError(400, f"tool_choice {json.dumps(choice)[:80]} needs tools", "tool_choice")
        return None
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                tool.get("function"), dict):
            raise HttpError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        f = tool["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise HttpError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                            f"{where}.function.name")
        if name in functions:
            raise HttpError(400, f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        parameters = f.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise HttpError(400, f"{where}.function.parameters must be a JSON schema (an object)",
                            f"{where}.function.parameters")
        description = f.get("description")
        if description is not None and not isinstance(description, str):
            raise HttpError(400, f"{where}.function.description must be a string", f"{where}.function.description")
        functions[name] = {"name": name, **({"description": description} if description else {}),
                           "parameters": parameters}
    if choice in (None, "auto"):
        choice = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        pass
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise HttpError(400, f"tool_choice.function.name {json.dumps(name)[:80]} is not one of the tools",
                            "tool_choice.function.name")
        choice = name
    else:
        raise HttpError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    return Tools(functions, choice, parallel, tool_format(template))


def chat_with_tools(messages: list[dict], tools: Tools | None, native: bool) -> list[dict]:
    """The chat as the template gets it. ``native`` (the template takes ``tools=``): assistant tool calls
    with their arguments as objects, as Hugging Face's templates read them. Otherwise the tools (when the
    request has any) are described in the system message, and earlier calls are written as the envelope the
    model is asked for."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and native:
            m = {**m, "tool_calls": [{"type": "function", "id": c["id"], "function": {
                "name": c["function"]["name"], "arguments": _loads_or_keep(c["function"]["arguments"])}}
                for c in calls]}
        elif calls:
            envelope = {"tool_calls": [{"name": c["function"]["name"],
                                        "arguments": _loads_or_keep(c["function"]["arguments"])} for c in calls]}
            m = {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + compact_json(envelope)}
        out.append(m)
    if native or tools is None:
        return out
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + tools.system_block()}] + out[1:]
    return [{"role": "system", "content": tools.system_block()}] + out


def _loads_or_keep(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: the same for the same request and call, whoever renders it."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def parse_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished answer: each call ``{"name", "arguments"}`` (arguments a JSON string), the
    content what is left (None when nothing). A call to an unknown function, or text that is not a call,
    stays content."""
    calls: list[dict] = []
    content = text
    if tools.format == HERMES and not tools.forced:
        parts, rest = [], []
        for chunk in re.split(f"({re.escape(CALL_OPEN)}.*?(?:{re.escape(CALL_CLOSE)}|$))", text, flags=re.S):
            if chunk.startswith(CALL_OPEN):
                found = _call(chunk[len(CALL_OPEN):].removesuffix(CALL_CLOSE), tools)
                (parts.append(found) if found else rest.append(chunk))
            else:
                rest.append(chunk)
        calls, content = parts, "".join(rest)
    else:
        value = _json(text.strip())
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            found = [_call(c, tools) for c in value["tool_calls"]]
            if found and all(found):
                calls, content = found, ""
        elif tools.format == LLAMA3 and (found := _call(value, tools)):
            calls, content = [found], ""
    if not tools.parallel:
        calls = calls[:1]
    return (content if content.strip() else None), calls


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(value, tools: Tools) -> dict | None:
    """A call from its JSON (text or parsed): ``{"name", "arguments" | "parameters"}`` naming a known tool."""
    if isinstance(value, str):
        value = _json(value.strip())
    if not isinstance(value, dict) or value.get("name") not in tools.functions:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def openai_calls(calls: list[dict], request_id: str) -> list[dict]:
    """The calls in OpenAI's response shape."""
    return [{"id": call_id(request_id, i), "type": "function", "function": call} for i, call in enumerate(calls)]


class HeldText:
    """A streamed choice's text while it may turn out to be tool calls: ``feed`` returns what can go to the
    client as content now; the rest waits for ``finish``. Forced calls hold everything; ``auto`` holds an
    answer that opens as a call does (``{`` for the JSON formats, ``<tool_call>`` for Hermes) and lets the
    rest through, keeping back only a possible start of the marker."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.held = ""
        self.passing = False  # auto, and the answer is plain content so far

    def feed(self, text: str) -> str:
        self.held += text
        if self.tools.forced:
            return ""
        if self.tools.format == HERMES:
            at = self.held.find(CALL_OPEN)
            if at >= 0:  # a call began: what came before it is content, the rest waits
                out, self.held = self.held[:at], self.held[at:]
                return out
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                         if CALL_OPEN.startswith(self.held[-k:])), 0)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
            return out
        if self.passing:
            out, self.held = self.held, ""
            return out
        stripped = self.held.lstrip()
        if not stripped or stripped.startswith("{"):
            return ""
        self.passing = True
        out, self.held = self.held, ""
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content still to send, calls) once the answer is complete."""
        content, calls = parse_calls(self.held, self.tools) if self.held else (None, [])
        return content, calls
