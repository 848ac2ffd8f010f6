"""Paged attention that reads the KV cache where it lies: PyTorch's ``flex_attention`` with a block mask
built from the block tables.

A layer's cache is ``(num_blocks, block_size, Hkv, D)``; seen as one long run of slots it is
K ``(1, Hkv, slots, D)``, a view, no copy. One call attends ``B`` rows of queries Q ``(B, H, Q, D)``
to all of it. Its block mask tells flex_attention, for each tile of ``Q_TILE`` queries, which cache
blocks (KV tiles of ``block_size`` slots) to read: the *full* ones, wholly before the tile's first
query, read with no mask; then the *partial* ones up to its last query, where the mask function
decides slot by slot. No other block is touched, so a step costs what its sequences' contexts cost,
not what the cache holds.

The mask function is exact on its own (PyTorch's unfused path evaluates it on every slot):
query ``q`` of row ``b`` belongs to sequence ``r = q_row[b, q]`` at position ``q_pos[b, q]``; it sees
slot ``s`` of block ``k = s // block_size`` when ``k`` is in ``r``'s table at index
``i = logical[k]`` and ``i * block_size + s % block_size <= q_pos``. One ``logical`` entry per block
suffices because a block has the same index in every table that holds it: a sequence's own blocks
are in one table, and a prefix-cache block sits at the same index in every sequence sharing it
(its key chains from the first block; its K carries the rotary phase of those positions).

Two calls per step at most: the decode tokens, one query row each (``B`` = decodes, ``Q`` = 1;
what a captured decode graph runs), and the prefill chunks of the step in one row, each chunk
starting on a tile boundary so that a tile belongs to one sequence.

Padding (rows of a captured graph's bucket, the tail of a chunk's last tile) has ``q_pos = -1``
(it sees nothing: flex_attention returns zeros there) and tables full of the scratch block, a
cache block the scheduler never hands out.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_TILE = 128  # queries per tile of the block mask: flex_attention's default, a multiple of its kernels' tiles


@cache
def flex(compiled: bool):
    """flex_attention fused by ``torch.compile`` (what a GPU runs; the CPU has a fused kernel too), or
    the unfused reference (materializes the scores: for small caches, as in tests)."""
    if compiled:
        # one fused kernel per shape: decode sizes and prefill tile counts, a few dozen in all (the setting
        # was called cache_size_limit before PyTorch 2.7)
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), 128))
        return torch.compile(flex_attention, dynamic=False)

    def unfused(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return unfused


@dataclass
class PagedCall:
    """One flex_attention call: ``B`` rows of ``Q`` query slots."""

    q_index: torch.Tensor  # (B, Q) long: the token of the step's flat batch in each query slot (padding: 0)
    block_mask: BlockMask


@dataclass
class PagedAttention:
    """This step's attention through the paged cache, for every layer."""

    calls: list[PagedCall]
    out_index: torch.Tensor  # (T,) long: each flat token's row in the calls' outputs, concatenated
    compiled: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor,
                 v_flat: torch.Tensor) -> torch.Tensor:
        """q: (T, H, D); k_flat, v_flat: the layer's cache as (slots, Hkv, D), this step's K/V written (so the
        step's own ``k``, ``v`` are read from there). -> (T, H, D)."""
        keys = k_flat.permute(1, 0, 2).unsqueeze(0)  # (1, Hkv, slots, D): a view
        values = v_flat.permute(1, 0, 2).unsqueeze(0)
        outs = []
        for call in self.calls:
            queries = q[call.q_index].permute(0, 2, 1, 3)  # (B, H, Q, D)
            out = flex(self.compiled)(queries, keys, values, block_mask=call.block_mask, enable_gqa=True)
            outs.append(out.permute(0, 2, 1, 3).reshape(-1, q.shape[1], q.shape[2]))  # (B * Q, H, D)
        return torch.cat(outs)[self.out_index] if len(outs) > 1 else outs[0][self.out_index]


