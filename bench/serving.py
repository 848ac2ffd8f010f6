"""Served throughput through the whole stack next to the bare worker step loop, in one run.

    python bench/serving.py                       # concurrency 1, 8, 32 on the default model
    python bench/serving.py --concurrency 8 --rounds 3
    python bench/serving.py --model /path/to/hf-folder --device cuda --concurrency 1 32 256 --kv-cache-bytes 8G

Workload per round: ``c`` requests at once, each a prompt of ``--prompt-tokens`` tokens and exactly
``--max-tokens`` output tokens (ignore_eos, greedy), streamed through the SDK (frontend, scheduler,
worker, detokenizer, Redis). Every request's prompt starts with a token of its own, so the served side's
prefix cache finds nothing to reuse and both sides compute every prompt. The bare loop runs the same shapes on
an in-process ModelRunner (no gRPC, no Redis): all prompts in one step, then ``max_tokens - 1`` decode steps at batch ``c``.
Output tokens/s = completion tokens / wall time; ITL = the gaps between two deltas of a stream, as its client
sees them (percentiles over every stream of every round). Served and bare rounds alternate (one at a time, so
they never compete for the CPU, and drift in the machine's speed hits both alike); the table shows medians.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import percentiles  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.config import parse_size  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402
from conveyor.params import SamplingParams  # noqa: E402
from worker_svc.config import NUMERICS, WorkerConfig  # noqa: E402
from worker_svc.graphs import CudaGraph  # noqa: E402
from worker_svc.kv_cache import KVCache  # noqa: E402
from worker_svc.loader import load_model  # noqa: E402
from worker_svc.runner import ModelRunner, SeqChunk, StepInput  # noqa: E402
from worker_svc.server import resolve_dtype  # noqa: E402


def prompt_text(client: Client, tokens: int) -> str:
    """A prompt of exactly ``tokens`` tokens (checked with the server's Tokenize)."""
    words = "the quick brown fox jumps over the lazy dog while a small bird sings".split()
    text = ""
    i = 0
    while len(client.tokenize(text)) < tokens:
        text += (" " if text else "") + words[i % len(words)]
        i += 1
    return text


FIRST_TOKEN = 1000  # prompts start with 1000, 1001, ...: ordinary tokens of any vocabulary
_handed_out = itertools.count()


def fresh_prompts(prompt_ids: list[int], n: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_ids``'s length, each starting with a token no earlier one started with: no two
    share a prefix, so the served side's prefix cache finds nothing to reuse."""
    return [[FIRST_TOKEN + next(_handed_out), *prompt_ids[1:]] for _ in range(n)]


def served(client: Client, concurrency: int, prompt_ids: list[int], max_tokens: int,
           rounds: int) -> tuple[float, float, list[float]]:
    """(output tokens/s, median time to first token in s, every gap in s between two deltas of a stream) over
    ``rounds`` rounds of ``concurrency`` streams."""
    ttfts: list[float] = []
    gaps: list[float] = []

    def one(ids: list[int]):
        start = time.perf_counter()
        count, first, last = 0, None, None
        for delta in client.stream(prompt_ids=ids, max_tokens=max_tokens, ignore_eos=True, temperature=0):
            if not delta.token_ids:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
            count += len(delta.token_ids)
        ttfts.append(first)
        return count

    tokens = 0
    begin = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(rounds):
            tokens += sum(pool.map(one, fresh_prompts(prompt_ids, concurrency)))
    return tokens / (time.perf_counter() - begin), statistics.median(ttfts), gaps


def bare(runner: ModelRunner, concurrency: int, prompt_ids: list[int], max_tokens: int, rounds: int) -> float:
    bs = runner.cache.block_size
    per_seq = (len(prompt_ids) + max_tokens + bs) // bs
    greedy = SamplingParams(temperature=0.0)
    tokens = 0
    begin = time.perf_counter()
    for r in range(rounds):
        ids = [f"r{r}s{i}" for i in range(concurrency)]
        chunks = [SeqChunk(s, p, 0, new_block_ids=list(range(i * per_seq, (i + 1) * per_seq)), sample=True,
                           sampling=greedy, num_prompt_tokens=len(p))
                  for i, (s, p) in enumerate(zip(ids, fresh_prompts(prompt_ids, concurrency)))]
        last = {x.seq_id: x.sampled.token_id for x in runner.step(StepInput(chunks))}
        for step in range(max_tokens - 1):
            pos = len(prompt_ids) + step
            last = {x.seq_id: x.sampled.token_id for x in
                    runner.step(StepInput([SeqChunk(s, [t], pos, new_block_ids=[], sample=True) for s, t in last.items()]))}
        runner.step(StepInput([], free_seq_ids=ids))
        tokens += concurrency * max_tokens
    return tokens / (time.perf_counter() - begin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating served / bare rounds per concurrency")
    parser.add_argument("--numerics", choices=tuple(NUMERICS), default="fast", help="the worker's --numerics (both sides)")
    parser.add_argument("--model-nice", type=int, default=WorkerConfig.model_nice,
                        help="the served worker's --model-nice (0: its model threads at the other processes' priority)")
    parser.add_argument("--small-step-threads", type=int, default=WorkerConfig.small_step_threads,
                        help="the served worker's --small-step-threads (-1: a lone stream's decode on one core fewer)")
    parser.add_argument("--model", default="default", help="any --model of `conveyor up` (both sides)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides; on a GPU in bf16, flex attention "
                        "and CUDA graphs, as the worker serves)")
    parser.add_argument("--kv-cache-bytes", type=parse_size, default=1 << 30, help="the served worker's KV cache")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)
    loaded = load_model(args.model, device=device, dtype=dtype, numerics=args.numerics)
    need = max(args.concurrency) * ((args.prompt_tokens + args.max_tokens + 32) // 16 + 1)
    runner = ModelRunner(loaded.model, KVCache.allocate(loaded.config, 16, need, device, loaded.kv_dtype()),
                         loaded.max_model_len, seed=0, graphs=CudaGraph.factory() if device.type == "cuda" else None,
                         max_graph_batch=max(args.concurrency))
    if runner.graphs is not None:  # as the served worker does before it serves: no capture inside a timed round
        with torch.inference_mode():
            runner.graphs.capture_all()
    free = {f"{name}_metrics_port": 0 for name in ("frontend", "scheduler", "worker", "detokenizer")}
    stack = start(UpConfig.of(model=args.model, device=args.device, port=free_port(), worker_port=0, scheduler_port=0,
                           detokenizer_port=0, deliver_port=0, kv_cache_bytes=args.kv_cache_bytes, log_level="WARNING",
                           numerics=args.numerics, model_nice=args.model_nice,
                           small_step_threads=args.small_step_threads, **free))
    try:
        with Client(stack.endpoint, timeout=1200) as client:
            prompt = prompt_text(client, args.prompt_tokens)
            prompt_ids = client.tokenize(prompt)
            served(client, 1, prompt_ids, 4, 1)  # warm-up both
            bare(runner, 1, prompt_ids, 4, 1)
            print(f"{loaded.name} on {device} ({str(dtype).removeprefix('torch.')}), prompt {len(prompt_ids)} tokens, "
                  f"{args.max_tokens} output tokens per request, {args.rounds} alternating rounds (medians), "
                  f"{torch.get_num_threads()} threads")
            print(f"{'concurrency':>11}{'served tok/s':>14}{'bare step loop tok/s':>22}{'served/bare':>13}"
                  f"{'median TTFT s':>15}{'ITL p50 ms':>12}{'ITL p90 ms':>12}")
            for c in args.concurrency:
                # served and bare alternate, so that drift in the machine's speed hits both alike
                rows = [(*served(client, c, prompt_ids, args.max_tokens, 1),
                         bare(runner, c, prompt_ids, args.max_tokens, 1)) for _ in range(args.rounds)]
                tps = statistics.median(r[0] for r in rows)
                ttft = statistics.median(r[1] for r in rows)
                ref = statistics.median(r[3] for r in rows)
                ratio = statistics.median(r[0] / r[3] for r in rows)
                itl = percentiles([g for r in rows for g in r[2]])  # a delta's arrival after its stream's last
                print(f"{c:>11}{tps:14.1f}{ref:22.1f}{ratio:13.2f}{ttft:15.3f}{itl['p50'] * 1e3:12.2f}"
                      f"{itl['p90'] * 1e3:12.2f}", flush=True)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
