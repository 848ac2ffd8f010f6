"""The whole stack end to end, through the client SDK: real processes, a real redis-server, the real model."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import KV_BLOCK_BYTES, TinyScheduler, make_runner, start_stack

from conveyor.client import AsyncClient, Client
from conveyor.errors import AlreadyExists, DeadlineExceeded, InvalidArgument, ResourceExhausted
from conveyor.state import RequestStore
from conveyor.v1 import conveyor_pb2, scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "안녕하세요! 한국의 수도는 어디인가요?",
    "用中文介绍一下你自己。",
    "List three animals that live in the ocean.",
    "Explain what a CPU does in one sentence.",
    "Give me a fun fact with an emoji 🎉.",
    "What is 12 times 12?",
]
MAX_TOKENS = 40


def _up(tmp_path_factory, name: str, **overrides):
    return start_stack(tmp_path_factory.mktemp(name), **overrides)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = _up(tmp_path_factory, "main", kv_cache_bytes=256 << 20, finished_ttl=3.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.endpoint, timeout=300) as c:
        yield c


def _scheduler_stub(stack) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(stack.channel("scheduler"))


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def reference(default_model):
    """What the worker alone produces for each prompt (greedy), cut at the first eos like the server."""
    tok = default_model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(_chat(p)), add_special_tokens=False) for p in PROMPTS]
    tokens, _ = TinyScheduler(make_runner(default_model)).run(prompts, MAX_TOKENS, together=False)
    eos = set(tok.eos_token_ids)
    return [t[: next((i + 1 for i, x in enumerate(t) if x in eos), len(t))] for t in tokens]


def test_sixteen_concurrent_streams_return_the_worker_tokens(client, reference, default_model):
    jobs = [PROMPTS[i % 8] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: client.chat(_chat(p), temperature=0, max_tokens=MAX_TOKENS), jobs))
    for i, result in enumerate(results):
        expected = reference[i % 8]
        assert result.token_ids == expected, f"stream {i} ({jobs[i]!r})"
        assert result.text == default_model.tokenizer.decode(expected, skip_special_tokens=True)
        assert result.completion_tokens == len(expected)
        assert result.finish_reason == ("stop" if len(expected) < MAX_TOKENS else "length")


@pytest.mark.parametrize("prompt", PROMPTS[2:4] + ["Reply with three different emoji and nothing else."])
def test_deltas_are_whole_characters_contiguous_and_add_up(client, prompt):
    deltas = list(client.stream(messages=_chat(prompt), temperature=0.7, seed=3, max_tokens=60))
    assert deltas[-1].finish_reason in ("stop", "length")
    assert all("\ufffd" not in d.text for d in deltas[:-1])
    # only a stream cut by max_tokens in the middle of a character ends with its incomplete bytes shown
    assert "\ufffd" not in deltas[-1].text or deltas[-1].finish_reason == "length"
    index = 0
    for d in deltas:
        assert d.first_token_index == index
        index += len(d.token_ids)
    assert index == deltas[-1].completion_tokens
    whole = client.tokenize(messages=_chat(prompt))  # and the prompt count matches what the server saw
    assert deltas[-1].prompt_tokens == len(whole)
    assert "".join(d.text for d in deltas) == client.generate(messages=_chat(prompt), temperature=0.7, seed=3,
                                                              max_tokens=60).text


def test_stop_string_spanning_two_tokens_never_reaches_the_client(client, default_model):
    tok = default_model.tokenizer
    plain = client.chat(_chat(PROMPTS[4]), temperature=0, max_tokens=MAX_TOKENS)
    pieces = [tok.decode([t]) for t in plain.token_ids]
    # a stop string made of the end of one token and the start of the next (both with letters)
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i].strip()[-2:] + pieces[i + 1][:2]
    assert tok.decode(plain.token_ids[: i + 1]).find(stop) == -1, "the stop string must not fit in one token"
    deltas = list(client.stream(messages=_chat(PROMPTS[4]), temperature=0, max_tokens=MAX_TOKENS, stop=[stop]))
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert stop not in text and all(stop not in d.text for d in deltas)
    assert plain.text.startswith(text) and plain.text[len(text) :].startswith(stop)
    kept = client.chat(_chat(PROMPTS[4]), temperature=0, max_tokens=MAX_TOKENS, stop=[stop],
                       include_stop_str_in_output=True)
    assert kept.text == text + stop


def test_cancelling_a_stream_frees_its_blocks_within_a_step(stack, client):
    scheduler = _scheduler_stub(stack)
    stream = client.stream("Tell me a very long story about dragons.", max_tokens=400, ignore_eos=True)
    it = iter(stream)
    first = next(it)
    next(it)
    before = scheduler.Stats(scheduler_pb2.StatsRequest())
    held = {r.client_id: r.num_blocks for r in before.requests}
    assert held.get(first.request_id, 0) > 0
    stream.cancel()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = scheduler.Stats(scheduler_pb2.StatsRequest())
        if first.request_id not in {r.client_id for r in after.requests}:
            break
        time.sleep(0.01)
    assert first.request_id not in {r.client_id for r in after.requests}
    assert after.aborts == before.aborts + 1
    assert after.steps - before.steps <= 2  # the step in flight when the abort arrived, at most one more
    assert after.free_blocks >= before.free_blocks + held[first.request_id] - 1


def test_public_abort_ends_the_stream_with_abort(client):
    stream = client.stream("Count from one to a thousand.", max_tokens=400, ignore_eos=True, request_id="abort-me-1")
    it = iter(stream)
    next(it)
    assert client.abort("abort-me-1")
    last = list(it)[-1]
    assert last.finish_reason == "abort"
    assert not client.abort("abort-me-1")


def test_redis_records_the_documented_fields_and_they_expire(stack, client, default_model):
    store = RequestStore.from_url(stack.redis_url)
    rid = "redis-fields-1"
    stream = iter(client.stream(messages=_chat(PROMPTS[0]), temperature=0, max_tokens=30, request_id=rid))
    first = next(stream)
    key = store.lookup("", rid)  # the request's own key; the client's id is its name (no API keys here: owner "")
    live = {k.decode(): v.decode() for k, v in store.redis.hgetall(store.key(key)).items()}
    assert {"request_id", "client_id", "owner", "status", "prompt_ids", "params", "frontend", "arrival",
            "num_output"} <= set(live)
    assert live["client_id"] == rid and live["request_id"] == key != rid
    assert live["status"] in ("running", "waiting") and key in store.inflight()
    deltas = [first, *stream]
    record = store.get(key)
    assert record.status == "finished" and record.finish_reason == deltas[-1].finish_reason
    assert record.output_ids == [t for d in deltas for t in d.token_ids]
    assert record.num_output == deltas[-1].completion_tokens and record.first_token >= record.arrival
    assert record.finish >= record.first_token and record.params.stop.max_tokens == 30 and record.params.sampling.temperature == 0
    assert key not in store.inflight()
    assert 0 < store.ttl(key) <= 3.0 and 0 < store.redis.pttl(store.alias_key("", rid)) <= 3000
    time.sleep(3.2)
    assert not store.redis.exists(store.key(key), store.out_key(key), store.alias_key("", rid))


INVALID = {
    "no input": ({}, "input must be exactly one of prompt, prompt_ids or chat"),
    "empty prompt": ({"prompt": ""}, "prompt must not be empty"),
    "max_tokens 0": ({"prompt": "hi", "max_tokens": 0}, "stop.max_tokens must be >= 1"),
    "past max length": ({"prompt": "hi", "max_tokens": 10**6}, "exceeds the max model length"),
    "negative temperature": ({"prompt": "hi", "temperature": -0.5}, "sampling.temperature must be >= 0"),
    "NaN temperature": ({"prompt": "hi", "temperature": math.nan}, "sampling.temperature must be a finite number"),
    "top_p 0": ({"prompt": "hi", "top_p": 0.0}, "sampling.top_p must be in (0, 1]"),
    "top_p above 1": ({"prompt": "hi", "top_p": 1.5}, "sampling.top_p must be in (0, 1]"),
    "top_k -2": ({"prompt": "hi", "top_k": -2}, "sampling.top_k"),
    "min_p above 1": ({"prompt": "hi", "min_p": 1.5}, "sampling.min_p must be in [0, 1]"),
    "repetition 0": ({"prompt": "hi", "repetition_penalty": 0.0}, "sampling.repetition_penalty must be > 0"),
    "presence 3": ({"prompt": "hi", "presence_penalty": 3.0}, "sampling.presence_penalty must be in [-2, 2]"),
    "frequency -3": ({"prompt": "hi", "frequency_penalty": -3.0}, "sampling.frequency_penalty must be in [-2, 2]"),
    "too many stops": ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "at most 16 are allowed"),
    "empty stop": ({"prompt": "hi", "stop": ["ok", ""]}, "stop.stop[1] must not be empty"),
    "min above max": ({"prompt": "hi", "max_tokens": 5, "min_tokens": 6}, "stop.min_tokens"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "chat.messages[0].role must be one of"),
    "logprobs 50": ({"prompt": "hi", "logprobs": 50}, "sampling.logprobs must be at most 20"),
    "bias token": ({"prompt": "hi", "logit_bias": {10**6: 1.0}}, "sampling.logit_bias"),
    "stop token": ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop.stop_token_ids"),
    "bad request id": ({"prompt": "hi", "request_id": "has space"}, "request_id must be"),
}


def test_every_invalid_field_is_invalid_argument_and_harms_nothing(client, reference):
    background = {}
    thread = threading.Thread(target=lambda: background.update(
        r=client.chat(_chat(PROMPTS[0]), temperature=0, max_tokens=MAX_TOKENS)))
    thread.start()
    for name, (kwargs, message) in INVALID.items():
        with pytest.raises(InvalidArgument) as err:
            client.generate(**kwargs)
        assert message in str(err.value), name
    long_prompt = "word " * 6000
    with pytest.raises(InvalidArgument, match="max model length"):
        client.generate(long_prompt)
    thread.join()
    assert background["r"].token_ids == reference[0]


def test_invalid_utf8_is_invalid_argument(stack):
    with grpc.insecure_channel(stack.endpoint) as channel:
        raw = channel.unary_stream("/conveyor.v1.Conveyor/Generate", request_serializer=lambda b: b,
                                   response_deserializer=conveyor_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x0a\x03\xff\xfe\xfd", timeout=30))  # field 1 (prompt), 3 bytes that are not UTF-8
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in err.value.details()


def test_duplicate_request_id_is_already_exists(client):
    stream = iter(client.stream("hello", max_tokens=200, ignore_eos=True, request_id="dup-1"))
    next(stream)
    with pytest.raises(AlreadyExists):
        client.generate("hello", request_id="dup-1")
    client.abort("dup-1")
    list(stream)


def test_server_info_tokenize_and_async_client(stack, client, default_model):
    info = client.server_info()
    assert info.model_name == "SmolLM2-135M-Instruct.Q4_1" and list(info.eos_token_ids) == [2]
    assert info.has_chat_template and info.worker == "cpu/float32" and info.max_model_len > 1000
    tok = default_model.tokenizer
    assert client.tokenize("Hello 세계") == tok.encode("Hello 세계")
    assert client.tokenize(messages=_chat("Hi")) == tok.encode(tok.apply_chat_template(_chat("Hi")), add_special_tokens=False)

    async def run():
        async with AsyncClient(stack.endpoint, timeout=120) as ac:
            return await ac.chat(_chat(PROMPTS[7]), temperature=0, max_tokens=12, logprobs=2)

    import asyncio

    result = asyncio.run(run())
    blocking = client.chat(_chat(PROMPTS[7]), temperature=0, max_tokens=12)
    assert result.token_ids == blocking.token_ids
    assert len(result.logprobs) == len(result.token_ids)
    assert all(lp.token_id == t and len(lp.top) == 2 and lp.top[0][0] == t for lp, t in zip(result.logprobs, result.token_ids))


# ---------------------------------------------------------------- small pools, small queues, restarts


LONG = [f"Write a long story about {thing}." for thing in
        ("a fox", "a ship", "a robot", "a castle", "a river", "a dragon", "a garden", "a train")]
LONG_TOKENS = 120


def _long_run(c: Client) -> list:
    with ThreadPoolExecutor(len(LONG)) as pool:
        return list(pool.map(lambda p: c.chat(_chat(p), temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True), LONG))


def test_small_kv_pool_preempts_and_everyone_finishes_identically(tmp_path_factory, client):
    expected = _long_run(client)  # the roomy stack
    small = _up(tmp_path_factory, "small", kv_cache_bytes=24 * KV_BLOCK_BYTES)  # 24 blocks: room for about two at once
    try:
        with Client(small.endpoint, timeout=600) as c:
            got = _long_run(c)
        stats = _scheduler_stub(small).Stats(scheduler_pb2.StatsRequest())
    finally:
        small.stop()
    assert stats.num_blocks == 24 and stats.preemptions > 0
    for e, g in zip(expected, got):
        assert g.finish_reason == "length" and g.token_ids == e.token_ids and g.text == e.text


def test_full_queue_is_resource_exhausted_and_the_admitted_finish(tmp_path_factory):
    small = _up(tmp_path_factory, "queue", max_num_seqs=1, max_waiting=2)
    try:
        with Client(small.endpoint, timeout=300) as c:
            # long enough that the first is still running when the third is queued (decode is ~10 ms a token)
            streams = [c.stream("Tell me about the moon.", max_tokens=150, ignore_eos=True) for _ in range(3)]
            scheduler = _scheduler_stub(small)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # one running, two waiting: the queue is full
                stats = scheduler.Stats(scheduler_pb2.StatsRequest())
                if (stats.running, stats.waiting) == (1, 2):
                    break
                time.sleep(0.01)
            assert (stats.running, stats.waiting) == (1, 2)
            with pytest.raises(ResourceExhausted, match="waiting queue is full"):
                c.generate("one too many", max_tokens=5)
            results = [list(s) for s in streams]
    finally:
        small.stop()
    assert [r[-1].finish_reason for r in results] == ["length"] * 3
    assert all(r[-1].completion_tokens == 150 for r in results)


def test_scheduler_killed_and_restarted_requests_finish_with_the_same_tokens(tmp_path_factory, reference):
    s = _up(tmp_path_factory, "restart")
    try:
        with Client(s.endpoint, timeout=300) as c:
            streams = [c.stream(messages=_chat(p), temperature=0, max_tokens=MAX_TOKENS) for p in PROMPTS[:4]]
            iters = [iter(x) for x in streams]
            got = [[next(it)] for it in iters]  # every stream has started
            s.child("scheduler").process.kill()  # SIGKILL mid-generation
            s.child("scheduler").process.wait()
            s.restart("scheduler")
            for deltas, it in zip(got, iters):
                deltas.extend(it)
    finally:
        s.stop()
    for deltas, expected in zip(got, reference[:4]):
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == expected
        indices = [d.first_token_index for d in deltas]
        assert indices == sorted(indices) and deltas[-1].completion_tokens == len(expected)


def test_deadline_exceeded_aborts_the_request_on_the_server(stack, client):
    rid = "deadline-1"
    with pytest.raises(DeadlineExceeded):
        client.generate("Write a very long essay about rivers.", max_tokens=400, ignore_eos=True, timeout=0.5,
                        request_id=rid)
    store = RequestStore.from_url(stack.redis_url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (store.find(rid) is None or store.find(rid).status != "finished"):
        time.sleep(0.02)
    record = store.find(rid)
    assert record.status == "finished" and record.finish_reason == "abort" and record.num_output < 400


def test_generate_and_chat_commands(stack, client):
    import subprocess

    from helpers import ROOT, conveyor_command

    expected = client.generate("The capital of France is", temperature=0, max_tokens=8)
    done = subprocess.run(conveyor_command("generate", "--target", stack.endpoint, "--temperature", "0",
                                           "--max-tokens", "8", "The capital of France is"),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == expected.text + "\n"
    assert f"[{expected.finish_reason}: {expected.prompt_tokens} prompt + {expected.completion_tokens}" in done.stderr
    reply = client.chat(_chat("Say hello."), temperature=0, max_tokens=10)
    chat = subprocess.run(conveyor_command("chat", "--target", stack.endpoint, "--temperature", "0", "--max-tokens", "10"),
                          cwd=ROOT, input="Say hello.\n\n", capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0 and reply.text in chat.stdout
