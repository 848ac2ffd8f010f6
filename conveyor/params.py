"""A request's validated parameters, as every service sees them (and as Redis stores them).

The frontend builds one ``RequestParams`` from a ``GenerateRequest`` after checking every field;
the scheduler turns it into the worker's sampling parameters and its own stop rules; the
detokenizer reads the stop strings. Stored as JSON in the request's Redis hash.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace

DEFAULT_MAX_TOKENS = 256


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
        from conveyor.gguf_file import GGUFFile

        meta = GGUFFile(source.path)
        found = {name: value for name, key in GGUF_KEYS.items() if (value := meta.get(key)) is not None}
        where = "the GGUF's general.sampling metadata"
    if not found:
        return SamplingDefaults()
    ours = SamplingDefaults()
    return replace(ours, **{name: type(getattr(ours, name))(value) for name, value in found.items()}, source=where)


@dataclass(frozen=True)
class RequestParams:
    # sampling
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; N: the sampled token's plus N alternatives
    prompt_logprobs: int | None = None  # None: off; N: every prompt token's after the first, plus N alternatives
    # stopping
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # scheduling: lower runs first (as vLLM); equal priorities run in arrival order
    priority: int = 0
    # whose cached prefixes this request may reuse and add to (conveyor.prefix.scoped): its API key's, and its
    # cache_salt's (vLLM's); "" shares the cache with every request of the same scope ""
    cache_scope: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestParams:
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in json.loads(text).items() if k in known}  # a newer process's fields: not ours
        raw["logit_bias"] = {int(k): float(v) for k, v in raw.get("logit_bias", {}).items()}
        raw["stop"] = tuple(raw.get("stop", ()))
        raw["stop_token_ids"] = tuple(raw.get("stop_token_ids", ()))
        return cls(**raw)

    def stop_ids(self, eos_token_ids: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Token ids that end the request: the model's eos (unless ignore_eos) and stop_token_ids."""
        ids = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(ids + self.stop_token_ids))
