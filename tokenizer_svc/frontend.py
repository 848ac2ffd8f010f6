"""The frontend's core: turn a checked request into a Redis record and a submission, and hand the
deltas the detokenizer delivers to the client stream that waits for them.

Deltas may arrive twice (a detokenizer or scheduler that restarted replays from Redis): each
carries the character offset of its text and the index of its first token, and ``ClientStream``
forwards only what its client has not seen, so the client sees every token exactly once. A delta
that starts past what the client has (one before it was lost) is not forwarded: the stream is
*behind*, and asks the detokenizer to replay the request from Redis.

A stream that hears nothing for ``STALL_SECONDS`` compares itself with Redis; if Redis is still
ahead at the next look (a delivery was lost while some process restarted, not merely in flight),
it asks for a replay too. So no token is lost or repeated whichever process restarts.

Everything here runs on the frontend's event loop, so a stream's state is only ever changed there: live
deltas are offered by the deliver link, replayed ones by ``keep_up`` once its replay is back, and no lock is needed.
Redis (``AsyncRequestStore``), the schedulers and the detokenizer are reached without blocking the loop;
only tokenizing (CPU work that would stall every other stream) runs on a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import KW_ONLY, dataclass, field

from redis.exceptions import RedisError

from conveyor.errors import AlreadyExists, ConveyorError, InvalidArgument, NotFound, Unavailable
from conveyor.messages import Delta
from conveyor.params import Limits, SamplingDefaults
from conveyor.state import REDIS_DOWN, AsyncRequestStore, RequestRecord, new_request_key
from conveyor.tokenizer import ModelTokenizer
from tokenizer_svc.validation import GenerateInput, build_params, cache_scope, check_input, check_size

log = logging.getLogger("conveyor.frontend")


@dataclass
class ClientDelta:
    """What the client gets: only text and tokens it has not seen."""

    request_id: str
    _: KW_ONLY
    text: str
    token_ids: list[int]
    first_token_index: int
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # on the first delta, when the request asked for prompt_logprobs: one (token id, logprob, rank, alternatives)
    # per prompt token from the second
    prompt_logprobs: list | None = None


STALL_SECONDS = 1.0
INLINE_PROMPT_CHARS = 512  # a plain prompt this short is tokenized on the event loop (at most ~0.1 ms), longer ones on a thread
POLL_SECONDS = 0.25  # how often every stream waiting for deltas is woken to look at Redis (``keep_up``) and its deadline


class ClientStream:
    """``interval``: tokens gathered before the next message goes to the client (the first message and the finish
    go at once); 1 sends every delta as it comes (``FrontendConfig.stream_interval``)."""

    def __init__(self, request_id: str, prompt_tokens: int, num_tokens: int = 0, text_len: int = 0,
                 client_id: str = "", interval: int = 1):
        self.request_id = request_id  # the request's key (what every process and Redis know it by)
        self.client_id = client_id or request_id  # the client's name for it (what the client sees)
        self.prompt_tokens = prompt_tokens
        self.text_len = text_len  # characters sent
        self.num_tokens = num_tokens  # tokens sent
        self.finished = False
        self.behind = False  # a delta came that starts past what the client has: replay from Redis
        self.last_activity = time.monotonic()
        self.last_check = 0.0
        self.suspect: tuple[int, bool] | None = None  # Redis's (tokens, finished) at the last look, when ahead
        self.scores_prompt = False  # it asked for prompt_logprobs: the first delta brings them (from Redis)
        self.prompt_ids: list[int] = []  # with scores_prompt: the prompt (echoed with its scores)
        self.interval = interval
        self._queue: deque[ClientDelta] = deque()  # the loop's alone: no lock
        self._held = 0  # tokens queued since the last message
        self._sent = False  # a message went to the client
        self.wake: Callable[[], None] = lambda: None  # called after each delta queued that makes the stream ready

    def offer(self, d: Delta) -> None:
        """Queue the unseen part of a delta (on the event loop: the deliver link's live ones, ``keep_up``'s replayed ones)."""
        if self.finished:
            return
        if d.first_token_index > self.num_tokens or d.text_offset > self.text_len:
            self.behind = True  # something before this delta never arrived
            return
        self.last_activity = time.monotonic()
        text = d.text[max(0, self.text_len - d.text_offset):] if d.text_offset + len(d.text) > self.text_len else ""
        skip = max(0, self.num_tokens - d.first_token_index)
        tokens, logprobs = d.token_ids[skip:], d.logprobs[skip:]
        if not (text or tokens or d.finish_reason):
            return
        out = ClientDelta(self.client_id, text=text, token_ids=tokens, first_token_index=self.num_tokens,
                          logprobs=logprobs, finish_reason=d.finish_reason)
        self.text_len += len(text)
        self.num_tokens += len(tokens)
        if d.finish_reason is not None:
            self.finished = True
            out.prompt_tokens, out.completion_tokens = d.prompt_tokens, d.completion_tokens
        self._queue.append(out)
        self._held += len(tokens)
        if self.ready:
            self.wake()

    @property
    def ready(self) -> bool:
        """Whether a message is due to the client: something is queued and, with an ``interval``, it is the first
        message, the finish, or at least ``interval`` tokens."""
        if not self._queue:
            return False
        return (self.interval <= 1 or self._held >= self.interval or not self._sent
                or self._queue[-1].finish_reason is not None)

    def due(self, now: float) -> bool:
        """Whether ``Frontend.keep_up`` has work now (a replay, or a look at Redis), without I/O."""
        if self.finished:
            return False
        return self.behind or (now - self.last_activity >= STALL_SECONDS and now - self.last_check >= STALL_SECONDS)

    def take(self) -> ClientDelta | None:
        """The next delta, merged with those already queued behind it (a frontend that fell behind by a
        few steps sends its client one message, not one per token); None when no message is due (``ready``)."""
        if not self.ready:
            return None
        self._held, self._sent = 0, True
        out = self._queue.popleft()
        while out.finish_reason is None and self._queue:
            more = self._queue.popleft()
            out = ClientDelta(out.request_id, text=out.text + more.text, token_ids=out.token_ids + more.token_ids,
                              first_token_index=out.first_token_index, logprobs=out.logprobs + more.logprobs,
                              finish_reason=more.finish_reason, prompt_tokens=more.prompt_tokens,
                              completion_tokens=more.completion_tokens)
        return out


class Frontend:
    def __init__(self, tokenizer: ModelTokenizer, store: AsyncRequestStore, limits: Limits, address: str,
                 submit: Callable[[RequestRecord], Awaitable[None]], abort: Callable[[str], Awaitable[bool]],
                 replay: Callable[[str, str], Awaitable[list[Delta]]],
                 route: Callable[[list[int], str], Awaitable[str]] | None = None, shared_prefix_cache: bool = False,
                 stream_interval: int = 1):
        """``address``: where the detokenizer reaches this frontend's internal service; ``submit(record)`` hands a
        recorded request to its engine (it may change ``record.engine`` for a retry when that engine is gone);
        ``replay(request_id, address)``: the detokenizer's deltas of the request so far, rebuilt from Redis;
        ``route(prompt_ids, cache_scope)``: the engine a new request goes to. Each is a coroutine function.
        ``shared_prefix_cache``: every API key reuses every other's cached prefixes (a trusted deployment); else
        each key has its own. ``stream_interval``: each stream's ``ClientStream.interval``."""
        self.shared_prefix_cache = shared_prefix_cache
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.store = store
        self.limits = limits
        self.address = address
        self.submit = submit
        self.route = route or _no_route
        self.abort_at_scheduler = abort
        self.replay = replay
        self.on_stalled: Callable[[], None] = lambda: None  # counted by the server
        self.defaults = SamplingDefaults()  # for sampling fields a request leaves unset (the model's own)
        self.streams: dict[str, ClientStream] = {}
        self._tasks: set[asyncio.Task] = set()  # work that outlives its caller: aborts retried, openings finished
        self._ticker: asyncio.Task | None = None

    def render(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """The prompt text (chat rendered with the model's template) and its token ids."""
        check_size(inp, self.limits)  # every route that tokenizes comes here: its cost is bounded first
        if inp.messages is not None:
            if not self.tokenizer.chat_template:
                raise InvalidArgument("this model has no chat template; send a prompt instead", field="chat")
            text = self.tokenizer.apply_chat_template(inp.messages, inp.add_generation_prompt, inp.tools)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if inp.prompt_ids is not None:
            return self.tokenizer.decode(inp.prompt_ids), list(inp.prompt_ids)
        return inp.prompt, self.tokenizer.encode(inp.prompt, add_special_tokens=inp.add_special_tokens)

    async def tokenize(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """``render`` on a thread: a long prompt's tokenizing must not hold up every other stream's tokens. A short
        plain prompt is tokenized here: the hop to a thread and back costs more (~145 against ~30 us of CPU for 135
        characters on a 2-core Zen 4)."""
        if inp.messages is None and inp.prompt is not None and len(inp.prompt) <= INLINE_PROMPT_CHARS:
            return self.render(inp)
        return await asyncio.to_thread(self.render, inp)

    async def open(self, inp: GenerateInput, owner: str = "", submit_timeout: float = 60.0) -> ClientStream:
        """Check, tokenize, record in Redis, submit; returns the stream the deltas will arrive on. A caller that
        goes away meanwhile leaves the opening to finish, and its stream is then closed (the request aborted):
        a request half recorded or submitted is never left behind."""
        return await self._finished_even_if_left(self._open(inp, owner, submit_timeout))

    async def _open(self, inp: GenerateInput, owner: str, submit_timeout: float) -> ClientStream:
        check_input(inp, self.limits)
        prompt_ids = list(inp.prompt_ids) if inp.prompt_ids is not None else (await self.tokenize(inp))[1]
        params = build_params(inp, len(prompt_ids), self.limits, self.defaults,
                              cache_scope(owner, inp.cache_salt, self.shared_prefix_cache))
        request_id = new_request_key()  # the client's id is only its name (see conveyor.state)
        engine = await _with_redis(lambda: self.route(prompt_ids, params.cache_scope), "choosing an engine")
        record = RequestRecord(request_id, prompt_ids, params, frontend=self.address, owner=owner,
                               client_id=inp.request_id, engine=engine)
        stream = ClientStream(request_id, len(prompt_ids), client_id=record.client_id, interval=self.stream_interval)
        stream.scores_prompt = params.sampling.prompt_logprobs is not None
        stream.prompt_ids = prompt_ids if stream.scores_prompt else []  # kept only to echo them with their scores
        self.streams[request_id] = stream
        try:
            if not await _with_redis(lambda: self.store.create(record), "recording the request"):
                raise AlreadyExists(f"request_id {record.client_id!r} is already in use by this API key (in flight, "
                                    "or finished less than --finished-ttl ago)")
            await self._submit(record, submit_timeout)
        except BaseException:
            self.streams.pop(request_id, None)
            raise
        return stream

    async def _finished_even_if_left(self, opening: Coroutine) -> ClientStream:
        task = self._background(opening)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def close(done: asyncio.Task) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.close(done.result().request_id, done.result())
            task.add_done_callback(close)
            raise

    def tick(self) -> None:
        """Make sure the ticker runs while streams are open: every ``POLL_SECONDS`` it wakes each one (one that
        waits then looks at ``keep_up`` and at its deadline). One timer for every stream rather than a timeout
        around each wait, which cost about a tenth of the frontend's CPU per token at 128 streams."""
        if self._ticker is None or self._ticker.done():
            self._ticker = self._background(self._ticks())

    async def _ticks(self) -> None:
        while self.streams:
            await asyncio.sleep(POLL_SECONDS)
            for stream in list(self.streams.values()):
                stream.wake()

    def _background(self, work: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return task

    async def _submit(self, record: RequestRecord, timeout: float) -> None:
        """Submit, retrying while the scheduler is unavailable (it may be restarting: a restarted
        scheduler also finds the request in Redis). A refusal removes the record again."""
        try:
            await _retry(lambda: self.submit(record), Unavailable, timeout)
        except ConveyorError:
            await self.store.discard(record)
            raise

    def deliver(self, deltas: list[Delta]) -> list[str]:
        """Hand deltas to their streams; returns ids this frontend holds no stream for."""
        unknown = []
        for d in deltas:
            stream = self.streams.get(d.request_id)
            if stream is None:
                unknown.append(d.request_id)
            else:
                stream.offer(d)
        return unknown

    def close(self, request_id: str, stream: ClientStream | None = None) -> None:
        """The client's call ended (finished, cancelled, disconnected or timed out): an unfinished request is
        aborted, in the background. ``stream``: only if it is still this one (a client may have resumed the
        request on a new stream meanwhile)."""
        if stream is not None and self.streams.get(request_id) is not stream:
            return
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._background(self._abort_until_done(request_id))

    async def _abort_until_done(self, request_id: str, give_up_after: float = 60.0) -> None:
        """Abort at the scheduler, retrying for a while: it may be restarting."""
        try:
            await _retry(lambda: self.abort_at_scheduler(request_id), ConveyorError, give_up_after, 0.2, 2.0)
        except ConveyorError as exc:
            log.warning("gave up aborting %s: %s", request_id, exc)

    async def abort(self, client_id: str, owner: str = "") -> bool:
        """The public Abort: the stream (here or on another frontend) ends with finish_reason abort.
        Ids are the owner's: another key's request of the same name is not this one."""
        record = await _with_redis(lambda: self.store.find(client_id, owner), "reading the request")
        if record is None:
            return False
        return await self.abort_at_scheduler(record.request_id)

    async def resume(self, client_id: str, token_index: int, text_offset: int, owner: str = "") -> ClientStream:
        """Continue a request's stream here (its frontend died, or the client's connection broke) from
        what the client already has; the detokenizer delivers to this frontend from now on. Only the
        owner can resume, so only the owner moves delivery."""
        return await self._finished_even_if_left(self._resume(client_id, token_index, text_offset, owner))

    async def _resume(self, client_id: str, token_index: int, text_offset: int, owner: str) -> ClientStream:
        record = await _with_redis(lambda: self.store.find(client_id, owner), "reading the request")
        if record is None:
            raise NotFound(f"request_id {client_id!r}: no such request (unknown, another key's, or finished "
                           "and expired)")
        if token_index > len(record.output_ids):
            raise InvalidArgument(f"token_index must be at most the {len(record.output_ids)} tokens generated so "
                                  f"far, got {token_index}")
        request_id = record.request_id
        stream = ClientStream(request_id, len(record.prompt_ids), token_index, text_offset, client_id,
                              self.stream_interval)
        stream.scores_prompt = record.params.sampling.prompt_logprobs is not None
        stream.prompt_ids = record.prompt_ids if stream.scores_prompt else []
        self.streams[request_id] = stream  # replaces a stream whose client went away unnoticed
        if not await _with_redis(lambda: self.store.set_frontend(request_id, self.address), "claiming the request"):
            self.streams.pop(request_id, None)
            raise NotFound(f"request_id {client_id!r}: its record expired just now")
        stream.behind = True
        await self.keep_up(stream, claim=True)
        return stream

    async def cached_tokens(self, stream: ClientStream) -> int:
        """Prompt tokens of the request the prefix cache held (recorded by the scheduler at admission)."""
        return await _with_redis(lambda: self.store.cached_tokens(stream.request_id), "reading the request's usage")

    async def prompt_logprobs(self, stream: ClientStream) -> list:
        """The request's scored prompt: the scheduler wrote it to Redis with the first token, before that
        token was published."""
        scored = await _with_redis(lambda: self.store.prompt_logprobs(stream.request_id), "reading the prompt's logprobs")
        return scored or []

    async def failure(self, stream: ClientStream) -> str:
        """Why the server ended a request with finish_reason "error" (recorded in Redis)."""
        record = await _with_redis(lambda: self.store.get(stream.request_id), "reading the request")
        return (record.error if record is not None else None) or "the server could not compute this request"

    async def keep_up(self, stream: ClientStream, claim: bool = False) -> None:
        """Called while a stream waits: replay it from Redis when it is behind (see the module doc).
        ``claim``: deliver to this frontend from now on (a client resumed here); a stream that is merely
        behind never moves delivery (it may be a stale one whose client resumed elsewhere)."""
        now = time.monotonic()
        if not stream.due(now):
            return
        if not stream.behind:
            stream.last_check = now
            try:
                progress = await self.store.progress(stream.request_id)
            except REDIS_DOWN:
                return  # Redis is restarting; look again later
            suspect, stream.suspect = stream.suspect, None
            if progress is None or (progress[0] <= stream.num_tokens and not progress[1]):
                return
            if suspect is None or not (stream.num_tokens < suspect[0] or suspect[1]):
                stream.suspect = progress  # ahead now: maybe only in flight; replay if still so next time
                return
            self.on_stalled()
        stream.behind = False  # a live delta dropped while the replay is in flight sets it again
        try:
            deltas = await self.replay(stream.request_id, self.address if claim else "")
        except ConveyorError as exc:
            log.warning("replay of %s failed (%s); trying again", stream.request_id, exc)
            stream.behind = True
            return
        for d in deltas:  # one go on the loop: no live delta lands in the middle
            stream.offer(d)


async def _no_route(prompt_ids: list[int], scope: str) -> str:
    return ""


async def _retry(call: Callable[[], Awaitable], retry_on, timeout: float, delay: float = 0.05, max_delay: float = 1.0):
    """``await call()``, again after a doubling delay while it raises ``retry_on``; once ``timeout`` seconds
    have passed, the last error propagates."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except retry_on:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


async def _with_redis(call: Callable[[], Awaitable], what: str, timeout: float = 10.0):
    """``await call()``, retried while Redis is unreachable (it may be restarting); then UNAVAILABLE. Any other
    Redis error is about this request alone: INTERNAL for this call, and nothing else is affected."""
    try:
        return await _retry(call, REDIS_DOWN, timeout)
    except REDIS_DOWN as exc:
        raise Unavailable(f"Redis is unreachable ({what}): {exc}") from exc
    except RedisError as exc:
        raise ConveyorError(f"Redis refused {what}: {exc}") from exc
