"""What the pipeline itself costs per output token: a model so small that the worker's arithmetic is
negligible, served through the real stack (frontend, scheduler, worker, detokenizer, Redis).

    python bench/pipeline_ceiling.py                      # 1, 32 and 128 streams
    python bench/pipeline_ceiling.py --streams 128 --max-tokens 128
    python bench/pipeline_ceiling.py --streams 1 128 --profile /tmp/prof   # and where each process spends it
    python bench/pipeline_ceiling.py --streams 128 --profile /tmp/prof --gil   # only its Python's CPU
    python bench/pipeline_ceiling.py --api openai        # the clients on the OpenAI HTTP API instead of gRPC
    python bench/pipeline_ceiling.py --streams 128 --stream-interval 4   # the frontend sends 4 tokens a message

The model is made here: a 1-layer Llama with hidden size 64 and random weights, with the default
model's tokenizer (vocabulary 49,152), written as a Hugging Face folder in a temporary directory.
For each level, ``streams`` clients stream at once (greedy, ``ignore_eos``, 16-token prompts); the
table gives output tokens/s and each process's CPU time per output token (user + system, from
/proc), the benchmark client's own included, and how often the worker's threads were preempted per output token
(with ``--model default`` on a CPU: each a model thread stopped mid-step by another process's wake). On a GPU host this per-token CPU is what caps
throughput. ``--profile DIR`` samples every service with py-spy (``pip install py-spy``; not a dependency) during
each level, writes its collapsed stacks to ``DIR/<streams>-<process>.txt`` and prints each process's functions
with the most samples of their own and in total.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import BenchConfig, ConveyorBackend, OpenAIBackend  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402
from worker_svc.config import NUMERICS  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2}


def make_tiny_model(folder: Path, tokenizer_from="default", shape: dict | None = None, std: float = 0.05) -> Path:
    """A Llama with random weights (``shape``: config.json's sizes; a 1-layer one with hidden size 64 by
    default) and the tokenizer of ``tokenizer_from`` (any --model, or a ``ModelTokenizer``), as a Hugging
    Face folder."""
    import torch
    from safetensors.torch import save_file

    from conveyor.tokenizer import ModelTokenizer, load_tokenizer

    tokenizer = tokenizer_from if isinstance(tokenizer_from, ModelTokenizer) else load_tokenizer(tokenizer_from)
    shape = shape or TINY
    vocab, hidden, inter = tokenizer.vocab_size, shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, **shape,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "eos_token_id": list(tokenizer.eos_token_ids), "bos_token_id": tokenizer.bos_token_id}
    g = torch.Generator().manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=g) * std).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(shape["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights |= {layer + "input_layernorm.weight": torch.ones(hidden),
                    layer + "post_attention_layernorm.weight": torch.ones(hidden),
                    layer + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                    layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                    layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                    layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                    layer + "mlp.gate_proj.weight": rand(inter, hidden),
                    layer + "mlp.up_proj.weight": rand(inter, hidden),
                    layer + "mlp.down_proj.weight": rand(hidden, inter)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}))
    return folder


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def preemptions(pid: int) -> int:
    """How often the process's threads were preempted so far (their involuntary context switches). For the worker,
    each is a model thread stopped mid-step while its partner waits at a barrier (on a CPU with as many model threads
    as cores), most of them by another process's wake between two tokens."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            total += sum(int(line.split()[1]) for line in status.read_text().splitlines()
                         if line.startswith("nonvoluntary_ctxt_switches:"))
        except OSError:  # a thread that ended meanwhile
            pass
    return total


def start_profiles(pids: dict[str, int], folder: Path, tag: str, gil: bool = False) -> list[tuple[subprocess.Popen, Path]]:
    """py-spy on every service process, until ``report_profiles``; ``gil``: only the thread holding the GIL
    (where each process's Python spends its CPU, not where its threads wait)."""
    folder.mkdir(parents=True, exist_ok=True)
    running = []
    for name, pid in pids.items():
        if name in ("redis", "client"):
            continue
        out = folder / f"{tag}-{name}.txt"
        proc = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "1000" if gil else "200",
                                 "--nonblocking", *(["--gil"] if gil else []), "--output", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        running.append((proc, out))
    time.sleep(1.0)  # py-spy attaches
    return running


