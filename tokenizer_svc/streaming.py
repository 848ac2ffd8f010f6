"""Following a client stream on the event loop, for every public API of the frontend (gRPC and HTTP).

``follow`` yields a request's deltas as the detokenizer delivers them, without a thread per stream:
The deliver link (on the same loop) wakes the stream's coroutine, the frontend's tick wakes it every ``POLL_SECONDS``
to look at Redis and its deadline, and a replay is offered by the coroutine itself once it is back, so a stream is
only ever changed on the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from conveyor.errors import ConveyorError, DeadlineExceeded
from conveyor.metrics import Metrics
from tokenizer_svc.frontend import ClientDelta, ClientStream, Frontend


class RequestTimer:
    """The client-side latencies of one request, recorded into the frontend's metrics."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.arrival = time.perf_counter()
        self.first: float | None = None
        self.last = self.arrival
        self.tokens = 0

    def sent(self, delta: ClientDelta) -> None:
        now, k = time.perf_counter(), len(delta.token_ids)
        if k:
            if self.first is None:  # the first token's latency is the TTFT; any others came with it
                self.first = now
                self.m.time_to_first_token_seconds.observe(now - self.arrival)
                count, gap = k - 1, 0.0
            else:
                count, gap = k, now - self.last
            for _ in range(count):
                self.m.inter_token_latency_seconds.observe(gap / count)
            self.m.generation_tokens.inc(k)
            self.tokens += len(delta.token_ids)
            self.last = now
        if delta.finish_reason is not None:
            self.finished(delta.finish_reason, delta.prompt_tokens)

    def finished(self, reason: str, prompt_tokens: int) -> None:
        e2e = time.perf_counter() - self.arrival
        self.m.e2e_request_latency_seconds.observe(e2e)
        self.m.requests.labels(finish_reason=reason).inc()
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.request_prompt_tokens.observe(prompt_tokens)
        self.m.request_generation_tokens.observe(self.tokens)
        if self.first is not None and self.tokens > 1:
            self.m.time_per_output_token_seconds.observe((e2e - (self.first - self.arrival)) / (self.tokens - 1))


class Wake:
    """What ``ClientStream.wake`` calls: wakes the one coroutine that waits, or is remembered until it next waits.
    An ``asyncio.Event`` does the same with a list of waiters and a look-up of the loop per wait (~5 % of the
    frontend's CPU a token at 128 streams)."""

    __slots__ = ("future", "woken")

    def __init__(self):
        self.future: asyncio.Future | None = None
        self.woken = False

    def __call__(self) -> None:
        future = self.future
        if future is None:
            self.woken = True
        elif not future.done():
            future.set_result(None)

    async def wait(self) -> None:
        if self.woken:
            self.woken = False
            return
        self.future = asyncio.get_running_loop().create_future()
        try:
            await self.future
        finally:
            self.future = None


async def follow(stream: ClientStream, frontend: Frontend, timer: RequestTimer, metrics: Metrics,
                 timeout: float = 0.0) -> AsyncIterator[ClientDelta]:
    """A stream's deltas until it finishes. The caller stops iterating (or is cancelled) when its client
    goes away: ``finally`` then closes the stream, which aborts the request. Raises ``DeadlineExceeded``
    after ``timeout`` seconds (0: none), and ``ConveyorError`` with the reason when the request failed."""
    ready = Wake()
    stream.wake = ready  # every delta is offered on this loop (the deliver link's, or the replays keep_up offers)
    metrics.client_streams.inc()
    deadline = time.monotonic() + timeout if timeout else None
    ended = False
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                ended = True
                timer.finished("abort", stream.prompt_tokens)
                raise DeadlineExceeded(f"the request ran longer than {timeout:g} s (--request-timeout)")
            ready.woken = False
            delta = stream.take()
            if delta is None:
                frontend.tick()
                await ready.wait()  # a message due, or the frontend's tick
                if not stream.ready:
                    await frontend.keep_up(stream)
                continue
            if delta.finish_reason == "error":  # the request could not be computed: say why
                ended = True
                timer.finished("error", stream.prompt_tokens)
                why = await frontend.failure(stream)
                raise ConveyorError(f"request_id {stream.client_id!r} failed: {why}")
            if stream.scores_prompt and delta.first_token_index == 0 and delta.token_ids:
                delta.prompt_logprobs = await frontend.prompt_logprobs(stream)
            yield delta
            timer.sent(delta)
            if delta.finish_reason is not None:
                ended = True
                return
    finally:
        if not ended:  # cancelled, disconnected or past the client's own deadline
            timer.finished("abort", stream.prompt_tokens)
        stream.wake = lambda: None
        metrics.client_streams.dec()
        frontend.close(stream.request_id, stream)
