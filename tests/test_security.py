"""API keys, TLS and mutual TLS on the public endpoint, request ownership, and every limit's status and message.

One stack (`conveyor up`'s launcher, a real Redis with a password) and two extra frontends on it: one with
API keys, TLS and limits, one with mutual TLS.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time

import grpc
import pytest
import redis
import yaml
from helpers import ROOT, conveyor_command, extra_frontend, start_stack, stop

from conveyor.client import Client
from conveyor.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable
from conveyor import grpc_util
from conveyor.link import HEADER, KEY_BYTES, Link, LinkServer, frame
from conveyor.v1 import detokenizer_pb2_grpc, frontend_pb2, frontend_pb2_grpc, link_pb2, scheduler_pb2, scheduler_pb2_grpc
from conveyor.v1 import worker_pb2, worker_pb2_grpc

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
        with grpc_util.internal_channel(s.child("worker").health) as channel:  # the scheduler's certificates
            step_port = worker_pb2_grpc.WorkerStub(channel).Link(link_pb2.LinkRequest(), timeout=10).port
        step = worker_pb2.StepRequest(step_id=1, free_all=True).SerializeToString()
        step = HEADER.pack(len(step), 0) + step  # a step that would make the worker forget every sequence
        anonymous_tls = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # verifies the worker, has no cert
        anonymous_tls.check_hostname = False

        def answer(tls: ssl.SSLContext | None) -> bytes:
            try:
                with socket.create_connection(("127.0.0.1", step_port), timeout=10) as plain:
                    sock = tls.wrap_socket(plain) if tls else plain
                    sock.sendall(step)
                    return sock.recv(64)
            except OSError:  # reset, or the handshake refused
                return b""

        assert answer(None) == b"" and answer(anonymous_tls) == b""  # closed without an answer
        with Client(s.endpoint, timeout=120) as c:  # the engine's own link was not disturbed
            assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
    finally:
        s.stop()


def _local_links(stack) -> dict[str, str]:
    """Each service's abstract link socket, as its ``Link`` call names it (asked with the internal certificates)."""
    stubs = {"worker": worker_pb2_grpc.WorkerStub, "detokenizer": detokenizer_pb2_grpc.DetokenizerStub,
             "frontend": frontend_pb2_grpc.FrontendStub}
    names = {}
    for name, stub in stubs.items():
        with stack.channel(name) as channel:
            names[name] = stub(channel).Link(link_pb2.LinkRequest(), timeout=10).local_name
    return names


def _connected_unix_names() -> set[str]:
    """The abstract names of this host's connected Unix sockets (/proc/net/unix: an accepted connection shows the
    name of the socket it was accepted on; state 03 is connected)."""
    names = set()
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[5] == "03" and fields[7].startswith("@"):
            names.add(fields[7][1:])
    return names


def test_the_stacks_links_go_over_local_sockets_on_one_host(stack):
    """The scheduler's link to the worker and to the detokenizer, and the detokenizer's to the frontend, are
    connections to the abstract Unix sockets their receivers name (not TCP with TLS)."""
    with Client(stack.endpoint, timeout=120) as c:  # every link has been dialled once a token is delivered
        assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2
    names = _local_links(stack)
    assert all(name.startswith("conveyor-link-") for name in names.values()), names
    assert set(names.values()) <= _connected_unix_names()


def test_a_local_link_socket_refuses_a_caller_without_its_key(stack):
    """The socket's name shows in /proc/net/unix; its key comes only with the Link call's answer (made over mutual
    TLS). A process of the same user that found the name and sends a wrong key and then a well-formed message (a
    step that would make the worker forget every sequence; an empty batch of deltas) is closed without an answer, on
    the worker's thread-served socket and the frontend's event-loop one alike."""
    messages = {"worker": worker_pb2.StepRequest(step_id=1, free_all=True), "frontend": frontend_pb2.DeltaBatch()}
    for service, message in messages.items():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect("\0" + _local_links(stack)[service])
            try:
                sock.sendall(bytes(KEY_BYTES) + frame(message))
                got = sock.recv(64)
            except OSError:
                got = b""
        assert got == b"", service
    with Client(stack.endpoint, timeout=120) as c:  # the engine's own links were not disturbed
        assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2


