"""Per-request decode state: token batches in, text deltas (grouped by frontend) out.

A request the detokenizer has not seen is read from Redis (its frontend, stop strings, prompt
length, and the output tokens already generated): a new request and one in flight before a restart
go down the same path. Tokens arrive with their output index, so a resend is skipped and a gap is
filled from Redis. Deltas carry text and token offsets, so the frontend can drop what its client
already has.

``replay`` rebuilds one request's text from Redis from the start and delivers all of it (to the
frontend named, which may be a new one the client resumed on): the frontend asks for it when its
stream is behind Redis (a delivery was lost while some process restarted).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.errors import NotFound
from conveyor.messages import Delta
from conveyor.params import RequestParams
from conveyor.state import REDIS_DOWN, RequestRecord, RequestStore
from conveyor.tokenizer import ModelTokenizer
from detokenizer_svc.incremental import IncrementalDetokenizer, StopMatcher

log = logging.getLogger("conveyor.detokenizer")
# Keys of finished requests kept to ignore late tokens. A key is never used twice (a client that reuses
# its request id gets a new key: ``conveyor.state``), so this memory cannot swallow a new request.
REMEMBER_FINISHED = 10_000


@dataclass
class TokenEntry:
    """New tokens of one request from one step (a detokenizer_pb2.RequestTokens)."""

    request_id: str
    first_index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stopped_by_token: bool = False
    logprobs: list = field(default_factory=list)  # per token, in the wire format (passed through)


@dataclass
class Stream:
    request_id: str
    frontend: str
    params: RequestParams
    prompt_tokens: int
    detok: IncrementalDetokenizer
    matcher: StopMatcher
    num_tokens: int = 0  # tokens taken in (the next expected index)

    def delta(self) -> Delta:
        return Delta(self.request_id, self.matcher.emitted, first_token_index=self.num_tokens)


class DetokenizerCore:
    def __init__(self, tokenizer: ModelTokenizer, store: RequestStore, on_stop: Callable[..., None]):
        """``on_stop(request_id, num_tokens, repeat=False)`` tells the scheduler a stop string ended the
        request (``repeat``: said again because tokens still arrive for it). It must not block."""
        self.tokenizer = tokenizer
        self.store = store
        self.on_stop = on_stop
        self.streams: dict[str, Stream] = {}
        # finished ids (to ignore late tokens) -> output length at a stop-string match, else None
        self.finished: OrderedDict[str, int | None] = OrderedDict()
        self.lock = threading.Lock()

    def push(self, entries: list[TokenEntry]) -> tuple[dict[str, list[Delta]], list[str]]:
        """Process one step's tokens; returns deltas by frontend address, and the ids that failed
        (Redis unreachable): their state is dropped, so a resend of the batch replays them from Redis.
        An error about one request's record (not an outage) drops that request's tokens alone."""
        by_frontend: dict[str, list[Delta]] = {}
        failed = []
        with self.lock:
            records = self._new_records(entries)
            for entry in entries:
                if entry.request_id in self.finished:
                    stopped_at = self.finished[entry.request_id]
                    if stopped_at is not None:  # the scheduler missed our Finish (it restarted): say it again
                        self.on_stop(entry.request_id, stopped_at, True)
                    continue
                try:
                    stream = self.streams.get(entry.request_id) or self._open(entry, records)
                    if stream is None:
                        continue
                    deltas = self._take(stream, entry)
                except REDIS_DOWN:  # forget the stream: the resend starts it over from Redis
                    log.warning("tokens for %s not processed; it will be replayed", entry.request_id, exc_info=True)
                    self.streams.pop(entry.request_id, None)
                    failed.append(entry.request_id)
                    continue
                except Exception:  # noqa: BLE001 - this request's record is unusable; the others go on
                    log.exception("tokens for %s dropped: its record could not be read", entry.request_id)
                    self.streams.pop(entry.request_id, None)
                    continue
                for delta in deltas:
                    by_frontend.setdefault(stream.frontend, []).append(delta)
        return by_frontend, failed

    def replay(self, request_id: str, frontend: str = "") -> tuple[str, list[Delta]]:
        """Rebuild a request's text from Redis and return (frontend, deltas) of everything so far,
        finished or not. ``frontend``: deliver there from now on (default: the one in Redis).

        The whole output is decoded again here, outside the lock every step's tokens need: a long
        replay delays nobody else. Tokens pushed meanwhile reach the new stream as a gap, which
        ``_decode`` fills from Redis (deltas carry offsets, so the frontend drops what it has)."""
        record = self.store.get(request_id)
        if record is None:
            raise NotFound(f"request {request_id!r} is not in Redis (unknown, or finished and expired)")
        stream = self._stream(record, frontend or record.frontend)
        finished = record.status == "finished"
        entry = TokenEntry(request_id, 0, list(record.output_ids), record.finish_reason if finished else None,
                           record.stopped_by_token)
        deltas, stopped_at = self._decode(stream, entry)
        with self.lock:
            self.finished.pop(request_id, None)
            self.streams[request_id] = stream
            self._settle(stream, deltas, stopped_at)
        return stream.frontend, deltas or [stream.delta()]

    def forget(self, request_id: str) -> None:
        with self.lock:
            self._close(request_id)

    def _stream(self, record, frontend: str) -> Stream:
        p = record.params
        detok = IncrementalDetokenizer(self.tokenizer, context=record.prompt_ids)
        return Stream(record.request_id, frontend, p, len(record.prompt_ids), detok,
                      StopMatcher(p.stop.stop, p.stop.include_stop_str_in_output))

    def _new_records(self, entries: list[TokenEntry]) -> dict[str, RequestRecord | None]:
        """The records of the requests in ``entries`` without a stream yet, in one round trip (a step that starts
        many requests pays one, not one each); {} when that read fails: ``_open`` then reads each alone, so an
        outage or one unreadable record fails only its own request."""
        new = [e.request_id for e in entries if e.request_id not in self.streams and e.request_id not in self.finished]
        if len(new) < 2:
            return {}
        try:
            return self.store.get_many(new)
        except Exception:  # noqa: BLE001 - read alone below, where each failure is its request's
            return {}

    def _open(self, entry: TokenEntry, records: dict[str, RequestRecord | None]) -> Stream | None:
        record = records[entry.request_id] if entry.request_id in records else self.store.get(entry.request_id)
        if record is None:
            log.warning("tokens for %s, which Redis does not know; dropped", entry.request_id)
            return None
        stream = self.streams[record.request_id] = self._stream(record, record.frontend)
        if entry.first_index > 0:  # tokens from before a restart (or a lost batch): replay them first
            earlier = record.output_ids[: entry.first_index]
            entry.token_ids = earlier + entry.token_ids[max(0, len(earlier) - entry.first_index):]
            entry.logprobs = [None] * len(earlier) + entry.logprobs if entry.logprobs else []
            entry.first_index = 0
        return stream

    def _take(self, stream: Stream, entry: TokenEntry) -> list[Delta]:
        """``_decode`` a registered stream's tokens, then ``_settle`` (call with the lock held)."""
        deltas, stopped_at = self._decode(stream, entry)
        self._settle(stream, deltas, stopped_at)
        return deltas

    def _settle(self, stream: Stream, deltas: list[Delta], stopped_at: int | None) -> None:
        """After decoding: a stream that ended is closed; a stop string is told to the scheduler."""
        if deltas and deltas[-1].finish_reason is not None:
            self._close(stream.request_id)
        if stopped_at is not None:
            self.finished[stream.request_id] = stopped_at
            self.on_stop(stream.request_id, stopped_at)

    def _decode(self, stream: Stream, entry: TokenEntry) -> tuple[list[Delta], int | None]:
        """Feed a stream; returns its deltas, and the output length when a stop string matched. Touches
        nothing but ``stream`` (and Redis, to fill a gap)."""
        skip = stream.num_tokens - entry.first_index
        if skip < 0:  # a gap: a batch went missing; take the missing tokens from Redis
            record = self.store.get(entry.request_id)
            missing = record.output_ids[stream.num_tokens : entry.first_index] if record else []
            entry = TokenEntry(entry.request_id, stream.num_tokens, missing + entry.token_ids, entry.finish_reason,
                               entry.stopped_by_token, [None] * len(missing) + entry.logprobs if entry.logprobs else [])
            skip = 0
        delta = stream.delta()
        tokens = entry.token_ids[skip:]
        logprobs = entry.logprobs[skip:] if entry.logprobs else []
        for i, token in enumerate(tokens):
            silent = entry.stopped_by_token and i == len(tokens) - 1  # the eos / stop token has no text
            text, stopped = stream.matcher.feed("" if silent else stream.detok.add(token))
            delta.text += text
            delta.token_ids.append(token)
            if logprobs:
                delta.logprobs.append(logprobs[i])
            stream.num_tokens += 1
            if stopped:
                return [self._final(stream, delta, "stop")], stream.num_tokens
        if entry.finish_reason is not None:  # the scheduler ended it: let out everything held back
            text, stopped = stream.matcher.feed(stream.detok.flush())
            delta.text += text if stopped else text + stream.matcher.release()
            return [self._final(stream, delta, "stop" if stopped else entry.finish_reason)], None
        return ([delta] if delta.text or delta.token_ids else []), None

    def _final(self, stream: Stream, delta: Delta, reason: str) -> Delta:
        delta.finish_reason = reason
        delta.prompt_tokens = stream.prompt_tokens
        delta.completion_tokens = stream.num_tokens
        return delta

    def _close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.finished[request_id] = None
        while len(self.finished) > REMEMBER_FINISHED:
            self.finished.popitem(last=False)
