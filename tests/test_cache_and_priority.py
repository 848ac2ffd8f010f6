"""The prefix cache and priorities end to end: real processes, the real model.

The prefix cache: Greedy outputs of requests that share
prefixes (block-aligned and not, whole prompts, a prompt that is another's prefix) equal what the
worker computes for each alone without any cache; also under preemption, with the cache off, and
after the worker restarted (its cache is gone: a scheduler that kept handing out cached blocks
would feed the model uninitialized KV).

Priorities: a high-priority request sent behind a burst of low-priority ones is admitted at once
(making room by preempting the newest low one), and the priority is carried in Redis."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import KV_BLOCK_BYTES, TinyScheduler, make_runner, scheduler_stats, start_stack, supervised_stack, wait_child

from conveyor.client import Client
from conveyor.state import RequestStore

BLOCK = 16  # the stack's block size (conveyor up's default)
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp "
        "and a notebook in which he recorded the colour of the sea, the shape of the clouds, and the names of "
        "the ships that passed the rocky headland. In winter the storms were so fierce that the whole tower "
        "shook, and the keeper would sit by the great lens listening to the wind until morning came. His "
        "daughter, who lived in the village below, brought him bread and letters twice a week, and on calm "
        "days they fished together from the jetty and talked about the cities she hoped to see one day.")
QUESTIONS = [" What did he write down?", " Why did the tower shake?", " Describe the lamp.", " Who was he?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tok(default_model):
    return default_model.tokenizer


@pytest.fixture(scope="module")
def base(tok) -> list[int]:
    ids = tok.encode(TEXT)
    assert len(ids) > 110
    return ids


def _alone(default_model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens the worker computes for each prompt alone, from scratch (no cache of any kind)."""
    tokens, _ = TinyScheduler(make_runner(default_model)).run(prompts, max_tokens, together=False)
    return tokens


def _generate(client: Client, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = pool.map(lambda p: client.generate(prompt_ids=p, temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True), prompts)
        return [c.token_ids for c in done]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with supervised_stack(tmp_path_factory.mktemp("prefix"), kv_cache_bytes=128 << 20) as s:
        yield s


def test_requests_sharing_prefixes_reuse_the_cache_and_give_the_outputs_of_each_alone(stack, tok, base, default_model):
    q = [tok.encode(text, add_special_tokens=False) for text in QUESTIONS]
    shared = {  # prompt -> tokens it shares with ``base`` from the start
        "aligned a": (base[:32] + q[0], 32), "aligned b": (base[:32] + q[1], 32),
        "unaligned a": (base[:37] + q[0], 37), "unaligned b": (base[:37] + q[2], 37),
        "long": (base[:100] + q[3], 100),
        "the same prompt": (list(base), len(base)),
        "a cached prefix itself": (base[:64], 64),
    }
    prompts = [p for p, _ in shared.values()]
    expected = _alone(default_model, [base, *prompts], MAX_TOKENS)
    with Client(stack.endpoint, timeout=300) as client:
        before = scheduler_stats(stack)
        assert _generate(client, [base], MAX_TOKENS) == expected[:1]  # fills the cache
        middle = scheduler_stats(stack)
        got = _generate(client, prompts, MAX_TOKENS)  # all at once
        after = scheduler_stats(stack)
    for name, g, e in zip(shared, got, expected[1:]):
        assert g == e, name
    assert middle.prefix_cache_queries - before.prefix_cache_queries == len(base)
    # whole blocks of the shared part, never a prompt's last token (it is computed to sample after it)
    want = sum((min(n, len(p) - 1) // BLOCK) * BLOCK for p, n in shared.values())
    assert after.prefix_cache_hits - middle.prefix_cache_hits == want
    assert after.prefix_cache_queries - middle.prefix_cache_queries == sum(len(p) for p in prompts)


def test_a_restarted_worker_empties_the_cache(stack, tok, base, default_model):
    prompt = base[:80] + tok.encode(" What happened next?", add_special_tokens=False)
    (expected,) = _alone(default_model, [prompt], MAX_TOKENS)
    with Client(stack.endpoint, timeout=300) as client:
        assert _generate(client, [base], MAX_TOKENS)  # the cache holds base's blocks
        assert scheduler_stats(stack).cached_blocks >= len(base) // BLOCK
        worker = stack.child("worker")
        os.kill(worker.process.pid, signal.SIGKILL)
        time.sleep(1.0)  # the supervisor restarts it after 0.5 s
        wait_child(stack, worker)
        assert _generate(client, [prompt], MAX_TOKENS) == [expected]
    # the cache was emptied: only what this request computed since is in it
    assert scheduler_stats(stack).cached_blocks <= (len(prompt) + MAX_TOKENS) // BLOCK


PREEMPT_TOKENS = 40


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache on", "cache off"])
def test_under_preemption_outputs_are_those_of_each_alone(tmp_path_factory, tok, base, default_model, prefix_cache):
    prompts = [base[:40] + tok.encode(f" Question {i}: what colour was the sea?", add_special_tokens=False)
               for i in range(6)]
    expected = _alone(default_model, prompts, PREEMPT_TOKENS)
    # 14 blocks of 16 tokens: each request needs 4-6, so two or three run at a time and the newest is preempted
    small = start_stack(tmp_path_factory.mktemp("prefix-small"), kv_cache_bytes=14 * KV_BLOCK_BYTES, prefix_cache=prefix_cache)
    try:
        with Client(small.endpoint, timeout=600) as client:
            got = _generate(client, prompts, PREEMPT_TOKENS)
        stats = scheduler_stats(small)
    finally:
        small.stop()
    assert stats.num_blocks == 14 and stats.preemptions > 0
    assert got == expected
    if prefix_cache:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == stats.prefix_cache_queries == stats.cached_blocks == 0


def test_a_high_priority_request_overtakes_a_burst_of_low_priority_ones(tmp_path_factory):
    small = start_stack(tmp_path_factory.mktemp("priority"), max_num_seqs=2)
    try:
        with Client(small.endpoint, timeout=300) as client:
            lows = [client.stream("Tell me a long story about the sea.", temperature=0, max_tokens=80, ignore_eos=True,
                                  priority=10, request_id=f"low-{i}") for i in range(6)]
            deadline = time.monotonic() + 60
            while ((stats := scheduler_stats(small)).running, stats.waiting) != (2, 4) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (stats.running, stats.waiting) == (2, 4)
            high = client.generate("Say hello.", temperature=0, max_tokens=4, ignore_eos=True, priority=-5)
            at_high_end = scheduler_stats(small)
            lows_done = [list(stream) for stream in lows]
            record = RequestStore.from_url(small.redis_url).find("low-3")
            http = httpx.post(f"{small.http_endpoint}/v1/completions", timeout=30,
                              json={"prompt": "Hi", "max_tokens": 2, "priority": 2_000_000})
    finally:
        small.stop()
    assert high.completion_tokens == 4
    # it was admitted by preempting a running low one, before any of the four waiting got a token
    assert at_high_end.preemptions >= 1
    untouched = [r for r in at_high_end.requests if r.client_id.startswith("low-") and r.num_output_tokens == 0]
    assert len(untouched) >= 4
    assert all(d[-1].completion_tokens == 80 for d in lows_done)  # and the burst finished afterwards
    assert record.params.priority == 10
    assert http.status_code == 400 and http.json()["error"]["param"] == "priority"
