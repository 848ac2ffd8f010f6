"""The prefix cache on and off, on the same machine in one run: the same workloads against a stack with
the cache (the default) and one with ``--no-prefix-cache``.

    python bench/prefix_cache.py                        # both workloads
    python bench/prefix_cache.py --chats 32 --system-tokens 1000 --turns 0

1. **Shared system prompt**: ``--chats`` chats at once, each the same ``--system-tokens``-token system
   prompt and a question of its own (after one chat that warms the cache, as earlier traffic would).
2. **Multi-turn**: ``--conversations`` conversations side by side, ``--turns`` turns each; every turn
   resends the whole history (the system prompt, the questions and the answers so far) plus a question.

Printed per workload and stack: TTFT p50 / p90 (client side, to the first token), wall time, output
tokens/s and the prefix-cache hit rate (tokens found cached / tokens looked up, from the scheduler's
Stats), then the TTFT p50 ratio off / on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.client import Client  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402
from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from worker_svc.config import NUMERICS  # noqa: E402

TOPICS = ["billing", "refunds", "shipping", "privacy", "accounts", "security", "warranty", "returns", "support",
          "discounts", "gift cards", "subscriptions", "invoices", "deliveries", "passwords", "complaints"]


def system_prompt(client: Client, tokens: int) -> str:
    """A support agent's rule book of about ``tokens`` tokens (counted by the server's tokenizer)."""
    rules, i = [], 0
    while True:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(f"Rule {i + 1}: when a customer asks about {topic}, answer politely, cite the {topic} policy "
                     f"section {i // len(TOPICS) + 1}, and never promise anything the policy does not say.")
        text = "You are the support assistant of Conveyor Shop.\n" + "\n".join(rules)
        if len(client.tokenize(text)) >= tokens:
            return text
        i += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Run:
    """One stack: the client, and the scheduler's prefix counters around a workload."""

    def __init__(self, stack):
        self.stack = stack
        self.client = Client(stack.endpoint, timeout=1200)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(stack.channel("scheduler"))

    def counters(self) -> tuple[int, int]:
        stats = self.scheduler.Stats(scheduler_pb2.StatsRequest(), timeout=10)
        return stats.prefix_cache_queries, stats.prefix_cache_hits

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
        """(TTFT seconds, reply text, output tokens) of one greedy chat."""
        start, ttft, text, count = time.perf_counter(), None, [], 0
        for delta in self.client.stream(messages=messages, temperature=0, max_tokens=max_tokens):
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - start
            text.append(delta.text)
            count += len(delta.token_ids)
        return ttft if ttft is not None else time.perf_counter() - start, "".join(text), count


def shared_system(run: Run, system: str, chats: int, max_tokens: int) -> dict:
    run.chat([{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}], max_tokens)  # warm
    before = run.counters()
    questions = [f"Question {i}: how do I handle {TOPICS[i % len(TOPICS)]} for order #{1000 + i}?" for i in range(chats)]
    start = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        done = list(pool.map(lambda q: run.chat([{"role": "system", "content": system},
                                                 {"role": "user", "content": q}], max_tokens), questions))
    return _summary(done, time.perf_counter() - start, before, run.counters())


def multi_turn(run: Run, system: str, conversations: int, turns: int, max_tokens: int) -> dict:
    before = run.counters()
    lock, done = threading.Lock(), []

    def converse(c: int) -> None:
        history = [{"role": "system", "content": system}]
        for t in range(turns):
            history.append({"role": "user", "content": f"Conversation {c}, turn {t}: tell me more about "
                                                       f"{TOPICS[(c + t) % len(TOPICS)]}."})
            result = run.chat(history, max_tokens)
            history.append({"role": "assistant", "content": result[1]})
            with lock:
                done.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(conversations) as pool:
        list(pool.map(converse, range(conversations)))
    return _summary(done, time.perf_counter() - start, before, run.counters())


def _summary(done: list[tuple[float, str, int]], wall: float, before, after) -> dict:
    ttfts = [d[0] for d in done]
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": percentile(ttfts, 0.9), "wall": wall,
            "tok_s": sum(d[2] for d in done) / wall, "hit_rate": hits / queries if queries else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="0: skip the multi-turn workload")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--numerics", default="fast", choices=tuple(NUMERICS))
    args = parser.parse_args()
    rows: dict[str, dict[str, dict]] = {}
    for cache in (True, False):
        name = "cache on" if cache else "cache off"
        with tempfile.TemporaryDirectory() as tmp:
            stack = start(UpConfig.of(port=free_port(), http_port=-1, worker_port=0, scheduler_port=0, detokenizer_port=0,
                                   deliver_port=0, log_level="WARNING", data_dir=str(Path(tmp) / "r"),
                                   numerics=args.numerics, prefix_cache=cache,
                                   **{f"{n}_metrics_port": 0 for n in ("frontend", "scheduler", "worker", "detokenizer")}))
            try:
                run = Run(stack)
                system = system_prompt(run.client, args.system_tokens)
                rows.setdefault("shared system prompt", {})[name] = shared_system(run, system, args.chats, args.max_tokens)
                print(f"{name}: shared system prompt done", flush=True)
                if args.turns:
                    rows.setdefault("multi-turn", {})[name] = multi_turn(run, system[: len(system) // 4],
                                                                         args.conversations, args.turns, args.max_tokens)
                    print(f"{name}: multi-turn done", flush=True)
            finally:
                stack.stop()
    print(f"\nshared system prompt: {args.chats} chats, ~{args.system_tokens}-token system prompt; multi-turn: "
          f"{args.conversations} conversations x {args.turns} turns; {args.max_tokens} output tokens each\n")
    print(f"{'workload':<22}{'stack':<11}{'TTFT p50 s':>11}{'TTFT p90 s':>11}{'wall s':>8}{'out tok/s':>10}"
          f"{'hit rate':>9}{'TTFT p50 off/on':>17}")
    for workload, by_stack in rows.items():
        ratio = by_stack["cache off"]["ttft_p50"] / by_stack["cache on"]["ttft_p50"]
        for name, r in by_stack.items():
            print(f"{workload:<22}{name:<11}{r['ttft_p50']:>11.3f}{r['ttft_p90']:>11.3f}{r['wall']:>8.1f}"
                  f"{r['tok_s']:>10.1f}{r['hit_rate']:>9.1%}" + (f"{ratio:>17.1f}" if name == "cache on" else ""))


if __name__ == "__main__":
    main()
