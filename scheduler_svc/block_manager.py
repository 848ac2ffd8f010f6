"""KV block accounting: which of the worker's blocks each request holds. Plain Python, no torch.

The worker owns the memory; this only hands out block ids. A request's table grows one block at a
time as its tokens need room, and all of it is freed at once (finish, abort or preemption).
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that ``num_tokens`` tokens of this request fit."""
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``num_tokens`` fit, leaving at least ``reserve`` blocks free."""
        return self.blocks_needed(request_id, num_tokens) + reserve <= len(self._free)

    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Add the blocks ``num_tokens`` need; returns the new block ids (maybe none)."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"{need} blocks needed for {request_id!r}, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def release(self, request_id: str) -> int:
        """Free every block of the request; returns how many."""
        table = self._tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)
