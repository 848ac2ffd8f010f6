"""API keys, TLS and mutual TLS on the public endpoint, request ownership, and every limit's status and message.

One stack (`conveyor up`'s launcher, a real Redis with a password) and two extra frontends on it: one with
API keys, TLS and limits, one with mutual TLS.
"""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
import redis
from helpers import extra_frontend, start_stack, stop

from conveyor.client import Client
from conveyor.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable
from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

KEYS = {"alice": "alice-secret-key-0123456789", "bob": "bob-secret-key-9876543210ab"}
CHAT = [{"role": "user", "content": "Count from one to fifty in words."}]


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=conveyor-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)
    return d


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("security"), kv_cache_bytes=128 << 20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(stack, certs, tmp_path_factory):
    """A frontend with API keys (from a file), TLS, and small limits."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# name:key\n" + "".join(f"{n}:{k}\n" for n, k in KEYS.items()))
    keys.chmod(0o600)
    proc, address = extra_frontend(stack, "--api-keys-file", str(keys), "--tls-cert", str(certs / "server.pem"),
                                   "--tls-key", str(certs / "server.key"), "--max-streams-per-key", "2",
                                   "--max-prompt-tokens", "64", "--max-message-bytes", "64K", "--max-stop-strings",
                                   "4", "--request-timeout", "3")
    yield address
    stop(proc)


def client(target: str, certs, key: str | None = "alice", **kw) -> Client:
    return Client(target, timeout=120, api_key=KEYS.get(key, key), ca_cert=str(certs / "ca.pem"), **kw)


def test_calls_without_a_valid_api_key_are_unauthenticated(guarded, certs):
    for key in (None, "not-a-key-of-this-server-000", KEYS["alice"][:-1]):
        with client(guarded, certs, key) as c:
            with pytest.raises(Unauthenticated):
                c.generate("Hello", max_tokens=2)
            with pytest.raises(Unauthenticated):
                c.tokenize("Hello")
    with client(guarded, certs, "bob") as c:
        assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2


def test_the_public_endpoint_speaks_only_tls(guarded, certs):
    with Client(guarded, timeout=5, api_key=KEYS["alice"]) as plain, pytest.raises(Unavailable):
        plain.generate("Hello", max_tokens=2)
    with client(guarded, certs) as c:
        assert c.server_info().model_name


def test_a_request_id_gives_no_access_to_another_keys_request(guarded, certs):
    with client(guarded, certs, "alice") as alice, client(guarded, certs, "bob") as bob:
        stream = alice.stream(messages=CHAT, temperature=0, max_tokens=24)
        deltas = iter(stream)
        first = next(deltas)
        assert not bob.abort(stream.request_id)  # as if it did not exist
        with pytest.raises(NotFound):
            list(bob.resume(stream.request_id))
        rest = list(deltas)
        assert (rest or [first])[-1].finish_reason == "length"  # bob's abort did nothing
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 24


def test_streams_per_key_are_limited(guarded, certs):
    with client(guarded, certs, "alice") as alice, client(guarded, certs, "bob") as bob:
        open_streams = [alice.stream(messages=CHAT, temperature=0, max_tokens=200) for _ in range(2)]
        firsts = [next(iter(s)) for s in open_streams]  # both running
        assert all(f.request_id for f in firsts)
        with pytest.raises(ResourceExhausted, match="max-streams-per-key"):
            alice.generate("Hello", max_tokens=2)
        assert bob.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2  # others are not affected
        for s in open_streams:
            s.cancel()
        deadline = time.monotonic() + 10
        while True:  # the slots come back once the cancelled streams end
            try:
                assert alice.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
                break
            except ResourceExhausted:
                assert time.monotonic() < deadline
                time.sleep(0.2)


def test_each_limit_gets_its_status_and_a_message_naming_it(guarded, certs):
    with client(guarded, certs) as c:
        with pytest.raises(InvalidArgument, match=r"prompt has \d+ tokens; the limit is 64"):
            c.generate("word " * 200, max_tokens=2)
        with pytest.raises(InvalidArgument, match="stop"):
            c.generate("Hello", max_tokens=2, stop=["a", "b", "c", "d", "e"])
        with pytest.raises(ResourceExhausted):  # gRPC refuses the message: over --max-message-bytes
            c.generate("x" * (100 << 10), max_tokens=2)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="request-timeout"):
            c.generate(messages=CHAT, temperature=0, max_tokens=2000, ignore_eos=True)
        assert time.monotonic() - started < 10
        assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2  # still serving


def test_mutual_tls_requires_a_client_certificate(stack, certs):
    proc, target = extra_frontend(stack, "--tls-cert", str(certs / "server.pem"), "--tls-key",
                                  str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"))
    try:
        with client(target, certs, None) as anonymous, pytest.raises(Unavailable):
            anonymous.generate("Hello", max_tokens=2)
        with client(target, certs, None, client_cert=str(certs / "client.pem"),
                    client_key=str(certs / "client.key")) as c:
            assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
    finally:
        stop(proc)


def test_private_redis_requires_its_password(stack):
    assert "@" in stack.redis_url  # redis://:password@host:port/0, given to the services in their environment
    bare = stack.redis_url.split("@", 1)[1]
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(f"redis://{bare}").ping()
    assert redis.Redis.from_url(stack.redis_url).ping()
    for child in stack.children:
        assert not any(stack.redis_url in arg for arg in child.argv)  # never on a command line (ps shows those)


def test_internal_services_with_mutual_tls_refuse_peers_without_a_certificate(certs, tmp_path, monkeypatch):
    folder = tmp_path / "internal"
    folder.mkdir()
    (certs / "internal.cnf").write_text("subjectAltName=DNS:conveyor-internal\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "key.pem"), "-out", "internal.csr",
             "-subj", "/CN=conveyor-internal", cwd=certs)
    _openssl("x509", "-req", "-in", "internal.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", str(folder / "cert.pem"), "-days", "2", "-extfile", "internal.cnf", cwd=certs)
    (folder / "ca.pem").write_bytes((certs / "ca.pem").read_bytes())
    monkeypatch.setenv("CONVEYOR_INTERNAL_TLS_DIR", str(folder))  # every service (and the launcher) reads it
    s = start_stack(tmp_path / "r", kv_cache_bytes=64 << 20)
    try:
        with Client(s.endpoint, timeout=120) as c:  # the public API is unchanged
            assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
        scheduler = s.child("scheduler").health
        info = scheduler_pb2.SchedulerInfoRequest()
        with grpc.insecure_channel(scheduler) as plain, pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerStub(plain).Info(info, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        ca_only = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        options = [("grpc.ssl_target_name_override", "conveyor-internal")]
        with grpc.secure_channel(scheduler, ca_only, options=options) as anonymous, pytest.raises(grpc.RpcError):
            scheduler_pb2_grpc.SchedulerStub(anonymous).Info(info, timeout=5)
    finally:
        s.stop()