@dataclass
class Rows:
    """Query slots and tiles of one call, host or device tensors (int32 unless said)."""

    q_index: torch.Tensor  # (B, Q) long
    q_row: torch.Tensor  # (B, Q): the query's sequence (row of the tables)
    q_pos: torch.Tensor  # (B, Q): its position; -1 for padding
    tile_row: torch.Tensor  # (B, nT): the sequence of each tile of Q_TILE queries
    tile_first: torch.Tensor  # (B, nT): first position in the tile; -1 for a tile of padding only
    tile_last: torch.Tensor  # (B, nT): last position in the tile; -1 for a tile of padding only
    token_slot: torch.Tensor  # (n,) long: the query slot (in the flattened B * Q) of each of the call's tokens

    def to(self, device) -> Rows:
        return Rows(*(t.to(device, non_blocking=True) for t in vars(self).values()))


def decode_size(n: int) -> int:
    """The padded size of a batch of ``n`` decodes: a power of two up to 32, then a multiple of 32 (the sizes
    a graph is captured for; the fused kernel is compiled for these shapes only)."""
    return 1 << (n - 1).bit_length() if n <= 32 else -(-n // 32) * 32


def decode_rows(positions: torch.Tensor, num_tokens: int) -> Rows:
    """Row ``i`` is sequence ``i``'s one query at ``positions[i]``; rows with position -1 are padding, and
    the first ``num_tokens`` rows are the call's tokens (a captured graph keeps them all). Torch ops on
    ``positions``' device."""
    pos = positions.to(torch.int32).unsqueeze(1)  # (B, 1)
    seq = torch.arange(len(positions), dtype=torch.int32, device=positions.device).unsqueeze(1)
    seq = torch.where(pos >= 0, seq, 0)  # padding reads sequence 0's table, and sees nothing of it
    return Rows(seq.long(), seq, pos, seq, pos, pos, torch.arange(num_tokens, device=positions.device))


def prefill_rows(first_row: int, starts: list[int], lengths: list[int], first_token: int) -> Rows:
    """Chunks of sequences ``first_row, first_row + 1, ...`` (tokens ``first_token, ...`` of the flat batch,
    one chunk after another) laid out in one query row, each chunk from a tile boundary. The row is padded
    to a power of two of tiles, so that a fused kernel is compiled for a few shapes only: a tile of padding
    lists no block, and costs nothing."""
    tiles = [-(-n // Q_TILE) for n in lengths]
    n_tiles = 1 << (sum(tiles) - 1).bit_length()
    width = n_tiles * Q_TILE
    q_index, q_row = torch.zeros(width, dtype=torch.long), torch.full((width,), first_row, dtype=torch.int32)
    q_pos = torch.full((width,), -1, dtype=torch.int32)
    tile_row, tile_first, tile_last = [first_row] * n_tiles, [-1] * n_tiles, [-1] * n_tiles
    at, token, token_slot, tile = 0, first_token, [], 0
    for i, (start, n, t) in enumerate(zip(starts, lengths, tiles)):
        q_index[at : at + n] = torch.arange(token, token + n)
        token_slot.append(torch.arange(at, at + n))
        q_row[at : at + t * Q_TILE] = first_row + i
        q_pos[at : at + n] = torch.arange(start, start + n, dtype=torch.int32)
        for j in range(t):
            tile_row[tile] = first_row + i
            tile_first[tile] = start + j * Q_TILE
            tile_last[tile] = start + min(n, (j + 1) * Q_TILE) - 1
            tile += 1
        at, token = at + t * Q_TILE, token + n
    tiles_of = lambda xs: torch.tensor(xs, dtype=torch.int32).unsqueeze(0)  # noqa: E731
    return Rows(q_index.unsqueeze(0), q_row.unsqueeze(0), q_pos.unsqueeze(0), tiles_of(tile_row),
                tiles_of(tile_first), tiles_of(tile_last), torch.cat(token_slot))


def block_mask(rows: Rows, tables: torch.Tensor, logical: torch.Tensor, block_size: int, width: int,
               num_slots: int) -> BlockMask:
    """The block mask of one call. ``tables``: (R, W) int32, one row per sequence of the step, padded with
    the scratch block; ``logical``: (blocks,) int32, each block's index in the tables holding it (filled by
    ``index_blocks`` this step); ``width``: columns of the mask's block lists (at least W; the CPU's fused
    kernel wants them to span every slot of the cache). Torch ops only, no host sync: a graph can capture it."""
    B, n_tiles = rows.tile_row.shape
    n_full = torch.div(rows.tile_first + 1, block_size, rounding_mode="floor")  # (B, nT) blocks before the tile
    n_need = torch.div(rows.tile_last, block_size, rounding_mode="floor") + 1  # blocks up to its last query
    own = tables[rows.tile_row.long()]  # (B, nT, W) each tile's table
    pad = own.new_zeros(B, n_tiles, width + width - own.shape[-1])
    own = torch.cat([own, pad], dim=-1)  # (B, nT, 2 * width): room to shift by n_full
    shift = n_full.long().unsqueeze(-1) + torch.arange(width, device=own.device)
    partial = torch.gather(own, -1, shift)  # the table from block n_full on
    full = own[..., :width]
    W = tables.shape[1]
    q_row, q_pos = rows.q_row, rows.q_pos

    def visible(b, h, q, kv):
        block = kv // block_size
        index = logical[block]
        mine = tables[q_row[b, q], index.clamp(0, W - 1)] == block
        return mine & (index * block_size + kv % block_size <= q_pos[b, q])

    return BlockMask.from_kv_blocks(
        (n_need - n_full).unsqueeze(1), partial.unsqueeze(1), n_full.unsqueeze(1), full.unsqueeze(1),
        BLOCK_SIZE=(Q_TILE, block_size), mask_mod=visible, seq_lengths=(rows.q_pos.shape[1], num_slots),
        compute_q_blocks=False,
    )


class BlockTable:
    """A sequence's block ids: a Python list (read id by id, for each token's cache slot) and the same ids in an
    int32 array that grows as blocks are added, so that a step's padded tables copy each sequence's row in one go.
    Made from the lists every step, they cost O(context) per sequence: 256 sequences of 256 blocks, 3.9 ms."""

    __slots__ = ("ids", "_array")

    def __init__(self, ids: list[int] | None = None):
        self.ids: list[int] = []
        self._array = np.empty(16, dtype=np.int32)
        self.extend(ids or [])

    def extend(self, new: list[int]) -> None:
        n, end = len(self.ids), len(self.ids) + len(new)
        if end > len(self._array):
            grown = np.empty(max(2 * len(self._array), end), dtype=np.int32)
            grown[:n] = self._array[:n]
            self._array = grown
        self._array[n:end] = new
        self.ids += new

    def truncate(self, n: int) -> None:
        del self.ids[n:]

    def row(self) -> np.ndarray:
        return self._array[: len(self.ids)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> int:
        return self.ids[i]


def padded_tables(tables: list[BlockTable | list[int]], rows: int, width: int, pad: int) -> torch.Tensor:
    """(rows, width) int32 on the host: the tables, padded with the ``pad`` block (rows too), each row copied from
    its ``BlockTable``'s array (or converted from a plain list)."""
    out = np.full((rows, width), pad, dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t.row() if isinstance(t, BlockTable) else t
    return torch.from_numpy(out)


def index_blocks(logical: torch.Tensor, tables: torch.Tensor) -> None:
    """Record each block's index in its table: ``logical[tables[r, i]] = i`` (shared blocks get the same
    value from every sharer; the padding's scratch block gets any)."""
    index = torch.arange(tables.shape[1], dtype=logical.dtype, device=tables.device).expand_as(tables)
    logical.index_put_((tables.reshape(-1).long(),), index.reshape(-1))


def paged_attention(rows: list[Rows], tables: torch.Tensor, logical: torch.Tensor, block_size: int, width: int,
                    num_slots: int, compiled: bool) -> PagedAttention:
    """Everything a step's layers need, from device tensors (see ``block_mask``). The calls' tokens follow
    one another in the flat batch: decodes first, then the prefill chunks."""
    index_blocks(logical, tables)
    calls, out_index, offset = [], [], 0
    for r in rows:
        calls.append(PagedCall(r.q_index, block_mask(r, tables, logical, block_size, width, num_slots)))
        out_index.append(r.token_slot + offset)
        offset += r.q_index.numel()
    return PagedAttention(calls, torch.cat(out_index) if len(out_index) > 1 else out_index[0], compiled)
