"""No request can stall the engine, and the API tells real clients the truth (issue 19).

An in-process engine shows that a request whose data cannot go on the wire ends alone; the rest runs
one real stack (short ``--max-model-len`` so that "no max_tokens" finishes quickly) through the ``openai``
SDK, raw HTTP, the gRPC SDK and lm-eval, with transformers as the reference for every log-probability.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import socketserver
import stat
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from helpers import conveyor_command, drained, extra_frontend, free_port, hf_logits, scheduler_stats, start_stack, stop

from conveyor.client import Client
from conveyor.errors import InvalidArgument, NotFound
from conveyor.params import RequestParams
from conveyor.state import RequestRecord, RequestStore
from conveyor.tokenizer import load_tokenizer
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine import Engine
from scheduler_svc.policy import Answer, Scheduler
from scheduler_svc.server import plan_to_pb, registration_pb

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_MODEL_LEN = 320
HEADER_TIMEOUT = 1.5  # --http-header-timeout of the stack
MAX_STREAMS = 4  # --max-streams-per-key of the stack (its clients have no key: they share the "" owner)


# ---------------------------------------------------------------- the class: data that breaks a step


class WireOnly:
    """The step transport up to the wire: every step is really converted to the worker's protobuf
    (``plan_to_pb``), and a stand-in answers token 7 for each sampled chunk (no worker is under test)."""

    def __init__(self):
        self.sent = []

    def send(self, plan):
        plan_to_pb(plan)
        self.sent.append(plan)

    def receive(self, plan):
        self.sent.remove(plan)
        return Answer({c.request.request_id: (7, None) for c in plan.chunks if c.sample})

    def reset(self):
        self.sent.clear()

    def capacity(self):
        return 64, 16, 1024


def test_a_submit_of_several_requests_refuses_each_bad_one_alone_and_queues_the_others(redis_server):
    """A frontend submits the requests that arrived together in one call: one whose data cannot go on the wire
    and one Redis has no record of are refused, each with its own error, and the good one is queued (once, though
    its id came twice)."""
    store = RequestStore.from_url(redis_server, prefix=f"truth-{uuid.uuid4().hex[:8]}")
    for record in (RequestRecord("good", [1, 2, 3], RequestParams.of(max_tokens=3, ignore_eos=True)),
                   RequestRecord("bad", [1, 2, 3], RequestParams.of(seed=-1, max_tokens=3))):
        assert store.create(record)
    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), store, WireOnly(), lambda *a: None, (2,))
    engine.check_request = registration_pb
    waiting, refused = engine.submit_many(["good", "bad", "missing", "good"])
    assert waiting == 1 and [r.request_id for r in engine.scheduler.waiting] == ["good"]
    assert set(refused) == {"bad", "missing"}
    assert isinstance(refused["bad"], InvalidArgument) and "cannot be computed" in str(refused["bad"])
    assert isinstance(refused["missing"], NotFound)


def test_a_request_whose_data_cannot_go_on_the_wire_ends_alone_and_health_stays_up(redis_server):
    store = RequestStore.from_url(redis_server, prefix=f"truth-{uuid.uuid4().hex[:8]}")
    good = RequestRecord("good", [1, 2, 3], RequestParams.of(max_tokens=3, ignore_eos=True))
    bad = RequestRecord("bad", [1, 2, 3], RequestParams.of(seed=-1, max_tokens=3))  # a uint64 field on the wire
    for record in (good, bad):
        assert store.create(record)
    engine = Engine(Scheduler(BlockManager(64, 16), 1024, 512, 8, 16), store, WireOnly(), lambda *a: None, (2,))
    engine.check_request = registration_pb
    with pytest.raises(InvalidArgument, match="cannot be computed"):
        engine.submit("bad")  # refused at the door
    health = []
    engine.health.on_change = health.append
    assert engine.adopt(["bad", "good"]) == 2  # as a restarted scheduler recovers them: past the door
    engine.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(store.get(r).status == "finished" for r in ("bad", "good")):
        time.sleep(0.05)
    engine.stop()
    bad_record, good_record = store.get("bad"), store.get("good")
    assert bad_record.finish_reason == "error" and "could not be sent to the worker" in bad_record.error
    assert good_record.finish_reason == "length" and good_record.output_ids == [7, 7, 7]
    assert health == [] and engine.health.worker_up  # never marked down


# ---------------------------------------------------------------- one real stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("truth")
    with pytest.MonkeyPatch.context() as env:  # the children keep the environment they started with
        env.setenv("CONVEYOR_FRONTEND_HTTP_HEADER_TIMEOUT", str(HEADER_TIMEOUT))
        s = start_stack(folder / "data", kv_cache_bytes=128 << 20, max_model_len=MAX_MODEL_LEN,
                        max_streams_per_key=MAX_STREAMS)
    s.data_dir = folder / "data"
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(client, model):
    """The innocent request's greedy text, as the stack gives it undisturbed."""
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=120)


