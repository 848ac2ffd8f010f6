"""The frontend's core: turn a checked request into a Redis record and a submission, and hand the
deltas the detokenizer delivers to the client stream that waits for them.

Deltas may arrive twice (a detokenizer or scheduler that restarted replays from Redis): each
carries the character offset of its text and the index of its first token, and ``ClientStream``
forwards only what its client has not seen, so the client sees every token exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.errors import AlreadyExists, ConveyorError, InvalidArgument, Unavailable
from conveyor.messages import Delta
from conveyor.state import RequestRecord, RequestStore
from conveyor.tokenizer import ModelTokenizer
from tokenizer_svc.validation import GenerateInput, Limits, build_params, check_input

log = logging.getLogger("conveyor.frontend")


@dataclass
class ClientDelta:
    """What the client gets: only text and tokens it has not seen."""

    request_id: str
    text: str
    token_ids: list[int]
    first_token_index: int
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ClientStream:
    def __init__(self, request_id: str, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.text_len = 0  # characters sent
        self.num_tokens = 0  # tokens sent
        self.finished = False
        self._queue: queue.Queue[ClientDelta] = queue.Queue()

    def offer(self, d: Delta) -> None:
        """Queue the unseen part of a delta (called from the Deliver handler's thread)."""
        if self.finished:
            return
        text = d.text[max(0, self.text_len - d.text_offset):] if d.text_offset + len(d.text) > self.text_len else ""
        skip = max(0, self.num_tokens - d.first_token_index)
        tokens, logprobs = d.token_ids[skip:], d.logprobs[skip:]
        if not (text or tokens or d.finish_reason):
            return
        out = ClientDelta(self.request_id, text, tokens, self.num_tokens, logprobs, d.finish_reason)
        self.text_len += len(text)
        self.num_tokens += len(tokens)
        if d.finish_reason is not None:
            self.finished = True
            out.prompt_tokens, out.completion_tokens = d.prompt_tokens, d.completion_tokens
        self._queue.put(out)

    def next(self, timeout: float) -> ClientDelta | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None


class Frontend:
    def __init__(self, tokenizer: ModelTokenizer, store: RequestStore, limits: Limits, address: str,
                 submit: Callable[[str], None], abort: Callable[[str], bool]):
        """``address``: where the detokenizer reaches this frontend's Deliver service."""
        self.tokenizer = tokenizer
        self.store = store
        self.limits = limits
        self.address = address
        self.submit = submit
        self.abort_at_scheduler = abort
        self.streams: dict[str, ClientStream] = {}
        self.lock = threading.Lock()

    def render(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """The prompt text (chat rendered with the model's template) and its token ids."""
        if inp.messages is not None:
            if not self.tokenizer.chat_template:
                raise InvalidArgument("chat: this model has no chat template; send a prompt instead")
            text = self.tokenizer.apply_chat_template(inp.messages, inp.add_generation_prompt)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return inp.prompt, self.tokenizer.encode(inp.prompt)

    def open(self, inp: GenerateInput, submit_timeout: float = 60.0) -> ClientStream:
        """Check, tokenize, record in Redis, submit; returns the stream the deltas will arrive on."""
        check_input(inp, self.limits)
        _, prompt_ids = self.render(inp)
        params = build_params(inp, len(prompt_ids), self.limits)
        request_id = inp.request_id or uuid.uuid4().hex
        stream = ClientStream(request_id, len(prompt_ids))
        with self.lock:
            if request_id in self.streams:
                raise AlreadyExists(f"request_id {request_id!r} is already in use")
            self.streams[request_id] = stream
        try:
            record = RequestRecord(request_id, prompt_ids, params, frontend=self.address)
            if not self.store.create(record):
                raise AlreadyExists(f"request_id {request_id!r} is already in use (in flight or finished recently)")
            self._submit(request_id, submit_timeout)
        except BaseException:
            self._unregister(request_id)
            raise
        return stream

    def _submit(self, request_id: str, timeout: float) -> None:
        """Submit, retrying while the scheduler is unavailable (it may be restarting: a restarted
        scheduler also finds the request in Redis). A refusal removes the record again."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                self.submit(request_id)
                return
            except Unavailable:
                if time.monotonic() > deadline:
                    self.store.discard(request_id)
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except ConveyorError:
                self.store.discard(request_id)
                raise

    def deliver(self, deltas: list[Delta]) -> list[str]:
        """Hand deltas to their streams; returns ids this frontend holds no stream for."""
        unknown = []
        for d in deltas:
            with self.lock:
                stream = self.streams.get(d.request_id)
            if stream is None:
                unknown.append(d.request_id)
            else:
                stream.offer(d)
        return unknown

    def close(self, request_id: str) -> None:
        """The client's call ended (finished, cancelled, disconnected or timed out)."""
        stream = self._unregister(request_id)
        if stream is not None and not stream.finished:
            try:
                self.abort_at_scheduler(request_id)
            except ConveyorError as exc:
                log.warning("abort of %s failed: %s", request_id, exc)

    def abort(self, request_id: str) -> bool:
        """The public Abort: the stream (here or on another frontend) ends with finish_reason abort."""
        return self.abort_at_scheduler(request_id)

    def _unregister(self, request_id: str) -> ClientStream | None:
        with self.lock:
            return self.streams.pop(request_id, None)
