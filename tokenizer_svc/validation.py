"""Checking a generate request field by field. Every error names the field and the limit.

Nothing here touches protobuf: ``tokenizer_svc.server`` converts the request to ``GenerateInput``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from conveyor.errors import InvalidArgument
from conveyor.params import RequestParams, SamplingDefaults

CHAT_ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # a name only: Redis keys never contain it (conveyor.state)


@dataclass
class GenerateInput:
    """A generate request as the client sent it; ``None`` means "not set, use the default"."""

    prompt: str | None = None
    prompt_ids: list[int] | None = None  # a prompt already tokenized (the HTTP API's token-id prompts)
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}]
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # a text prompt's (the model's bos, when it adds one)
    request_id: str = ""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: only requests with the same salt (and API key) share cached prefixes


MAX_CACHE_SALT = 256  # characters
MAX_PRIORITY = 1_000_000  # |priority|: room for any scheme of levels, far from integer limits
MAX_TOP_K = 2**31 - 1  # the worker's wire field is an int32 (any top_k past the vocabulary means "off")
SEED_RANGE = 2**64  # seeds are unsigned 64-bit on the wire; the HTTP API's signed ones map onto them


def seed_from_int64(seed: int | None, name: str = "seed") -> int | None:
    """A seed as the HTTP API takes it (vLLM's and llama.cpp's): any signed 64-bit integer, -1 meaning "random"
    (llama.cpp's documented default), as the unsigned seed the core keeps (two's complement)."""
    if seed is None or seed == -1:
        return None
    _check(-(2**63) <= seed < 2**63, name, f"must be a 64-bit signed integer (-1: random), got {seed}")
    return seed % SEED_RANGE


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters
    max_logprobs: int = 20
    max_prompt_chars: int = 1 << 20
    max_prompt_tokens: int = 0  # 0: max_model_len - 1
    max_stop_token_ids: int = 64  # each is checked on every token
    max_logit_bias: int = 300  # entries; applied on every token (OpenAI's limit too)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(f"{name} {message}")


def _finite(value: float | None, name: str) -> None:
    _check(value is None or math.isfinite(value), name, f"must be a finite number, got {value}")


def cache_scope(owner: str, salt: str | None, shared: bool) -> str:
    """A request's prefix-cache scope (``RequestParams.cache_scope``): its API key's unless the cache is
    ``shared`` across keys, and within that its ``cache_salt``'s."""
    parts = ([] if shared or not owner else [f"key:{owner}"]) + ([f"salt:{salt}"] if salt else [])
    return "\n".join(parts)


def check_size(inp: GenerateInput, limits: Limits) -> None:
    """What tokenizing would cost, checked before it: a text prompt's or a chat's characters."""
    if inp.prompt is not None:
        _check(len(inp.prompt) <= limits.max_prompt_chars, "prompt",
               f"has {len(inp.prompt)} characters; the limit is {limits.max_prompt_chars}")
    if inp.messages is not None:
        size = sum(len(m["content"]) for m in inp.messages if isinstance(m.get("content"), str))
        _check(size <= limits.max_prompt_chars, "chat.messages",
               f"have {size} characters of content; the limit is {limits.max_prompt_chars}")


