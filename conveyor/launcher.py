"""``conveyor up``: Redis and the four services as child processes, watched until Ctrl-C.

Starts a private ``redis-server`` (append-only file in ``--data-dir``) unless ``--redis-url`` is
given, then the worker, detokenizer, scheduler and frontend (``conveyor serve <service>``), waits
until each reports SERVING on ``grpc.health.v1``, and prints the endpoint. With ``--engines N``, N
workers and N schedulers (engines ``engine-0`` ... ; children ``worker``, ``scheduler``, then
``worker-1``, ``scheduler-1`` ... on free ports) share the detokenizer and the frontend. Ctrl-C or
SIGTERM stops everything (frontend first).

Supervision: a child that exits is started again with its own command line, after a backoff that
doubles with each recent restart (0.5 s, 1 s, 2 s, ... up to 10 s); more than ``--max-restarts``
restarts of one child within a minute bring the whole stack down with a non-zero exit. Requests in
flight survive: every service rebuilds from Redis (see ``conveyor/state.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor import grpc_util
from conveyor.config import add_arguments, redact, require, secrets_env, setting, to_argv
from conveyor.errors import ConfigError

log = logging.getLogger("conveyor.up")
ENV_PREFIX = "CONVEYOR_UP_"


# Fields of the service configs the stack sets for each child (where it listens, whom it calls, its engine's
# name): not flags of ``conveyor up``. Every other field of every service is one (``service_settings``).
ADDRESSING = frozenset({"host", "port", "http_port", "internal_host", "internal_port", "advertise", "worker",
                        "detokenizer", "engine", "redis_url", "metrics_port"})
GRPC_SERVICE = {"worker": "conveyor.v1.Worker", "scheduler": "conveyor.v1.Scheduler",
                "detokenizer": "conveyor.v1.Detokenizer", "frontend": "conveyor.v1.Frontend"}


def service_settings() -> dict[str, list[str]]:
    """Each service setting ``conveyor up`` passes on -> the services (in start order) that have it."""
    from conveyor.cli import SERVICES, config_class  # noqa: PLC0415 - the registry of services lives there

    settings: dict[str, list[str]] = {}
    for service in SERVICES:
        for f in dataclasses.fields(config_class(service)[0]):
            if f.name not in ADDRESSING:
                settings.setdefault(f.name, []).append(service)
    return settings


@dataclass
class UpConfig:
    """The stack's own settings. ``settings``: the services' (``--numerics``, ``--max-num-seqs``, ...; each given
    to every service that has it), from the flags ``conveyor up`` takes from the service configs."""

    host: str = setting("127.0.0.1", "address of the public API (0.0.0.0 to accept other machines)")
    port: int = setting(50051, "port of the public API")
    http_port: int = setting(8000, "port of the OpenAI-compatible HTTP API (-1: off)")
    redis_url: str = setting("", "use this Redis instead of starting a private redis-server", secret=True)
    data_dir: str = setting("", "folder of the private Redis's append-only file (default: a temporary folder)")
    worker_port: int = setting(50053, "worker port (0: any free port)")
    scheduler_port: int = setting(50052, "scheduler port (0: any free port)")
    detokenizer_port: int = setting(50054, "detokenizer port (0: any free port)")
    deliver_port: int = setting(50055, "frontend's internal port: health, and the Link call naming where deltas "
                                       "are delivered (0: any free port)")
    frontend_metrics_port: int = setting(9101, "frontend /metrics port (0: any free port)")
    scheduler_metrics_port: int = setting(9102, "scheduler /metrics port (0: any free port)")
    worker_metrics_port: int = setting(9103, "worker /metrics port (0: any free port)")
    detokenizer_metrics_port: int = setting(9104, "detokenizer /metrics port (0: any free port)")
    engines: int = setting(1, "engines (a worker and its scheduler each) behind the frontend")
    ready_timeout: float = setting(300.0, "seconds to wait for every service to report SERVING")
    max_restarts: int = setting(5, "restarts of one child within a minute before the stack gives up (0: never restart)")
    internal_tls: bool = setting(True, "internal services talk mutual TLS (only the stack's own processes may call "
                                       "them), with certificates made at first start in --data-dir/credentials or a "
                                       "temporary folder; CONVEYOR_INTERNAL_TLS_DIR names your own")
    settings: dict = field(default_factory=dict)  # no flag of its own: each service setting is one

    def __post_init__(self):
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(self.ready_timeout > 0, "ready_timeout", "must be > 0")
        require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        require(1 <= self.engines <= 64, "engines", f"must be in [1, 64], got {self.engines}")
        known = service_settings()
        for name in self.settings:
            require(name in known, name, "is no setting of conveyor up or of a service it starts")
        for service in GRPC_SERVICE:
            self.service(service)  # each service checks its settings now, naming the flag

    @classmethod
    def of(cls, **values) -> UpConfig:
        """From keyword arguments: the stack's fields, and service settings by their field names."""
        own = {f.name for f in dataclasses.fields(cls)} - {"settings"}
        return cls(**{k: v for k, v in values.items() if k in own},
                   settings={k: v for k, v in values.items() if k not in own})

    @classmethod
    def from_args(cls, namespace) -> UpConfig:
        """From ``conveyor up``'s parsed flags."""
        return cls.of(**{name: getattr(namespace, name)
                         for name in [*(f.name for f in dataclasses.fields(cls) if f.name != "settings"),
                                      *service_settings()]})

    def service(self, name: str):
        """The config of service ``name`` with this stack's settings (its addresses still the defaults)."""
        from conveyor.cli import config_class  # noqa: PLC0415

        cls = config_class(name)[0]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in self.settings.items() if k in names})

    def setting(self, name: str):
        """A service setting as the stack runs it (its default when not given)."""
        service = service_settings()[name][0]
        return getattr(self.service(service), name)


