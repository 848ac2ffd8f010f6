"""Incremental detokenization and stop strings, on the real default tokenizer and a real Redis."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from conveyor import grpc_util
from conveyor.engines import Registry
from conveyor.messages import Delta
from conveyor.metrics import Metrics
from conveyor.params import RequestParams
from conveyor.schedulers import Schedulers
from conveyor.errors import NotFound
from conveyor.state import RequestRecord, RequestStore
from conveyor.tokenizer import load_tokenizer
from conveyor.v1 import frontend_pb2, frontend_pb2_grpc
from detokenizer_svc.core import DetokenizerCore, TokenEntry
from detokenizer_svc.incremental import IncrementalDetokenizer, StopMatcher
from detokenizer_svc.server import Channels, DetokenizerService
from helpers import FlakyLink

TEXTS = [
    "안녕하세요, 세계! 한국어 문장입니다.",
    "你好，世界。这是一个中文句子。",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇰🇷",
    "plain English with    spaces\nand lines",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_never_emits_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert sum(1 for p in pieces if p == "") > 0 or text.isascii()  # multi-byte characters were held back


def test_flush_shows_incomplete_bytes_at_the_end(tokenizer):
    ids = tokenizer.encode("😀")
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == tokenizer.decode(ids[:-1])  # the partial character, as U+FFFD


@pytest.mark.parametrize(
    "stops, pieces, emitted, stopped",
    [
        # the stop string arrives split over pieces; nothing of it is let out
        (("END",), ["Hello E", "N", "D more"], ["Hello ", "", ""], True),
        # a held-back prefix that turns out not to be a stop string is let out
        (("END",), ["abc E", "NX"], ["abc ", "ENX"], False),
        # the earliest of several stop strings wins
        (("cd", "bcd"), ["ab", "cde"], ["a", ""], True),
        # no stop strings: everything at once
        ((), ["x", "y"], ["x", "y"], False),
        # a stop string inside one piece
        (("\n\n",), ["one\n\ntwo"], ["one"], True),
    ],
)
def test_stop_matcher(stops, pieces, emitted, stopped):
    matcher = StopMatcher(stops)
    outs, done = [], False
    for piece in pieces:
        out, done = matcher.feed(piece)
        outs.append(out)
        if done:
            break
    assert outs == emitted[: len(outs)] and done == stopped


def test_stop_string_kept_when_asked():
    matcher = StopMatcher(("END",), include_stop=True)
    assert matcher.feed("a EN") == ("a ", False)
    assert matcher.feed("D tail") == ("END", True)


def test_release_lets_out_what_was_held():
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("ends with ST") == ("ends with ", False)
    assert matcher.release() == "ST"


# ---------------------------------------------------------------- the core, over a real Redis


@pytest.fixture
def store(redis_server):
    return RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")


def _record(store, tokenizer, params: RequestParams, output_ids=()) -> str:
    rid = uuid.uuid4().hex
    record = RequestRecord(rid, tokenizer.encode("Hi"), params, frontend="fe:1")
    assert store.create(record)
    if output_ids:
        store.redis.rpush(store.out_key(rid), *output_ids)
    return rid


def test_core_splits_text_across_steps_and_reports_a_stop_string(store, tokenizer):
    stops = []
    core = DetokenizerCore(tokenizer, store, lambda rid, n, repeat=False: stops.append((rid, n, repeat)))
    ids = tokenizer.encode(" one two three four five")
    rid = _record(store, tokenizer, RequestParams.of(stop=("three",)))
    deltas = []
    for i in range(0, len(ids), 2):
        for fe, ds in core.push([TokenEntry(rid, i, ids[i : i + 2])])[0].items():
            assert fe == "fe:1"
            deltas += ds
    text = "".join(d.text for d in deltas)
    assert text == " one two " and deltas[-1].finish_reason == "stop"
    n = tokenizer.encode(" one two three").__len__()
    assert stops[0] == (rid, n, False) and deltas[-1].completion_tokens == n
    assert all(s == (rid, n, True) for s in stops[1:])  # later steps' tokens: the stop is only repeated
    assert core.push([TokenEntry(rid, len(ids), [5])]) == ({}, [])  # finished: late tokens ignored...
    assert stops[-1] == (rid, n, True)  # ...but the stop is said again (the scheduler may have missed it)


def test_core_skips_resent_tokens_and_replays_from_redis_after_a_restart(store, tokenizer):
    ids = tokenizer.encode(" 안녕하세요 세계")
    rid = _record(store, tokenizer, RequestParams(), output_ids=ids[:4])
    fresh = DetokenizerCore(tokenizer, store, lambda *a: None)  # as if restarted: tokens 0..3 only in Redis
    out = fresh.push([TokenEntry(rid, 4, ids[4:6])])[0]["fe:1"]
    assert out[0].first_token_index == 0 and out[0].token_ids == ids[:6]
    again = fresh.push([TokenEntry(rid, 4, ids[4:6])])  # a resend: nothing new
    assert again == ({}, [])
    final = fresh.push([TokenEntry(rid, 6, ids[6:], finish_reason="length")])[0]["fe:1"][-1]
    text = "".join(d.text for d in out) + final.text
    assert text == " 안녕하세요 세계" and final.finish_reason == "length" and final.completion_tokens == len(ids)


def test_core_gives_no_text_to_the_token_that_stopped_it(store, tokenizer):
    rid = _record(store, tokenizer, RequestParams.of(stop_token_ids=(tokenizer.encode("!")[0],)))
    core = DetokenizerCore(tokenizer, store, lambda *a: None)
    ids = tokenizer.encode("Yes!")
    final = core.push([TokenEntry(rid, 0, ids, finish_reason="stop", stopped_by_token=True)])[0]["fe:1"][-1]
    assert final.text == "Yes" and final.token_ids == ids


def test_replay_rebuilds_the_text_from_redis_for_a_new_frontend(store, tokenizer):
    ids = tokenizer.encode(" Hello there, general Kenobi")
    rid = _record(store, tokenizer, RequestParams.of(stop=("general",)), output_ids=ids)
    core = DetokenizerCore(tokenizer, store, lambda *a, **k: None)
    seen = core.push([TokenEntry(rid, 0, ids[:3])])[0]["fe:1"]
    frontend, deltas = core.replay(rid, "fe:2")  # a client resumed on another frontend
    assert frontend == "fe:2" and deltas[0].text_offset == 0 and deltas[0].first_token_index == 0
    assert "".join(d.text for d in deltas) == " Hello there, " and deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in seen) == " Hello there,"[: len("".join(d.text for d in seen))]
    with pytest.raises(NotFound):
        core.replay("no-such-request")


def test_push_that_cannot_read_redis_reports_the_request_and_keeps_no_state(store, tokenizer):
    rid = _record(store, tokenizer, RequestParams())
    broken = RequestStore.from_url("redis://127.0.0.1:1/0", prefix=store.prefix)  # nothing listens there
    core = DetokenizerCore(tokenizer, broken, lambda *a, **k: None)
    assert core.push([TokenEntry(rid, 0, tokenizer.encode(" hi"))]) == ({}, [rid])
    assert rid not in core.streams


class _CountingStore(RequestStore):
    """The real store, counting its round trips to Redis."""

    round_trips = 0

    def _send(self, commands):
        self.round_trips += 1
        return super()._send(commands)


def test_a_step_that_starts_many_requests_reads_their_records_in_one_round_trip(store, tokenizer):
    rids = [_record(store, tokenizer, RequestParams()) for _ in range(8)]
    counting = _CountingStore(store.redis, store.prefix)
    core = DetokenizerCore(tokenizer, counting, lambda *a, **k: None)
    ids = tokenizer.encode(" hi there")
    by_frontend, failed = core.push([TokenEntry(rid, 0, ids) for rid in rids])
    assert counting.round_trips == 1 and not failed
    assert sorted(d.request_id for d in by_frontend["fe:1"]) == sorted(rids)
    assert all(d.text == " hi there" for d in by_frontend["fe:1"])


def test_an_unreadable_record_among_new_requests_fails_only_its_own(store, tokenizer):
    rids = [_record(store, tokenizer, RequestParams()) for _ in range(4)]
    store.redis.hset(store.key(rids[1]), "params", "{not json")  # written by something else: unreadable
    core = DetokenizerCore(tokenizer, store, lambda *a, **k: None)
    by_frontend, failed = core.push([TokenEntry(rid, 0, tokenizer.encode(" hi")) for rid in rids])
    assert sorted(d.request_id for d in by_frontend["fe:1"]) == sorted(rids[:1] + rids[2:]) and not failed
    assert rids[1] not in core.streams


# ---------------------------------------------------------------- bounded work and the first token's space


class _Spy:
    """The real tokenizer, counting what ``decode`` is given (and whether a lock was held)."""

    def __init__(self, tokenizer, lock=None):
        self.tokenizer, self.lock = tokenizer, lock
        self.decoded, self.calls_under_lock, self.calls = 0, 0, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        self.calls += 1
        self.calls_under_lock += bool(self.lock is not None and self.lock.locked())
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_output_that_keeps_ending_in_a_broken_character_decodes_in_linear_time(tokenizer):
    broken = next(i for i in range(512) if tokenizer.decode([i] * 3).endswith("\ufffd"))  # a lone UTF-8 byte
    spy = _Spy(tokenizer)
    detok = IncrementalDetokenizer(spy)
    n = 3000
    text = "".join(detok.add(broken) for _ in range(n)) + detok.flush()
    assert text == tokenizer.decode([broken] * n)  # nothing lost: the bytes come out as U+FFFD
    assert spy.decoded < 20 * n  # not ~n*n/2 (each token decoding everything since the last character)


def test_replay_decodes_without_the_lock_every_step_needs(redis_server, tokenizer):
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    spy = _Spy(tokenizer)
    core = DetokenizerCore(spy, store, lambda *a, **k: None)
    spy.lock = core.lock
    output = tokenizer.encode(" one two three four five six seven eight nine ten" * 20)
    record = RequestRecord(uuid.uuid4().hex, tokenizer.encode("Count"), RequestParams(), frontend="fe:1",
                           output_ids=output)
    assert store.create(record)
    store.redis.rpush(store.out_key(record.request_id), *output)
    frontend, deltas = core.replay(record.request_id)
    assert "".join(d.text for d in deltas) == tokenizer.decode(output)
    assert spy.calls > len(output) and spy.calls_under_lock == 0
    assert core.push([TokenEntry(record.request_id, len(output), tokenizer.encode(" more"))])[0]  # continues


def _sentencepiece_folder(folder):
    """A Llama-2 style tokenizer (metaspace, byte fallback, a decoder that strips the text's first space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["The capital of France is Paris.", "Paris is a city.", "The capital of Italy is Rome."] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return folder


def test_the_first_token_of_a_sentencepiece_model_keeps_its_leading_space(redis_server, tmp_path):
    from conveyor.tokenizer import tokenizer_from_hf_folder

    tokenizer = tokenizer_from_hf_folder(_sentencepiece_folder(tmp_path / "sp"))
    prompt, full = tokenizer.encode("The capital of France is"), tokenizer.encode("The capital of France is Paris")
    assert full[: len(prompt)] == prompt and tokenizer.decode(full[len(prompt):]) == "Paris"  # alone: no space
    store = RequestStore.from_url(redis_server, prefix=f"test-{uuid.uuid4().hex[:8]}")
    record = RequestRecord(uuid.uuid4().hex, prompt, RequestParams(), frontend="fe:1")
    assert store.create(record)
    core = DetokenizerCore(tokenizer, store, lambda *a, **k: None)
    by_frontend, _ = core.push([TokenEntry(record.request_id, 0, full[len(prompt):], "length")])
    assert "".join(d.text for d in by_frontend["fe:1"]) == " Paris"


class LinkOnly(frontend_pb2_grpc.FrontendServicer):
    """A frontend's gRPC service with nothing but its ``Link`` call (``FlakyLink``'s)."""

    def __init__(self, end: FlakyLink):
        self.end = end

    def Link(self, request, context):
        return self.end.service.Link(request, context)


def test_a_frontend_that_answers_late_or_hangs_up_still_gets_every_token_once_in_order(store, tokenizer):
    """A frontend that answers late and hangs up on some batches unanswered (``FlakyLink``). The detokenizer reads a
    frontend's answer to a batch just before its next one (or, for the last of a burst,
    from its resend thread), so a batch the frontend hung up on without answering is held and sent again ahead of
    anything newer: every token reaches it, in order, each once; the last one too, although no batch follows it."""
    hang_up_on, taken = {30, 75, 120}, []

    def answer(batch):
        indices = [i for d in batch.deltas for i in range(d.first_token_index, d.first_token_index + len(d.token_ids))]
        if hang_up_on & set(indices):  # the first time
            hang_up_on.difference_update(indices)
            return None
        taken.extend(i for i in indices if i >= len(taken))  # one it had already is dropped, as a frontend does
        return frontend_pb2.DeliverResponse()

    end = FlakyLink(3, frontend_pb2.DeltaBatch.FromString, answer)
    server = grpc_util.make_server()
    frontend_pb2_grpc.add_FrontendServicer_to_server(LinkOnly(end), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    service = DetokenizerService(DetokenizerCore(tokenizer, store, lambda *a, **k: None), Schedulers(Registry(store)),
                                 Metrics("detokenizer-test"), orphan_timeout=30.0)
    pace = random.Random(3)
    for i in range(120):
        service._deliver(address, [Delta("r", i, text="x", first_token_index=i, token_ids=[7])])
        time.sleep(pace.choice((0, 0.0005, 0.002, 0.006)))
    deadline = time.monotonic() + 10
    while len(taken) < 120 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(Channels.DOWN_SECONDS + 0.1)  # all taken, and none failed lately: the next batch goes from _deliver
    service._deliver(address, [Delta("r", 120, text="x", first_token_index=120, token_ids=[7],
                                              finish_reason="length")])  # hung up on, and nothing follows it
    deadline = time.monotonic() + 10
    while len(taken) < 121 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert taken == list(range(121))
    server.stop(None)
