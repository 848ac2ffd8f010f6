"""Checking a generate request field by field. Every error names the field and the limit.

Nothing here touches protobuf: ``tokenizer_svc.server`` converts the request to ``GenerateInput``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from conveyor.params import (SEED_RANGE, Limits, RequestParams, SamplingDefaults, SamplingParams, StopParams,
                             Structured, check, params_from)
from conveyor.structured import validate as validate_structured

CHAT_ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # a name only: Redis keys never contain it (conveyor.state)


@dataclass
class GenerateInput:
    """A generate request as the client sent it. ``sampling`` and ``stop`` hold only the fields it set, by
    their ``conveyor.params`` names; the others take the defaults (the model's, for sampling)."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None  # a prompt already tokenized (the HTTP API's token-id prompts)
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}]
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # a text prompt's (the model's bos, when it adds one)
    request_id: str = ""
    sampling: dict = field(default_factory=dict)
    stop: dict = field(default_factory=dict)
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: only requests with the same salt (and API key) share cached prefixes
    structured: Structured | None = None  # the output's constraint
    structured_field: str = "structured"  # where the request gave it (an error names it there)
    tools: list[dict] | None = None  # function definitions for a chat template that takes them (tools=)
    speculative: bool = True  # False: this request opts out of speculative decoding


MAX_CACHE_SALT = 256  # characters
MAX_PRIORITY = 1_000_000  # |priority|: room for any scheme of levels, far from integer limits


def seed_from_int64(seed: int | None, name: str = "seed") -> int | None:
    """A seed as the HTTP API takes it (vLLM's and llama.cpp's): any signed 64-bit integer, -1 meaning "random"
    (llama.cpp's documented default), as the unsigned seed the core keeps (two's complement)."""
    if seed is None or seed == -1:
        return None
    check(-(2**63) <= seed < 2**63, name, f"must be a 64-bit signed integer (-1: random), got {seed}")
    return seed % SEED_RANGE


def cache_scope(owner: str, salt: str | None, shared: bool) -> str:
    """A request's prefix-cache scope (``RequestParams.cache_scope``): its API key's unless the cache is
    ``shared`` across keys, and within that its ``cache_salt``'s."""
    parts = ([] if shared or not owner else [f"key:{owner}"]) + ([f"salt:{salt}"] if salt else [])
    return "\n".join(parts)


def check_size(inp: GenerateInput, limits: Limits) -> None:
    """What tokenizing would cost, checked before it: a text prompt's or a chat's characters."""
    if inp.prompt is not None:
        check(len(inp.prompt) <= limits.max_prompt_chars, "prompt",
               f"has {len(inp.prompt)} characters; the limit is {limits.max_prompt_chars}")
    if inp.messages is not None:
        size = sum(len(m["content"]) for m in inp.messages if isinstance(m.get("content"), str))
        check(size <= limits.max_prompt_chars, "chat.messages",
               f"have {size} characters of content; the limit is {limits.max_prompt_chars}")


def check_input(inp: GenerateInput, limits: Limits) -> None:
    """The request's own fields (before tokenizing)."""
    given = sum(x is not None for x in (inp.prompt, inp.messages, inp.prompt_ids))
    check(given == 1, "input", "must be exactly one of prompt, prompt_ids or chat")
    if inp.prompt_ids is not None:
        check(len(inp.prompt_ids) > 0, "prompt_ids", "must not be empty")
        bad = [t for t in inp.prompt_ids if not 0 <= t < limits.vocab_size]
        check(not bad, "prompt_ids", f"token id {bad[0] if bad else 0} is not below the vocabulary size {limits.vocab_size}")
    if inp.prompt is not None:
        check(inp.prompt != "", "prompt", "must not be empty")
    check_size(inp, limits)
    if inp.messages is not None:
        check(len(inp.messages) > 0, "chat.messages", "must not be empty")
        for i, message in enumerate(inp.messages):
            check(message["role"] in CHAT_ROLES, f"chat.messages[{i}].role",
                   f"must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r}")
    check(inp.cache_salt is None or 0 < len(inp.cache_salt) <= MAX_CACHE_SALT, "cache_salt",
           f"must be 1-{MAX_CACHE_SALT} characters")
    check(-MAX_PRIORITY <= inp.priority <= MAX_PRIORITY, "priority",
           f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {inp.priority}")
    check(inp.request_id == "" or bool(REQUEST_ID.match(inp.request_id)), "request_id",
           "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    if inp.structured is not None:
        validate_structured(inp.structured, limits, inp.structured_field)


def build_params(inp: GenerateInput, num_prompt_tokens: int, limits: Limits,
                 defaults: SamplingDefaults = SamplingDefaults(), scope: str = "") -> RequestParams:
    """The request's parameters with defaults filled in (sampling: the model's, ``defaults``), after the
    prompt is tokenized; ``scope``: its prefix-cache scope (``cache_scope``)."""
    check(num_prompt_tokens >= 1, "prompt", "gives no tokens")
    if limits.max_prompt_tokens:
        check(num_prompt_tokens <= limits.max_prompt_tokens, "prompt",
               f"has {num_prompt_tokens} tokens; the limit is {limits.max_prompt_tokens} (--max-prompt-tokens)")
    room = limits.max_model_len - num_prompt_tokens
    check(room >= 1, "prompt", f"has {num_prompt_tokens} tokens; the max model length is {limits.max_model_len}")
    # unset: up to the end of the context, as vLLM, llama.cpp and OpenAI do (a chat UI that never sends it must
    # not get answers cut mid-sentence)
    max_tokens = inp.stop.get("max_tokens")
    max_tokens = room if max_tokens is None else max_tokens
    stop = params_from(StopParams, {**inp.stop, "max_tokens": max_tokens})
    stop.check(limits)
    check(max_tokens <= room, "stop.max_tokens",
          f"({max_tokens}) + prompt ({num_prompt_tokens} tokens) exceeds the max model length {limits.max_model_len}")
    model = {f.name: getattr(defaults, f.name) for f in fields(defaults) if f.name != "source"}
    sampling = params_from(SamplingParams, {**model, **inp.sampling})
    sampling.check(limits)
    return RequestParams(sampling, stop, priority=inp.priority, cache_scope=scope, structured=inp.structured,
                         speculative=inp.speculative)
