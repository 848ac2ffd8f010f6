"""One bad request or one careless id must never hurt anyone else (issue 13), item by item.

Unit tests run the real parts in process over a real Redis; the rest run one real stack whose worker
has a fault injected (``--fail-on-token``: every step that computes one rare token fails, as a kernel
or device error would) and a short step timeout, plus an API-keyed frontend and a second frontend.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import ROOT, conveyor_command, drained, extra_frontend, scheduler_stats, start_stack, stop

from conveyor.client import Client
from conveyor.errors import AlreadyExists, ConveyorError, InvalidArgument
from conveyor.params import RequestParams
from conveyor.state import RequestRecord, RequestStore
from conveyor.tokenizer import load_tokenizer
from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc
from detokenizer_svc.core import DetokenizerCore, TokenEntry
from detokenizer_svc.incremental import IncrementalDetokenizer
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.engine import Engine
from scheduler_svc.policy import Scheduler, StepPlan
from scheduler_svc.request import Request

POISON_WORD = " xylophone"  # its first token is the injected fault: no other prompt or answer here has it
STEP_TIMEOUT = 3.0
FINISHED_TTL = 2.0
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-fedcba9876543210"}
CHAT = [{"role": "user", "content": "Count from one to twenty in words."}]


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short poem about the number {i}."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def poison_token(tokenizer) -> int:
    return tokenizer.encode(POISON_WORD, add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, poison_token):
    with pytest.MonkeyPatch.context() as env:  # the children keep the environment they started with
        env.setenv("CONVEYOR_WORKER_FAIL_ON_TOKEN", str(poison_token))
        env.setenv("CONVEYOR_SCHEDULER_STEP_TIMEOUT", str(STEP_TIMEOUT))
        s = start_stack(tmp_path_factory.mktemp("hardening"), kv_cache_bytes=128 << 20, finished_ttl=FINISHED_TTL)
    yield s
    s.stop()


def _store(stack) -> RequestStore:
    return RequestStore.from_url(stack.redis_url)


def _stub(stack, name: str):
    channel = stack.channel(name)
    return channel, health_pb2_grpc.HealthStub(channel)


def _serving(stack, name: str) -> bool:
    channel, stub = _stub(stack, name)
    with channel:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


# ---------------------------------------------------------------- 1. secrets in --help


def test_help_says_a_secret_is_set_and_never_shows_it():
    secrets = {"CONVEYOR_FRONTEND_API_KEYS": "alice:topsecret123",
               **{f"CONVEYOR_{s}_REDIS_URL": "redis://:hunter2pw@redis.example:6379/0"
                  for s in ("FRONTEND", "SCHEDULER", "DETOKENIZER", "UP")},
               "CONVEYOR_BENCH_API_KEY": "bench-secret-777"}
    env = dict(os.environ, **secrets)
    for args in (["serve", "frontend"], ["serve", "scheduler"], ["serve", "detokenizer"], ["up"], ["bench"]):
        done = subprocess.run(conveyor_command(*args, "--help"), env=env, capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr
        help_text = " ".join(done.stdout.split())  # argparse wraps lines
        for value in ("topsecret123", "hunter2pw", "bench-secret-777"):
            assert value not in help_text, f"conveyor {' '.join(args)} --help shows a secret"
        assert "value hidden" in help_text


def test_a_setting_can_come_from_a_file_and_stays_hidden(tmp_path, monkeypatch):
    import argparse

    from conveyor.config import add_arguments, from_args
    from tokenizer_svc.config import ENV_PREFIX, FrontendConfig

    secret = tmp_path / "redis_url"
    secret.write_text("redis://:from-a-file-pw@redis:6379/0\n")
    monkeypatch.setenv(f"{ENV_PREFIX}REDIS_URL_FILE", str(secret))
    parser = argparse.ArgumentParser()
    add_arguments(parser, FrontendConfig, ENV_PREFIX)
    assert from_args(FrontendConfig, parser.parse_args([])).redis_url == "redis://:from-a-file-pw@redis:6379/0"
    assert "from-a-file-pw" not in parser.format_help()


# ---------------------------------------------------------------- 2-4. request ids


def test_ids_shaped_like_another_requests_keys_do_not_collide(stack):
    ids = ["x", "x:out", "x:out:out", "inflight", "conveyor:inflight"]
    with Client(stack.endpoint, timeout=90) as client:
        streams = [client.stream(messages=CHAT, temperature=0, max_tokens=16, ignore_eos=True, request_id=i)
                   for i in ids]  # all in flight together
        results = [list(s) for s in streams]
    for rid, deltas in zip(ids, results):
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 16
        assert {d.request_id for d in deltas} == {rid}
    assert len({"".join(d.text for d in deltas) for deltas in results}) == 1  # the same greedy answer each
    store = _store(stack)
    records = [store.find(rid) for rid in ids]
    assert [r.client_id for r in records] == ids and len({r.request_id for r in records}) == len(ids)
    assert all(len(r.output_ids) == 16 and r.status == "finished" for r in records)
    assert _serving(stack, "scheduler")


def test_request_ids_belong_to_their_api_key(keyed):
    alice = Client(keyed, timeout=90, api_key=KEYS["alice"])
    bob = Client(keyed, timeout=90, api_key=KEYS["bob"])
    with alice, bob:
        mine = alice.stream(messages=CHAT, temperature=0, max_tokens=300, ignore_eos=True, request_id="shared-1")
        deltas = iter(mine)
        first = next(deltas)  # running
        theirs = bob.generate(messages=CHAT, temperature=0, max_tokens=4, request_id="shared-1")
        assert theirs.completion_tokens == 4  # the same id, another key: another request
        with pytest.raises(AlreadyExists, match="this API key"):
            alice.generate("Hello", max_tokens=2, request_id="shared-1")  # unique per key while it lives
        assert not bob.abort("shared-1")  # bob's own (finished) request, not alice's
        assert alice.abort("shared-1")
        rest = list(deltas)
        assert rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 300


def test_an_id_used_again_after_its_record_expired_is_a_new_request(stack):
    with Client(stack.endpoint, timeout=90) as client:
        reference = client.generate(messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True)
        stop = reference.text.split()[2]  # ends the first use early, with a stop string
        first = client.generate(messages=CHAT, temperature=0, max_tokens=24, stop=[stop], request_id="again-1")
        assert first.finish_reason == "stop" and first.completion_tokens < 24
        store = _store(stack)
        deadline = time.monotonic() + FINISHED_TTL + 10
        while store.lookup("", "again-1") is not None:  # its record (and the name) expire
            assert time.monotonic() < deadline
            time.sleep(0.1)
        again = client.generate(messages=CHAT, temperature=0, max_tokens=24, ignore_eos=True, request_id="again-1")
    assert again.finish_reason == "length" and again.token_ids == reference.token_ids and again.text == reference.text


# ---------------------------------------------------------------- 5. a poison request, a dead loop, a hung worker


def test_a_request_that_fails_every_step_ends_alone_and_the_others_finish(stack, tokenizer, poison_token):
    prompts = [_chat(i) for i in range(6)]
    with Client(stack.endpoint, timeout=120) as client:
        undisturbed = [client.stream(messages=p, temperature=0, max_tokens=16, ignore_eos=True) for p in prompts]
        reference = [[t for d in s for t in d.token_ids] for s in undisturbed]
        poison = [{"role": "user", "content": f"Tell me about the{POISON_WORD}."}]
        assert poison_token in client.tokenize(messages=poison)
        started = time.monotonic()
        bad = client.stream(messages=poison, temperature=0, max_tokens=16, request_id="poison-1")
        good = [client.stream(messages=p, temperature=0, max_tokens=16, ignore_eos=True) for p in prompts]
        with pytest.raises(ConveyorError, match="max-step-failures") as failed:
            list(bad)
        assert failed.value.code == "INTERNAL"
        got = [[t for d in s for t in d.token_ids] for s in good]
        elapsed = time.monotonic() - started
    assert got == reference  # every other request finished, exactly as undisturbed
    assert elapsed < 60
    record = _store(stack).find("poison-1")
    assert record.finish_reason == "error" and "injected fault" in record.error
    assert drained(stack).free_blocks == scheduler_stats(stack).num_blocks  # nothing left holding blocks


def test_an_engine_loop_that_dies_says_so_and_goes_not_serving(redis_server):
    scheduler = Scheduler(BlockManager(8, 4), 32, 16, 4, 4)

    def broken():
        raise RuntimeError("a bug in the loop (injected)")

    scheduler.schedule = broken
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    engine = Engine(scheduler, store, transport=None, publish=lambda *a: None, eos_token_ids=(2,))
    crashed, health = [], []
    engine.on_crash, engine.health.on_change = crashed.append, health.append
    scheduler.free_all = True  # something to do: the loop calls schedule()
    engine.start()
    engine._thread.join(timeout=10)
    assert not engine._thread.is_alive()
    assert len(crashed) == 1 and "injected" in str(crashed[0]) and health == [False]


def test_a_worker_that_stops_answering_is_declared_dead_and_no_request_is_lost(stack):
    worker = stack.child("worker").process
    with Client(stack.endpoint, timeout=120) as client:
        # long enough to be still generating when the worker is stopped (a worker with no step in flight
        # cannot be seen to hang)
        reference = [client.generate(messages=_chat(i), temperature=0, max_tokens=200, ignore_eos=True).token_ids
                     for i in range(3)]
        streams = [client.stream(messages=_chat(i), temperature=0, max_tokens=200, ignore_eos=True) for i in range(3)]
        iterators = [iter(s) for s in streams]
        firsts = [next(it) for it in iterators]
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while _serving(stack, "scheduler"):
                assert time.monotonic() - stopped < STEP_TIMEOUT + 5, "a hung worker was never declared dead"
                time.sleep(0.1)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        got = [f.token_ids + [t for d in it for t in d.token_ids] for f, it in zip(firsts, iterators)]
    assert got == reference
    deadline = time.monotonic() + 20
    while not _serving(stack, "scheduler"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


# ---------------------------------------------------------------- 6. bounded work per request


def test_per_token_work_has_limits_that_name_their_flag(stack):
    with Client(stack.endpoint, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="max-stop-token-ids"):
            client.generate("Hi", max_tokens=2, stop_token_ids=list(range(100, 165)))
        with pytest.raises(InvalidArgument, match="max-logit-bias"):
            client.generate("Hi", max_tokens=2, logit_bias={i: 1.0 for i in range(100, 401)})
        assert client.generate("Hi", max_tokens=2, stop_token_ids=list(range(100, 164)),
                               logit_bias={i: 1.0 for i in range(100, 400)}).completion_tokens >= 1


class _Spy:
    """The real tokenizer, counting what ``decode`` is given (and whether a lock was held)."""

    def __init__(self, tokenizer, lock=None):
        self.tokenizer, self.lock = tokenizer, lock
        self.decoded, self.calls_under_lock, self.calls = 0, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        self.calls += 1
        self.calls_under_lock += bool(self.lock is not None and self.lock.locked())
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_output_that_keeps_ending_in_a_broken_character_decodes_in_linear_time(tokenizer):
    broken = next(i for i in range(512) if tokenizer.decode([i] * 3).endswith("\ufffd"))  # a lone UTF-8 byte
    spy = _Spy(tokenizer)
    detok = IncrementalDetokenizer(spy)
    n = 3000
    text = "".join(detok.add(broken) for _ in range(n)) + detok.flush()
    assert text == tokenizer.decode([broken] * n)  # nothing lost: the bytes come out as U+FFFD
    assert spy.decoded < 20 * n  # not ~n*n/2 (each token decoding everything since the last character)


def test_replay_decodes_without_the_lock_every_step_needs(redis_server, tokenizer):
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    spy = _Spy(tokenizer)
    core = DetokenizerCore(spy, store, lambda *a, **k: None)
    spy.lock = core.lock
    output = tokenizer.encode(" one two three four five six seven eight nine ten" * 20)
    record = RequestRecord(uuid.uuid4().hex, tokenizer.encode("Count"), RequestParams(), frontend="fe:1",
                           output_ids=output)
    assert store.create(record)
    store.redis.rpush(store.out_key(record.request_id), *output)
    frontend, deltas = core.replay(record.request_id)
    assert "".join(d.text for d in deltas) == tokenizer.decode(output)
    assert spy.calls > len(output) and spy.calls_under_lock == 0
    assert core.push([TokenEntry(record.request_id, len(output), tokenizer.encode(" more"))])[0]  # continues


# ---------------------------------------------------------------- 7. what a step writes is snapshotted


def test_a_stop_string_finish_during_a_step_does_not_move_the_steps_token(redis_server):
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    scheduler = Scheduler(BlockManager(64, 4), 1000, 32, 8, 16)
    record = RequestRecord(uuid.uuid4().hex, [10, 11, 12], RequestParams.of(max_tokens=50))
    assert store.create(record)
    rid = record.request_id
    scheduler.add(Request.from_record(record, (2,)))
    engine = Engine(scheduler, store, transport=None, publish=lambda *a: None, eos_token_ids=(2,))

    def step(token: int):
        plan = scheduler.schedule()
        return plan, scheduler.update(plan, {rid: (token, None)})

    for token in (20, 21, 22, 23):
        engine._write_and_publish(*step(token), [])
    plan, outputs = step(24)  # the step that samples output token 4 is answered...
    finish = scheduler.finish_at(rid, 2)  # ...and a stop string's Finish cuts the output before it is written
    engine._write_and_publish(plan, outputs, [])
    assert store.get(rid).output_ids == [20, 21, 22, 23, 24]  # token 4 at index 4, not at index 2
    engine._write_and_publish(StepPlan(0, [], []), [], [finish])  # the Finish's own write trims
    assert store.get(rid).output_ids == [20, 21] and store.get(rid).finish_reason == "stop"


# ---------------------------------------------------------------- 8. only the owner moves delivery


def test_a_stale_stream_does_not_take_delivery_back_from_where_the_client_resumed(stack):
    """A stream whose client went away unnoticed (never read again) sees Redis get ahead of it and replays;
    that must not move delivery back to its frontend: before, it did, the resumed stream then heard nothing
    until its own stall check (2 s) replayed it back, and the two frontends took turns."""
    proc, other = extra_frontend(stack)
    try:
        with Client(stack.endpoint, timeout=120) as first, Client(other, timeout=120) as second:
            # long enough (~4 s) for the stale stream to see Redis ahead twice (1 s apart) and replay
            stale = first.stream(messages=CHAT, temperature=0, max_tokens=400, ignore_eos=True)
            head = next(iter(stale))  # the first stream stays open but is never read again (half-open)
            resumed = second.resume(stale.request_id, len(head.token_ids), len(head.text))
            arrivals, count = [], len(head.token_ids)
            for delta in resumed:
                count += len(delta.token_ids)
                arrivals.append(time.monotonic())
            stale.cancel()
    finally:
        stop(proc)
    assert count == 400 and delta.finish_reason == "length"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert arrivals[-1] - arrivals[0] > 2.5  # the stale stream had time to replay (it does, every ~2 s)
    assert max(gaps) < 1.0, f"the resumed stream stalled for {max(gaps):.1f} s: delivery went elsewhere"


# ---------------------------------------------------------------- 9. SentencePiece's leading space


def _sentencepiece_folder(folder):
    """A Llama-2 style tokenizer (metaspace, byte fallback, a decoder that strips the text's first space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["The capital of France is Paris.", "Paris is a city.", "The capital of Italy is Rome."] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return folder


def test_the_first_token_of_a_sentencepiece_model_keeps_its_leading_space(redis_server, tmp_path):
    from conveyor.tokenizer import tokenizer_from_hf_folder

    tokenizer = tokenizer_from_hf_folder(_sentencepiece_folder(tmp_path / "sp"))
    prompt, full = tokenizer.encode("The capital of France is"), tokenizer.encode("The capital of France is Paris")
    assert full[: len(prompt)] == prompt and tokenizer.decode(full[len(prompt):]) == "Paris"  # alone: no space
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    record = RequestRecord(uuid.uuid4().hex, prompt, RequestParams(), frontend="fe:1")
    assert store.create(record)
    core = DetokenizerCore(tokenizer, store, lambda *a, **k: None)
    by_frontend, _ = core.push([TokenEntry(record.request_id, 0, full[len(prompt):], "length")])
    assert "".join(d.text for d in by_frontend["fe:1"]) == " Paris"


# ---------------------------------------------------------------- 10. the compose stack is private by default


def test_compose_stack_has_internal_mutual_tls_and_a_redis_password_by_default():
    from conveyor.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    parser = build_parser()
    init = parser.parse_args(services["credentials"]["command"])
    assert init.command == "credentials" and init.folder == "/secrets"
    assert "conveyor-secrets:/secrets" in services["credentials"]["volumes"]
    assert services["redis"]["command"][:2] == ["redis-server", "/secrets/redis.conf"]
    assert services["redis"]["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    for name in ("worker", "scheduler", "detokenizer", "frontend"):
        service = services[name]
        assert service["environment"]["CONVEYOR_INTERNAL_TLS_DIR"] == "/secrets"
        assert "conveyor-secrets:/secrets:ro" in service["volumes"]
        assert not any("redis://" in a for a in service["command"])  # no URL, no password on a command line
        if name != "worker":
            assert service["environment"][f"CONVEYOR_{name.upper()}_REDIS_URL_FILE"] == "/secrets/redis_url"


def test_credentials_made_at_first_start_secure_a_running_stack(tmp_path, monkeypatch):
    import redis

    from conveyor.credentials import make_credentials
    from helpers import free_port

    folder = tmp_path / "secrets"
    made = make_credentials(folder, redis_host="127.0.0.1")
    assert sorted(made) == ["ca.pem", "cert.pem", "grafana_password", "key.pem", "redis.conf", "redis_url"]
    assert make_credentials(folder) == []  # a restart keeps them
    assert all((folder / name).stat().st_mode & 0o077 == 0 for name in made)
    port = free_port()
    server = subprocess.Popen(["redis-server", str(folder / "redis.conf"), "--port", str(port), "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = (folder / "redis_url").read_text().strip().replace(":6379/", f":{port}/")
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                assert redis.Redis.from_url(url).ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
        monkeypatch.setenv("CONVEYOR_INTERNAL_TLS_DIR", str(folder))
        s = start_stack(tmp_path / "data", kv_cache_bytes=64 << 20, redis_url=url)
        try:
            with Client(s.endpoint, timeout=120) as client:
                assert client.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
            with grpc.insecure_channel(s.child("scheduler").health) as plain, pytest.raises(grpc.RpcError):
                scheduler_pb2_grpc.SchedulerStub(plain).Info(scheduler_pb2.SchedulerInfoRequest(), timeout=5)
        finally:
            s.stop()
    finally:
        server.terminate()
        server.wait()
