"""Tool calling's parts that need no model: the request checked, the chat rendered with the tools, answers in
each template's format parsed into calls, a stream held back only while it may be a call. (Calls made by the
model, forced and streamed, through the real stack: tests/test_structured.py.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from conveyor.tokenizer import load_tokenizer
from tokenizer_svc.openai_bodies import HttpError, chat_messages
from tokenizer_svc.tools import GENERIC, HERMES, LLAMA3, HeldText, Tools, call_id, chat_with_tools, parse_calls, \
    tool_format, tools_input

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def _tools(fmt: str = GENERIC, choice="auto", parallel=True) -> Tools:
    return tools_input({"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel},
                       "<tool_call>" if fmt == HERMES else "<|python_tag|>" if fmt == LLAMA3 else None)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_get_a_400_naming_the_field(body, param):
    with pytest.raises(HttpError) as raised:
        tools_input(body, None)
    assert raised.value.status == 400 and raised.value.param == param


def test_no_tools_or_tool_choice_none_asks_for_nothing():
    assert tools_input({}, None) is None and tools_input({"tools": [], "tool_choice": "auto"}, None) is None
    assert tools_input({"tools": [WEATHER], "tool_choice": "none"}, None) is None


def test_a_forced_choice_is_a_schema_every_call_it_admits_parses_into_a_valid_call():
    required, named = _tools(choice="required"), _tools(choice={"type": "function", "function": {"name": "get_time"}})
    one = _tools(choice="required", parallel=False)
    schema = json.loads(required.constraint().spec)
    answer = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}},
                             {"name": "get_time", "arguments": {"zone": "CET"}}]}
    jsonschema.validate(answer, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "get_weather", "arguments": {"unit": "C"}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):  # a named choice admits that function only
        jsonschema.validate(answer, json.loads(named.constraint().spec))
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(answer, json.loads(one.constraint().spec))
    content, calls = parse_calls(json.dumps(answer), required)
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert _tools().constraint() is None  # auto: nothing forced


@pytest.mark.parametrize("fmt,text,content,names", [
    (GENERIC, '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}', None, ["get_time"]),
    (GENERIC, "It is sunny today.", "It is sunny today.", []),
    (GENERIC, '{"tool_calls": [{"name": "unknown", "arguments": {}}]}', None, []),  # not a call: stays content
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "Let me check.\n\n",
     ["get_weather", "get_time"]),
    (HERMES, "No tools needed.", "No tools needed.", []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Lima"}}', None, ["get_weather"]),
])
def test_each_templates_format_parses_into_calls(fmt, text, content, names):
    tools = _tools(fmt)
    got_content, calls = parse_calls(text, tools)
    assert [c["name"] for c in calls] == names
    if names:
        assert got_content == content and all(isinstance(json.loads(c["arguments"]), dict) for c in calls)
    else:
        assert got_content == text


def test_a_stream_holds_back_only_what_may_be_a_call():
    plain = HeldText(_tools(HERMES))
    out = "".join(plain.feed(piece) for piece in ["Hello ", "there", " <tool", "_call>\n{", '"name": "get_time", ',
                                                  '"arguments": {"zone": "UTC"}}\n</tool_call>'])
    assert out == "Hello there "  # the marker's start was held until it turned out to be a call
    content, calls = plain.finish()
    assert content is None and calls[0]["name"] == "get_time"
    lookalike = HeldText(_tools(HERMES))
    assert "".join(lookalike.feed(p) for p in ["a <to", "ol> b"]) + (lookalike.finish()[0] or "") == "a <tool> b"
    envelope = HeldText(_tools(GENERIC))
    assert envelope.feed(" ") == "" and envelope.feed("{") == ""  # an answer that opens like the JSON envelope
    assert envelope.feed('"tool_calls": [{"name": "get_time", "arguments": {"zone": "X"}}]}') == ""
    assert envelope.finish()[1][0]["name"] == "get_time"
    prose = HeldText(_tools(GENERIC))
    assert prose.feed("Sure") == "Sure" and prose.feed(", {x}") == ", {x}" and prose.finish() == (None, [])
    forced = HeldText(_tools(choice="required"))
    assert forced.feed("anything") == ""


def test_a_template_without_tools_gets_them_in_the_system_message_and_past_calls_as_the_envelope():
    tokenizer = load_tokenizer("default")
    assert not tokenizer.supports_tools and tool_format(tokenizer.chat_template) == GENERIC
    messages = chat_messages({"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]})
    rendered = tokenizer.apply_chat_template(chat_with_tools(messages, _tools(), native=False))
    assert rendered.startswith("<|im_start|>system\nYou can call these tools:") and '"get_time"' in rendered
    assert '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}' in rendered
    assert "<|im_start|>tool\n12 C<|im_end|>" in rendered
    with pytest.raises(HttpError) as raised:
        chat_messages({"messages": [{"role": "tool", "content": "x"}]})
    assert raised.value.param == "messages[0].tool_call_id"


def test_a_template_with_tools_gets_them_as_it_expects():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.name }}:{{ c.function.arguments.city }}>{% endfor %}"
                "{{ m.content }}{% endfor %}")
    tokenizer = load_tokenizer("default")
    tokenizer.chat_template = template
    tools = _tools()
    messages = chat_with_tools([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}],
        tools, native=tokenizer.supports_tools)
    assert tokenizer.apply_chat_template(messages, False, tools.template_tools()) == \
        "[get_weather][get_time]<get_weather:Oslo>"


def test_call_ids_come_from_the_request_so_a_replay_repeats_them():
    assert call_id("req-1", 0) == call_id("req-1", 0) != call_id("req-1", 1) != call_id("req-2", 0)
