"""What one message between two Conveyor processes costs in CPU, over a link (``conveyor/link.py``, what the
services use for their per-step streams) and over gRPC (what they used before), in one run: a scheduler-like
client sends a ``TokenBatch`` of one request's token to a server it starts, which answers with a ``PushResponse``.

    python bench/grpc_hop.py                              # every variant below, 1,000 messages each
    python bench/grpc_hop.py --messages 3000 --pace-ms 0 2
    python bench/grpc_hop.py --tls                        # with the internal mutual TLS (conveyor up's default)

Variants: a link (a thread per link on the server, as the worker and the detokenizer serve theirs; the link on
an event loop, as the frontend serves its, ``link-aio``), dialled over TCP (client ``link``: with TLS under
``--tls``) or to its abstract Unix socket (client ``local``: what services in one network namespace use, never
TLS); a gRPC bidirectional stream on gRPC's thread
pool or on ``grpc.aio``, its client ``AnsweredStream`` below (requests from a queue, answers read on a thread of
their own, as the scheduler's was) or ``grpc.aio`` on an event loop thread; every message answered or only every
64th; back to back or one every ``--pace-ms`` (as engine steps come). The table gives wall time and the CPU of
each side (user + system, the server's from /proc in 10 ms ticks: use enough messages) per message. On a 2-core
Zen 5, paced at 2 ms and answered each: gRPC ~300-390 µs of client and ~210-280 µs of server CPU whichever API
(most of it waking threads: back to back and answered every 64th, under 10 µs), a link ~100 + ~60 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from conveyor.launcher import free_port  # noqa: E402
from conveyor.link import Link, LinkServer, serve_on_loop  # noqa: E402
from conveyor.v1 import detokenizer_pb2  # noqa: E402

METHOD = "/bench.Hop/Push"
BATCH, ANSWER = detokenizer_pb2.TokenBatch, detokenizer_pb2.PushResponse


def answer(batch, every: int):
    return ANSWER(step=batch.step) if batch.step % every == 0 else None


def serve(kind: str, port: int, every: int, name_file: str) -> None:
    """The server side, in its own process: ``kind`` threads | aio (gRPC) or link | link-aio (which write their
    local socket's name and key to ``name_file``)."""
    if kind == "threads":
        def push(request_iterator, context):
            for batch in request_iterator:
                if (reply := answer(batch, every)) is not None:
                    yield reply

        server = grpc.server(futures.ThreadPoolExecutor(8))
        server.add_generic_rpc_handlers([_handler(push)])
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
    elif kind == "link":
        def run(link: Link) -> None:
            while True:
                try:
                    batch = link.receive(BATCH.FromString)
                except ConnectionError:
                    return  # the client is done
                if (reply := answer(batch, every)) is not None:
                    link.send(reply)

        links = LinkServer("127.0.0.1", port,
                           lambda link: threading.Thread(target=run, args=(link,), daemon=True).start(), "hop")
        Path(name_file).write_text(f"{links.local.name} {links.local.key.hex()}")
        threading.Event().wait()
    else:
        asyncio.run(_serve_aio(kind, port, every, name_file))


def _handler(push: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("bench.Hop", {"Push": grpc.stream_stream_rpc_method_handler(
        push, request_deserializer=BATCH.FromString, response_serializer=ANSWER.SerializeToString)})


async def _serve_aio(kind: str, port: int, every: int, name_file: str) -> None:
    if kind == "link-aio":  # every message is answered there (the frontend's deltas are)
        links = await serve_on_loop("127.0.0.1", port, BATCH.FromString, lambda batch: ANSWER(step=batch.step), "hop")
        Path(name_file).write_text(f"{links.local.name} {links.local.key.hex()}")
        await asyncio.Event().wait()

    async def push(request_iterator, context):
        async for batch in request_iterator:
            if (reply := answer(batch, every)) is not None:
                yield reply

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([_handler(push)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class AnsweredStream:
    """A gRPC bidirectional call whose every request gets one answer, in order: requests go out from a queue,
    answers are read on a thread of their own (what the scheduler and the detokenizer used before links)."""

    def __init__(self, channel: grpc.Channel):
        self.requests: queue.Queue = queue.Queue()
        self.call = channel.stream_stream(METHOD, request_serializer=BATCH.SerializeToString,
                                          response_deserializer=ANSWER.FromString)(iter(self.requests.get, None))
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.put(reply)
        except grpc.RpcError:
            pass  # closed

    def send(self, message) -> None:
        self.requests.put(message)

    def receive(self, timeout: float):
        return self.replies.get(timeout=timeout)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()


class AioStream:
    """``send``/``receive`` as ``AnsweredStream``'s, on a ``grpc.aio`` call driven by an event loop thread."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.replies: queue.Queue = queue.Queue()
        asyncio.run_coroutine_threadsafe(self._open(address), self.loop).result()

    async def _open(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = self.channel.stream_stream(METHOD, request_serializer=BATCH.SerializeToString,
                                               response_deserializer=ANSWER.FromString)()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.tasks = [self.loop.create_task(self._write()), self.loop.create_task(self._read())]

    async def _write(self) -> None:
        while True:
            await self.call.write(await self.outbox.get())

    async def _read(self) -> None:
        while (reply := await self.call.read()) is not grpc.aio.EOF:
            self.replies.put(reply)

    async def _close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.call.cancel()
        await self.channel.close()

    def send(self, message) -> None:
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, message)

    def receive(self, timeout: float):
        return self.replies.get(timeout=timeout)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class LinkStream:
    """``send``/``receive`` on a link, both on the caller's thread (as the scheduler's): to its local socket
    ``local_name``, or over TCP ("")."""

    def __init__(self, port: int, local_name: str = "", local_key: bytes = b""):
        self.link = Link.connect("127.0.0.1", port, timeout=30, local_name=local_name, local_key=local_key)

    def send(self, message) -> None:
        self.link.send(message)

    def receive(self, timeout: float):
        return self.link.receive(ANSWER.FromString, timeout)

    def close(self) -> None:
        self.link.close()


def connect(client_kind: str, port: int, name_file: Path):
    deadline = time.monotonic() + 30
    while True:  # until the server listens
        try:
            if client_kind == "link":
                return LinkStream(port)
            if client_kind == "local":  # the name is written once both sockets listen
                if not (written := name_file.read_text().split() if name_file.exists() else []):
                    raise OSError("the server names no local socket yet")
                return LinkStream(port, written[0], bytes.fromhex(written[1]))
            address = f"127.0.0.1:{port}"
            channel = grpc.insecure_channel(address)
            grpc.channel_ready_future(channel).result(timeout=30)
            return AnsweredStream(channel) if client_kind == "threads" else AioStream(address)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure(server_kind: str, client_kind: str, every: int, pace: float, messages: int) -> tuple[float, float, float]:
    """(wall µs, client CPU µs, server CPU µs) per message."""
    from pipeline_ceiling import cpu_seconds  # bench/ is this script's folder

    port = free_port()
    name_file = Path(tempfile.mkdtemp()) / "name"
    server = subprocess.Popen([sys.executable, __file__, "--serve", server_kind, str(port), str(every), str(name_file)])
    try:
        stream = connect(client_kind, port, name_file)
        batch = BATCH(requests=[detokenizer_pb2.RequestTokens(request_id="0" * 32, first_index=100, token_ids=[1234])])

        def run(first: int, count: int) -> None:
            for step in range(first, first + count):
                batch.step = step
                stream.send(batch)
                if step % every == 0:
                    stream.receive(30)
                if pace:
                    time.sleep(pace)

        run(0, 128)  # warm-up
        server_before = cpu_seconds(server.pid)
        own = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        run(128, messages)
        wall = time.perf_counter() - start
        used = resource.getrusage(resource.RUSAGE_SELF)
        client = used.ru_utime - own.ru_utime + used.ru_stime - own.ru_stime
        server_cpu = cpu_seconds(server.pid) - server_before
        stream.close()
        return wall / messages * 1e6, client / messages * 1e6, server_cpu / messages * 1e6
    finally:
        server.kill()
        server.wait()


VARIANTS = [("link", "link"), ("link", "local"), ("link-aio", "link"), ("link-aio", "local"), ("threads", "threads"),
            ("threads", "aio"), ("aio", "threads"), ("aio", "aio")]  # (server, client)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 2.0],
                        help="a message every this many ms (0: back to back)")
    parser.add_argument("--answer-every", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tls", action="store_true",
                        help="links over TCP with the internal mutual TLS (certificates made in a temporary folder)")
    args = parser.parse_args()
    if args.tls:
        from conveyor.credentials import make_internal_tls  # noqa: PLC0415 - cryptography only when asked for
        from conveyor.grpc_util import INTERNAL_TLS_ENV  # noqa: PLC0415

        folder = tempfile.mkdtemp()
        make_internal_tls(folder)
        os.environ[INTERNAL_TLS_ENV] = folder  # this process's links and the servers it starts
    print(f"{args.messages} messages per row, {os.cpu_count()} cores (µs per message){', TLS' if args.tls else ''}")
    print(f"{'server':>9}{'client':>8}{'answered':>10}{'pace ms':>9}{'wall':>8}{'client CPU':>12}{'server CPU':>12}")
    for pace in args.pace_ms:
        for every in args.answer_every:
            for server_kind, client_kind in VARIANTS:
                if server_kind == "link-aio" and every != 1:
                    continue
                wall, client, server = measure(server_kind, client_kind, every, pace / 1000, args.messages)
                label = "each" if every == 1 else f"1/{every}"
                print(f"{server_kind:>9}{client_kind:>8}{label:>10}{pace:9.1f}{wall:8.0f}{client:12.0f}"
                      f"{server:12.0f}", flush=True)


if __name__ == "__main__":
    main()
