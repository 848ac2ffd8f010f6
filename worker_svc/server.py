"""``conveyor serve worker``: the Worker gRPC service over a ``ModelRunner``.

Protobuf messages are converted to the runner's dataclasses here and nowhere else.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

from conveyor import grpc_util
from conveyor.errors import InvalidArgument
from conveyor.link import Link, LinkServer, LinkService
from conveyor.metrics import Metrics
from conveyor.params import Limits, SamplingParams, StopParams, Structured, from_pb
from conveyor.structured import Constraints
from conveyor.v1 import worker_pb2, worker_pb2_grpc
from worker_svc import cpu_kernels
from worker_svc.config import WorkerConfig
from worker_svc.graphs import CudaGraph
from worker_svc.kv_cache import GpuMemory, KVCache, bytes_per_block, kv_budget_bytes
from worker_svc.loader import LoadedModel, load_model
from worker_svc.packed import PackedLinear
from worker_svc.runner import InvalidStep, ModelRunner, SeqChunk, StepInput, StepResult


log = logging.getLogger("conveyor.worker")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
VERIFY_DRAFTS = 8  # speculation's cost model is measured up to this many drafts (the scheduler extrapolates)
T = TypeVar("T")


# ---------------------------------------------------------------- protobuf <-> dataclasses


def registration_from_pb(c: worker_pb2.SequenceChunk, limits: Limits) -> tuple[SamplingParams, StopParams]:
    """A registering chunk's sampling and stop parameters, checked against the ranges the sampler relies on
    (the frontend checks users' values under its own limits; this guards the wire)."""
    sampling, stop = from_pb(SamplingParams, c.sampling), from_pb(StopParams, c.stop)
    try:
        sampling.check(limits)
        stop.check(limits)
    except InvalidArgument as exc:
        raise InvalidStep(f"sequence {c.seq_id!r}: {exc}", c.seq_id) from None
    return sampling, stop


NO_STOP = StopParams()  # a chunk that does not register: its stop is unused (one frozen instance, not one a chunk)


def step_from_pb(pb: worker_pb2.StepRequest, limits: Limits) -> StepInput:
    chunks = []
    for c in pb.chunks:
        sampling, stop = registration_from_pb(c, limits) if c.HasField("sampling") else (None, NO_STOP)
        structured = Structured.from_pb(c.structured) if c.HasField("structured") else None
        chunks.append(SeqChunk(c.seq_id, c.token_ids[:], c.start_pos, new_block_ids=c.new_block_ids[:],
                               sample=c.sample, sampling=sampling, num_prompt_tokens=c.num_prompt_tokens,
                               decode_last=c.decode_last, cached_token_ids=c.cached_token_ids[:], stop=stop,
                               structured=structured, max_drafts=c.max_drafts))
    return StepInput(chunks, pb.free_seq_ids[:], pb.free_all)


def _token_into(pb: worker_pb2.SampledToken, token_id: int, logprob: float, top: list[tuple[int, float]],
                error: str | None = None) -> None:
    """Fill an added token in place with only the fields that are set (an id and a logprob, most of them)."""
    pb.token_id, pb.logprob = token_id, logprob
    if error:
        pb.error = error
    for t, lp in top:
        pb.top_logprobs.add(token_id=t, logprob=lp)


def results_to_pb(step_id: int, results: list[StepResult], seconds: float) -> worker_pb2.StepResponse:
    """The step's answer, each token added in place (0.8 against 3.0 us a decode's token built from keywords)."""
    reply = worker_pb2.StepResponse(step_id=step_id, compute_seconds=seconds)
    add = reply.tokens.add
    for r in results:
        if (s := r.sampled) is None:
            continue
        token = add(seq_id=r.seq_id)
        _token_into(token, s.token_id, s.logprob, s.top_logprobs, s.error)
        for a in r.accepted:
            _token_into(token.accepted.add(), a.token_id, a.logprob, a.top_logprobs)
        if r.drafted:
            token.drafted = r.drafted
    for r in results:
        if r.prompt is not None:
            prompt = reply.prompt_logprobs.add(seq_id=r.seq_id, first_position=r.prompt[0])
            for scored in r.prompt[1]:
                _token_into(prompt.tokens.add(), scored.token_id, scored.logprob, scored.top_logprobs)
                prompt.ranks.append(scored.rank)
    return reply


# ---------------------------------------------------------------- the service


class ModelThread(threading.Thread):
    """The one thread that touches the model: it builds the runner, then serves the steps. GNU OpenMP keeps a
    thread team per thread that opens a parallel region and counts every team's threads; once they outnumber the
    cores, threads stop spinning at a barrier and sleep in the kernel instead. A model built on the main thread
    and stepped on another had two teams on 2 cores: ~100 sleeps and wake-ups per decode step, and a served step
    at 8 streams took 24 ms (18 ms with one team)."""

    def __init__(self):
        super().__init__(name="model", daemon=True)
        self.calls: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue()
        self.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self.calls.put((fn, future))
        return future

    def run(self) -> None:
        while True:
            fn, future = self.calls.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(exc)


class WorkerService(LinkService, worker_pb2_grpc.WorkerServicer):
    """``Info`` over gRPC, and the steps of the scheduler's step link (``conveyor.link``) on one thread of their
    own: it reads a step, runs it and answers, then reads the next, which the scheduler sent while this one ran,
    so a busy worker never sleeps between steps and a step costs no hand-off between threads. Every step runs on
    this one thread, the ``ModelThread`` that built the runner: steps mutate the cache and sequence state, and an
    OpenMP runtime keeps a thread team per calling thread. A new link replaces the one before it (a scheduler that
    restarted; the old one is closed)."""

    def __init__(self, runner: ModelRunner, info: worker_pb2.InfoResponse, metrics: Metrics, model: ModelThread):
        self.runner = runner
        self.info = info
        self.limits = Limits.wire(info.max_model_len, info.vocab_size)
        self.metrics = metrics
        self.links: queue.Queue[Link] = queue.Queue()
        self.current: Link | None = None
        self.lock = threading.Lock()
        model.submit(self._serve_links)

    def Info(self, request, context):
        return self.info

    def add_link(self, link: Link) -> None:
        """A scheduler connected (from the link server's thread): its link replaces the current one."""
        with self.lock:
            previous, self.current = self.current, link
        self.links.put(link)
        if previous is not None:
            previous.interrupt()  # the step thread, blocked reading it or answering on it, moves on

    def _serve_links(self) -> None:
        while True:
            link = self.links.get()
            if link is not self.current:  # a newer one replaced it before it was served
                link.close()
                continue
            link.answer_each("step", worker_pb2.StepRequest.FromString,
                             lambda request: self._run(request.step_id, step_from_pb(request, self.limits)),
                             self._refusal)

    @staticmethod
    def _refusal(exc: Exception) -> tuple[str, str, str | None]:
        """A failed step's error for the scheduler, naming the sequence at fault when it is known (the scheduler
        then blames that request alone; otherwise it finds it by running suspects alone)."""
        seq_id = getattr(exc, "seq_id", None)
        if isinstance(exc, InvalidStep):
            return "INVALID_ARGUMENT", str(exc), seq_id
        log.error("step failed: %s", exc, exc_info=True)
        return "INTERNAL", f"step failed: {type(exc).__name__}: {exc}", seq_id

    def _run(self, step_id: int, step: StepInput) -> worker_pb2.StepResponse:
        start = time.perf_counter()
        results = self.runner.step(step)
        seconds = time.perf_counter() - start
        self.metrics.worker_forward_seconds.observe(seconds)
        self.metrics.worker_tokens.inc(sum(len(c.token_ids) or 1 for c in step.chunks))
        self.metrics.worker_sequences.set(len(self.runner.seqs))
        for c in step.chunks:
            if c.structured is not None and c.registers:
                self.metrics.worker_constrained_sequences.labels(c.structured.kind).inc()
        if self.runner.mask_seconds is not None:
            self.metrics.worker_mask_seconds.observe(self.runner.mask_seconds)
        self.metrics.worker_constraint_errors.inc(sum(r.sampled is not None and r.sampled.error is not None
                                                      for r in results))
        return results_to_pb(step_id, results, seconds)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def small_step_threads(setting: int, threads: int, model) -> int:
    """The threads of a step of one token (``--small-step-threads``): -1 leaves a core to the other processes when
    the model's linear weights are quantized (a lone decode reads ~0.6 bytes a weight, which one core streams
    about as fast as two) and takes every thread for dense ones (a bf16 folder as stored reads 2 bytes a weight,
    and one thread draws less memory bandwidth than two); 0 every thread; n that many."""
    if setting > 0:
        return setting
    linear = model.layers[0].mlp.down_proj
    quantized = isinstance(linear, PackedLinear) and linear.qtype in cpu_kernels.QUANTIZED
    return max(1, threads - 1) if setting < 0 and quantized else threads


def lower_priority(step: int) -> None:
    """Add ``step`` to this thread's nice value (at most 19), before it starts its OpenMP threads: Linux keeps a
    nice value per thread and a new thread starts with its creator's. Raising it needs no privilege."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except OSError as exc:  # not Linux's per-thread semantics, or a sandbox that refuses it
        log.warning("could not lower the model thread's priority (--model-nice): %s", exc)


def build_runner(cfg: WorkerConfig) -> tuple[ModelRunner, LoadedModel, worker_pb2.InfoResponse]:
    """Load the model, size and allocate the KV cache, and describe it all for ``Info``."""
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.model_nice:
        lower_priority(cfg.model_nice)
    dtype = resolve_dtype(cfg.dtype, device)
    cpu_kernels.use_isa(cfg.cpu_isa)
    started = time.perf_counter()
    loaded = load_model(cfg.model, device=device, dtype=dtype, max_model_len=cfg.max_model_len,
                        attention=cfg.attention, numerics=cfg.numerics, quantize=cfg.quantize)
    cache_dtype = loaded.kv_dtype(cfg.kv_cache_dtype, cfg.attention)
    block_bytes = bytes_per_block(loaded.config, cfg.block_size, cache_dtype)
    memory = None
    if device.type == "cuda" and cfg.kv_cache_bytes is None:
        memory = profile_step(loaded, cfg.block_size, min(cfg.profile_tokens, loaded.max_model_len), device, dtype,
                              cfg.attention)
    num_blocks = kv_budget_bytes(device, cfg.kv_cache_bytes, cfg.gpu_memory_utilization, memory) // block_bytes
    if num_blocks < 1:
        if memory is not None:
            raise ValueError(f"no GPU memory is left for the KV cache: --gpu-memory-utilization {cfg.gpu_memory_utilization} "
                             f"of {memory.total / 2**30:.1f} GiB, the weights and a {cfg.profile_tokens}-token step "
                             f"took {memory.peak / 2**30:.1f} GiB, {memory.free / 2**30:.1f} GiB free")
        raise ValueError(f"--kv-cache-bytes is smaller than one block ({block_bytes} bytes)")
    cache = KVCache.allocate(loaded.config, cfg.block_size, num_blocks, device, cache_dtype)
    threads = cfg.threads or torch.get_num_threads()  # PyTorch's default: the cores this process may use
    small = small_step_threads(cfg.small_step_threads, threads, loaded.model)
    graphs = CudaGraph.factory() if device.type == "cuda" and cfg.cuda_graphs else None
    runner = ModelRunner(loaded.model, cache, loaded.max_model_len, seed=cfg.seed, fail_on_token=cfg.fail_on_token,
                         threads=(threads, min(small, threads)), attention=cfg.attention, graphs=graphs,
                         max_graph_batch=cfg.max_graph_batch, ngram=(cfg.spec_min_ngram, cfg.spec_max_ngram),
                         constraints=Constraints(loaded.tokenizer.tokenizer.to_str(), loaded.config.vocab_size,
                                                 loaded.tokenizer.eos_token_ids))
    if runner.graphs is not None:
        with torch.inference_mode():
            runner.graphs.capture_all()
    verify_cost = runner.verify_cost(VERIFY_DRAFTS)
    log.info(
        "loaded %s in %.2fs on %s (%s%s%s): %d KV blocks x %d tokens = %d tokens, %.0f MiB of %s",
        loaded.name, time.perf_counter() - started, device, str(dtype).removeprefix("torch."),
        f", {loaded.weight_formats()} weights" if loaded.packed else "",
        f", native attention (the CPU kernels, {cpu_kernels.isa()}), {cfg.numerics} numerics" if runner.attention == "native"
        else f", {runner.attention} attention{', CUDA graphs' if runner.graphs else ''}",
        num_blocks, cfg.block_size, num_blocks * cfg.block_size, num_blocks * block_bytes / 2**20,
        str(cache_dtype).removeprefix("torch."),
    )
    info = worker_pb2.InfoResponse(
        model_name=loaded.name, vocab_size=loaded.config.vocab_size, eos_token_ids=loaded.tokenizer.eos_token_ids,
        max_model_len=loaded.max_model_len, num_blocks=num_blocks, block_size=cfg.block_size,
        dtype=str(dtype).removeprefix("torch."), device=str(device), block_bytes=block_bytes,
        bos_token_id=loaded.tokenizer.bos_token_id, verify_cost=verify_cost,
    )
    if verify_cost:
        log.info("speculation's cost: a decode verifying %s drafts takes %s times one without (measured)",
                 "/".join(str(d) for d in range(1, len(verify_cost))), "/".join(f"{c:.2f}" for c in verify_cost[1:]))
    return runner, loaded, info


@torch.inference_mode()
def profile_step(loaded: LoadedModel, block_size: int, tokens: int, device: torch.device,
                 dtype: torch.dtype, attention: str = "auto") -> GpuMemory:
    """Run one step of a ``tokens``-token prompt (the largest step the scheduler sends) in a scratch cache,
    sampling after it, with the ``attention`` the worker serves with, and measure the memory it took. On a
    CPU it runs as well (the tests' check of this code); the figures are PyTorch's CUDA statistics, zero there."""
    num_blocks = -(-tokens // block_size)
    scratch = KVCache.allocate(loaded.config, block_size, num_blocks, device, dtype)
    runner = ModelRunner(loaded.model, scratch, loaded.max_model_len, attention=attention)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    ids = (torch.arange(tokens) % loaded.config.vocab_size).tolist()
    runner.step(StepInput([SeqChunk("\0profile", ids, 0, new_block_ids=list(range(num_blocks)), sample=True,
                                    sampling=SamplingParams(), num_prompt_tokens=tokens)]))
    if not cuda:
        return GpuMemory(0, 0, 0, 0)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner, scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total, free, peak, torch.cuda.memory_allocated(device))


def serve(cfg: WorkerConfig) -> None:
    model = ModelThread()
    # a bad --model fails before any port is taken
    runner, _loaded, info = model.submit(lambda: build_runner(cfg)).result()
    metrics = Metrics("worker")
    metrics_port = metrics.serve(cfg.metrics_port, cfg.metrics_host)
    server = grpc_util.make_server(metrics=metrics)
    health = grpc_util.add_health_and_reflection(server, [SERVICE_NAME])
    service = WorkerService(runner, info, metrics, model)
    links = LinkServer(cfg.host, cfg.link_port, service.add_link, "step")
    service.listening(links)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = grpc_util.bind_internal(server, cfg.host, cfg.port)
    server.start()
    grpc_util.set_serving(health, [SERVICE_NAME], True, metrics)
    log.info("worker serving %s on %s:%d, steps on link port %d (metrics on %s:%d)", info.model_name, cfg.host, port,
             links.port, cfg.metrics_host, metrics_port)
    grpc_util.wait_for_termination(server, on_stop=lambda: grpc_util.set_serving(health, [SERVICE_NAME], False, metrics))
