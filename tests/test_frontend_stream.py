"""The frontend's per-client stream (``ClientStream``): what reaches the client of the deltas offered."""

from __future__ import annotations

from conveyor.messages import Delta
from tokenizer_svc.frontend import ClientStream


def test_deltas_queued_behind_one_go_out_as_one_message():
    stream = ClientStream("key", prompt_tokens=4, client_id="mine")
    woken = []
    stream.wake = lambda: woken.append(1)
    stream.offer(Delta("key", 0, text="Hel", first_token_index=0, token_ids=[10], logprobs=[-0.1]))
    stream.offer(Delta("key", 3, text="lo", first_token_index=1, token_ids=[11], logprobs=[-0.2]))
    stream.offer(Delta("key", 5, text="!", first_token_index=2, token_ids=[12], logprobs=[-0.3], finish_reason="stop",
                       prompt_tokens=4, completion_tokens=3))
    stream.offer(Delta("key", 6, text="late", first_token_index=3, token_ids=[13]))  # after the finish: never sent
    merged = stream.take()
    assert (merged.request_id, merged.text, merged.token_ids, merged.first_token_index) == ("mine", "Hello!", [10, 11, 12], 0)
    assert merged.logprobs == [-0.1, -0.2, -0.3]
    assert (merged.finish_reason, merged.prompt_tokens, merged.completion_tokens) == ("stop", 4, 3)
    assert stream.take() is None
    assert len(woken) == 3  # once per delta queued (the one after the finish is dropped)


def test_a_merged_delta_stops_at_the_finish_and_later_ones_wait():
    stream = ClientStream("key", prompt_tokens=1)
    stream.offer(Delta("key", 0, text="a", first_token_index=0, token_ids=[1]))
    assert stream.take().token_ids == [1]
    stream.offer(Delta("key", 1, text="b", first_token_index=1, token_ids=[2]))
    stream.offer(Delta("key", 2, text="c", first_token_index=2, token_ids=[3]))
    second = stream.take()
    assert (second.text, second.token_ids, second.first_token_index, second.finish_reason) == ("bc", [2, 3], 1, None)


class _SlowDelta(Delta):
    """A replayed delta that takes its time to be read: its second read of ``first_token_index`` (in the middle
    of ``offer``, after the stream's counters were read) waits until live delivery had its chance to run."""

    def __init__(self, *args, reading, go, **kwargs):
        super().__init__(*args, **kwargs)
        self._reading, self._go, self._reads = reading, go, 0

    def __getattribute__(self, name):
        if name == "first_token_index":
            self._reads += 1
            if self._reads == 2:
                self._reading.set()
                self._go.wait(0.5)
        return super().__getattribute__(name)


def test_a_replay_overlapping_live_delivery_reaches_the_client_exactly_once():
    """A stream behind Redis asks for a replay (fetched on the pool) while Deliver keeps handing it live
    deltas on the loop: the client gets every character and token exactly once, in order. (When the replay
    was offered from the pool thread, a live delta landing in the middle of it was sent twice.)"""
    import asyncio
    import threading

    from conveyor.metrics import Metrics
    from tokenizer_svc.frontend import Frontend
    from tokenizer_svc.streaming import Blocking, RequestTimer, follow

    reading, go = threading.Event(), threading.Event()

    def replay(request_id, address):  # the detokenizer's replay from Redis: everything so far, and the end
        return [_SlowDelta("key", 0, text="Hello", first_token_index=0, token_ids=[10, 11], reading=reading, go=go),
                Delta("key", 5, text=" world", first_token_index=2, token_ids=[12], finish_reason="stop",
                      prompt_tokens=3, completion_tokens=3)]

    frontend = Frontend(None, None, None, "fe:1", submit=None, abort=lambda rid: True, replay=replay)
    stream = ClientStream("key", prompt_tokens=3)
    frontend.streams["key"] = stream
    metrics = Metrics("frontend")

    async def run():
        frontend.deliver([Delta("key", 0, text="Hel", first_token_index=0, token_ids=[10])])
        stream.behind = True  # a delta went missing: the next keep_up replays

        async def live():  # the detokenizer's next live delta, arriving while the replay is being offered
            while not reading.is_set():
                await asyncio.sleep(0.001)
            frontend.deliver([Delta("key", 3, text="lo", first_token_index=1, token_ids=[11])])
            go.set()

        deliverer = asyncio.create_task(live())
        got = [d async for d in follow(stream, Blocking(frontend, threads=2), RequestTimer(metrics), metrics)]
        await deliverer
        return got

    got = asyncio.run(run())
    assert "".join(d.text for d in got) == "Hello world"
    assert [t for d in got for t in d.token_ids] == [10, 11, 12]
    assert [d.first_token_index for d in got] == sorted(d.first_token_index for d in got)
    assert got[-1].finish_reason == "stop"
