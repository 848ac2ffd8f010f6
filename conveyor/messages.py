"""Dataclasses that cross a process boundary between services (their protobuf twins in frontend.proto)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field


@dataclass
class Delta:
    """A piece of one request's output, from the detokenizer to the frontend (``frontend_pb2.Delta``)."""

    request_id: str
    text_offset: int
    _: KW_ONLY
    text: str = ""
    first_token_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


