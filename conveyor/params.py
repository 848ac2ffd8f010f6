"""A request's validated parameters, as every service sees them (and as Redis stores them).

The frontend builds one ``RequestParams`` from a ``GenerateRequest`` after checking every field;
the scheduler turns it into the worker's sampling parameters and its own stop rules; the
detokenizer reads the stop strings. Stored as JSON in the request's Redis hash.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

DEFAULT_MAX_TOKENS = 256


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
    # stopping
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RequestParams:
        raw = json.loads(text)
        raw["logit_bias"] = {int(k): float(v) for k, v in raw.get("logit_bias", {}).items()}
        raw["stop"] = tuple(raw.get("stop", ()))
        raw["stop_token_ids"] = tuple(raw.get("stop_token_ids", ()))
        return cls(**raw)

    def stop_ids(self, eos_token_ids: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Token ids that end the request: the model's eos (unless ignore_eos) and stop_token_ids."""
        ids = () if self.ignore_eos else tuple(eos_token_ids)
        return tuple(dict.fromkeys(ids + self.stop_token_ids))
