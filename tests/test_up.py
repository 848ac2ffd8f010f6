"""``conveyor up`` as a user runs it: one command, an endpoint, Ctrl-C; a dying child is restarted, one that
keeps dying stops the stack."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import FREE_METRICS_FLAGS, ROOT, conveyor_command, free_port

from conveyor.client import Client


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture
def up(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        conveyor_command("up", "--port", str(port), "--worker-port", "0", "--scheduler-port", "0",
                         "--detokenizer-port", "0", "--deliver-port", "0", "--kv-cache-bytes", "64M",
                         "--data-dir", str(tmp_path), "--log-level", "WARNING", "--max-restarts", "1",
                         *FREE_METRICS_FLAGS),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Conveyor is serving" in line or proc.poll() is not None:
            break
    assert any("Conveyor is serving" in x for x in lines), "".join(lines)
    assert f"127.0.0.1:{port}" in lines[-1]
    # keep reading what the stack prints: a full pipe would block its logging, and a failure can show it
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    proc.output = lines
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _wait(proc: subprocess.Popen, timeout: float = 60) -> int:
    return proc.wait(timeout=timeout)


def test_up_serves_then_ctrl_c_stops_everything(up):
    proc, endpoint = up
    children = _children(proc.pid)
    assert len(children) == 5  # redis + four services
    with Client(endpoint, timeout=120) as client:
        assert client.generate("The capital of France is", temperature=0, max_tokens=5).completion_tokens > 0
    proc.send_signal(signal.SIGINT)
    assert _wait(proc) == 0
    assert not [c for c in children if Path(f"/proc/{c}").exists()]  # all stopped and reaped


def _child(pid: int, service: str) -> int:
    return next(c for c in _children(pid) if f"serve\0{service}" in Path(f"/proc/{c}/cmdline").read_text())


def test_a_dead_child_is_restarted_and_one_that_keeps_dying_stops_the_stack(up):
    proc, endpoint = up
    first = _child(proc.pid, "frontend")
    os.kill(first, signal.SIGKILL)
    with Client(endpoint, timeout=120) as client:
        deadline = time.monotonic() + 90
        while True:  # the supervisor starts a new frontend on the same port
            try:
                assert client.generate("The capital of France is", temperature=0, max_tokens=3).completion_tokens > 0
                break
            except Exception:
                assert time.monotonic() < deadline, "the frontend was not restarted:\n" + "".join(proc.output[-40:])
                time.sleep(0.5)
    second = _child(proc.pid, "frontend")
    assert second != first and proc.poll() is None
    children = _children(proc.pid)
    os.kill(second, signal.SIGKILL)  # a second death within a minute: over --max-restarts 1
    assert _wait(proc) != 0
    assert not [c for c in children if Path(f"/proc/{c}").exists()]


# ---------------------------------------------------------------- the children's command lines


CHECKED_VALUES = {"device": "cpu", "log_level": "DEBUG", "allowed_origins": "https://example.test"}


def _other_value(field, kind):
    """A valid value of a setting other than its default."""
    choices = field.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != field.default)
    if kind is bool:
        return not field.default
    if kind is float:
        return field.default / 2 if field.default else 2.5
    if kind is int:
        return (field.default or 0) + 3
    return f"{field.default or 'x'}-set"


def test_every_service_setting_reaches_its_children_through_conveyor_up():
    """Each field of each service's config (but where it listens and whom it calls, which the stack sets) is a
    flag of ``conveyor up``; given a value other than its default, it is on the command line of every child
    whose service has it (a secret in its environment instead), and that command line parses back to that
    value with the real CLI. So a new service flag reaches ``conveyor up`` with no edit."""
    import dataclasses
    import typing

    from conveyor.cli import build_parser, config_class
    from conveyor.config import _base_type, from_args, secrets_env, to_argv
    from conveyor.launcher import ADDRESSING, GRPC_SERVICE, UpConfig, plan, service_settings

    settings = service_settings()
    assert {"numerics", "max_num_seqs", "max_grammar_bytes", "orphan_timeout", "model"} <= settings.keys()
    parser = build_parser()
    up_flags = {a.dest for a in parser._subparsers._group_actions[0].choices["up"]._actions}
    assert settings.keys() <= up_flags
    for service in GRPC_SERVICE:
        cls, env_prefix = config_class(service)
        hints = typing.get_type_hints(cls)
        values = {f.name: _other_value(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls)
                  if f.name not in ADDRESSING}
        values.update({k: v for k, v in CHECKED_VALUES.items() if k in values})
        cfg = UpConfig.of(**values)
        (config,) = [c for name, _, c, _ in plan(cfg, "redis://:pw@127.0.0.1:1/0") if name == service]
        argv, env = ["serve", service, *to_argv(config)], secrets_env(config, env_prefix)
        for key, value in env.items():
            os.environ[key] = value
        try:
            parsed = from_args(cls, build_parser().parse_args(argv))  # the environment is read as the CLI starts
        finally:
            for key in env:
                del os.environ[key]
        assert parsed == config
        for setting_name, value in values.items():
            assert getattr(parsed, setting_name) == value, (service, setting_name)
        assert not any("redis://" in a or "pw" in a for a in argv)



def test_the_ports_a_stack_picks_lie_outside_the_range_its_own_connections_take():
    """A stack's ports are picked before its services bind them; one from the ephemeral range could meanwhile
    become the source port of an outgoing connection (a frontend then failed with 'address already in use'
    while two engines started). They come from below that range, bindable, and never twice."""
    import socket

    from conveyor.launcher import ephemeral_ports

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= p < ephemeral_ports().start for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free as promised
