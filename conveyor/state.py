"""Every request's state in Redis: the durable record any process rebuilds from after a restart.

Identity: a client names its request (``request_id``, or the frontend makes one), but names are
the client's: two API keys may use the same name, and a name may come back after its record expired.
Every request therefore gets its own **key** (32 hex digits, new for every request) when it is
created; every process and every Redis key below uses that key, so no name a client chooses can
collide with another request's keys or with the layout itself (a name ``x:out`` is just a string).
The client's name finds the key through an alias that is unique per API key.

Layout (all keys under one prefix, ``--redis-prefix``, default ``conveyor``):

``{prefix}:req:{key}`` hash
    ``request_id`` (the key), ``client_id`` (the client's name), ``owner`` (the API key name that
    created it; only that key may see, abort or resume it), ``status`` (``waiting`` | ``running`` |
    ``finished``), ``prompt_ids`` (JSON list), ``params`` (``RequestParams`` as JSON: sampling and stop
    conditions), ``frontend`` (address of the frontend holding the client stream), ``arrival`` /
    ``first_token`` / ``finish`` (Unix seconds), ``num_output`` (output tokens so far), ``finish_reason``
    (``stop`` | ``length`` | ``abort`` | ``error``), ``error`` (with ``error``: what failed),
    ``stopped_by_token`` (``1`` when an eos / stop token ended it: that token has no text), ``engine``
    (the engine holding it: ``conveyor.engines``), ``prompt_logprobs`` (JSON, when the request asked for them:
    one ``[token id, logprob, rank, [[id, logprob], ...]]`` per prompt token from the second; written with the
    first output token), ``cached_tokens`` (prompt tokens the prefix cache held when it was last admitted).
``{prefix}:req:{key}:out`` list
    The output token ids, appended once per step (position in the list = index in the output).
``{prefix}:alias:{owner as hex}:{client_id}`` string
    The key of the request that ``owner`` named ``client_id`` (the owner is hex-encoded, so the first
    ``:`` after it ends it). Created atomically with the hash, only if free: names are unique per API
    key while the record lives; it expires with the record.
``{prefix}:inflight`` sorted set
    Keys of requests not finished, scored by arrival time: a restarted scheduler requeues them in order.

Who writes what: the frontend creates the alias and the hash and adds the key to ``inflight`` (one
script, atomic); the scheduler writes every later change, one pipeline (one round trip) per engine
step. Once finished, the three keys expire after ``finished_ttl`` seconds and the key leaves
``inflight``.

Self-healing: Redis may restart and lose its last second of writes (AOF ``everysec``), and a pipeline
that failed half way may be retried. Every write of a step therefore says what it expects to find
(``RPUSH`` returns the list's new length, ``HSET`` the number of fields it had to create); a record
that does not match is rewritten whole from the scheduler's memory (``StepWriter.restore``), which
is idempotent. The scheduler's copy is authoritative for the requests it holds.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import KW_ONLY, dataclass, field
from typing import TypeVar

import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from conveyor.params import RequestParams


# Redis could not be reached (it may be restarting): retry. Any other RedisError concerns one command,
# so one request: it is that request's error, never a sign that Redis is down.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
T = TypeVar("T")


def new_request_key() -> str:
    """A request's own key: new for every request, whatever name the client gave it."""
    return uuid.uuid4().hex


@dataclass
class RequestRecord:
    """A request as Redis holds it (see the layout in the module doc)."""

    request_id: str  # the request's key (``new_request_key``)
    prompt_ids: list[int]
    params: RequestParams
    _: KW_ONLY
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
    client_id: str = ""  # the client's name for it ("" : the key itself)
    error: str | None = None  # with finish_reason "error"
    engine: str = ""  # the engine that holds it (conveyor.engines)
    prompt_logprobs: list | None = None  # see the layout above
    cached_tokens: int = 0

    def __post_init__(self):
        self.client_id = self.client_id or self.request_id

    def to_hash(self) -> dict[str, str]:
        """The record's hash fields (its output tokens live in the ``:out`` list, not here)."""
        fields = {
            "request_id": self.request_id, "status": self.status, "prompt_ids": json.dumps(self.prompt_ids),
            "params": self.params.to_json(), "frontend": self.frontend, "arrival": repr(self.arrival),
            "num_output": str(self.num_output), "owner": self.owner, "client_id": self.client_id,
            "engine": self.engine,
        }
        if self.stopped_by_token:
            fields["stopped_by_token"] = "1"
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = json.dumps(self.prompt_logprobs, separators=(",", ":"))
        if self.cached_tokens:
            fields["cached_tokens"] = str(self.cached_tokens)
        for name in ("first_token", "finish", "finish_reason", "error"):
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
            client_id=raw.get("client_id", ""), error=raw.get("error"), engine=raw.get("engine", ""),
            prompt_logprobs=json.loads(raw["prompt_logprobs"]) if "prompt_logprobs" in raw else None,
            cached_tokens=int(raw.get("cached_tokens", 0)),
        )