def assert_unharmed(base: str, client, model, reference) -> None:
    """Health answers 200 within a second and an innocent request finishes with its reference text."""
    deadline = time.monotonic() + 1.0
    while httpx.get(base + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "health did not come back within a second"
        time.sleep(0.05)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, timeout=30)
    assert r.choices[0].text == reference


@pytest.mark.parametrize("field,value,param", [
    ("seed", 2**63, "seed"), ("seed", 2**64, "seed"), ("seed", -(2**63) - 1, "seed"),
    ("min_tokens", -1, "min_tokens"), ("logprobs", -1, "logprobs"), ("top_k", 2**31, "top_k"),
    ("prompt_logprobs", -1, "prompt_logprobs"), ("prompt_logprobs", 21, "prompt_logprobs"),
    ("temperature", 10**400, "temperature"), ("max_tokens", 2**64, "max_tokens"),
])
def test_numbers_out_of_range_get_a_400_naming_the_field_and_stall_nobody(base, client, model, reference, field,
                                                                          value, param):
    r = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert_unharmed(base, client, model, reference)


def test_seed_minus_one_is_random_and_any_int64_seed_reproduces(base, client, model, reference):
    def text(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    # -1 means "random", as llama.cpp documents it: not one fixed seed. A short answer (" Paris." then the end) can
    # come out the same three times in a row by chance (one clean-clone run did), so draw until two differ, up
    # to 10: a fixed seed still gives one text every time
    randoms = {text(-1)}
    for _ in range(9):
        randoms.add(text(-1))
        if len(randoms) > 1:
            break
    assert len(randoms) > 1
    for seed in (-(2**63), -5, 2**63 - 1):
        assert text(seed) == text(seed)
    assert_unharmed(base, client, model, reference)


def test_usage_counts_each_prompt_once_whatever_n(client, model):
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).usage.prompt_tokens
    three = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=3, temperature=0.7, seed=1)
    assert three.usage.prompt_tokens == one and three.usage.completion_tokens == 6
    two_prompts = client.completions.create(model=model, prompt=[PROMPT, PROMPT + " Paris"], max_tokens=1, n=2)
    paris = client.completions.create(model=model, prompt=PROMPT + " Paris", max_tokens=1).usage.prompt_tokens
    assert two_prompts.usage.prompt_tokens == one + paris
    chat_one = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).usage.prompt_tokens
    chat_two = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, n=2).usage.prompt_tokens
    assert chat_two == chat_one


def test_a_chat_stream_opens_with_the_role_alone(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, stream=True, n=2))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(c.delta.role is None for c in mine[1:]) and "".join(c.delta.content or "" for c in mine)


