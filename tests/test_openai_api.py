"""The OpenAI-compatible HTTP API, with the ``openai`` client users have and raw HTTP for the wire details."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import replace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import conveyor_command, drained, extra_frontend, start_stack, stop

from conveyor.client import Client
from conveyor.launcher import free_port

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("http")
    (folder / "keys").write_text(f"tester:{KEY}\n")
    s = start_stack(folder, http_port=free_port(), kv_cache_bytes=128 << 20, api_keys_file=str(folder / "keys"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_key() -> str:
    return KEY


def sse(response: httpx.Response) -> list:
    """The events of an SSE body: parsed JSON, or the string "[DONE]"."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_greedy_completion_is_the_grpc_apis_output(stack, client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    with Client(stack.endpoint, api_key=KEY, timeout=120) as grpc_client:
        expected = "".join(d.text for d in grpc_client.stream(PROMPT, max_tokens=12, temperature=0))
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_sends_the_role_once_one_finish_and_the_usage_before_done(base):
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 10
    assert len({c["id"] for c in events[:-1]}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [("role" in c["choices"][0]["delta"]) for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # role alone, as OpenAI
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    plain = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "stream_options": None},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120).json()
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain["choices"][0]["message"]["content"]


@settings(max_examples=200, deadline=None)
@given(text=st.text(), chat=st.booleans(), index=st.integers(0, 2))
def test_a_text_chunk_is_the_bytes_json_dumps_writes_for_any_text(text, chat, index):
    """The hot path writes a token's chunk from parts encoded once; it must be the general chunk's exact bytes."""
    from types import SimpleNamespace

    from tokenizer_svc.openai_reply import Reply

    api = SimpleNamespace(model='a "model"/\u00e9\n')
    reply = Reply(api, [SimpleNamespace(prompt_tokens=2)] * 3, chat, False, [""] * 3, False)
    fast = reply._text_chunk(index, text)
    assert fast == reply._chunk([reply._choice(index, text, None, None)])
    assert json.loads(fast.removeprefix(b"data: "))["choices"][0]["delta" if chat else "text"] == (
        {"content": text} if chat else text)


def test_the_openai_client_streams_and_n_gives_n_choices(client, model):
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, temperature=0.8, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, temperature=0.8, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible


def test_a_stream_interval_sends_the_first_token_at_once_then_that_many_tokens_a_chunk(stack, client, model, tmp_path):
    """--stream-interval 4: a stream's first token is not held back for four (its latency stays), later ones come in
    chunks of at least four (the finish may come with fewer), the same text as every token streamed alone."""
    (tmp_path / "keys").write_text(f"tester:{KEY}\n")
    port = free_port()
    proc, _ = extra_frontend(stack, "--http-port", str(port), "--api-keys-file", str(tmp_path / "keys"),
                             "--stream-interval", "4")
    try:
        gathered = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)

        def chunks(c: openai.OpenAI) -> list[tuple[str, int]]:
            stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=11, temperature=0, stream=True,
                                          logprobs=0, extra_body={"ignore_eos": True})
            return [(ch.choices[0].text, len(ch.choices[0].logprobs.tokens)) for ch in stream
                    if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.tokens]

        alone, held = chunks(client), chunks(gathered)
    finally:
        stop(proc)
    assert "".join(t for t, _ in held) == "".join(t for t, _ in alone)
    sizes = [n for _, n in held]
    # the first is not held for four (exactly one in tests/test_frontend_stream.py; a loaded loop may merge a second)
    assert sum(sizes) == 11 and sizes[0] < 4 and all(n >= 4 for n in sizes[1:-1]), sizes
    assert len(sizes) <= 4 < len(alone), (sizes, alone)


def test_tokenize_and_detokenize_round_trip_as_the_grpc_api_tokenizes(stack, base):
    ok = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/tokenize", json={"prompt": "Hello 세계"}, headers=ok).json()
    with Client(stack.endpoint, api_key=KEY, timeout=60) as grpc_client:
        assert r["tokens"] == grpc_client.tokenize("Hello 세계") and r["count"] == len(r["tokens"])
        chat = httpx.post(base + "/tokenize", json={"messages": CHAT}, headers=ok).json()
        assert chat["tokens"] == grpc_client.tokenize(messages=CHAT)
    assert httpx.post(base + "/detokenize", json={"tokens": r["tokens"]}, headers=ok).json()["prompt"].endswith("Hello 세계")
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]}, headers=ok)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_echo_puts_the_prompt_before_the_completion(client, model, base):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
                                                   "stream": True}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert "".join(e["choices"][0]["text"] for e in sse(r)[:-1]) == PROMPT + plain