Steps = Generator[list[tuple], list, T]  # a Redis operation: yields round trips (commands sent together), gets their results


def op(steps: Callable[..., Steps]) -> Callable:
    """A Redis operation written once, as a generator of round trips: each ``yield`` sends a list of commands in
    one pipeline and receives their results. The object's ``drive`` runs it: at once on a ``RequestStore``, as a
    coroutine on an ``AsyncRequestStore`` (the frontend's, on its event loop). ``method.steps(obj, ...)`` is the
    generator itself, for one operation made of others (``yield from``)."""

    @functools.wraps(steps)
    def run(self, *args, **kwargs):
        return self.drive(steps(self, *args, **kwargs))

    run.steps = steps
    return run


class StepScript:
    """The step's script (``_FENCED_STEP``), called on a connection of each calling thread's own (a scheduler's
    engine thread: one call a step). redis-py's command layers (pool, retries, instrumentation) cost more CPU than
    the call itself at one stream (~70 against ~40 us here), so the call is packed, sent and read on the
    connection directly. A Redis that lost the script (it restarted) gets it again, and a connection that broke
    (an idle one Redis dropped) is tried once more afresh, as redis-py's own retry would; then the error is the
    caller's."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self.sha = client.register_script(_FENCED_STEP).sha
        self._local = threading.local()

    def __call__(self, *args: str) -> list:
        try:
            return self._call(args)
        except NoScriptError:
            self.client.script_load(_FENCED_STEP)
        except REDIS_DOWN:
            self._connection().disconnect()
        return self._call(args)

    def _connection(self):
        """This thread's connection, with the client's settings, outside its pool; it connects when first used (so
        a Redis out of reach raises in the call, as any other)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            pool = self.client.connection_pool
            conn = self._local.conn = pool.connection_class(**pool.connection_kwargs)
        return conn

    def _call(self, args: tuple[str, ...]) -> list:
        conn = self._connection()
        conn.send_packed_command(conn.pack_command("EVALSHA", self.sha, 0, *args))
        return conn.read_response()


