"""Engines: a scheduler and the worker it drives. Several run behind the frontends; Redis says which
exist, how loaded each is, and which holds each request.

Layout (under the same prefix as ``conveyor.state``):

``{prefix}:engines`` set
    Names of the engines that registered (a dead one leaves once its requests moved elsewhere).
``{prefix}:engine:{name}`` hash
    ``address`` (its scheduler, as the other processes reach it), ``model``, ``running``, ``waiting``,
    ``kv_usage`` (0 to 1), ``serving`` (``1`` while its worker and Redis answer), ``block_size`` (its
    KV block's tokens: routing keys prompts by the same blocks as its prefix cache). The scheduler
    rewrites it every ``ttl / 6`` seconds and it expires after ``ttl``: an engine is live while its
    hash exists. That expiry is also the engine's **lease** on its requests: a scheduler writes a
    step only while its last refresh is recent enough (``Lease``), and once the hash expired, another
    engine may take them over.
``{prefix}:route:{key}`` string
    The engine that last took a prompt starting with the prefix ``key`` names (the chained hash of
    blocks of the engines' block size, as their prefix caches key blocks); expires after ``ROUTE_TTL``.
A request's hash has ``engine``: the engine that holds it. The frontend sets it when it creates the
request; it changes only by compare-and-set (``reassign``, ``claim``), so one engine holds a
request at a time.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from dataclasses import dataclass

from conveyor.prefix import chain, root_key, scoped
from conveyor.state import RequestStore, Steps, op

ROUTE_MAX_TOKENS = 4096  # a prompt's first 4,096 tokens decide its route
ROUTE_TTL = 600.0  # seconds a route entry lives without being taken again
ROUTE_DEPTHS = tuple(2**i for i in range(13))  # the block depths a request writes (as deep as its blocks go)


@dataclass
class EngineInfo:
    """An engine as its heartbeat registers it: where its scheduler is, its load, and whether it serves."""

    name: str
    address: str
    model: str = ""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    serving: bool = True
    block_size: int = 16

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def to_hash(self) -> dict[str, str]:
        return {"address": self.address, "model": self.model, "running": str(self.running),
                "waiting": str(self.waiting), "kv_usage": f"{self.kv_usage:.4f}", "serving": "1" if self.serving else "0",
                "block_size": str(self.block_size)}

    @classmethod
    def from_hash(cls, name: str, raw: dict[bytes, bytes]) -> EngineInfo:
        get = lambda key, default="": raw.get(key.encode(), default.encode()).decode()  # noqa: E731
        return cls(name, get("address"), get("model"), int(get("running", "0")), int(get("waiting", "0")),
                   float(get("kv_usage", "0")), get("serving", "1") == "1", int(get("block_size", "16")))


# KEYS: the engine's hash, the engine set; ARGV: ttl ms, name, then the hash's fields and values.
# Returns whether the hash existed before (0: a first registration, or the lease had lapsed).
_HEARTBEAT = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
return existed
"""
# KEYS: a request's hash; ARGV: the engine it must have, the engine to give it.
_REASSIGN = """
if redis.call('HGET', KEYS[1], 'engine') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'status') == 'finished' then return 0 end
redis.call('HSET', KEYS[1], 'engine', ARGV[2])
return 1
"""
# KEYS: the in-flight set, the dead engine's hash, the engine set; ARGV: request key prefix, dead, taker.
# Moves every unfinished request of a dead engine to the taker; returns their keys.
_CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {} end
local moved = {}
for _, key in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local hash = ARGV[1] .. key
  if redis.call('HGET', hash, 'engine') == ARGV[2] and redis.call('HGET', hash, 'status') ~= 'finished' then
    redis.call('HSET', hash, 'engine', ARGV[3])
    moved[#moved + 1] = key
  end
end
redis.call('SREM', KEYS[3], ARGV[2])
return moved
"""


class Registry:
    """The engines in Redis (thread-safe, like the store). Its operations run as its store runs them: at once,
    or as coroutines over an ``AsyncRequestStore``."""

    def __init__(self, store: RequestStore):
        self.store = store
        self.drive = store.drive
        self.prefix = store.prefix
        self._live: tuple[float, list[EngineInfo]] | None = None  # (monotonic time read, live engines)

    @property
    def set_key(self) -> str:
        return f"{self.prefix}:engines"

    def key(self, name: str) -> str:
        return f"{self.prefix}:engine:{name}"

    @op
    def heartbeat(self, info: EngineInfo, ttl: float) -> Steps[bool]:
        """Register or refresh an engine; False when its hash did not exist (first time, or a lapsed lease)."""
        fields = [x for pair in info.to_hash().items() for x in pair]
        (existed,) = yield [("EVAL", _HEARTBEAT, 2, self.key(info.name), self.set_key, int(ttl * 1000), info.name,
                             *fields)]
        return bool(existed)

    @op
    def leave(self, name: str) -> Steps[None]:
        """An engine that stops cleanly: gone at once (its requests are taken over without waiting out the lease)."""
        yield [("DEL", self.key(name))]

    @op
    def names(self) -> Steps[list[str]]:
        (names,) = yield [("SMEMBERS", self.set_key)]
        return sorted(n.decode() for n in names)

    @op
    def live(self, max_age: float = 0.0) -> Steps[list[EngineInfo]]:
        """The live engines; ``max_age``: a read at most that many seconds old is answered again (a new list
        object only when Redis was read)."""
        now = time.monotonic()
        if self._live is not None and now - self._live[0] <= max_age:
            return self._live[1]
        names = yield from self.names.steps(self)
        hashes = (yield [("HGETALL", self.key(name)) for name in names]) if names else []
        engines = [EngineInfo.from_hash(name, raw) for name, raw in zip(names, hashes) if raw]
        self._live = (now, engines)
        return engines

    @op
    def dead(self) -> Steps[list[str]]:
        """Registered engines whose lease expired and whose requests were not yet taken over."""
        names = yield from self.names.steps(self)
        alive = (yield [("EXISTS", self.key(name)) for name in names]) if names else []
        return [name for name, up in zip(names, alive) if not up]

    @op
    def claim(self, dead: str, taker: str) -> Steps[list[str]]:
        """Move every unfinished request of ``dead`` (its lease expired) to ``taker``; returns their keys.
        Atomic: of several engines claiming at once, one gets them."""
        keys = [self.store.inflight_key, self.key(dead), self.set_key]
        (moved,) = yield [("EVAL", _CLAIM, len(keys), *keys, f"{self.prefix}:req:", dead, taker)]
        return [k.decode() for k in moved]

    @op
    def engine_of(self, request_id: str) -> Steps[str | None]:
        (name,) = yield [("HGET", self.store.key(request_id), "engine")]
        return name.decode() if name is not None else None

    @op
    def engines_of(self, request_ids: list[str]) -> Steps[list[str | None]]:
        """The engine each request's record names (None for a request with no record), in one round trip."""
        names = (yield [("HGET", self.store.key(rid), "engine") for rid in request_ids]) if request_ids else []
        return [v.decode() if v is not None else None for v in names]

    @op
    def reassign(self, request_id: str, old: str, new: str) -> Steps[bool]:
        """Give an unfinished request held by ``old`` to ``new``, only if ``old`` still holds it."""
        (done,) = yield [("EVAL", _REASSIGN, 1, self.store.key(request_id), old, new)]
        return bool(done)


class Lease:
    """An engine's right to write its requests' steps: valid for ``ttl`` after a refresh was sent, less a
    margin for the write's own trip to Redis (another engine takes the requests over only after the hash
    expired, which is at least ``ttl`` after the refresh was sent)."""

    MARGIN = 0.25  # of the ttl

    def __init__(self, ttl: float):
        self.ttl = ttl
        self.sent_at: float | None = None  # monotonic time the last successful refresh was sent

    def refreshed(self, sent_at: float) -> None:
        self.sent_at = sent_at

    def fresh(self) -> bool:
        return self.sent_at is not None and time.monotonic() < self.sent_at + self.ttl * (1 - self.MARGIN)


# ---------------------------------------------------------------- routing


def route_keys(prompt_ids: list[int], block_size: int, model: str = "", scope: str = "") -> list[str]:
    """Keys of a prompt's full blocks of ``block_size`` tokens (the last token left out, as the prefix cache
    does), in its cache ``scope``: routing follows the prefix cache's scopes, so it tells no tenant where
    another's prefixes are."""
    keys, key = [], scoped(root_key(model), scope)
    for i in range(min((len(prompt_ids) - 1) // block_size, ROUTE_MAX_TOKENS // block_size)):
        key = chain(key, prompt_ids[i * block_size : (i + 1) * block_size])
        keys.append(key.hex())
    return keys


@dataclass
class Route:
    """The engine ``Router.choose`` picked for a request, and why."""

    engine: EngineInfo
    reason: str  # "prefix" (an engine has its prefix), "balance" (the least loaded) or "only"
    matched_blocks: int = 0


class Router:
    """Picks an engine for a new request: the one that last took the longest prefix of its prompt (its
    prefix cache likely holds it), unless that engine is overloaded next to the least loaded one; else
    the least loaded. Loads come from the engines' heartbeats plus what this router sent in the last
    ``recent`` seconds: a heartbeat read is up to a heartbeat period plus ``refresh`` old, and a burst of
    requests counted only since the last read (as it was) could all follow one prefix to one engine whose
    heartbeat had not shown them yet (a sent request may be counted twice for a while: it balances a little
    more, never less)."""

    def __init__(self, registry: Registry, refresh: float = 0.25, imbalance: float = 2.0, slack: int = 8,
                 recent: float = 1.0):
        """Prefix affinity holds while the matched engine's load <= ``imbalance`` x the least loaded's + ``slack``."""
        self.registry = registry
        self.drive = registry.drive
        self.refresh = refresh
        self.imbalance, self.slack, self.recent = imbalance, slack, recent
        self._read: list[EngineInfo] | None = None  # the registry's read the loads below follow
        self._gone: set[str] = set()  # engines that did not answer since that read
        self._sent: deque[tuple[float, str]] = deque()  # (when, engine) of the requests routed, oldest first
        self._sent_to: Counter[str] = Counter()  # of those, how many each engine got (counted as they come and go)
        self.block_size = 16  # the live engines' KV block size (the smallest, should they differ)

    @op
    def engines(self) -> Steps[list[EngineInfo]]:
        """Live, serving engines (re-read from Redis at most every ``refresh`` seconds)."""
        read = yield from self.registry.live.steps(self.registry, self.refresh)
        if read is not self._read:
            self._read, self._gone = read, set()
            self.block_size = min((e.block_size for e in read), default=self.block_size)
        return [e for e in read if e.serving and e.name not in self._gone]

    def forget(self, name: str) -> None:
        """An engine did not answer: leave it out until the registry is read again."""
        self._gone.add(name)

    @op
    def choose(self, prompt_ids: list[int], model: str = "", exclude: str | None = None,
               scope: str = "") -> Steps[Route | None]:
        """The engine for a new request (it writes nothing: ``remember`` does, once an engine accepted it)."""
        engines = [e for e in (yield from self.engines.steps(self)) if e.name != exclude]
        if not engines:
            return None
        now = time.monotonic()
        while self._sent and self._sent[0][0] < now - self.recent:
            _, name = self._sent.popleft()
            self._sent_to[name] -= 1
            if not self._sent_to[name]:
                del self._sent_to[name]
        load = {e.name: e.load + self._sent_to[e.name] for e in engines}
        least = min(engines, key=lambda e: (load[e.name], random.random()))
        keys = route_keys(prompt_ids, self.block_size, model, scope) if len(engines) > 1 else []
        route = Route(least, "balance" if len(engines) > 1 else "only")
        if keys:
            (owners,) = yield [("MGET", *(f"{self.registry.prefix}:route:{k}" for k in keys))]
            by_name = {e.name: e for e in engines}
            for i in range(len(owners) - 1, -1, -1):  # the longest prefix an engine still live took
                owner = owners[i].decode() if owners[i] is not None else None
                if owner in by_name:
                    matched = by_name[owner]
                    if load[matched.name] <= self.imbalance * load[least.name] + self.slack:
                        route = Route(matched, "prefix", i + 1)
                    break
        self._sent.append((now, route.engine.name))
        self._sent_to[route.engine.name] += 1
        return route

    @op
    def remember(self, prompt_ids: list[int], engine: str, model: str = "", scope: str = "") -> Steps[None]:
        """An engine accepted a request: its prompt's prefixes route there from now on. Only the blocks at depths
        1, 2, 4, ... and the last are written (at most ``len(ROUTE_DEPTHS) + 1`` keys a request): a later
        prompt sharing n blocks still finds the deepest written one within them."""
        keys = route_keys(prompt_ids, self.block_size, model, scope)
        if not keys:
            return
        depths = sorted({d for d in ROUTE_DEPTHS if d <= len(keys)} | {len(keys)})
        yield [("SET", f"{self.registry.prefix}:route:{keys[depth - 1]}", engine, "PX", int(ROUTE_TTL * 1000))
               for depth in depths]
