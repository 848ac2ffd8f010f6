"""A request's parameters: the one list of them, as every service sees them (and as Redis stores them).

``SamplingParams`` and ``StopParams`` are the public API's ``SamplingOptions`` and ``StopConditions`` field
for field, each with one ``check(limits)`` whose errors name the field; ``RequestParams`` holds both with
the request's scheduling fields. Protobuf goes by field name (``given_from_pb``, ``from_pb``, ``to_pb``), so
the frontend, the scheduler and the worker convert with the same two functions, and a new option is a field
here, in the proto message, and where it is used. The frontend fills what a request leaves unset (the
model's sampling defaults) and checks it; the scheduler sends the sampling and stop parameters to the
worker (which checks their ranges again, ``Limits.wire``) and applies the stop rules; the detokenizer reads
the stop strings. Stored as JSON in the request's Redis hash.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields, replace

from conveyor.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 256
GREEDY_EPS = 1e-5  # temperatures below this mean greedy
MAX_LOGPROBS = 20  # alternatives per token: what the worker computes and the wire carries at most


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field unset gets: the model's own generation defaults where it
    has them, else llama.cpp's server defaults (chat-friendly: a little randomness, the long tail cut)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    source: str = "Conveyor's defaults (llama.cpp's)"


# generation_config.json keys, and the GGUF metadata keys llama.cpp writes for the same defaults
HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
             "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}


def _gguf_sampling(path) -> dict:
    """A GGUF's ``general.sampling.*`` values, through the model-file cache: parsing a GGUF's metadata takes
    seconds (the tokenizer's arrays), and every frontend start would pay it."""
    from conveyor.cache import cache_dir_for, write_atomic

    cached = cache_dir_for(path) / "sampling_defaults.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    from conveyor.gguf_file import GGUFFile

    meta = GGUFFile(path)
    found = {name: value for name, key in GGUF_KEYS.items() if (value := meta.get(key)) is not None}
    write_atomic(cached, lambda tmp: tmp.write_text(json.dumps(found)))
    return found


def sampling_defaults(model) -> SamplingDefaults:
    """The defaults of ``--model``: its ``generation_config.json`` (a Hugging Face folder) or its GGUF
    ``general.sampling.*`` metadata, field by field over Conveyor's own."""
    from conveyor.model_files import resolve_model

    source = resolve_model(model)
    found: dict = {}
    if source.kind == "hf":
        path = source.path / "generation_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            if config.get("do_sample") is False:  # the model asks for greedy decoding
                config = {**config, "temperature": 0.0}
            found = {name: config[key] for name, key in HF_KEYS.items() if isinstance(config.get(key), (int, float))}
            where = str(path.name)
    else:
        found = _gguf_sampling(source.path)
        where = "the GGUF's general.sampling metadata"
    if not found:
        return SamplingDefaults()
    ours = SamplingDefaults()
    return replace(ours, **{name: type(getattr(ours, name))(value) for name, value in found.items()}, source=where)


@dataclass(frozen=True)
class Limits:
    """What a request may ask for. The frontend's come from its flags; the worker's (``Limits.wire``) are the
    ranges its sampler and wire rely on, whatever the frontend allowed."""

    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters
    max_logprobs: int = MAX_LOGPROBS
    max_prompt_chars: int = 1 << 20
    max_prompt_tokens: int = 0  # 0: max_model_len - 1
    max_stop_token_ids: int = 64  # each is checked on every token
    max_logit_bias: int = 300  # entries; applied on every token (OpenAI's limit too)
    max_grammar_bytes: int = 64 << 10  # a structured-output spec's UTF-8 bytes (a schema, a regex, a grammar)

    @classmethod
    def wire(cls, max_model_len: int, vocab_size: int) -> Limits:
        """Ranges only: the counts a frontend may have raised by flag are not the worker's to refuse."""
        many = 1 << 62
        return cls(max_model_len, vocab_size, max_stop_strings=many, max_stop_length=many,
                   max_stop_token_ids=many, max_logit_bias=many, max_grammar_bytes=many)


MAX_TOP_K = 2**31 - 1  # the wire's field is an int32 (any top_k past the vocabulary means "off")
SEED_RANGE = 2**64  # seeds are unsigned 64-bit on the wire


def check(ok: bool, name: str, message: str) -> None:
    """``InvalidArgument`` naming the field ``name`` (gRPC's path: ``sampling.top_p``) unless ``ok``."""
    if not ok:
        raise InvalidArgument(message, field=name)


def _finite(value, name: str) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
          f"must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn (the public API's ``SamplingOptions``, the worker's sampler)."""

    temperature: float = 1.0  # 0 (below GREEDY_EPS): greedy
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; N: the sampled token's plus N alternatives
    prompt_logprobs: int | None = None  # None: off; N: every prompt token's after the first, plus N alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check(self, limits: Limits) -> None:
        """Raise ``InvalidArgument`` naming the field for a value out of its range or past a limit."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            _finite(getattr(self, name), f"sampling.{name}")
        check(self.temperature >= 0, "sampling.temperature", f"must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        check(-1 <= self.top_k <= MAX_TOP_K, "sampling.top_k",
              f"must be -1 (off), 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        check(self.seed is None or 0 <= self.seed < SEED_RANGE, "sampling.seed", f"must be in [0, 2^64), got {self.seed}")
        check(0 <= self.min_p <= 1, "sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, "sampling.repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2 <= value <= 2, f"sampling.{name}", f"must be in [-2, 2], got {value}")
        check(len(self.logit_bias) <= limits.max_logit_bias, "sampling.logit_bias",
              f"has {len(self.logit_bias)} entries; at most {limits.max_logit_bias} are allowed (--max-logit-bias)")
        for token, bias in self.logit_bias.items():
            check(0 <= token < limits.vocab_size, "sampling.logit_bias",
                  f"token id {token} is not below the vocabulary size {limits.vocab_size}")
            check(math.isfinite(bias) and -100 <= bias <= 100, "sampling.logit_bias",
                  f"value for token {token} must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= limits.max_logprobs, f"sampling.{name}",
                  f"must be at most {limits.max_logprobs} and not negative, got {value}")


@dataclass(frozen=True)
class StopParams:
    """When generation ends (the public API's ``StopConditions``). On the worker's wire ``stop_token_ids``
    holds every id that ends the sequence (the model's eos included): the ones masked before ``min_tokens``."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def check(self, limits: Limits) -> None:
        """Raise ``InvalidArgument`` naming the field for a value out of its range or past a limit."""
        check(self.min_tokens >= 0, "stop.min_tokens", f"must be >= 0, got {self.min_tokens}")
        check(self.max_tokens >= 1, "stop.max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(self.min_tokens <= self.max_tokens, "stop.min_tokens",
              f"({self.min_tokens}) must not exceed stop.max_tokens ({self.max_tokens})")
        check(len(self.stop) <= limits.max_stop_strings, "stop.stop",
              f"has {len(self.stop)} strings; at most {limits.max_stop_strings} are allowed (--max-stop-strings)")
        for i, text in enumerate(self.stop):
            check(text != "", f"stop.stop[{i}]", "must not be empty")
            check(len(text) <= limits.max_stop_length, f"stop.stop[{i}]",
                  f"is longer than {limits.max_stop_length} characters")
        check(len(self.stop_token_ids) <= limits.max_stop_token_ids, "stop.stop_token_ids",
              f"has {len(self.stop_token_ids)} ids; at most {limits.max_stop_token_ids} are allowed (--max-stop-token-ids)")
        for token in self.stop_token_ids:
            check(0 <= token < limits.vocab_size, "stop.stop_token_ids",
                  f"token id {token} is not below the vocabulary size {limits.vocab_size}")

    def stop_ids(self, eos_token_ids: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Token ids that end the request: the model's eos (unless ignore_eos) and stop_token_ids."""
        ids = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(ids + self.stop_token_ids))


def compact_json(value) -> str:
    """The one JSON text of a value a spec stores (a schema, choices): no spaces, non-ASCII kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")  # the proto's oneof


@dataclass(frozen=True)
class Structured:
    """A constraint on the output (the public API's ``Structured``). ``spec``: the JSON schema as JSON text,
    the regex, the choices as a JSON array of strings, or the grammar; "" for json_object.
    ``whitespace_pattern``: the JSON kinds' whitespace between tokens (None: the default, bounded)."""

    kind: str
    spec: str = ""
    whitespace_pattern: str | None = None

    def check(self, limits: Limits, name: str = "structured") -> None:
        """The kind and the size; whether the engine can enforce the spec is ``conveyor.structured.validate``'s."""
        check(self.kind in STRUCTURED_KINDS, name, f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        size = len(self.spec.encode()) + len((self.whitespace_pattern or "").encode())
        check(size <= limits.max_grammar_bytes, name,
              f"is {size} bytes; at most {limits.max_grammar_bytes} are allowed (--max-grammar-bytes)")

    @classmethod
    def from_pb(cls, message) -> Structured | None:
        """From a ``Structured`` message (None when it sets no constraint)."""
        kind = message.WhichOneof("kind")
        if kind is None:
            return None
        value = getattr(message, kind)
        spec = compact_json(list(value.choices)) if kind == "choice" else "" if kind == "json_object" else value
        pattern = message.whitespace_pattern if message.HasField("whitespace_pattern") else None
        return cls(kind, spec, pattern)

    def to_pb(self, message):
        """Into a ``Structured`` message (``message``, filled in place)."""
        if self.kind == "choice":
            message.choice.choices.extend(json.loads(self.spec))
        elif self.kind == "json_object":
            message.json_object = True
        else:
            setattr(message, self.kind, self.spec)
        if self.whitespace_pattern is not None:
            message.whitespace_pattern = self.whitespace_pattern
        return message


GROUPS = {"sampling": SamplingParams, "stop": StopParams}  # RequestParams' parts, as the public API groups them


@dataclass(frozen=True)
class RequestParams:
    """Everything a request asks for beyond its prompt: the one list of request fields (see the module doc)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    # scheduling: lower runs first (as vLLM); equal priorities run in arrival order
    priority: int = 0
    # whose cached prefixes this request may reuse and add to (conveyor.prefix.scoped): its API key's, and its
    # cache_salt's (vLLM's); "" shares the cache with every request of the same scope ""
    cache_scope: str = ""
    structured: Structured | None = None  # the output's constraint (structured output); None: free text
    speculative: bool = True  # may draft tokens when its engine speculates (False: the request opted out)

    @classmethod
    def of(cls, **values) -> RequestParams:
        """From flat field names (``max_tokens=9, temperature=0``): each goes to the group that has it."""
        groups = {name: {} for name in GROUPS}
        top = {}
        for name, value in values.items():
            group = next((g for g, kind in GROUPS.items() if name in field_names(kind)), None)
            (groups[group] if group else top)[name] = value
        return cls(**{g: params_from(GROUPS[g], raw) for g, raw in groups.items()}, **top)

    def to_json(self) -> str:
        return json.dumps(plain(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestParams:
        """From the JSON stored in a request's record (a flat record from before the groups reads too)."""
        raw = json.loads(text)
        if "sampling" not in raw:  # a record written before the groups (flat): sorted by name
            return cls.of(**{k: v for k, v in raw.items() if k in _ALL_NAMES})
        top = {k: v for k, v in raw.items() if k in field_names(cls) and k not in GROUPS}  # a newer process's: not ours
        if top.get("structured") is not None:
            top["structured"] = Structured(**{k: v for k, v in top["structured"].items() if k in field_names(Structured)})
        return cls(**{g: params_from(kind, raw.get(g, {})) for g, kind in GROUPS.items()}, **top)


@functools.cache
def field_names(kind) -> tuple[str, ...]:
    """The field names of a dataclass, in order (kept: each request's record asks for them several times)."""
    return tuple(f.name for f in fields(kind))


def plain(value):
    """A dataclass as a dict of its fields, nested ones too (``dataclasses.asdict`` without its deep copy of every
    value, which cost more than the rest of recording a request); other values as they are."""
    if hasattr(type(value), "__dataclass_fields__"):
        return {name: plain(getattr(value, name)) for name in field_names(type(value))}
    return value


_ALL_NAMES = set().union(*(field_names(k) for k in GROUPS.values()), field_names(RequestParams))


def params_from(kind, raw: dict):
    """A group (``SamplingParams``, ``StopParams``) from JSON-ish values (keys as strings, lists): its own
    fields only, in their types."""
    raw = {k: v for k, v in raw.items() if k in field_names(kind)}
    if "logit_bias" in raw:
        raw["logit_bias"] = {int(k): float(v) for k, v in raw["logit_bias"].items()}
    for name in ("stop", "stop_token_ids"):
        if name in raw:
            raw[name] = tuple(raw[name])
    return kind(**raw)


# ---------------------------------------------------------------- protobuf, by field name


def _is_map(desc) -> bool:
    return desc.message_type is not None and desc.message_type.GetOptions().map_entry


def given_from_pb(message, kind) -> dict:
    """The fields of ``kind`` that ``message`` sets, by name (an unset optional field is left out): a map as a
    dict, a repeated field as a tuple. Fields only one side has are skipped, so a message may carry a subset."""
    out = {}
    by_name = message.DESCRIPTOR.fields_by_name
    for name in field_names(kind):
        desc = by_name.get(name)
        if desc is None or (desc.has_presence and not message.HasField(name)):
            continue
        value = getattr(message, name)
        if _is_map(desc):
            value = dict(value)
        elif desc.is_repeated:
            value = tuple(value)
        out[name] = value
    return out


def from_pb(kind, message):
    """``kind`` from ``message`` (``given_from_pb``), unset fields at their defaults."""
    return kind(**given_from_pb(message, kind))


def to_pb(values, message):
    """Fill ``message`` from a dataclass (or a dict of field values) by name; None leaves a field unset."""
    items = (values if isinstance(values, dict) else plain(values)).items()
    by_name = message.DESCRIPTOR.fields_by_name
    for name, value in items:
        desc = by_name.get(name)
        if desc is None or value is None:
            continue
        if _is_map(desc):
            getattr(message, name).update(value)
        elif desc.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message
