"""Speculative decoding (prompt lookup) on against off, through the whole stack, in one run.

    python bench/speculative.py                                  # 20 prompts per kind, 1, 4 and 32 streams
    python bench/speculative.py --prompts-per-kind 8 --streams 1 4 --numerics exact

Five kinds of prompt, ``--prompts-per-kind`` of each (``conveyor.bench.speculation_prompts``: fixed word lists,
so every run asks the same): repeat a passage, summarize one, edit a piece of code, extract JSON from a sentence, and free chat.
Two stacks run side by side, ``--speculative off`` and ``ngram``; for each number of streams, every kind runs
alone on one stack and then the other (which goes first alternates, so the machine's drift hits both alike):
its prompts ``streams`` at a time, greedy, ``--max-tokens`` each (eos ends a request early, as users see it). The table gives output tokens/s, the median over requests of
the mean gap between a request's tokens (ITL), and with speculation the share of drafted tokens the model
confirmed and how many of the output tokens were such confirmed drafts (from the scheduler's counters). The
ratio column is on / off in the same run; read ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import speculation_prompts  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.config import parse_size  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402
from conveyor.metrics import scrape, value  # noqa: E402
from worker_svc.config import NUMERICS  # noqa: E402

def counters(address: str) -> dict[str, float]:
    """The scheduler's speculation counters."""
    samples = scrape(address)
    return {name: value(samples, name) for name in ("conveyor_spec_draft_tokens_total", "conveyor_spec_accepted_tokens_total")}


def run_kind(client: Client, asks: list[str], streams: int, max_tokens: int) -> tuple[int, float, list[float]]:
    """(output tokens, wall seconds, each request's mean gap between tokens)."""
    def one(ask: str) -> tuple[int, float | None]:
        first = last = None
        count = 0
        for delta in client.stream(messages=[{"role": "user", "content": ask}], max_tokens=max_tokens, temperature=0):
            if delta.token_ids:
                now = time.perf_counter()
                first = now if first is None else first
                last, count = now, count + len(delta.token_ids)
        return count, (last - first) / (count - 1) if count > 1 else None

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = list(pool.map(one, asks))
    wall = time.perf_counter() - start
    return sum(c for c, _ in done), wall, [g for _, g in done if g is not None]


def up(setting: str, args) -> tuple:
    config = UpConfig.of(port=free_port(), http_port=-1, worker_port=0, scheduler_port=0, detokenizer_port=0,
                         deliver_port=0, frontend_metrics_port=0, scheduler_metrics_port=0, worker_metrics_port=0,
                         detokenizer_metrics_port=0, log_level="ERROR", numerics=args.numerics,
                         speculative=setting, spec_tokens=args.spec_tokens, spec_max_batch=args.spec_max_batch,
                         kv_cache_bytes=args.kv_cache_bytes)
    stack = start(config)
    client = Client(stack.endpoint, timeout=600)
    run_kind(client, ["Say hi."] * 2, 2, 8)  # warm up
    return stack, client


def measure(stacks: dict, kinds: dict[str, list[str]], args) -> dict[tuple[str, int, str], dict]:
    """Every kind at every number of streams on each stack, the stacks taking turns (and which goes first
    alternating), so that the machine's drift hits both alike."""
    results = {}
    turn = 0
    for streams in args.streams:
        for kind, asks in kinds.items():
            order = list(stacks) if turn % 2 == 0 else list(reversed(stacks))
            turn += 1
            for setting in order:
                stack, client = stacks[setting]
                metrics = stack.child("scheduler").metrics
                before = counters(metrics)
                tokens, wall, gaps = run_kind(client, asks, streams, args.max_tokens)
                after = counters(metrics)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                results[setting, streams, kind] = {
                    "tok/s": tokens / wall, "itl": statistics.median(gaps) if gaps else 0.0, "tokens": tokens,
                    "drafted": delta.get("conveyor_spec_draft_tokens_total", 0.0),
                    "accepted": delta.get("conveyor_spec_accepted_tokens_total", 0.0)}
                print(f"  {setting:5} {streams:3} streams  {kind:10} {tokens / wall:7.1f} tok/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-kind", type=int, default=20)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--numerics", choices=tuple(NUMERICS), default="fast")
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--spec-max-batch", type=int, default=8)
    parser.add_argument("--kv-cache-bytes", type=parse_size, default=parse_size("512M"))
    args = parser.parse_args()
    kinds = speculation_prompts(args.prompts_per_kind)
    stacks = {}
    try:
        for setting in ("off", "ngram"):
            stacks[setting] = up(setting, args)
        results = measure(stacks, kinds, args)
    finally:
        for stack, client in stacks.values():
            client.close()
            stack.stop()
    print(f"\n{args.prompts_per_kind} prompts per kind, greedy, up to {args.max_tokens} tokens, --numerics "
          f"{args.numerics}, --spec-tokens {args.spec_tokens}, --spec-max-batch {args.spec_max_batch}")
    print("| streams | kind | off tok/s | ngram tok/s | ratio | ITL off / on (ms) | drafts confirmed |")
    print("|---|---|---|---|---|---|---|")
    for streams in args.streams:
        for kind in kinds:
            a, b = results["off", streams, kind], results["ngram", streams, kind]
            share = f"{b['accepted'] / b['drafted']:.0%}" if b["drafted"] else "none drafted"
            print(f"| {streams} | {kind} | {a['tok/s']:.1f} | {b['tok/s']:.1f} | {b['tok/s'] / a['tok/s']:.2f} | "
                  f"{a['itl'] * 1000:.0f} / {b['itl'] * 1000:.0f} | {share} ({b['accepted']:.0f} of {b['tokens']}) |")


if __name__ == "__main__":
    main()
