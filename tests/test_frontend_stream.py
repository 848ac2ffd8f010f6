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


def test_with_an_interval_the_first_token_goes_at_once_then_every_interval_tokens_and_the_finish():
    stream = ClientStream("key", prompt_tokens=1, interval=3)
    woken = []
    stream.wake = lambda: woken.append(1)

    def offer(i: int, finish: str | None = None) -> None:
        stream.offer(Delta("key", i, text=chr(97 + i), first_token_index=i, token_ids=[i], finish_reason=finish))

    offer(0)
    assert stream.take().token_ids == [0] and len(woken) == 1  # the time to first token is not held back
    offer(1)
    offer(2)
    assert stream.take() is None and len(woken) == 1  # two of three: held, the follower not woken
    offer(3)
    third = stream.take()
    assert (third.text, third.token_ids, third.first_token_index, len(woken)) == ("bcd", [1, 2, 3], 1, 2)
    offer(4)
    assert stream.take() is None
    offer(5, finish="length")
    last = stream.take()
    assert (last.token_ids, last.finish_reason, len(woken)) == ([4, 5], "length", 3)  # the finish is not held


def _follow_with_replays(replies, live):
    """Follow a stream that is behind (its first delta, "Hel", arrived; the rest went missing), on a frontend
    whose replays answer ``replies`` in turn. ``live(frontend)`` runs beside it: the detokenizer's live
    deliveries. Returns what the client got."""
    import asyncio

    from conveyor.metrics import Metrics
    from tokenizer_svc.frontend import Frontend
    from tokenizer_svc.streaming import RequestTimer, follow

    async def run():
        asked, delivered = asyncio.Event(), asyncio.Event()
        answers = iter(replies)

        async def replay(request_id, address):  # the detokenizer's replay: in flight until live delivery ran
            asked.set()
            await delivered.wait()
            return next(answers)

        frontend = Frontend(None, None, None, "fe:1", submit=None, abort=None, replay=replay)
        stream = ClientStream("key", prompt_tokens=3)
        frontend.streams["key"] = stream
        frontend.deliver([Delta("key", 0, text="Hel", first_token_index=0, token_ids=[10])])
        stream.behind = True  # a delta went missing: the next keep_up replays

        async def deliverer():
            await asked.wait()
            live(frontend)
            delivered.set()

        task = asyncio.create_task(deliverer())
        metrics = Metrics("frontend")
        got = [d async for d in follow(stream, frontend, RequestTimer(metrics), metrics)]
        await task
        return got

    return asyncio.run(run())


def test_a_replay_overlapping_live_delivery_reaches_the_client_exactly_once():
    """A stream behind Redis asks for a replay; while the replay is in flight the deliver link hands it the next live
    delta. The client gets every character and token exactly once, in order."""
    everything = [Delta("key", 0, text="Hello", first_token_index=0, token_ids=[10, 11]),
                  Delta("key", 5, text=" world", first_token_index=2, token_ids=[12], finish_reason="stop",
                        prompt_tokens=3, completion_tokens=3)]
    got = _follow_with_replays([everything], lambda f: f.deliver([Delta("key", 3, text="lo", first_token_index=1,
                                                                        token_ids=[11])]))
    assert "".join(d.text for d in got) == "Hello world"
    assert [t for d in got for t in d.token_ids] == [10, 11, 12]
    assert [d.first_token_index for d in got] == sorted(d.first_token_index for d in got)
    assert got[-1].finish_reason == "stop"


def test_a_live_delta_dropped_while_a_replay_is_in_flight_is_replayed_next():
    """The replay was read from Redis before the live delta's tokens were written: that delta, arriving while
    the replay travels, starts past what the client has and is dropped. The stream stays behind and replays
    again at its next poll (it does not wait out the stall check), and the client gets everything exactly once."""
    first = [Delta("key", 0, text="Hello", first_token_index=0, token_ids=[10, 11])]
    second = [*first, Delta("key", 5, text=" world", first_token_index=2, token_ids=[12], finish_reason="stop",
                            prompt_tokens=3, completion_tokens=3)]
    got = _follow_with_replays([first, second], lambda f: f.deliver([Delta(
        "key", 5, text=" world", first_token_index=2, token_ids=[12], finish_reason="stop", prompt_tokens=3,
        completion_tokens=3)]))
    assert "".join(d.text for d in got) == "Hello world"
    assert [t for d in got for t in d.token_ids] == [10, 11, 12]
    assert got[-1].finish_reason == "stop"


def test_submits_that_arrive_while_one_is_in_flight_go_together_and_each_gets_its_own_answer():
    """The frontend's submits to a scheduler (``Batched``): the first goes at once, alone; the three that arrive
    while it is in flight go in one call; a refusal reaches only its own caller; a call that fails fails each of
    its items."""
    import asyncio

    from conveyor.errors import InvalidArgument, Unavailable
    from tokenizer_svc.server import Batched

    async def run():
        calls, release = [], asyncio.Event()

        async def send(ids):
            calls.append(list(ids))
            await release.wait()
            if "down" in ids:
                raise Unavailable("the scheduler is restarting")
            return [InvalidArgument("bad data") if i == "bad" else None for i in ids]

        batched = Batched(send)
        first = asyncio.ensure_future(batched("a"))
        await asyncio.sleep(0)  # its call is in flight
        rest = [asyncio.ensure_future(batched(i)) for i in ("b", "bad", "c")]
        await asyncio.sleep(0)
        release.set()
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        failed = await asyncio.gather(batched("down"), batched("x"), return_exceptions=True)
        return calls, answers, failed

    calls, answers, failed = asyncio.run(run())
    assert calls[:2] == [["a"], ["b", "bad", "c"]]
    assert answers[0] is None and answers[1] is None and answers[3] is None
    assert isinstance(answers[2], InvalidArgument)
    assert all(isinstance(f, Unavailable) for f in failed) and ["down", "x"] in calls