def test_a_link_takes_tcp_where_the_local_socket_cannot_be_reached():
    """A caller in another network namespace (another host or container) finds no such socket: it dials TCP."""
    server = LinkServer("127.0.0.1", 0, lambda link: None, "test")
    try:
        assert server.local.name
        local = Link.connect("127.0.0.1", server.port, local_name=server.local.name, local_key=server.local.key)
        assert local.sock.family == socket.AF_UNIX
        remote = Link.connect("127.0.0.1", server.port, local_name="conveyor-link-" + "0" * 32)  # nobody's
        assert remote.sock.family == socket.AF_INET
        local.close()
        remote.close()
    finally:
        server.close()


def test_a_service_where_local_sockets_are_forbidden_takes_links_over_tcp(monkeypatch):
    """A sandbox that refuses an abstract Unix socket (an injected EPERM on bind) leaves the service its TCP port:
    it names no local socket, and a caller dials TCP."""
    import conveyor.link as link_module

    class NoLocal(socket.socket):
        def bind(self, address):
            if self.family == socket.AF_UNIX:
                raise PermissionError(1, "Operation not permitted")
            return super().bind(address)

    monkeypatch.setattr(link_module.socket, "socket", NoLocal)
    server = LinkServer("127.0.0.1", 0, lambda link: None, "test")
    try:
        assert server.local.name == ""
        link = Link.connect("127.0.0.1", server.port, local_name=server.local.name)
        assert link.sock.family == socket.AF_INET
        link.close()
    finally:
        server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a service as another user takes root")
def test_a_local_link_socket_of_another_user_is_passed_over_for_tcp():
    """Two containers of one pod share a network namespace but may run as two users: a caller finds the other's
    local socket, sees it is not its user's (which would refuse it), and dials TCP instead."""
    local_name = "conveyor-link-test-" + os.urandom(8).hex()
    holder = ("import socket, sys\n"  # another user's process holding the socket
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
              f"s.bind('\\0' + {local_name!r})\n"
              "s.listen()\n"
              "print('listening', flush=True)\n"
              "sys.stdin.read()\n")
    other = subprocess.Popen(["python3", "-c", holder], user=65534, group=65534, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    server = LinkServer("127.0.0.1", 0, lambda link: None, "test")  # the service's TCP port
    try:
        assert other.stdout.readline().strip() == "listening"
        link = Link.connect("127.0.0.1", server.port, local_name=local_name)
        assert link.sock.family == socket.AF_INET
        link.close()
    finally:
        server.close()
        other.kill()
        other.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a peer as another user takes root")
def test_a_local_link_socket_refuses_a_peer_of_another_user(stack):
    """Without TLS on the local socket, the user is the credential: a process of another user that learned the
    worker's socket name gets its connection closed without an answer, and the engine's own link goes on."""
    local = _local_links(stack)["worker"]
    step = worker_pb2.StepRequest(step_id=1, free_all=True).SerializeToString()
    step = HEADER.pack(len(step), 0) + step  # a step that would make the worker forget every sequence
    peer = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "s.settimeout(10)\n"
            f"s.connect('\\0' + {local!r})\n"  # it reaches the socket (the kernel queues the connection)
            "try:\n"  # and is closed, before or after its step
            f"    s.sendall({step!r})\n"
            "    got = s.recv(64)\n"
            "except OSError:\n"
            "    got = b''\n"
            "sys.stdout.write(repr(got))\n")
    done = subprocess.run(["python3", "-c", peer], user=65534, group=65534, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "b''"  # closed without an answer
    with Client(stack.endpoint, timeout=120) as c:
        assert c.generate("Hello", max_tokens=2, temperature=0).completion_tokens == 2


# ---------------------------------------------------------------- secrets stay out of help, command lines and files


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
