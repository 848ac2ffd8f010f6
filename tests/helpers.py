"""Helpers the tests share (not fixtures): runners, the reference forward, service processes."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conveyor import grpc_util, launcher
from conveyor.metrics import scrape, value  # noqa: F401 - re-exported for the tests
from conveyor.launcher import free_port  # noqa: F401 - re-exported for the tests
from worker_svc import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent

needs_kernels = pytest.mark.skipif(not cpu_kernels.available()[0], reason="CPU kernels need x86-64 AVX2 and cc")


def make_runner(loaded, block_size: int = 16, num_blocks: int = 1024, seed: int = 0, threads=None,
                kv_cache_dtype: str = "auto", **options):
    """A runner over a fresh cache on the model's device, in the dtype the worker's ``--kv-cache-dtype`` gives;
    ``options`` go to ``ModelRunner`` (attention, compile_attention, graphs, max_graph_batch)."""
    from worker_svc.kv_cache import KVCache
    from worker_svc.runner import ModelRunner

    dtype = loaded.kv_dtype(kv_cache_dtype, options.get("attention", "auto"))
    cache = KVCache.allocate(loaded.config, block_size, num_blocks, loaded.model.norm.weight.device, dtype)
    return ModelRunner(loaded.model, cache, loaded.max_model_len, seed=seed, threads=threads, **options)


def word_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer ``w0 .. w{n-1}`` for a model folder made in a test."""
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)


def save_hf(model, folder) -> None:
    """A Hugging Face folder of ``model``: safetensors, config and a word-level tokenizer."""
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer(folder, model.config.vocab_size)


def tiny_llama():
    """A random 3-layer Llama with Llama-3 rope scaling, GQA and untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        rope_theta=500000.0,
    )
    model = LlamaForCausalLM(cfg).eval()
    _randomize(model, 1)
    return model


def tiny_qwen2():
    """A random 2-layer Qwen2: q/k/v biases, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False,
        rope_theta=1000000.0,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    _randomize(model, 2)
    return model


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """(n, vocab) logits of transformers at every position of ``ids``."""
    return hf_model(torch.tensor([ids])).logits[0].float()


def wait_serving(address: str, service: str, proc: subprocess.Popen, timeout: float = 120.0,
                 tls_dir: str | None = None) -> None:
    launcher.wait_serving(address, service, proc, timeout, tls_dir=tls_dir)


def wait_child(stack: launcher.Stack, child: launcher.Child, timeout: float = 120.0) -> None:
    """A child of ``stack`` (started again) SERVING, asked with the stack's internal credentials."""
    launcher.wait_serving(child.health, child.service, child.process, timeout, child.name, stack.internal_tls_dir or None)


