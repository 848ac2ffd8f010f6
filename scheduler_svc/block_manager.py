"""KV block accounting and the prefix cache. Plain Python, no torch.

The worker owns the memory; this hands out block ids. A request's table grows one block at a time
as its tokens need room, and all of it is released at once (finish, abort or preemption).

Prefix cache: a block is *full* once all ``block_size`` of its tokens are known and sent to the
worker. A full block gets a key naming its whole prefix (``conveyor.prefix``). ``cached`` maps keys to blocks. A new request looks its prompt up block by block and
reuses the longest run of cached blocks; it computes only the rest. Blocks are reference-counted:
a block several requests hold is shared, and it is never written again (a request writes only
the positions after its cached prefix, which lie in blocks of its own: ``match`` leaves the last
token of a request out, because the worker needs it computed to sample the next).

A released block with a key stays in ``cached`` until the memory is needed: the free list is in
eviction order (least recently released first; a request's blocks are released tail first, so a
shared head outlives the tails; blocks without a key go to the front, reused first). Taking a
free block for new tokens evicts its key.

A block filled by a step this scheduler is still building becomes reusable only once that step is
complete (``publish``, called at the end of ``Scheduler.schedule``): steps run on the worker in
the order sent, so any later step finds its KV written. The worker can lose every block (it
restarted, or failed a step half way): ``clear`` forgets every key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conveyor.prefix import chain, root_key, scoped

TokenRange = Callable[[int, int], Sequence[int]]  # (start, end) -> a request's tokens in [start, end)


@dataclass
class PrefixStats:
    queries: int = 0  # tokens of admitted requests looked up
    hits: int = 0  # of those, tokens found cached (not computed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True, root: bytes = b""):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.root = root or root_key("")
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks  # set only while ``cached`` maps the key to it
        self.cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[bytes]] = {}  # a request's full blocks' keys, in order
        self._pending: list[tuple[int, bytes]] = []  # full in the step being built: reusable after ``publish``
        self.stats = PrefixStats()

    def resized(self, num_blocks: int, block_size: int) -> BlockManager:
        """An empty manager for another cache size, with the same prefix-cache settings (and counters)."""
        blocks = BlockManager(num_blocks, block_size, self.prefix_cache, self.root)
        blocks.stats = self.stats
        return blocks

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones among them: they are evicted when needed)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks with a key (held or free)."""
        return len(self.cached)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # ------------------------------------------------------------ admission

    def match(self, tokens: TokenRange, num_tokens: int, scope: str = "") -> list[int]:
        """The cached blocks holding the longest prefix of a request's ``num_tokens`` tokens (whole
        blocks, never the last token), among those of its cache ``scope`` (``conveyor.prefix.scoped``)."""
        if not self.prefix_cache:
            return []
        hits, key = [], scoped(self.root, scope)
        for i in range((num_tokens - 1) // self.block_size):
            key = chain(key, tokens(i * self.block_size, (i + 1) * self.block_size))
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, hits: list[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether a request holding no blocks can take ``hits`` and room for ``num_tokens`` tokens."""
        taken = sum(1 for b in hits if self._refs[b] == 0)  # cached but free: they leave the free list
        return taken + max(0, self._blocks_for(num_tokens) - len(hits)) + reserve <= len(self._free)

    def allocate(self, request_id: str, hits: list[int], num_tokens: int) -> list[int]:
        """Give a request ``hits`` (from ``match``) and room for ``num_tokens`` tokens; its table."""
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        self._tables[request_id] = list(hits)
        self._keys[request_id] = [self._key_of[b] for b in hits]  # a hit is cached: its key is known
        self.stats.queries += num_tokens if self.prefix_cache else 0
        self.stats.hits += len(hits) * self.block_size
        self.grow(request_id, num_tokens)
        return self._tables[request_id]

    # ------------------------------------------------------------ growth and release

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``num_tokens`` tokens of this request fit."""
        return max(0, self._blocks_for(num_tokens) - len(self._tables.get(request_id, ())))

    def can_grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``num_tokens`` fit, leaving at least ``reserve`` blocks free."""
        return self.blocks_needed(request_id, num_tokens) + reserve <= len(self._free)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Add the blocks ``num_tokens`` need; returns the new block ids (maybe none)."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{need} blocks needed for {request_id!r}, {len(self._free)} free")
        new = []
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._key_of[block]
            if key is not None:  # evict the least recently released prefix
                del self.cached[key]
                self._key_of[block] = None
            self._refs[block] = 1
            new.append(block)
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def fill(self, request_id: str, tokens: TokenRange, num_computed: int, now: bool = False, scope: str = "") -> None:
        """Key the request's blocks that ``num_computed`` known tokens (sent to the worker) fill, in its cache
        ``scope``. ``now``: their KV is computed by steps already sent (else: once the step being built is)."""
        if not self.prefix_cache:
            return
        keys, table = self._keys.setdefault(request_id, []), self._tables.get(request_id, [])
        for i in range(len(keys), min(num_computed // self.block_size, len(table))):
            key = chain(keys[-1] if keys else scoped(self.root, scope), tokens(i * self.block_size, (i + 1) * self.block_size))
            keys.append(key)
            if now:
                self._cache(table[i], key)
            else:
                self._pending.append((table[i], key))

    def _cache(self, block: int, key: bytes) -> None:
        if key not in self.cached and self._key_of[block] is None:  # a twin computed the same prefix: keep one
            self.cached[key] = block
            self._key_of[block] = key

    def publish(self) -> None:
        """The step being built is complete: the blocks it fills become reusable."""
        for block, key in self._pending:
            self._cache(block, key)
        self._pending.clear()

    def release(self, request_id: str) -> int:
        """Give back every block of the request (shared ones stay with their other holders); returns how
        many it held."""
        table = self._tables.pop(request_id, [])
        self._keys.pop(request_id, None)
        for block in reversed(table):  # the tail first: it is evicted before the head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._key_of[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing to keep: reuse it first
        return len(table)

    def clear(self) -> None:
        """The worker lost its cache: no key names valid KV any more."""
        self.cached.clear()
        self._key_of = [None] * self.num_blocks
        self._pending.clear()
        for keys in self._keys.values():
            keys.clear()
