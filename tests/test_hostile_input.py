"""Hostile input against a real stack: random and malformed requests (hypothesis), raw garbage bytes, and a
burst of 10x the queue size at once. Every call must end with a well-formed status, the server must keep
serving, and every admitted request must complete.

Figures are printed (run with ``-s``): fuzz cases tried by outcome, overload admitted/rejected/hung.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import start_stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.client import Client
from conveyor.errors import ResourceExhausted
from conveyor.v1 import conveyor_pb2, conveyor_pb2_grpc

MAX_WAITING = 4
# statuses a bad request may get; never INTERNAL or UNKNOWN (a crash), never a hang
WELL_FORMED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
               grpc.StatusCode.OUT_OF_RANGE}
OUTCOMES: Counter = Counter()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("hostile"), kv_cache_bytes=128 << 20, log_level="ERROR",
                    max_waiting=MAX_WAITING, max_num_seqs=4)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.endpoint) as ch:
        yield ch


def _floats():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1e30]))


def _texts(large: bool = True):
    small = st.text(max_size=40)
    return st.one_of(small, st.just(""), st.just("x" * 2_000_000)) if large else small


def _optional(strategy):
    return st.one_of(st.none(), strategy)


def _int_range(bits: int, signed: bool):
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return st.one_of(st.integers(low, high), st.sampled_from([low, high, 0, 1]))


SANE = {  # values the server accepts
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "top_k": st.integers(-1, 100), "seed": st.integers(0, 2**64 - 1),
    "logprobs": st.integers(0, 20), "max_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 4),
}
WILD = {  # anything the wire allows
    **{name: _floats() for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                    "frequency_penalty")},
    "top_k": _int_range(32, True), "seed": _int_range(64, False), "logprobs": _int_range(32, False),
    "max_tokens": _int_range(32, False), "min_tokens": _int_range(32, False),
}
SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k",
            "seed", "logprobs")
GROUPS = [*SANE, "input", "logit_bias", "stop", "stop_token_ids", "request_id"]


@st.composite
def requests(draw) -> conveyor_pb2.GenerateRequest:
    """A request with a few fields (often none) given wild values and the others sane or unset."""
    wild = draw(st.sets(st.sampled_from(GROUPS), max_size=3))
    r = conveyor_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "chat", "none"])) if "input" in wild else "prompt"
    if kind == "prompt":
        r.prompt = draw(_texts()) if "input" in wild else draw(st.text(min_size=1, max_size=40))
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            r.chat.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "", "robot"])),
                                content=draw(_texts(large=False)))
    for name in SANE:
        value = draw(WILD[name]) if name in wild else draw(_optional(SANE[name]))
        if value is not None:
            setattr(r.sampling if name in SAMPLING else r.stop, name, value)
    if "max_tokens" not in wild:
        r.stop.max_tokens = draw(SANE["max_tokens"])  # keep accepted requests short
    bias = st.dictionaries(_int_range(32, False), _floats(), max_size=3) if "logit_bias" in wild else \
        st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=2)
    for token, value in draw(bias).items():
        r.sampling.logit_bias[token] = value
    r.stop.stop.extend(draw(st.lists(_texts(large=False), max_size=20 if "stop" in wild else 2)))
    ids = _int_range(32, False) if "stop_token_ids" in wild else st.integers(0, 1000)
    r.stop.stop_token_ids.extend(draw(st.lists(ids, max_size=3)))
    r.stop.ignore_eos = draw(st.booleans())
    if "request_id" in wild:
        r.request_id = draw(st.text(max_size=140))
    return r


def _first_answer(call) -> str:
    """Read until the first response or the status; cancel a request that was accepted."""
    try:
        next(iter(call))
        call.cancel()
        return "OK"
    except StopIteration:
        return "OK"
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED:
            return "OK"
        assert exc.code() in WELL_FORMED, (exc.code(), exc.details())
        assert exc.details(), exc.code()  # a message that says what was wrong
        return exc.code().name


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(request=requests())
def test_random_requests_get_a_well_formed_status(channel, request):
    stub = conveyor_pb2_grpc.ConveyorStub(channel)
    OUTCOMES[_first_answer(stub.Generate(request, timeout=60))] += 1


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(
    st.binary(max_size=200),
    st.sampled_from([
        b"\x0a\x02\xff\xfe",  # prompt: invalid UTF-8
        b"\x2a\x03\xc3\x28\x41",  # request_id: invalid UTF-8
        b"\x08\x05",  # prompt sent as a number (wrong wire type)
        b"\x1d\x00\x00\xc0\x7f",  # sampling sent as a float (wrong wire type)
        b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end of the message
    ]),
))
def test_raw_bytes_get_a_well_formed_status(channel, payload):
    generate = channel.unary_stream("/conveyor.v1.Conveyor/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
    OUTCOMES["bytes " + _first_answer(generate(payload, timeout=60))] += 1


def test_server_still_serves_after_the_fuzz(stack):
    print(f"\nFUZZ cases by outcome: {dict(OUTCOMES)} (total {sum(OUTCOMES.values())})")
    assert sum(OUTCOMES.values()) >= 150
    assert OUTCOMES["INVALID_ARGUMENT"] > 0 and OUTCOMES["OK"] > 0
    for child in stack.children:
        assert child.process.poll() is None, f"{child.name} died"
    with Client(stack.endpoint, timeout=60) as c:
        assert c.generate("The capital of France is", temperature=0, max_tokens=4).completion_tokens == 4


def test_a_burst_of_ten_times_the_queue_gets_rejections_and_every_admitted_request_completes(stack):
    burst = 10 * MAX_WAITING

    def one(i: int):
        with Client(stack.endpoint, timeout=180) as c:
            try:
                done = c.generate(f"Count to ten, take {i}:", temperature=0, max_tokens=12, ignore_eos=True)
            except ResourceExhausted as exc:
                assert "max-waiting" in str(exc)
                return "rejected"
            assert done.finish_reason == "length" and done.completion_tokens == 12
            return "completed"

    started = time.monotonic()
    with ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(one, i) for i in range(burst)]
        outcomes = Counter()
        for f in futures:
            try:
                outcomes[f.result(timeout=max(1.0, 200 - (time.monotonic() - started)))] += 1
            except TimeoutError:
                outcomes["hung"] += 1
    print(f"\nOVERLOAD sent {burst}: admitted+completed {outcomes['completed']}, rejected {outcomes['rejected']}, "
          f"hung {outcomes['hung']} in {time.monotonic() - started:.1f} s")
    assert outcomes["hung"] == 0
    assert outcomes["completed"] + outcomes["rejected"] == burst
    assert outcomes["rejected"] > 0 and outcomes["completed"] >= MAX_WAITING
