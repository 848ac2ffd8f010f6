"""The frontend's per-client stream (``ClientStream``): what reaches the client of the deltas offered."""

from __future__ import annotations

from conveyor.messages import Delta
from tokenizer_svc.frontend import ClientStream


def test_deltas_queued_behind_one_go_out_as_one_message():
    stream = ClientStream("key", prompt_tokens=4, client_id="mine")
    woken = []
    stream.wake = lambda: woken.append(1)
    stream.offer(Delta("key", 0, "Hel", 0, [10], [-0.1]))
    stream.offer(Delta("key", 3, "lo", 1, [11], [-0.2]))
    stream.offer(Delta("key", 5, "!", 2, [12], [-0.3], finish_reason="stop", prompt_tokens=4, completion_tokens=3))
    stream.offer(Delta("key", 6, "late", 3, [13]))  # after the finish: never sent
    merged = stream.take()
    assert (merged.request_id, merged.text, merged.token_ids, merged.first_token_index) == ("mine", "Hello!", [10, 11, 12], 0)
    assert merged.logprobs == [-0.1, -0.2, -0.3]
    assert (merged.finish_reason, merged.prompt_tokens, merged.completion_tokens) == ("stop", 4, 3)
    assert stream.take() is None
    assert len(woken) == 3  # once per delta queued (the one after the finish is dropped)


def test_a_merged_delta_stops_at_the_finish_and_later_ones_wait():
    stream = ClientStream("key", prompt_tokens=1)
    stream.offer(Delta("key", 0, "a", 0, [1]))
    assert stream.take().token_ids == [1]
    stream.offer(Delta("key", 1, "b", 1, [2]))
    stream.offer(Delta("key", 2, "c", 2, [3]))
    second = stream.take()
    assert (second.text, second.token_ids, second.first_token_index, second.finish_reason) == ("bc", [2, 3], 1, None)
