"""Every request's state in Redis: the durable record any process rebuilds from after a restart.

Layout (all keys under one prefix, ``--redis-prefix``, default ``conveyor``):

``{prefix}:req:{id}`` hash
    ``request_id``, ``status`` (``waiting`` | ``running`` | ``finished``), ``prompt_ids`` (JSON list),
    ``params`` (``RequestParams`` as JSON: sampling and stop conditions), ``frontend`` (address of the
    frontend holding the client stream), ``arrival`` / ``first_token`` / ``finish`` (Unix seconds),
    ``num_output`` (output tokens so far), ``finish_reason`` (``stop`` | ``length`` | ``abort``),
    ``stopped_by_token`` (``1`` when an eos / stop token ended it: that token has no text), ``owner``
    (the API key name that created it; only that key may abort or resume it).
``{prefix}:req:{id}:out`` list
    The output token ids, appended once per step (position in the list = index in the output).
``{prefix}:inflight`` sorted set
    Ids not finished, scored by arrival time: a restarted scheduler requeues them in this order.

Who writes what: the frontend creates the hash and adds the id to ``inflight``; the scheduler writes
every later change, one pipeline (one round trip) per engine step. Once finished, both keys expire
after ``finished_ttl`` seconds and the id leaves ``inflight``.

Self-healing: Redis may restart and lose its last second of writes (AOF ``everysec``), and a pipeline
that failed half way may be retried. Every write of a step therefore says what it expects to find
(``RPUSH`` returns the list's new length, ``HSET`` the number of fields it had to create); a record
that does not match is rewritten whole from the scheduler's memory (``StepWriter.restore``), which
is idempotent. The scheduler's copy is authoritative for the requests it holds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from conveyor.params import RequestParams


@dataclass
class RequestRecord:
    request_id: str
    prompt_ids: list[int]
    params: RequestParams
    frontend: str = ""
    arrival: float = field(default_factory=time.time)
    status: str = "waiting"
    num_output: int = 0
    first_token: float | None = None
    finish: float | None = None
    finish_reason: str | None = None
    stopped_by_token: bool = False
    owner: str = ""
    output_ids: list[int] = field(default_factory=list)  # from the :out list, not the hash

    def to_hash(self) -> dict[str, str]:
        fields = {
            "request_id": self.request_id, "status": self.status, "prompt_ids": json.dumps(self.prompt_ids),
            "params": self.params.to_json(), "frontend": self.frontend, "arrival": repr(self.arrival),
            "num_output": str(self.num_output), "owner": self.owner,
        }
        if self.stopped_by_token:
            fields["stopped_by_token"] = "1"
        for name in ("first_token", "finish", "finish_reason"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = repr(value) if isinstance(value, float) else value
        return fields

    @classmethod
    def from_hash(cls, raw: dict[str, str], output_ids: list[int]) -> RequestRecord:
        def number(name: str) -> float | None:
            return float(raw[name]) if name in raw else None

        return cls(
            request_id=raw["request_id"], prompt_ids=json.loads(raw["prompt_ids"]),
            params=RequestParams.from_json(raw["params"]), frontend=raw.get("frontend", ""),
            arrival=float(raw["arrival"]), status=raw["status"], num_output=int(raw.get("num_output", 0)),
            first_token=number("first_token"), finish=number("finish"), finish_reason=raw.get("finish_reason"),
            stopped_by_token=raw.get("stopped_by_token") == "1", owner=raw.get("owner", ""), output_ids=output_ids,
        )


class RequestStore:
    """Reads and writes the layout above. Thread-safe (redis-py pools its connections)."""

    def __init__(self, client: redis.Redis, prefix: str = "conveyor", finished_ttl: float = 600.0):
        self.redis = client
        self.prefix = prefix
        self.finished_ttl = finished_ttl

    @classmethod
    def from_url(cls, url: str, prefix: str = "conveyor", finished_ttl: float = 600.0) -> RequestStore:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, health_check_interval=10)
        return cls(client, prefix, finished_ttl)

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def out_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:out"

    @property
    def inflight_key(self) -> str:
        return f"{self.prefix}:inflight"

    def create(self, record: RequestRecord) -> bool:
        """Record a new request; False (and nothing written) when the id is already taken."""
        key = self.key(record.request_id)
        if not self.redis.hsetnx(key, "request_id", record.request_id):
            return False
        pipe = self.redis.pipeline()
        pipe.hset(key, mapping=record.to_hash())
        pipe.zadd(self.inflight_key, {record.request_id: record.arrival})
        pipe.execute()
        return True

    def discard(self, request_id: str) -> None:
        """Remove a request that was recorded but never accepted (the scheduler refused it)."""
        pipe = self.redis.pipeline()
        pipe.delete(self.key(request_id), self.out_key(request_id))
        pipe.zrem(self.inflight_key, request_id)
        pipe.execute()

    def get(self, request_id: str) -> RequestRecord | None:
        pipe = self.redis.pipeline()
        pipe.hgetall(self.key(request_id))
        pipe.lrange(self.out_key(request_id), 0, -1)
        raw, out = pipe.execute()
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        if "prompt_ids" not in fields:
            return None
        return RequestRecord.from_hash(fields, [int(t) for t in out])

    def progress(self, request_id: str) -> tuple[int, bool] | None:
        """(output tokens recorded, finished?) in one round trip; None when there is no record."""
        num_output, status = self.redis.hmget(self.key(request_id), "num_output", "status")
        if status is None:
            return None
        return int(num_output or 0), status == b"finished"

    def set_frontend(self, request_id: str, address: str) -> None:
        """Deliver this request's deltas to another frontend from now on (a client resumed there)."""
        self.redis.hset(self.key(request_id), "frontend", address)

    def inflight(self) -> list[str]:
        """Ids of unfinished requests, oldest first."""
        return [i.decode() for i in self.redis.zrange(self.inflight_key, 0, -1)]

    def ttl(self, request_id: str) -> float:
        return self.redis.pttl(self.key(request_id)) / 1000

    def writer(self) -> StepWriter:
        return StepWriter(self)


