"""Conveyor's OpenAI HTTP API next to its gRPC API, on one stack, in one run (the same prompts and client).

    python bench/http_vs_grpc.py                     # 32 streams, 64-token prompts and outputs, 3 rounds
    python bench/http_vs_grpc.py --concurrency 8 --rounds 5

Both go through ``conveyor bench``: the gRPC API through the SDK, the HTTP API through its OpenAI
backend (stdlib HTTP, SSE). Rounds alternate so drift in the machine's speed hits both alike; the table
shows each round and the median ratio (HTTP / gRPC output tokens/s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import BenchConfig, ConveyorBackend, OpenAIBackend, summarize, sweep  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="prompt and output tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stack = start(UpConfig.of(port=free_port(), http_port=free_port(), worker_port=0, scheduler_port=0,
                               detokenizer_port=0, deliver_port=0, log_level="WARNING", data_dir=str(Path(tmp) / "r"),
                               **{f"{n}_metrics_port": 0 for n in ("frontend", "scheduler", "worker", "detokenizer")}))
        try:
            base = BenchConfig(concurrency=[args.concurrency], num_requests=args.requests, prompt_tokens=args.tokens,
                               max_tokens=args.tokens, warmup=2)
            grpc_cfg = replace(base, target=stack.endpoint)
            http_cfg = replace(base, target=stack.http_endpoint, backend="openai")
            rows = []
            with Client(stack.endpoint, timeout=600) as client:
                grpc_backend, http_backend = ConveyorBackend(client, grpc_cfg), OpenAIBackend(http_cfg)
                for r in range(args.rounds):
                    rates = []
                    for backend, cfg in ((grpc_backend, grpc_cfg), (http_backend, http_cfg)):
                        [(_, results, wall)] = sweep(backend, cfg)
                        rates.append(summarize(results, wall)["output_tokens_per_second"])
                    rows.append(rates)
                    print(f"round {r + 1}: gRPC {rates[0]:.1f}  HTTP {rates[1]:.1f} output tok/s", flush=True)
            ratio = statistics.median(h / g for g, h in rows)
            print(f"\n{args.concurrency} streams, {args.tokens}/{args.tokens} tokens: HTTP / gRPC output tok/s = "
                  f"{ratio:.3f} (median of {args.rounds} rounds)")
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