def check_input(inp: GenerateInput, limits: Limits) -> None:
    """The request's own fields (before tokenizing)."""
    given = sum(x is not None for x in (inp.prompt, inp.messages, inp.prompt_ids))
    _check(given == 1, "input", "must be exactly one of prompt, prompt_ids or chat")
    if inp.prompt_ids is not None:
        _check(len(inp.prompt_ids) > 0, "prompt_ids", "must not be empty")
        bad = [t for t in inp.prompt_ids if not 0 <= t < limits.vocab_size]
        _check(not bad, "prompt_ids", f"token id {bad[0] if bad else 0} is not below the vocabulary size {limits.vocab_size}")
    if inp.prompt is not None:
        _check(inp.prompt != "", "prompt", "must not be empty")
    check_size(inp, limits)
    if inp.messages is not None:
        _check(len(inp.messages) > 0, "chat.messages", "must not be empty")
        for i, message in enumerate(inp.messages):
            _check(message["role"] in CHAT_ROLES, f"chat.messages[{i}].role",
                   f"must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r}")
    _check(inp.cache_salt is None or 0 < len(inp.cache_salt) <= MAX_CACHE_SALT, "cache_salt",
           f"must be 1-{MAX_CACHE_SALT} characters")
    _check(-MAX_PRIORITY <= inp.priority <= MAX_PRIORITY, "priority",
           f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {inp.priority}")
    _check(inp.request_id == "" or bool(REQUEST_ID.match(inp.request_id)), "request_id",
           "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        _finite(getattr(inp, name), f"sampling.{name}")
    _check(inp.temperature is None or inp.temperature >= 0, "sampling.temperature", f"must be >= 0, got {inp.temperature}")
    _check(inp.top_p is None or 0 < inp.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {inp.top_p}")
    _check(inp.top_k is None or -1 <= inp.top_k <= MAX_TOP_K, "sampling.top_k",
           f"must be -1 (off), 0 (off) or in [1, {MAX_TOP_K}], got {inp.top_k}")
    _check(inp.seed is None or 0 <= inp.seed < SEED_RANGE, "sampling.seed",
           f"must be in [0, 2^64), got {inp.seed}")
    _check(inp.min_p is None or 0 <= inp.min_p <= 1, "sampling.min_p", f"must be in [0, 1], got {inp.min_p}")
    _check(inp.repetition_penalty is None or inp.repetition_penalty > 0, "sampling.repetition_penalty",
           f"must be > 0, got {inp.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(inp, name)
        _check(value is None or -2 <= value <= 2, f"sampling.{name}", f"must be in [-2, 2], got {value}")
    _check(len(inp.logit_bias) <= limits.max_logit_bias, "sampling.logit_bias",
           f"has {len(inp.logit_bias)} entries; at most {limits.max_logit_bias} are allowed (--max-logit-bias)")
    for token, bias in inp.logit_bias.items():
        _check(0 <= token < limits.vocab_size, "sampling.logit_bias", f"token id {token} is not below the vocabulary size {limits.vocab_size}")
        _check(math.isfinite(bias) and -100 <= bias <= 100, "sampling.logit_bias", f"value for token {token} must be in [-100, 100], got {bias}")
    _check(inp.logprobs is None or 0 <= inp.logprobs <= limits.max_logprobs, "sampling.logprobs",
           f"must be at most {limits.max_logprobs} and not negative, got {inp.logprobs}")
    _check(inp.prompt_logprobs is None or 0 <= inp.prompt_logprobs <= limits.max_logprobs, "sampling.prompt_logprobs",
           f"must be at most {limits.max_logprobs} and not negative, got {inp.prompt_logprobs}")
    _check(inp.min_tokens >= 0, "stop.min_tokens", f"must be >= 0, got {inp.min_tokens}")
    _check(inp.max_tokens is None or inp.max_tokens >= 1, "stop.max_tokens", f"must be >= 1, got {inp.max_tokens}")
    _check(inp.max_tokens is None or inp.min_tokens <= inp.max_tokens, "stop.min_tokens",
           f"({inp.min_tokens}) must not exceed stop.max_tokens ({inp.max_tokens})")
    _check(len(inp.stop) <= limits.max_stop_strings, "stop.stop",
           f"has {len(inp.stop)} strings; at most {limits.max_stop_strings} are allowed (--max-stop-strings)")
    for i, text in enumerate(inp.stop):
        _check(text != "", f"stop.stop[{i}]", "must not be empty")
        _check(len(text) <= limits.max_stop_length, f"stop.stop[{i}]", f"is longer than {limits.max_stop_length} characters")
    _check(len(inp.stop_token_ids) <= limits.max_stop_token_ids, "stop.stop_token_ids",
           f"has {len(inp.stop_token_ids)} ids; at most {limits.max_stop_token_ids} are allowed (--max-stop-token-ids)")
    for token in inp.stop_token_ids:
        _check(0 <= token < limits.vocab_size, "stop.stop_token_ids", f"token id {token} is not below the vocabulary size {limits.vocab_size}")


def build_params(inp: GenerateInput, num_prompt_tokens: int, limits: Limits,
                 defaults: SamplingDefaults = SamplingDefaults(), scope: str = "") -> RequestParams:
    """The request's parameters with defaults filled in (sampling: the model's, ``defaults``), after the
    prompt is tokenized; ``scope``: its prefix-cache scope (``cache_scope``)."""
    _check(num_prompt_tokens >= 1, "prompt", "gives no tokens")
    if limits.max_prompt_tokens:
        _check(num_prompt_tokens <= limits.max_prompt_tokens, "prompt",
               f"has {num_prompt_tokens} tokens; the limit is {limits.max_prompt_tokens} (--max-prompt-tokens)")
    room = limits.max_model_len - num_prompt_tokens
    _check(room >= 1, "prompt", f"has {num_prompt_tokens} tokens; the max model length is {limits.max_model_len}")
    # unset: up to the end of the context, as vLLM, llama.cpp and OpenAI do (a chat UI that never sends it must
    # not get answers cut mid-sentence)
    max_tokens = inp.max_tokens if inp.max_tokens is not None else room
    _check(max_tokens <= room, "stop.max_tokens",
           f"({max_tokens}) + prompt ({num_prompt_tokens} tokens) exceeds the max model length {limits.max_model_len}")
    _check(inp.min_tokens <= max_tokens, "stop.min_tokens", f"({inp.min_tokens}) must not exceed max_tokens ({max_tokens})")

    def pick(value, default):
        return default if value is None else value

    return RequestParams(
        temperature=pick(inp.temperature, defaults.temperature), top_k=pick(inp.top_k, defaults.top_k),
        top_p=pick(inp.top_p, defaults.top_p), min_p=pick(inp.min_p, defaults.min_p),
        repetition_penalty=pick(inp.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=pick(inp.presence_penalty, 0.0), frequency_penalty=pick(inp.frequency_penalty, 0.0),
        logit_bias=dict(inp.logit_bias), seed=inp.seed, logprobs=inp.logprobs, prompt_logprobs=inp.prompt_logprobs,
        max_tokens=max_tokens,
        min_tokens=inp.min_tokens, stop=tuple(inp.stop), stop_token_ids=tuple(inp.stop_token_ids),
        ignore_eos=inp.ignore_eos, include_stop_str_in_output=inp.include_stop_str_in_output, priority=inp.priority,
        cache_scope=scope,
    )
