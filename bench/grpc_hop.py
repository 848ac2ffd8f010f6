"""What one message between two Conveyor processes costs in CPU: the scheduler's ``Push`` stream to the
detokenizer (a ``TokenBatch`` of one request's token), between this process and a server it starts, on the
same transport the services use.

    python bench/grpc_hop.py                              # every variant below, 1,000 messages each
    python bench/grpc_hop.py --messages 3000 --pace-ms 0 2

Variants: the server on gRPC's thread pool (as the detokenizer and the worker) or on ``grpc.aio`` (as the
frontend); the client ``conveyor.grpc_util.AnsweredStream`` (as the scheduler) or ``grpc.aio`` on an event loop
thread; every message answered (as Push and Deliver are) or only every 64th; messages back to back or one every
``--pace-ms`` (as engine steps come). The table gives wall time and the CPU of each side (user + system, the
server's from /proc in 10 ms ticks: use enough messages) per message. On a 2-core Zen 5 (client + server CPU):
back to back and answered each ~210 + ~160 µs, answered every 64th under 10 µs; paced at 2 ms and answered each
~300-390 + ~210-280 µs, every 64th about a third less; ``grpc.aio`` on either side no cheaper than the thread
pool. What a message costs is waking the threads that wait for it, not its bytes: a paced pipeline (a step every
few ms) pays it for every message.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from conveyor import grpc_util  # noqa: E402
from conveyor.launcher import free_port  # noqa: E402
from conveyor.v1 import detokenizer_pb2, detokenizer_pb2_grpc  # noqa: E402


class ThreadPoolPush(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, every: int):
        self.every = every

    def Push(self, request_iterator, context):
        for batch in request_iterator:
            if batch.step % self.every == 0:
                yield detokenizer_pb2.PushResponse(step=batch.step)


class AioPush(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, every: int):
        self.every = every

    async def Push(self, request_iterator, context):
        async for batch in request_iterator:
            if batch.step % self.every == 0:
                yield detokenizer_pb2.PushResponse(step=batch.step)


def serve(kind: str, port: int, every: int) -> None:
    if kind == "threads":
        server = grpc.server(futures.ThreadPoolExecutor(8))
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(ThreadPoolPush(every), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def run() -> None:
        server = grpc.aio.server()
        detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(AioPush(every), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


class AioStream:
    """``send``/``receive`` as ``AnsweredStream``'s, on a ``grpc.aio`` call driven by an event loop thread."""

    def __init__(self, address: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.replies: queue.Queue = queue.Queue()
        asyncio.run_coroutine_threadsafe(self._open(address), self.loop).result()

    async def _open(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = detokenizer_pb2_grpc.DetokenizerStub(self.channel).Push()
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


def measure(server_kind: str, client_kind: str, every: int, pace: float, messages: int) -> tuple[float, float, float]:
    """(wall µs, client CPU µs, server CPU µs) per message."""
    from pipeline_ceiling import cpu_seconds  # bench/ is this script's folder

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", server_kind, str(port), str(every)])
    try:
        address = f"127.0.0.1:{port}"
        grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=30)
        stream = grpc_util.AnsweredStream(detokenizer_pb2_grpc.DetokenizerStub(grpc.insecure_channel(address)).Push,
                                          "push") if client_kind == "threads" else AioStream(address)
        batch = detokenizer_pb2.TokenBatch(requests=[detokenizer_pb2.RequestTokens(
            request_id="0" * 32, first_index=100, token_ids=[1234])])

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


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 2.0],
                        help="a message every this many ms (0: back to back)")
    parser.add_argument("--answer-every", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    print(f"{args.messages} messages per row, {os.cpu_count()} cores (µs per message)")
    print(f"{'server':>8}{'client':>8}{'answered':>10}{'pace ms':>9}{'wall':>8}{'client CPU':>12}{'server CPU':>12}")
    for pace in args.pace_ms:
        for every in args.answer_every:
            for server_kind in ("threads", "aio"):
                for client_kind in ("threads", "aio"):
                    wall, client, server = measure(server_kind, client_kind, every, pace / 1000, args.messages)
                    label = "each" if every == 1 else f"1/{every}"
                    print(f"{server_kind:>8}{client_kind:>8}{label:>10}{pace:9.1f}{wall:8.0f}{client:12.0f}"
                          f"{server:12.0f}", flush=True)


if __name__ == "__main__":
    main()