def add_up_arguments(parser) -> None:
    """``conveyor up``'s flags: the stack's, then every service setting once (its help says who takes it)."""
    from conveyor.cli import config_class  # noqa: PLC0415

    add_arguments(parser, UpConfig, ENV_PREFIX)
    shared = service_settings()
    for service in GRPC_SERVICE:  # a setting's flag is made from the first service that has it
        mine = {n for n, services in shared.items() if services[0] == service}
        add_arguments(parser, config_class(service)[0], ENV_PREFIX, names=mine,
                      note={n: f" [{', '.join(shared[n])}]" for n in mine})


_HANDED_OUT: set[int] = set()
_LOWEST_PORT = 10000


def ephemeral_ports() -> range:
    """The kernel's range of source ports for outgoing connections (Linux's ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A port nothing listens on now, and not one this process handed out before: the ports of a stack are
    picked before its services bind them. It lies below the ephemeral range where there is room, since a
    port from that range (what binding port 0 gives) may meanwhile become the source port of one of the
    stack's own outgoing connections, and its service then fails to bind ("address already in use")."""
    below = range(_LOWEST_PORT, ephemeral_ports().start)
    for _ in range(1000 if len(below) > 1000 else 0):
        port = secrets.choice(below)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    while True:  # no room below the ephemeral range: any port the kernel offers
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class Child:
    """One process of the stack, with what it takes to start it again."""

    name: str
    process: subprocess.Popen
    health: str | None = None  # address to poll, None for Redis
    service: str = ""
    argv: list[str] = field(default_factory=list)
    metrics: str = ""  # host:port of its /metrics endpoint
    env: dict[str, str] | None = None  # secrets (the Redis URL) go here, never on the command line
    restarts: list[float] = field(default_factory=list)  # monotonic times of recent restarts
    due: float | None = None  # when a dead child is to be started again

    def spawn(self) -> subprocess.Popen:
        return _popen(self.argv, self.env, quiet=self.name == "redis")


_SETPRIV = shutil.which("setpriv")  # util-linux


def _popen(argv: list[str], env: dict[str, str] | None = None, quiet: bool = False) -> subprocess.Popen:
    """A child of the stack, stopped when the launcher dies even by SIGKILL (no orphans holding ports):
    ``setpriv --pdeathsig`` sets PR_SET_PDEATHSIG and execs it. (Not a ``preexec_fn``: that makes Python
    fork() instead of vfork(), which runs gRPC's fork handlers in the child, and those can abort it.)"""
    if _SETPRIV:
        argv = [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL if quiet else None)