class RequestStore:
    """Reads and writes the layout above. Thread-safe (redis-py pools its connections). Its operations
    (``@op``) run to completion here; ``AsyncRequestStore`` runs the same ones on an event loop."""

    def __init__(self, client: redis.Redis, prefix: str = "conveyor", finished_ttl: float = 600.0):
        self.redis = client
        self.prefix = prefix
        self.finished_ttl = finished_ttl
        self.step_script = StepScript(client)

    OPTIONS = {"socket_timeout": 5, "socket_connect_timeout": 5, "health_check_interval": 10}

    @classmethod
    def from_url(cls, url: str, prefix: str = "conveyor", finished_ttl: float = 600.0) -> RequestStore:
        return cls(redis.Redis.from_url(url, **cls.OPTIONS), prefix, finished_ttl)

    def drive(self, steps: Steps):
        """Run an operation's round trips, one after another; its result."""
        try:
            commands = next(steps)
            while True:
                commands = steps.send(self._send(commands))
        except StopIteration as done:
            return done.value

    def _send(self, commands: list[tuple]) -> list:
        if len(commands) == 1:
            return [self.redis.execute_command(*commands[0])]
        pipe = self.redis.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return pipe.execute()

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def out_key(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:out"

    def alias_key(self, owner: str, client_id: str) -> str:
        return f"{self.prefix}:alias:{owner.encode().hex()}:{client_id}"

    @property
    def inflight_key(self) -> str:
        return f"{self.prefix}:inflight"

    @op
    def create(self, record: RequestRecord) -> Steps[bool]:
        """Record a new request; False (and nothing written) when its owner already uses its client id."""
        fields = json.dumps(record.to_hash(), ensure_ascii=False, separators=(",", ":"))
        keys = [self.alias_key(record.owner, record.client_id), self.key(record.request_id), self.inflight_key]
        (created,) = yield [("EVAL", _CREATE, len(keys), *keys, record.request_id, repr(record.arrival), fields)]
        return bool(created)

    @op
    def discard(self, record: RequestRecord) -> Steps[None]:
        """Remove a request that was recorded but never accepted (the scheduler refused it), in one script."""
        rid = record.request_id
        keys = [self.key(rid), self.out_key(rid), self.inflight_key, self.alias_key(record.owner, record.client_id)]
        yield [("EVAL", _DISCARD, len(keys), *keys, rid)]

    @op
    def lookup(self, owner: str, client_id: str) -> Steps[str | None]:
        """The key of the request ``owner`` named ``client_id``, while its record lives."""
        (key,) = yield [("GET", self.alias_key(owner, client_id))]
        return key.decode() if key is not None else None

    @op
    def find(self, client_id: str, owner: str = "") -> Steps[RequestRecord | None]:
        """The record of the request ``owner`` named ``client_id`` (None: unknown, another key's, expired)."""
        key = yield from self.lookup.steps(self, owner, client_id)
        return (yield from self.get.steps(self, key)) if key is not None else None

    @op
    def get(self, request_id: str) -> Steps[RequestRecord | None]:
        """A request's whole record with its output tokens, read in one round trip; None when Redis has none."""
        return (yield from self.get_many.steps(self, [request_id]))[request_id]

    @op
    def get_many(self, request_ids: list[str]) -> Steps[dict[str, RequestRecord | None]]:
        """``get`` of several requests in one round trip. One unreadable record raises for all: read those alone
        to fail them alone."""
        replies = yield [c for rid in request_ids
                         for c in (("HGETALL", self.key(rid)), ("LRANGE", self.out_key(rid), 0, -1))]
        records = {}
        for i, rid in enumerate(request_ids):
            fields = {k.decode(): v.decode() for k, v in replies[2 * i].items()}
            records[rid] = RequestRecord.from_hash(fields, [int(t) for t in replies[2 * i + 1]]) \
                if "prompt_ids" in fields else None
        return records

    @op
    def progress(self, request_id: str) -> Steps[tuple[int, bool] | None]:
        """(output tokens recorded, finished?) in one round trip; None when there is no record."""
        ((num_output, status),) = yield [("HMGET", self.key(request_id), "num_output", "status")]
        if status is None:
            return None
        return int(num_output or 0), status == b"finished"

    @op
    def cached_tokens(self, request_id: str) -> Steps[int]:
        """Prompt tokens the prefix cache held for the request (``usage.prompt_tokens_details.cached_tokens``)."""
        (cached,) = yield [("HGET", self.key(request_id), "cached_tokens")]
        return int(cached or 0)

    @op
    def prompt_logprobs(self, request_id: str) -> Steps[list | None]:
        """The request's scored prompt (``prompt_logprobs`` in the layout), once its first token is written."""
        (raw,) = yield [("HGET", self.key(request_id), "prompt_logprobs")]
        return json.loads(raw) if raw is not None else None

    @op
    def set_frontend(self, request_id: str, address: str) -> Steps[bool]:
        """Deliver this request's deltas to another frontend from now on (a client resumed there). A record that
        expired meanwhile is not brought back as a stray hash without a TTL: False then."""
        (done,) = yield [("EVAL", _SET_IF_EXISTS, 1, self.key(request_id), "frontend", address)]
        return bool(done)

    @op
    def inflight(self) -> Steps[list[str]]:
        """Ids of unfinished requests, oldest first."""
        (keys,) = yield [("ZRANGE", self.inflight_key, 0, -1)]
        return [i.decode() for i in keys]

    @op
    def ttl(self, request_id: str) -> Steps[float]:
        (ms,) = yield [("PTTL", self.key(request_id))]
        return ms / 1000

    def writer(self) -> StepWriter:
        return StepWriter(self)


class AsyncRequestStore(RequestStore):
    """The same store on an event loop (``redis.asyncio``): each operation is a coroutine. The frontend's,
    so that no request's Redis round trip holds a thread."""

    # Connections at once; a coroutine past them waits for one (for up to socket_timeout, then it is a Redis that is
    # down). redis-py's own pool raises past its 100 instead, and a burst of streams that all looked at Redis at
    # once (their ``keep_up`` on the same tick) got a 500.
    MAX_CONNECTIONS = 100

    @classmethod
    def from_url(cls, url: str, prefix: str = "conveyor", finished_ttl: float = 600.0) -> AsyncRequestStore:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=cls.MAX_CONNECTIONS, timeout=cls.OPTIONS["socket_timeout"], **cls.OPTIONS)
        return cls(redis.asyncio.Redis.from_pool(pool), prefix, finished_ttl)

    async def drive(self, steps: Steps):
        try:
            commands = next(steps)
            while True:
                commands = steps.send(await self._send(commands))
        except StopIteration as done:
            return done.value

    async def _send(self, commands: list[tuple]) -> list:
        if len(commands) == 1:
            return [await self.redis.execute_command(*commands[0])]
        pipe = self.redis.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return await pipe.execute()

    def writer(self) -> StepWriter:
        raise TypeError("a step's writes are the scheduler's, on its own (synchronous) store")