def conveyor_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "conveyor.cli", *args]


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``conveyor <args>`` as a child process (``env``: more environment); a served process gets a free metrics
    port."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    extra = ["--metrics-port", "0"] if args[:1] == ("serve",) else []
    return subprocess.Popen(
        conveyor_command(*args, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


KV_BLOCK_BYTES = 737280  # one 16-token KV block of the default model (30 layers, 3 KV heads of 64, fp32)
FREE_METRICS_PORTS = {f"{name}_metrics_port": 0 for name in ("frontend", "scheduler", "worker", "detokenizer")}
FREE_METRICS_FLAGS = [a for name in ("frontend", "scheduler", "worker", "detokenizer")
                      for a in (f"--{name}-metrics-port", "0")]


def start_stack(data_dir, **overrides) -> launcher.Stack:
    """``conveyor up``'s stack on free ports (metrics included), quiet logs; ``overrides``: UpConfig fields.
    Exact numerics unless overridden: tests compare greedy outputs across batchings and with transformers."""
    settings = dict(port=free_port(), http_port=free_port(), worker_port=0, scheduler_port=0, detokenizer_port=0, deliver_port=0,
                    data_dir=str(data_dir), log_level="WARNING", numerics="exact", **FREE_METRICS_PORTS)
    return launcher.start(launcher.UpConfig.of(**(settings | overrides)))


@contextlib.contextmanager
def supervised_stack(data_dir, **overrides):
    """``start_stack`` with ``conveyor up``'s supervisor restarting what dies (at most 5 times a minute)."""
    stack = start_stack(data_dir, **overrides)
    supervisor = stack.supervise(max_restarts=5)
    try:
        yield stack
    finally:
        supervisor.set()
        stack.stop()


def internal_tls_env(stack: launcher.Stack) -> dict[str, str]:
    """The environment a process joining ``stack`` needs to talk to its internal services."""
    return {grpc_util.INTERNAL_TLS_ENV: stack.internal_tls_dir} if stack.internal_tls_dir else {}


def extra_frontend(stack: launcher.Stack, *flags: str) -> tuple[subprocess.Popen, str]:
    """Another frontend on ``stack`` (its scheduler, detokenizer and Redis), SERVING; returns it and its
    public address. The caller stops it."""
    port, internal = free_port(), free_port()
    proc = spawn("serve", "frontend", "--port", str(port), "--internal-port", str(internal), "--http-port", "-1",
                 "--detokenizer", stack.child("detokenizer").health,
                 "--redis-url", stack.redis_url, "--log-level", "WARNING", *flags, env=internal_tls_env(stack))
    wait_serving(f"127.0.0.1:{internal}", "conveyor.v1.Frontend", proc, tls_dir=stack.internal_tls_dir or None)
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TinyScheduler:
    """Just enough scheduling to drive a ModelRunner in tests: blocks from a free list, prompts in
    chunks of the given sizes, every sequence decoding greedily (or with its own params)."""

    def __init__(self, runner, chunk_sizes: list[int] | None = None):
        self.runner = runner
        self.free_blocks = list(range(runner.cache.num_blocks))
        self.chunk_sizes = chunk_sizes
        self.accepted = 0  # drafted tokens the runner confirmed, over every run

    def run(self, prompts: list[list[int]], max_tokens: int, params=None, together: bool = True, max_drafts: int = 0,
            structured=None):
        """Returns (tokens, logprobs) per prompt (``max_tokens`` each). ``together``: all sequences share every
        step. ``max_drafts``: each decode may draft that many tokens (its blocks reach that far). ``structured``:
        each prompt's constraint (the runner needs its ``constraints``)."""
        from worker_svc.runner import SeqChunk, StepInput
        from conveyor.params import SamplingParams

        params = params or [SamplingParams(temperature=0.0, logprobs=0)] * len(prompts)
        structured = structured or [None] * len(prompts)
        if not together:
            outs = [self.run([p], max_tokens, [q], max_drafts=max_drafts, structured=[g])
                    for p, q, g in zip(prompts, params, structured)]
            return [o[0][0] for o in outs], [o[1][0] for o in outs]
        seqs = [
            {"id": f"seq{i}", "prompt": p, "done": 0, "out": [], "lp": [], "blocks": [], "params": q, "turn": i,
             "structured": g}
            for i, (p, q, g) in enumerate(zip(prompts, params, structured))
        ]
        bs = self.runner.cache.block_size
        while any(len(s["out"]) < max_tokens for s in seqs):
            chunks, finished = [], []
            for s in seqs:
                if len(s["out"]) >= max_tokens:
                    if s["blocks"]:
                        finished.append(s)
                    continue
                if s["done"] < len(s["prompt"]):
                    size = len(s["prompt"]) - s["done"]
                    if self.chunk_sizes:
                        size = min(size, self.chunk_sizes[s["turn"] % len(self.chunk_sizes)])
                        s["turn"] += 1
                    tokens = s["prompt"][s["done"] : s["done"] + size]
                else:
                    tokens = [s["out"][-1]]
                start = s["done"]
                drafts = max_drafts if start >= len(s["prompt"]) else 0
                need = -(-(start + len(tokens) + drafts) // bs) - len(s["blocks"])
                new = [self.free_blocks.pop() for _ in range(max(need, 0))]
                s["blocks"] += new
                sample = start + len(tokens) >= len(s["prompt"])
                chunks.append(SeqChunk(s["id"], tokens, start, new_block_ids=new, sample=sample,
                                       sampling=s["params"] if start == 0 else None, num_prompt_tokens=len(s["prompt"]),
                                       max_drafts=drafts, structured=s["structured"] if start == 0 else None))
                s["done"] = start + len(tokens)
            free_ids = [s["id"] for s in finished]
            for s in finished:
                self.free_blocks += s["blocks"]
                s["blocks"] = []
            by_id = {s["id"]: s for s in seqs}
            for r in self.runner.step(StepInput(chunks, free_ids)):
                s = by_id[r.seq_id]
                s["out"] += [t.token_id for t in r.tokens]
                s["lp"] += [t.logprob for t in r.tokens]
                s["done"] += len(r.accepted)  # the confirmed drafts' KV is computed
                self.accepted += len(r.accepted)
        leftover = [s for s in seqs if s["blocks"]]
        if leftover:
            self.runner.step(StepInput([], [s["id"] for s in leftover]))
            for s in leftover:
                self.free_blocks += s["blocks"]
                s["blocks"] = []
        return [s["out"][:max_tokens] for s in seqs], [s["lp"][:max_tokens] for s in seqs]


def scheduler_stats(stack, name: str = "scheduler"):
    """The Stats of the stack's scheduler ``name`` (running, waiting, free blocks ...)."""
    from conveyor.v1 import scheduler_pb2, scheduler_pb2_grpc

    with stack.channel(name) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=10)


def drained(stack, timeout: float = 10.0):
    """The scheduler's Stats once nothing runs or waits and every block is free (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler_stats(stack)
        if (stats.running, stats.waiting, stats.free_blocks) == (0, 0, stats.num_blocks) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


class FlakyLink:
    """A service's end of a per-step link (``conveyor.link``) on a real ``LinkServer``, for the faults its sender
    must survive: each message is answered after a random delay, with ``answer(message)``'s reply, or not at all
    when that is None (the link closed, as by a service killed after reading it). ``service``: what its gRPC
    ``Link`` call answers with (``LinkService``); ``stub()``: a stand-in for a stub whose ``Link`` is that call."""

    def __init__(self, seed: int, parse, answer):
        from conveyor.link import LinkServer, LinkService

        self.random = random.Random(seed)
        self.parse, self.answer = parse, answer
        self.links = 0
        self.service = LinkService()
        self.service.listening(LinkServer("127.0.0.1", 0, self._add, "test-link"))

    def _add(self, link) -> None:
        self.links += 1
        threading.Thread(target=self._serve, args=(link,), daemon=True).start()

    def _serve(self, link) -> None:
        while True:
            try:
                message = link.receive(self.parse)
            except (ConnectionError, OSError):
                return
            reply = self.answer(message)
            if reply is None:
                link.close()
                return
            time.sleep(self.random.choice((0, 0, 0, 0.001, 0.004)))
            link.send(reply)

    def stub(self) -> SimpleNamespace:
        return SimpleNamespace(Link=lambda request, timeout=None: self.service.Link(request, None))