@dataclass
class Stack:
    """The running processes, in start order."""

    children: list[Child] = field(default_factory=list)
    endpoint: str = ""
    http_endpoint: str = ""  # the OpenAI-compatible HTTP API's base URL ("" when off)
    redis_url: str = ""
    internal_tls_dir: str = ""  # the certificates of internal mutual TLS ("" : plain gRPC on localhost)

    def channel(self, name: str) -> grpc.Channel:
        """A channel to a child's gRPC port, with the stack's internal credentials."""
        return grpc_util.internal_channel(self.child(name).health, self.internal_tls_dir or None)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every child, the frontend first (SIGTERM, then SIGKILL after ``timeout`` seconds)."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start a child again with its own command line (after it died) and wait until SERVING."""
        child = self.child(name)
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()
        child.process = child.spawn()
        if child.health:
            _wait_serving(child, time.monotonic() + timeout)

    def supervise_once(self, max_restarts: int, window: float = 60.0) -> Child | None:
        """Restart dead children when their backoff is over; returns a child that died too often."""
        now = time.monotonic()
        for child in self.children:
            if child.process.poll() is None:
                continue
            child.restarts = [t for t in child.restarts if now - t < window]
            if len(child.restarts) >= max_restarts:
                return child
            if child.due is None:
                child.due = now + min(0.5 * 2 ** len(child.restarts), 10.0)
                log.error("%s exited with status %s; restarting it in %.1f s", child.name, child.process.returncode,
                          child.due - now)
            elif now >= child.due:
                child.due = None
                child.restarts.append(now)
                child.process = child.spawn()
        return None

    def supervise(self, max_restarts: int = 5, every: float = 0.2) -> threading.Event:
        """Supervise from a daemon thread (for tests and embedding); set the returned event to stop."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(every):
                if self.supervise_once(max_restarts) is not None:
                    return

        threading.Thread(target=run, name="supervisor", daemon=True).start()
        return stop


def _serve(service: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "conveyor.cli", "serve", service, *flags]


def wait_serving(address: str, service: str, process: subprocess.Popen, timeout: float, name: str = "",
                 tls_dir: str | None = None) -> None:
    """Poll ``grpc.health.v1`` at ``address`` until ``service`` is SERVING; fail if ``process`` exits.
    ``tls_dir``: the internal certificates the service asks for (default: ``CONVEYOR_INTERNAL_TLS_DIR``)."""
    name = name or service
    deadline = time.monotonic() + timeout
    with grpc_util.internal_channel(address, tls_dir) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                output = process.stdout.read() if process.stdout else ""
                raise RuntimeError(f"{name} exited with status {process.returncode} while starting\n{output}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{name} at {address} did not report SERVING within {timeout:.0f} s")


def _wait_serving(child: Child, deadline: float) -> None:
    wait_serving(child.health, child.service, child.process, max(0.1, deadline - time.monotonic()), child.name,
                 (child.env or {}).get(grpc_util.INTERNAL_TLS_ENV))


def _internal_tls_dir(cfg: UpConfig) -> str:
    """The internal certificates: CONVEYOR_INTERNAL_TLS_DIR's, else made (once) in --data-dir/credentials or a
    temporary folder; "" with --no-internal-tls."""
    if os.environ.get(grpc_util.INTERNAL_TLS_ENV):
        return os.environ[grpc_util.INTERNAL_TLS_ENV]
    if not cfg.internal_tls:
        return ""
    from conveyor.credentials import make_internal_tls  # noqa: PLC0415 - cryptography only when it is needed

    folder = Path(cfg.data_dir) / "credentials" if cfg.data_dir else Path(tempfile.mkdtemp(prefix="conveyor-tls-"))
    make_internal_tls(folder)
    return str(folder)


def _start_redis(cfg: UpConfig, stack: Stack) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server is not installed (apt-get install -y redis-server), or pass --redis-url")
    port = free_port()
    data = Path(cfg.data_dir) if cfg.data_dir else Path(tempfile.mkdtemp(prefix="conveyor-redis-"))
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)  # it holds every prompt and output: its owner's alone
    password = secrets.token_urlsafe(24)
    conf = data / "conveyor-redis.conf"  # the password stays out of every command line
    conf.touch(mode=0o600)
    conf.write_text(f"requirepass {password}\n")
    argv = [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
            "--save", "", "--daemonize", "no", "--loglevel", "warning"]
    umask = os.umask(0o077)  # inherited by redis-server: its append-only files are 0600
    try:
        process = _popen(argv, quiet=True)
    finally:
        os.umask(umask)
    stack.children.append(Child("redis", process, argv=argv))
    import redis  # noqa: PLC0415 - only the launcher needs to ping

    url = f"redis://:{password}@127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            return url
        except redis.exceptions.ConnectionError:
            if process.poll() is not None:
                raise RuntimeError("redis-server exited while starting") from None
            time.sleep(0.05)
    raise TimeoutError("redis-server did not answer")


def plan(cfg: UpConfig, redis_url: str) -> list[tuple[str, str, object, str]]:
    """The children in start order: (name, service, its config, the address its health is polled at). Ports the
    stack's config leaves at 0 (and those of every engine after the first) are free ones."""
    def port(name: str, i: int = 0) -> int:
        return (getattr(cfg, f"{name}_port") if i == 0 else 0) or free_port()

    detokenizer_port, deliver = port("detokenizer"), port("deliver")
    detokenizer = f"127.0.0.1:{detokenizer_port}"
    workers, schedulers = [], []
    for i in range(cfg.engines):
        suffix = f"-{i}" if i else ""
        worker, scheduler = port("worker", i), port("scheduler", i)
        workers.append((f"worker{suffix}", "worker", dataclasses.replace(
            cfg.service("worker"), port=worker, metrics_port=port("worker_metrics", i)), f"127.0.0.1:{worker}"))
        schedulers.append((f"scheduler{suffix}", "scheduler", dataclasses.replace(
            cfg.service("scheduler"), port=scheduler, engine=f"engine-{i}", advertise=f"127.0.0.1:{scheduler}",
            worker=f"127.0.0.1:{worker}", detokenizer=detokenizer, redis_url=redis_url,
            metrics_port=port("scheduler_metrics", i)), f"127.0.0.1:{scheduler}"))
    return [
        *workers,
        ("detokenizer", "detokenizer", dataclasses.replace(
            cfg.service("detokenizer"), port=detokenizer_port, redis_url=redis_url,
            metrics_port=port("detokenizer_metrics")), detokenizer),
        *schedulers,
        ("frontend", "frontend", dataclasses.replace(
            cfg.service("frontend"), host=cfg.host, port=cfg.port, http_port=cfg.http_port, internal_port=deliver,
            detokenizer=detokenizer, redis_url=redis_url, metrics_port=port("frontend_metrics")),
         f"127.0.0.1:{deliver}"),  # its internal port (plain gRPC even with TLS on the public one)
    ]