def test_token_id_prompts_and_lists_of_prompts(stack, client, model):
    with Client(stack.endpoint, api_key=KEY, timeout=60) as grpc_client:
        ids = grpc_client.tokenize(PROMPT)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    both = client.completions.create(model=model, prompt=[ids, "Once upon a time"], max_tokens=5, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == by_text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=model, prompt=[10**9], max_tokens=5)


def test_stop_strings_are_trimmed(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]


def test_async_client(base, model):
    async def run():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            return await aclient.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0)

    r = asyncio.run(run())
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, 400, "n"),
    ({"prompt": PROMPT, "speculative": "no"}, 400, "speculative"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
])
def test_bad_fields_get_openais_error_shape_naming_the_field(base, body, status, param):
    r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and param in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_keys_routes_and_bodies_are_checked(base):
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(base + "/v1/completions", json={"prompt": PROMPT}).status_code == 401
    assert httpx.post(base + "/v1/completions", json={"prompt": PROMPT},
                      headers={"Authorization": "Bearer sk-wrong-0123456789"}).status_code == 401
    assert httpx.get(base + "/v1/nothing", headers=ok).status_code == 404
    assert httpx.get(base + "/v1/models/gpt-4", headers=ok).status_code == 404
    bad_utf8 = httpx.post(base + "/v1/completions", content=b'{"prompt": "\xff"}',
                          headers={**ok, "content-type": "application/json"})
    assert bad_utf8.status_code == 400 and bad_utf8.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(base + "/v1/completions", content=b"prompt=x", headers=ok).status_code == 400
    huge = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}',
                      headers={**ok, "content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_its_request(stack, base):
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: the request runs
    stats = drained(stack)
    assert (stats.running, stats.free_blocks) == (0, stats.num_blocks), "the request still runs"


def test_conveyor_bench_drives_the_http_api_with_the_served_model_and_exact_counts(base, model):
    from conveyor.bench import BenchConfig, OpenAIBackend, sweep

    cfg = BenchConfig(target=base, backend="openai", api_key=KEY, concurrency=[2], num_requests=3, prompt_tokens=8,
                      max_tokens=5, warmup=0)
    backend = OpenAIBackend(cfg)
    assert backend.model == model  # from /v1/models: this server checks the model it is asked for
    [(_, results, _)] = sweep(backend, cfg)
    assert [(r.error, r.output_tokens) for r in results] == [(None, 5)] * 3
    # a sweep's own output length, not the one the backend was made with (bench/side_by_side.py sweeps each
    # workload with one backend per server)
    [(_, longer, _)] = sweep(backend, replace(cfg, max_tokens=7))
    assert [(r.error, r.output_tokens) for r in longer] == [(None, 7)] * 3


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
          "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stream",
          "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "include_stop_str_in_output", "echo", "user"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def _bodies():
    good = st.fixed_dictionaries({}, optional={
        "prompt": st.sampled_from([PROMPT, "", "x" * 3000]) | JSON_VALUES,
        "messages": st.just(CHAT) | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x", 3]),
                                                                    "content": JSON_VALUES}), max_size=3),
    })
    return st.tuples(good, st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6))


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(parts=_bodies(), chat=st.booleans())
def test_random_bodies_get_a_4xx_or_a_short_answer_never_a_5xx(base, parts, chat):
    body = {**parts[0], **parts[1]}
    for name in ("max_tokens", "max_completion_tokens", "n"):  # keep valid requests short
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 3:
            body[name] = 3
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 3  # unset, an answer runs to the end of the context
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = json.dumps(body).encode()  # NaN and Infinity too: Python's JSON reader takes them
    r = httpx.post(base + path, content=raw, headers={"Authorization": f"Bearer {KEY}",
                                                      "content-type": "application/json"}, timeout=120)
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and set(error) == {"message", "type", "param", "code"}