class StepWriter:
    """Collects one engine step's changes and sends them in one pipeline (one round trip).

    ``execute`` returns the ids whose record did not look as expected (lost in a Redis restart):
    the caller rewrites those whole with ``restore``."""

    def __init__(self, store: RequestStore):
        self.store = store
        self.pipe = store.redis.pipeline(transaction=False)
        self.count = 0
        self._checks: list[tuple[int, str, int, bool]] = []  # (op index, request id, expected, exact)

    def _expect(self, request_id: str, value: int, exact: bool) -> None:
        """The result of the op just queued must equal ``value`` (``exact``) or be at most ``value``."""
        self._checks.append((len(self.pipe.command_stack) - 1, request_id, value, exact))

    def status(self, request_id: str, status: str) -> None:
        self.pipe.hset(self.store.key(request_id), "status", status)
        self._expect(request_id, 0, exact=False)
        self.count += 1

    def tokens(self, request_id: str, token_ids: list[int], num_output: int, first_token: float | None) -> None:
        """Append new output tokens; ``first_token`` is set when these include the first."""
        key, out = self.store.key(request_id), self.store.out_key(request_id)
        before = num_output - len(token_ids)  # a retried append must not add twice: cut back to before it
        if before:
            self.pipe.ltrim(out, 0, before - 1)
        else:
            self.pipe.delete(out)
        self.pipe.rpush(out, *token_ids)
        self._expect(request_id, num_output, exact=True)
        fields = {"num_output": num_output, "status": "running"}
        if first_token is not None:
            fields["first_token"] = repr(first_token)
        self.pipe.hset(key, mapping=fields)
        self._expect(request_id, 1 if first_token is not None else 0, exact=False)
        self.count += 1

    def finished(self, request_id: str, reason: str, num_output: int, now: float, trim: bool = False,
                 stopped_by_token: bool = False) -> None:
        """Mark finished (keeping the first ``num_output`` tokens when ``trim``), start the expiry."""
        key, out = self.store.key(request_id), self.store.out_key(request_id)
        if trim:
            self.pipe.ltrim(out, 0, num_output - 1)
        fields = {"status": "finished", "finish_reason": reason, "finish": repr(now), "num_output": num_output}
        if stopped_by_token:
            fields["stopped_by_token"] = "1"
        self.pipe.hset(key, mapping=fields)
        self._expect(request_id, len(fields) - 2, exact=False)  # only the new fields may be created
        self.pipe.zrem(self.store.inflight_key, request_id)
        self._expire(request_id)
        self.count += 1

    def _expire(self, request_id: str) -> None:
        ttl_ms = max(1, int(self.store.finished_ttl * 1000))
        self.pipe.pexpire(self.store.key(request_id), ttl_ms)
        self.pipe.pexpire(self.store.out_key(request_id), ttl_ms)

    def restore(self, record: RequestRecord) -> None:
        """Rewrite a whole record (hash, output list, in-flight entry) from memory; idempotent."""
        key, out = self.store.key(record.request_id), self.store.out_key(record.request_id)
        self.pipe.delete(key, out)
        self.pipe.hset(key, mapping=record.to_hash())
        if record.output_ids:
            self.pipe.rpush(out, *record.output_ids)
        if record.status == "finished":
            self.pipe.zrem(self.store.inflight_key, record.request_id)
            self._expire(record.request_id)
        else:
            self.pipe.zadd(self.store.inflight_key, {record.request_id: record.arrival})
        self.count += 1

    def execute(self) -> set[str]:
        """Send everything; returns the ids whose record was not as expected (to ``restore``)."""
        if not self.count:
            return set()
        results = self.pipe.execute()
        return {rid for i, rid, value, exact in self._checks
                if (results[i] != value if exact else results[i] > value)}