# KEYS: alias, hash, inflight; ARGV: request key, arrival, the hash as one JSON object (one argument, as a step's
# commands are: redis-py encodes each argument in Python).
_CREATE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
local fields = {}
for name, value in pairs(cjson.decode(ARGV[3])) do fields[#fields + 1] = name; fields[#fields + 1] = value end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
return 1
"""
_SET_IF_EXISTS = "if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) + 1 end return 0"
# KEYS: request hashes; returns each one's engine ("" when none, or no record)
_HOLDERS = "local out = {} for i, k in ipairs(KEYS) do out[i] = redis.call('HGET', k, 'engine') or '' end return out"
# A decode's append, the command most of a step is made of, run whole in Redis: ``APPEND_OP key n token...`` cuts the
# output list back to before these tokens (a retried append must not add twice), appends them, sets ``num_output``
# to ``n`` and the status to running, and answers 1 when the record was as expected (the list now holds ``n``
# tokens, the hash had both fields), else 0 (lost in a Redis restart: the caller rewrites it whole). One command
# instead of three, and one result to check: at a few hundred requests a step, the Python that built and checked
# the three was most of the scheduler's CPU per token.
APPEND_OP = "@APPEND"
_APPEND = """
local function append(key, n, a, first)
  local out = key .. ':out'
  local before = n - (#a - first + 1)
  if before > 0 then redis.call('LTRIM', out, 0, before - 1) else redis.call('DEL', out) end
  if redis.call('RPUSH', out, unpack(a, first)) ~= n then return 0 end
  if redis.call('HSET', key, 'num_output', n, 'status', 'running') > 0 then return 0 end
  return 1
end
"""
_APPEND_ALONE = _APPEND + "return append(KEYS[1], tonumber(ARGV[1]), ARGV, 2)"  # KEYS: hash; ARGV: n, tokens
# A step's write in one round trip. ARGV: the owner (empty: an engine alone, no fence), the commands as one JSON array
# of argument arrays, and the keys of the records the step writes as one JSON array (empty without a fence): one
# string each, so a step of a few hundred requests is encoded by two json.dumps, not argument by argument in redis-py
# (that was most of the scheduler's CPU per token; the keys alone, ~60 us a step at 128 requests). Returns
# {indices of the records another engine holds, results}: nothing is run when the first is not empty. A script runs
# alone, so no other client's write can fall between the check and the commands (what WATCH ensured in the
# three-round-trip form). A command Redis refuses is its result, as an error.
_FENCED_STEP = _APPEND + """
local taken = {}
if ARGV[1] ~= '' then
  for i, key in ipairs(cjson.decode(ARGV[3])) do
    local ok, holder = pcall(redis.call, 'HGET', key, 'engine')  -- not a hash: its own commands fail below
    if ok and holder and holder ~= '' and holder ~= ARGV[1] then taken[#taken + 1] = i end
  end
end
if #taken > 0 then return {taken, {}} end
local results = {}
for i, args in ipairs(cjson.decode(ARGV[2])) do
  local ok, res
  if args[1] == '""" + APPEND_OP + """' then ok, res = pcall(append, args[2], args[3], args, 4)
  else ok, res = pcall(redis.call, unpack(args)) end
  if ok or type(res) == 'table' then results[i] = res else results[i] = {err = tostring(res)} end
end
return {taken, results}
"""
_SCRIPT_MAX_ARGS = 4000  # a command with more (a long output restored whole) takes the WATCH form: Lua's unpack limit
# KEYS: hash, out list, inflight, alias; ARGV: request key. The alias goes only while it names this request.
_DISCARD = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
return 1
"""


class Fenced(Exception):
    """A step's records name another engine now (it took them over while this one was paused): nothing of the
    step was written. ``taken``: those requests."""

    def __init__(self, taken: set[str]):
        super().__init__(f"{len(taken)} requests are held by another engine now")
        self.taken = taken


class StepWriter:
    """Collects one engine step's changes and sends them in one round trip.

    The commands are kept as plain argument tuples (the step's script takes them as they are; redis-py's
    pipeline methods cost more than the rest of a step's bookkeeping at a few hundred requests).
    ``execute`` returns the keys of requests whose record did not look as expected (lost in a Redis
    restart) or whose commands Redis refused (an error about that record, such as WRONGTYPE): the
    caller rewrites those whole with ``restore``. Only a Redis that cannot be reached raises."""

    def __init__(self, store: RequestStore):
        self.store = store
        self.commands: list[tuple] = []
        self.count = 0
        self._checks: list[tuple[int, str, int, bool]] = []  # (command index, request key, expected, exact)
        self._op_request: list[str] = []  # the request each queued command writes

    def _queued(self, request_id: str) -> None:
        """The commands queued since the last call write ``request_id``'s record."""
        self._op_request += [request_id] * (len(self.commands) - len(self._op_request))
        self.count += 1

    def _expect(self, request_id: str, value: int, exact: bool) -> None:
        """The result of the command just queued must equal ``value`` (``exact``) or be at most ``value``."""
        self._checks.append((len(self.commands) - 1, request_id, value, exact))

    def _hset(self, key: str, fields: dict) -> None:
        self.commands.append(("HSET", key, *(x for pair in fields.items() for x in pair)))

    def status(self, request_id: str, status: str, cached_tokens: int | None = None) -> None:
        """The request's status; ``cached_tokens`` when it was admitted (only that field may be created)."""
        fields = {"status": status} if cached_tokens is None else {"status": status, "cached_tokens": cached_tokens}
        self._hset(self.store.key(request_id), fields)
        self._expect(request_id, len(fields) - 1, exact=False)
        self._queued(request_id)

    def tokens(self, request_id: str, token_ids: list[int], num_output: int, first_token: float | None,
               prompt_logprobs: list | None = None) -> None:
        """Append new output tokens, the last at index ``num_output - 1``; ``first_token`` is set when
        these include the first, and ``prompt_logprobs`` with it when the request asked for them."""
        key = self.store.key(request_id)
        if first_token is None and prompt_logprobs is None:  # a decode's: one command, run whole in Redis
            self.commands.append((APPEND_OP, key, num_output, *token_ids))
            self._expect(request_id, 1, exact=True)
            self._queued(request_id)
            return
        out = self.store.out_key(request_id)
        before = num_output - len(token_ids)  # a retried append must not add twice: cut back to before it
        hset = ["HSET", key, "num_output", num_output, "status", "running"]
        if first_token is not None:
            hset += ("first_token", repr(first_token))
        if prompt_logprobs is not None:
            hset += ("prompt_logprobs", json.dumps(prompt_logprobs, separators=(",", ":")))
        self.commands += (("LTRIM", out, 0, before - 1) if before else ("DEL", out), ("RPUSH", out, *token_ids))
        self._expect(request_id, num_output, exact=True)
        self.commands.append(hset)
        self._expect(request_id, (len(hset) - 6) // 2, exact=False)  # only the new fields may be created
        self._queued(request_id)

    def finished(self, request_id: str, alias: str, reason: str, num_output: int, now: float, trim: bool = False,
                 stopped_by_token: bool = False, error: str | None = None) -> None:
        """Mark finished (keeping the first ``num_output`` tokens when ``trim``), start the expiry of the
        record and of its ``alias`` key."""
        key, out = self.store.key(request_id), self.store.out_key(request_id)
        if trim:
            self.commands.append(("LTRIM", out, 0, num_output - 1))
        fields = {"status": "finished", "finish_reason": reason, "finish": repr(now), "num_output": num_output}
        if stopped_by_token:
            fields["stopped_by_token"] = "1"
        if error is not None:
            fields["error"] = error
        self._hset(key, fields)
        self._expect(request_id, len(fields) - 2, exact=False)  # only the new fields may be created
        self.commands.append(("ZREM", self.store.inflight_key, request_id))
        self._expire(request_id, alias)
        self._queued(request_id)

    def _send(self, owner: str) -> list:
        """Run the commands, fenced when ``owner`` is set: in the step's script, or (a command too long for a
        script) in a pipeline, under WATCH and MULTI when fenced."""
        ids = list(dict.fromkeys(self._op_request))
        keys = [self.store.key(rid) for rid in ids] if owner else []
        if max(map(len, self.commands)) <= _SCRIPT_MAX_ARGS:
            commands = json.dumps(self.commands, ensure_ascii=False, separators=(",", ":"))
            taken, results = self.store.step_script(owner, commands, json.dumps(keys, ensure_ascii=False))
            if taken:
                raise Fenced({ids[i - 1] for i in taken})
            return results
        with self.store.redis.pipeline(transaction=bool(owner)) as pipe:
            if owner:
                pipe.watch(*keys)
                holders = pipe.eval(_HOLDERS, len(keys), *keys)
                taken = {rid for rid, holder in zip(ids, holders) if holder.decode() not in ("", owner)}
                if taken:
                    raise Fenced(taken)
                pipe.multi()
            for args in self.commands:
                if args[0] == APPEND_OP:
                    pipe.eval(_APPEND_ALONE, 1, *args[1:])
                else:
                    pipe.execute_command(*args)
            return pipe.execute(raise_on_error=False)

    def _expire(self, request_id: str, alias: str) -> None:
        ttl_ms = max(1, int(self.store.finished_ttl * 1000))
        for key in (self.store.key(request_id), self.store.out_key(request_id), alias):
            self.commands.append(("PEXPIRE", key, ttl_ms))

    def restore(self, record: RequestRecord) -> None:
        """Rewrite a whole record (hash, output list, alias, in-flight entry) from memory; idempotent."""
        key, out = self.store.key(record.request_id), self.store.out_key(record.request_id)
        alias = self.store.alias_key(record.owner, record.client_id)
        self.commands.append(("DEL", key, out))
        self._hset(key, record.to_hash())
        if record.output_ids:
            self.commands.append(("RPUSH", out, *record.output_ids))
        self.commands.append(("SET", alias, record.request_id, "NX"))  # the name stays this request's
        if record.status == "finished":
            self.commands.append(("ZREM", self.store.inflight_key, record.request_id))
            self._expire(record.request_id, alias)
        else:
            self.commands.append(("ZADD", self.store.inflight_key, record.arrival, record.request_id))
        self._queued(record.request_id)

    def execute(self, owner: str = "") -> set[str]:
        """Send everything; returns the keys whose record was not as expected or refused (to ``restore``).

        ``owner``: the engine writing (several engines share this Redis). The writes are then fenced: they
        land only if every record they touch still names ``owner`` (or no engine) when they land, checked in
        the same script as the writes (one round trip; for a command too long for a script, WATCH, then the
        records' ``engine``, then MULTI/EXEC). A record another engine took raises ``Fenced`` (nothing was
        written); in the WATCH form, one changed meanwhile raises ``redis.WatchError``."""
        if not self.count:
            return set()
        results = self._send(owner)
        for result in results:
            if isinstance(result, REDIS_DOWN):
                raise result
        refused = {self._op_request[i] for i, result in enumerate(results) if isinstance(result, Exception)}
        return refused | {rid for i, rid, value, exact in self._checks if rid not in refused
                          and (results[i] != value if exact else results[i] > value)}