def test_still_serving_after_the_fuzz(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_logprobs_in_each_endpoints_shape_match_the_grpc_apis(stack, client, model):
    with Client(stack.endpoint, api_key=KEY, timeout=60) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_tokens=4, temperature=0, logprobs=2)
    want = [(lp.token_id, lp.logprob) for lp in expected.logprobs]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert r.logprobs.token_logprobs == pytest.approx([lp for _, lp in want], abs=1e-6)
    assert "".join(r.logprobs.tokens) == r.text and r.logprobs.text_offset[0] == 0
    assert all(len(top) == 2 for top in r.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=3).choices[0]
    assert len(chat.logprobs.content) == 3 and all(len(c.top_logprobs) == 3 for c in chat.logprobs.content)
    assert "".join(c.token for c in chat.logprobs.content) == chat.message.content


def test_conveyor_batch_killed_midway_and_resumed_writes_every_line_exactly_once(base, tmp_path):
    lines = []
    for i in range(200):
        body = ({"messages": [{"role": "user", "content": f"Count to {i}."}]} if i % 2 else {"prompt": f"Number {i} is"})
        lines.append(json.dumps({"custom_id": f"job-{i}", "method": "POST",
                                 "url": "/v1/chat/completions" if i % 2 else "/v1/completions",
                                 "body": {**body, "max_tokens": 2, "temperature": 0}}))
    lines[10] = "not json at all"  # no custom_id: it is named after its line, line-11
    lines[20] = json.dumps({"custom_id": "job-20", "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines[30] = json.dumps({"custom_id": "job-30", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": "x", "temperature": -1}})
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    argv = [*conveyor_command(), "batch", str(source), "-o", str(results), "--target", base, "--concurrency", "8"]
    env = {**os.environ, "CONVEYOR_BATCH_API_KEY": KEY}
    first = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (not results.exists() or results.read_text().count("\n") < 40) and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # mid-way, maybe mid-line
    first.wait()
    assert 40 <= results.read_text().count("\n") < 200
    subprocess.run(argv, env=env, check=True, stderr=subprocess.DEVNULL, timeout=300)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    expected = {f"job-{i}" for i in range(200)} - {"job-10"} | {"line-11"}
    assert len(ids) == 200 and set(ids) == expected
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["line-11"]["error"]["code"] == "invalid_request" and by_id["job-20"]["response"] is None
    assert by_id["job-30"]["response"]["status_code"] == 400
    assert by_id["job-30"]["response"]["body"]["error"]["param"] == "temperature"
    good = [r for r in records if r["custom_id"] not in ("line-11", "job-20", "job-30")]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in good)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 2 for r in good)


def test_a_request_without_sampling_fields_gets_the_servers_defaults(stack, client, model):
    from conveyor.params import SamplingDefaults
    from conveyor.state import RequestStore

    with Client(stack.endpoint, api_key=KEY, timeout=60) as grpc_client:
        grpc_client.generate(PROMPT, max_tokens=2, request_id="no-sampling-fields")
    params = RequestStore.from_url(stack.redis_url).find("no-sampling-fields", owner="tester").params.sampling
    d = SamplingDefaults()  # the default model has no defaults of its own
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (d.temperature, d.top_k, d.top_p, d.min_p)


def test_limits_deadlines_and_a_down_scheduler_get_429_504_and_503(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_FRONTEND_REQUEST_TIMEOUT", "2")  # the frontend reads it (--request-timeout)
    (tmp_path / "keys").write_text(f"tester:{KEY}\n")
    s = start_stack(tmp_path / "r", http_port=free_port(), kv_cache_bytes=64 << 20, max_streams_per_key=1,
                    api_keys_file=str(tmp_path / "keys"))
    ok = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", s.http_endpoint + "/v1/completions", json={**long, "stream": True}, headers=ok,
                          timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # one stream open: the key's limit
            second = httpx.post(s.http_endpoint + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                                headers=ok, timeout=60)
            assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
        late = httpx.post(s.http_endpoint + "/v1/completions", json=long, headers=ok, timeout=60)
        assert late.status_code == 504 and "--request-timeout" in late.json()["error"]["message"]
        os.kill(s.child("scheduler").process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(s.http_endpoint + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(s.http_endpoint + "/health").status_code == 503
    finally:
        s.stop()