def report_profiles(running: list[tuple[subprocess.Popen, Path]], top: int = 8) -> None:
    """Stop the samplers and print, per process, the functions with the most samples (own, and in total)."""
    for proc, _ in running:
        proc.send_signal(signal.SIGINT)
    for proc, out in running:
        proc.wait(timeout=60)
        own, total, samples = Counter(), Counter(), 0
        for line in out.read_text().splitlines() if out.exists() else []:
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")]
            samples += int(count)
            own[frames[-1]] += int(count)
            for f in set(frames):
                total[f] += int(count)
        print(f"  {out.name}: {samples} samples")
        for (f, n), (g, m) in zip(own.most_common(top), total.most_common(top)):
            print(f"    own {100 * n / max(samples, 1):5.1f}%  {f[:60]:<60}  total {100 * m / max(samples, 1):5.1f}%  {g[:70]}")


def level(backend, pids: dict[str, int], streams: int, requests: int, max_tokens: int) -> dict:
    prompt = " ".join(["hello"] * 16)

    def one(_):
        return sum(backend.stream(prompt, max_tokens))

    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    preempted = preemptions(pids["worker"])
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return {"tokens_per_second": tokens / wall, "cpu_ms_per_token": {n: 1000 * s / tokens for n, s in used.items()},
            "worker_preemptions_per_token": (preemptions(pids["worker"]) - preempted) / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="'tiny' (made here), or any --model of `conveyor up` "
                        "('default': where the worker's arithmetic shows next to the pipeline's)")
    parser.add_argument("--numerics", choices=tuple(NUMERICS), default="fast")
    parser.add_argument("--tokenizer", default="default", help="the tiny model's tokenizer: that of this --model")
    parser.add_argument("--internal-tls", action=argparse.BooleanOptionalAction, default=True,
                        help="internal mutual TLS, as conveyor up by default (--no-internal-tls: plain gRPC)")
    parser.add_argument("--api", choices=("conveyor", "openai"), default="conveyor",
                        help="the clients' API: gRPC through the SDK, or the OpenAI HTTP API (streamed completions)")
    parser.add_argument("--profile", type=Path, help="sample each service with py-spy into this folder")
    parser.add_argument("--stream-interval", type=int, default=1, help="the frontend's --stream-interval")
    parser.add_argument("--gil", action="store_true", help="with --profile: sample only the thread holding the GIL")
    args = parser.parse_args()
    if args.profile and not shutil.which("py-spy"):
        parser.error("--profile needs py-spy on PATH (pip install py-spy)")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-llama", args.tokenizer) if args.model == "tiny" else args.model
        stack = start(UpConfig.of(model=str(model), port=free_port(), http_port=free_port(), worker_port=0,
                               scheduler_port=0, detokenizer_port=0, deliver_port=0, kv_cache_bytes=256 << 20, max_num_seqs=256, log_level="WARNING",
                               numerics=args.numerics, internal_tls=args.internal_tls,
                               stream_interval=args.stream_interval,
                               data_dir=str(Path(tmp) / "redis"),
                               **{f"{n}_metrics_port": 0 for n in ("frontend", "scheduler", "worker", "detokenizer")}))
        try:
            pids = {c.name: c.process.pid for c in stack.children}
            pids["client"] = os.getpid()
            names = ["frontend", "scheduler", "worker", "detokenizer", "redis", "client"]
            with Client(stack.endpoint, timeout=600) as client:
                backend = ConveyorBackend(client, BenchConfig(target=stack.endpoint)) if args.api == "conveyor" else \
                    OpenAIBackend(BenchConfig(target=stack.http_endpoint, backend="openai", model=str(model)))
                level(backend, pids, 4, 4, 8)  # warm-up
                what = "tiny random Llama (1 layer, hidden 64, vocab 49,152)" if args.model == "tiny" else args.model
                print(f"{what}, {args.max_tokens} output tokens per request, {os.cpu_count()} cores, {args.api} API, "
                      f"stream interval {args.stream_interval}")
                print(f"{'streams':>8}{'tok/s':>10}   CPU ms per output token: " + "".join(f"{n:>12}" for n in names)
                      + "   worker preempted a token")
                for streams in args.streams:
                    profiles = start_profiles(pids, args.profile, str(streams), args.gil) if args.profile else []
                    r = level(backend, pids, streams, streams * args.requests_per_stream, args.max_tokens)
                    cpu = r["cpu_ms_per_token"]
                    print(f"{streams:>8}{r['tokens_per_second']:10.1f}{'':28}" + "".join(f"{cpu[n]:12.3f}" for n in names)
                          + f"{r['worker_preemptions_per_token']:26.2f}", flush=True)
                    if profiles:
                        report_profiles(profiles)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