def test_stream_options_without_stream_is_refused(base):
    r = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_without_max_tokens_an_answer_runs_to_the_end_of_the_context(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_MODEL_LEN - r.usage.prompt_tokens > 256  # not the old 256 cut


def test_tool_fields_are_refused_where_they_cannot_be_honoured_not_ignored(base):
    """Tools belong to chat: on /v1/completions they are a 400, as OpenAI's deprecated functions are anywhere
    (tool calling itself: tests/test_structured.py and tests/test_tools.py)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "functions": [{"name": "f"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions", r.text


def test_plain_text_response_format_and_no_tools_still_work(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, response_format={"type": "text"},
                                       tool_choice="none")
    assert r.choices[0].message.content


def test_usage_tells_the_prompt_tokens_the_prefix_cache_held(client, model):
    prompt = "A long shared system prompt about the history of bread. " * 6 + str(uuid.uuid4())
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0).usage
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens and cached % 16 == 0  # whole KV blocks, never the last token


def test_logprob_bytes_are_a_tokens_own_bytes_for_pieces_of_a_character(client, model, tokenizer):
    pieces = tokenizer.encode(" \U0001F600")  # an emoji as byte-level pieces: neither decodes alone
    assert len(pieces) >= 2 and all(tokenizer.decode([t]).endswith("\ufffd") for t in pieces)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                       logit_bias={str(t): 100 for t in pieces})
    own = {tuple(tokenizer.token_bytes(t)) for t in pieces}
    assert tuple(tokenizer.token_bytes(pieces[-1])) == (0x80,)
    for entry in r.choices[0].logprobs.content:
        assert tuple(entry.bytes) in own and entry.bytes != list("\ufffd".encode())


def test_the_private_redis_keeps_its_data_from_other_local_users(stack, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=1)  # something in the append-only file
    assert stat.S_IMODE(stack.data_dir.stat().st_mode) == 0o700
    files = [p for p in stack.data_dir.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]


def test_the_internal_services_refuse_callers_without_the_stacks_certificate(stack):
    """conveyor up's default: internal mutual TLS with certificates it made, so no other local process can list
    requests (Stats), abort another tenant's (Abort) or drive the worker."""
    import grpc

    from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

    assert stack.internal_tls_dir
    with grpc.insecure_channel(stack.child("scheduler").health) as plain, pytest.raises(grpc.RpcError):
        scheduler_pb2_grpc.SchedulerStub(plain).Abort(scheduler_pb2.SchedulerAbortRequest(request_id="x"), timeout=5)
    with grpc.insecure_channel(stack.child("worker").health) as plain, pytest.raises(grpc.RpcError):
        worker_pb2_grpc.WorkerStub(plain).Info(worker_pb2.InfoRequest(), timeout=5)
    assert scheduler_stats(stack).num_blocks > 0  # with the stack's certificate: answered


def test_grpc_error_series_are_exported_at_zero_from_the_start(stack):
    text = httpx.get(f"http://{stack.child('scheduler').metrics}/metrics", timeout=10).text
    assert 'conveyor_grpc_errors_total{code="UNAVAILABLE",method="/conveyor.v1.Scheduler/Abort"} 0.0' in text


def test_each_choice_counts_as_a_stream_toward_the_per_key_limit(client, model):
    assert len(client.completions.create(model=model, prompt=PROMPT, max_tokens=1, n=MAX_STREAMS).choices) == 4
    with pytest.raises(openai.RateLimitError, match="max-streams-per-key"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, n=MAX_STREAMS + 1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=model, prompt=[PROMPT] * 3, max_tokens=1, n=2)


@pytest.fixture(scope="module")
def small_frontend(stack):
    """Another frontend on the stack, serving both APIs with --max-streams 2, its output kept:
    (process, gRPC address, HTTP base URL)."""
    port = free_port()
    proc, address = extra_frontend(stack, "--http-port", str(port), "--max-streams", "2")
    yield proc, address, f"http://127.0.0.1:{port}"
    stop(proc)


def test_the_frontends_stream_limit_covers_both_apis(small_frontend, model):
    _, address, http_base = small_frontend
    http = openai.OpenAI(base_url=http_base + "/v1", api_key="none", max_retries=0, timeout=60)
    with Client(address, timeout=60) as grpc_client, grpc_client.stream(
            PROMPT, max_tokens=250, ignore_eos=True, temperature=0) as long:
        next(iter(long))  # one gRPC stream open
        with pytest.raises(openai.RateLimitError, match="max-streams"):
            http.completions.create(model=model, prompt=PROMPT, max_tokens=1, n=2)
        assert http.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_a_client_that_leaves_a_plain_request_aborts_it_without_a_traceback(stack, small_frontend):
    proc, _, http_base = small_frontend
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(http_base + "/v1/completions", timeout=1.0, json={
            "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0})
    assert drained(stack, timeout=10).running == 0  # aborted, not decoded for nobody
    stop(proc)  # its output, to the end
    output = proc.stdout.read()
    assert "never retrieved" not in output and "Traceback" not in output, output[-2000:]


def test_browsers_get_cors_and_every_response_an_x_request_id(base):
    preflight = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"}, timeout=10)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://ui.example")
    r = httpx.get(base + "/v1/models", headers={"Origin": "http://ui.example", "x-request-id": "mine-1"}, timeout=10)
    assert r.headers["access-control-allow-origin"] in ("*", "http://ui.example") and r.headers["x-request-id"] == "mine-1"
    assert len(httpx.get(base + "/v1/models", timeout=10).headers["x-request-id"]) == 32


def test_the_routes_without_v1_metrics_and_version_are_served(base, model):
    bare = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    assert bare.models.list().data[0].id == model
    assert bare.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
    assert bare.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].message.content
    metrics = httpx.get(base + "/metrics", timeout=10)
    assert metrics.status_code == 200 and "conveyor_http_requests_total" in metrics.text
    assert httpx.get(base + "/version", timeout=10).json()["version"]


def test_half_sent_requests_are_closed_after_the_header_timeout(base, client, model, reference):
    host, port = base.removeprefix("http://").split(":")
    slow = []
    for _ in range(40):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")  # no end
        slow.append(sock)
    assert_unharmed(base, client, model, reference)  # served meanwhile
    time.sleep(HEADER_TIMEOUT + 1.0)
    try:
        assert all(sock.recv(1) == b"" for sock in slow)  # each closed by the server
    finally:
        for sock in slow:
            sock.close()
    idle = socket.create_connection((host, int(port)), timeout=10)  # a connection that never sends a byte
    time.sleep(HEADER_TIMEOUT + 1.0)
    assert idle.recv(1) == b""
    idle.close()


def test_sizes_are_checked_before_expansion_or_tokenization(base, client, model, reference):
    huge = "word " * ((1 << 20) // 5 + 10)  # past --max-prompt-chars (1 MiB)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}),
                       ("/tokenize", {"messages": [{"role": "user", "content": huge}]}),
                       ("/tokenize", {"prompt": huge}),
                       ("/v1/completions", {"prompt": ["x"] * 100_000, "max_tokens": 1})):
        started = time.monotonic()
        r = post(base, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "prompt"), (path, r.text[:200])
        assert time.monotonic() - started < 2.0  # refused, not tokenized first
    assert_unharmed(base, client, model, reference)


KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-fedcba9876543210"}


def test_the_prefix_cache_is_scoped_per_api_key_and_per_cache_salt(stack, keyed):
    secret = "The launch code for the vault, known to nobody but Alice, is " + " ".join(f"w{i}" for i in range(80))

    def hits(key: str, **options) -> int:
        before = scheduler_stats(stack).prefix_cache_hits
        with Client(keyed, api_key=KEYS[key], timeout=60) as c:
            c.generate(secret, max_tokens=1, temperature=0, **options)
        return scheduler_stats(stack).prefix_cache_hits - before

    hits("alice")
    assert hits("alice") > 0  # her own prefix is reused
    assert hits("bob") == 0  # never another key's: no reuse, no timing to tell it was there
    assert hits("alice", cache_salt="s1") == 0 and hits("alice", cache_salt="s1") > 0
    assert hits("alice", cache_salt="s2") == 0
    with Client(keyed, api_key=KEYS["bob"], timeout=60) as c, pytest.raises(InvalidArgument, match="cache_salt"):
        c.generate(PROMPT, max_tokens=1, cache_salt="x" * 257)


class Relay(socketserver.ThreadingTCPServer):
    """A TCP relay to the stack's HTTP port: the server "coming back" after an outage (the injected fault is
    the time before the relay listens)."""

    daemon_threads = allow_reuse_address = True

    def __init__(self, port: int, target: tuple[str, int]):
        target_address = target

        class Pipe(socketserver.BaseRequestHandler):
            def handle(self):
                with socket.create_connection(target_address) as upstream:
                    def pump(a, b):
                        try:
                            while data := a.recv(65536):
                                b.sendall(data)
                        except OSError:
                            pass
                        finally:
                            with contextlib.suppress(OSError):
                                b.shutdown(socket.SHUT_WR)

                    back = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
                    back.start()
                    pump(self.request, upstream)
                    back.join()

        super().__init__(("127.0.0.1", port), Pipe)


def _jobs(n: int) -> str:
    return "".join(json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": f"Number {i} is", "max_tokens": 2, "temperature": 0}}) + "\n"
                   for i in range(n))


def test_conveyor_batch_waits_out_a_server_that_is_down_and_retries_transient_results_on_resume(base, tmp_path):
    port = free_port()
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_jobs(6))
    argv = [*conveyor_command(), "batch", str(source), "-o", str(results), "--target", f"http://127.0.0.1:{port}",
            "--concurrency", "3", "--retry-for", "60"]
    job = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    time.sleep(3.0)  # connections refused meanwhile: the old client gave up after ~3 s and recorded the failure
    host, http_port = base.removeprefix("http://").split(":")
    relay = Relay(port, (host, int(http_port)))
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        assert job.wait(timeout=120) == 0
        records = [json.loads(line) for line in results.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in records) == [f"job-{i}" for i in range(6)]
        assert all(r["response"]["status_code"] == 200 for r in records)
        # a run that ended before the server came back recorded a transient failure: the resumed run retries it
        lines = results.read_text().splitlines()
        lines[2] = json.dumps({"id": "x", "custom_id": "job-2", "response": None,
                               "error": {"code": "request_failed", "message": "ConnectionRefusedError"}})
        lines[4] = json.dumps({"id": "y", "custom_id": "job-4", "response": {"status_code": 503, "request_id": "",
                                                                          "body": {}}, "error": None})
        results.write_text("\n".join(lines) + "\n")
        subprocess.run(argv, check=True, stderr=subprocess.DEVNULL, timeout=120)
    finally:
        relay.shutdown()
        relay.server_close()
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"job-{i}" for i in range(6)]  # one line each
    assert all(r["response"]["status_code"] == 200 for r in records)


