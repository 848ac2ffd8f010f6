"""The one parameter schema: every field crosses each wire by name, old Redis records still read, and an error
names its field for the HTTP API without parsing the message."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from conveyor.client import build_request
from conveyor.errors import InvalidArgument
from conveyor.params import (GROUPS, Limits, RequestParams, SamplingParams, StopParams, field_names, from_pb,
                             given_from_pb, to_pb)
from conveyor.v1 import conveyor_pb2, worker_pb2
from tokenizer_svc.openai_bodies import from_conveyor

LIMITS = Limits(max_model_len=1000, vocab_size=100)
SET = RequestParams(  # floats a float32 proto field holds exactly
    SamplingParams(temperature=0.5, top_k=7, top_p=0.75, min_p=0.125, repetition_penalty=1.25, presence_penalty=0.25,
                   frequency_penalty=-0.5, logit_bias={3: 1.5, 9: -2.0}, seed=2**64 - 1, logprobs=0, prompt_logprobs=2),
    StopParams(max_tokens=17, min_tokens=2, stop=("a", "bc"), stop_token_ids=(4, 5), ignore_eos=True,
               include_stop_str_in_output=True),
    priority=-3, cache_scope="key:x", speculative=False)


def test_every_field_of_each_group_has_its_proto_field_of_the_same_name():
    messages = {"sampling": conveyor_pb2.SamplingOptions, "stop": conveyor_pb2.StopConditions}
    for group, kind in GROUPS.items():
        assert set(field_names(kind)) == set(messages[group].DESCRIPTOR.fields_by_name), group


def test_the_groups_go_through_the_public_and_the_worker_messages_unchanged():
    for kind, value in ((SamplingParams, SET.sampling), (StopParams, SET.stop)):
        public = to_pb(value, conveyor_pb2.SamplingOptions() if kind is SamplingParams else conveyor_pb2.StopConditions())
        assert from_pb(kind, public) == value
    chunk = worker_pb2.SequenceChunk()
    to_pb(SET.sampling, chunk.sampling)
    to_pb(SET.stop, chunk.stop)
    assert from_pb(SamplingParams, chunk.sampling) == SET.sampling and from_pb(StopParams, chunk.stop) == SET.stop


def test_an_unset_field_is_not_given_so_the_default_applies():
    assert given_from_pb(conveyor_pb2.SamplingOptions(top_p=0.5), SamplingParams) == {"top_p": 0.5, "logit_bias": {}}
    assert from_pb(SamplingParams, conveyor_pb2.SamplingOptions()).temperature == SamplingParams().temperature
    # logprobs=0 is "the sampled token's logprob, no alternatives", not "off"
    assert from_pb(SamplingParams, conveyor_pb2.SamplingOptions(logprobs=0)).logprobs == 0


def test_the_sdk_fills_every_option_by_name():
    flat = {**asdict(SET.sampling), **asdict(SET.stop)}
    request = build_request("hi", **flat)
    assert from_pb(SamplingParams, request.sampling) == SET.sampling and from_pb(StopParams, request.stop) == SET.stop
    with pytest.raises(TypeError, match="tempreature"):
        build_request("hi", tempreature=0)


def test_redis_json_round_trips_and_a_flat_record_from_before_the_groups_still_reads():
    assert RequestParams.from_json(SET.to_json()) == SET
    flat = {**asdict(SET.sampling), **asdict(SET.stop), "priority": -3, "cache_scope": "key:x", "speculative": False}
    assert RequestParams.from_json(json.dumps(flat)) == SET
    newer = json.loads(SET.to_json())
    newer["sampling"]["a_future_field"] = 1
    newer["a_future_group"] = {}
    assert RequestParams.from_json(json.dumps(newer)) == SET  # a newer process's fields: not ours, skipped


@pytest.mark.parametrize("params,field", [
    (SamplingParams(top_p=0.0), "sampling.top_p"),
    (SamplingParams(temperature=float("nan")), "sampling.temperature"),
    (SamplingParams(logit_bias={100: 1.0}), "sampling.logit_bias"),
    (SamplingParams(logprobs=21), "sampling.logprobs"),
    (StopParams(min_tokens=5, max_tokens=4), "stop.min_tokens"),
    (StopParams(stop=("",)), "stop.stop[0]"),
    (StopParams(stop_token_ids=(100,)), "stop.stop_token_ids"),
])
def test_a_check_names_its_field_and_the_http_api_reads_it_from_the_error(params, field):
    with pytest.raises(InvalidArgument) as raised:
        params.check(LIMITS)
    assert raised.value.field == field and str(raised.value).startswith(field + " ")
    http = from_conveyor(raised.value)
    assert http.status == 400 and http.param == field.split(".", 1)[1] and str(http).startswith(http.param + " ")


def test_the_workers_limits_keep_the_ranges_but_not_the_frontends_counts():
    many = SamplingParams(logit_bias={t: 1.0 for t in range(99)})
    with pytest.raises(InvalidArgument):
        many.check(Limits(max_model_len=1000, vocab_size=100, max_logit_bias=10))
    many.check(Limits.wire(1000, 100))  # a frontend flag allowed more: not the worker's to refuse
    with pytest.raises(InvalidArgument, match="sampling.top_p"):
        SamplingParams(top_p=2.0).check(Limits.wire(1000, 100))
    assert {f.name for f in fields(Limits)} >= {"max_logprobs", "vocab_size"}