def start(cfg: UpConfig) -> Stack:
    """Start Redis and the services, wait until all are SERVING; the caller stops the stack."""
    from conveyor.cli import config_class  # noqa: PLC0415

    stack = Stack()
    # the ports given explicitly are taken later (the public ones last, by the frontend): never hand them out
    _HANDED_OUT.update(getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                       if f.name.endswith("port") and getattr(cfg, f.name) > 0)
    try:
        stack.redis_url = cfg.redis_url or _start_redis(cfg, stack)
        stack.internal_tls_dir = _internal_tls_dir(cfg)
        tls_env = {grpc_util.INTERNAL_TLS_ENV: stack.internal_tls_dir} if stack.internal_tls_dir else {}
        for name, service, config, health in plan(cfg, stack.redis_url):
            argv = _serve(service, *to_argv(config))
            env = dict(os.environ, **secrets_env(config, config_class(service)[1]), **tls_env)
            stack.children.append(Child(name, _popen(argv, env), health, GRPC_SERVICE[service], argv,
                                        f"{config.metrics_host}:{config.metrics_port}", env=env))
        deadline = time.monotonic() + cfg.ready_timeout
        for child in stack.children:
            if child.health:
                _wait_serving(child, deadline)
        stack.endpoint = f"{cfg.host}:{cfg.port}"
        if cfg.http_port >= 0:
            scheme = "https" if cfg.setting("tls_cert") else "http"
            stack.http_endpoint = f"{scheme}://{cfg.host}:{cfg.http_port}"
        return stack
    except BaseException:
        stack.stop()
        raise


def run(cfg: UpConfig) -> int:
    """``conveyor up``: start, print the endpoint, watch; returns the exit status."""
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = start(cfg)
    engines = f" on {cfg.engines} engines" if cfg.engines > 1 else ""
    print(f"Conveyor is serving {cfg.setting('model')}{engines} at {stack.endpoint} (Redis {redact(stack.redis_url)}). "
          "Ctrl-C stops it.", flush=True)
    print(f'  try: conveyor generate --target {stack.endpoint} "The capital of France is"', flush=True)
    if stack.http_endpoint:
        print(f"  or the OpenAI API: curl {stack.http_endpoint}/v1/completions -H 'Content-Type: application/json' "
              """-d '{"prompt": "The capital of France is", "max_tokens": 16}'""", flush=True)
    status = 0
    while not stopping:
        failing = stack.supervise_once(cfg.max_restarts)
        if failing is not None:
            log.error("%s exited %d times within a minute (--max-restarts); stopping the stack", failing.name,
                      len(failing.restarts) + 1)
            status = 1
            break
        time.sleep(0.2)
    stack.stop()
    return status