# ---------------------------------------------------------------- prompt logprobs


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def reference_logprobs(hf_model, ids: list[int]) -> list[float]:
    """transformers' log-probability of every token after the first, given the ones before it."""
    logp = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)
    return [logp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def test_echo_with_logprobs_scores_every_prompt_token_as_transformers(client, model, tokenizer, hf_model):
    prompt = "The quick brown fox jumps over the lazy dog because it wanted to"
    ids = tokenizer.encode(prompt)
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)  # now in the prefix cache
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(reference_logprobs(hf_model, ids), abs=1e-3)
    assert "".join(lp.tokens[: len(ids)]) == tokenizer.decode(ids) and lp.text_offset[: 2] == [0, len(lp.tokens[0])]
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])


def test_vllm_prompt_logprobs_and_the_grpc_sdk_agree(stack, base, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    r = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    entries = r["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    want = reference_logprobs(hf_model, ids)
    for position, entry in enumerate(entries[1:], 1):
        mine = entry[str(ids[position])]
        assert mine["logprob"] == pytest.approx(want[position - 1], abs=1e-3) and mine["rank"] >= 1
        assert mine["decoded_token"] == tokenizer.decode([ids[position]]) and 2 <= len(entry) <= 3
    with Client(stack.endpoint, timeout=60) as grpc_client:
        done = grpc_client.generate(PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert [lp.token_id for lp in done.prompt_logprobs] == ids[1:]
    assert [lp.logprob for lp in done.prompt_logprobs] == pytest.approx(want, abs=1e-3)
    assert all(len(lp.top) == 2 for lp in done.prompt_logprobs)


TASK = """task: conveyor_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "a banana"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "loud"], "answer": 1},
]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (trailing spaces move on)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def test_lm_eval_loglikelihoods_match_transformers(stack, base, model, tokenizer, hf_model, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["conveyor_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"model={model},base_url={base}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                   "max_retries=1", log_samples=True)
    samples = results["samples"]["conveyor_mc"]
    assert len(samples) == len(QUESTIONS)
    checked = 0
    for sample in samples:
        for (context, continuation), (got, _greedy) in zip([a for a in sample["arguments"]],
                                                            [r[0] for r in sample["resps"]]):
            context_ids, continuation_ids = _encode_pair(tokenizer, context, continuation)
            ids = context_ids + continuation_ids
            want = sum(reference_logprobs(hf_model, ids)[len(context_ids) - 1:])
            assert got == pytest.approx(want, abs=1e-3) and got < 0
            checked += 1
    assert checked == sum(len(q["choices"]) for q in QUESTIONS)
    assert results["results"]["conveyor_mc"]["acc,none"] > 0  # not the all-zero scores of an empty echo


# ---------------------------------------------------------------- the fuzz: every number at its bounds

BOUNDS = [-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, math.nan, math.inf, -math.inf]
NUMERIC = ["seed", "min_tokens", "max_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "top_k", "n",
           "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "priority"]
STRINGS = st.sampled_from(["", "x" * 5000, "\u00e9" * 3000])
GRPC_OPTIONS = ("seed", "min_tokens", "logprobs", "prompt_logprobs", "top_k", "temperature", "top_p", "min_p",
                "repetition_penalty", "presence_penalty", "frequency_penalty")


def _body():
    number = st.sampled_from(BOUNDS)
    return st.tuples(st.dictionaries(st.sampled_from(NUMERIC), number, min_size=1, max_size=3),
                     st.fixed_dictionaries({}, optional={"stop": st.lists(STRINGS, max_size=20) | STRINGS,
                                                         "stop_token_ids": st.lists(st.sampled_from(BOUNDS[:6]),
                                                                                    max_size=70),
                                                         "logit_bias": st.dictionaries(
                                                             st.sampled_from(["-1", "0", str(2**40)]),
                                                             st.sampled_from(BOUNDS), max_size=3)}),
                     st.booleans(), st.none() | STRINGS | st.just("y" * ((1 << 20) + 1)))


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(parts=_body())
@example(parts=({"seed": -1}, {}, False, None))  # the request that took the engine down (issue 19)
@example(parts=({"top_k": 2**31, "min_tokens": -1}, {}, True, None))
def test_fuzz_every_numeric_field_at_its_bounds_never_harms_another_request(stack, base, client, model, reference,
                                                                           parts):
    numbers, rest, chat, text = parts
    grpc_endpoint = stack.endpoint
    text = PROMPT if text is None else text
    body = {**({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}), "max_tokens": 2,
            **numbers, **rest}
    for name in ("max_tokens", "n"):  # keep an accepted request short
        if isinstance(body.get(name), int) and body[name] > 2:
            body[name] = 2
    raw = json.dumps(body).encode()  # NaN and Infinity as Python's JSON writes them
    r = httpx.post(base + ("/v1/chat/completions" if chat else "/v1/completions"), content=raw,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], body)
    if r.status_code == 400:
        assert r.json()["error"]["param"], r.text
    # the same numbers through the gRPC API, where its field types let them through the SDK
    options = {name: value for name, value in numbers.items() if name in GRPC_OPTIONS}
    if options:
        with Client(grpc_endpoint, timeout=60) as grpc_client:
            try:
                grpc_client.generate(PROMPT, **{"max_tokens": 2, **options} | {"max_tokens": 2})
            except (ValueError, TypeError, OverflowError):
                pass  # the SDK's protobuf refused the value before sending it
            except InvalidArgument as exc:
                assert str(exc).split(" ")[0].split(".")[-1] in options or "must" in str(exc), str(exc)
    assert_unharmed(base, client, model, reference)
