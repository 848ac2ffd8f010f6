"""What a constraint costs: output tokens/s and inter-token latency with and without a grammar, in one run.

    python bench/structured.py                       # the default model, 1, 8 and 32 streams
    python bench/structured.py --concurrency 1 32 --max-tokens 128

Starts a stack (``conveyor up``'s, the default model, fast numerics, no prefix cache: both runs of a level
send the same prompts), then runs each level twice,
interleaved: free text, and every request held to a JSON schema (an array of short strings whose
``minItems`` no output of this length can reach, so every request runs its full ``max_tokens``, as the
free ones do with ``ignore_eos``). Greedy, exact-length prompts, through the gRPC SDK
(``conveyor.bench``'s load generator). The ratio is what a user pays for structured output.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import BenchConfig, ConveyorBackend, make_prompts, run_level, summarize  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1000}


class ConstrainedBackend(ConveyorBackend):
    """The SDK's stream with the schema (no ignore_eos: the grammar cannot end within max_tokens)."""

    def stream(self, prompt: str, max_tokens: int):
        for delta in self.client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                        timeout=self.cfg.timeout, structured={"json_schema": SCHEMA}):
            yield len(delta.token_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=0, help="timed requests per level (default: 2 x streams, >= 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        stack = start(UpConfig.of(model=args.model, port=free_port(), http_port=-1, worker_port=0, scheduler_port=0,
                               detokenizer_port=0, deliver_port=0, data_dir=data, log_level="WARNING",
                               numerics="fast", prefix_cache=False, frontend_metrics_port=0, scheduler_metrics_port=0, worker_metrics_port=0,
                               detokenizer_metrics_port=0))
        try:
            rows = []
            with Client(stack.endpoint, timeout=600) as client:
                for streams in args.concurrency:
                    n = args.requests or max(8, 2 * streams)
                    cfg = BenchConfig(target=stack.endpoint, concurrency=[streams], num_requests=n,
                                      prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, warmup=2)
                    prompts = make_prompts(client, n + cfg.warmup, cfg.prompt_tokens, cfg.seed)
                    row = {}
                    for name, backend in (("free", ConveyorBackend(client, cfg)),
                                          ("json", ConstrainedBackend(client, cfg))):
                        results, wall = run_level(backend, prompts, cfg, concurrency=streams)
                        row[name] = summarize(results, wall)
                    rows.append((streams, row))
        finally:
            stack.stop()
    print(f"\n{args.model}, {args.prompt_tokens} prompt / {args.max_tokens} output tokens, greedy\n")
    print("| streams | free tok/s | JSON schema tok/s | ratio | ITL p50 free / JSON (ms) | ITL p99 free / JSON (ms) |")
    print("|---|---|---|---|---|---|")
    for streams, row in rows:
        free, json_ = row["free"], row["json"]
        ratio = json_["output_tokens_per_second"] / free["output_tokens_per_second"]
        itl = [(free["itl"][q] or 0) * 1000 for q in ("p50", "p99")], [(json_["itl"][q] or 0) * 1000 for q in ("p50", "p99")]
        print(f"| {streams} | {free['output_tokens_per_second']:.1f} | {json_['output_tokens_per_second']:.1f} | "
              f"{ratio:.2f} | {itl[0][0]:.1f} / {itl[1][0]:.1f} | {itl[0][1]:.1f} / {itl[1][1]:.1f} |")
        if free["failures"] or json_["failures"]:
            print(f"  failures: free {free['failures']}, json {json_['failures']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
