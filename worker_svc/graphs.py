"""Captured decode steps: one graph per padded batch size, replayed with new inputs.

A small model's decode step on a GPU is a few hundred short kernels; launched one by one from Python
the host is the bottleneck. A CUDA graph records them once and replays them in one launch. A graph
replays fixed shapes at fixed addresses, so a step of ``n`` decodes runs the graph of the smallest
size ``decode_size`` gives that holds it; its inputs (token ids, positions, cache slots, block tables)
are copied into static buffers first, and the padding rows write their K/V to the scratch block and
attend to nothing. Prefill steps and mixed steps run eagerly.

The worker captures every size at start-up (``capture_all``; the fused attention kernel is compiled for
each on the way); a size not captured yet is captured on first use. The capture itself comes from ``new_graph``, so that the logic here (sizes, padding, static
buffers, reuse) runs under a device-independent stand-in in the tests; ``CudaGraph`` is the real one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from worker_svc.attention import BlockTable, decode_size, padded_tables

log = logging.getLogger("conveyor.worker")


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (run on static buffers) and return its output tensor, which ``replay`` refills."""

    def replay(self) -> None: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph``, warmed up on a side stream first as PyTorch asks (the warm-up also compiles
    the fused kernels), all graphs drawing on one memory pool (they never run at once)."""

    def __init__(self, pool):
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def factory() -> Callable[[], CudaGraph]:
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraph(pool)


# The step a graph captures: (token ids, positions (-1: padding), cache slots, block tables) -> hidden states.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Decode steps of up to ``max_batch`` sequences, replayed from graphs captured per padded size."""

    def __init__(self, forward: DecodeForward, new_graph: Callable[[], Graph], max_batch: int, table_width: int,
                 scratch_block: int, block_size: int, device: torch.device):
        self.forward = forward
        self.new_graph = new_graph
        self.max_size = decode_size(max_batch)
        self.max_batch = max_batch
        self.table_width = table_width  # blocks of the longest sequence
        self.scratch_block = scratch_block
        self.block_size = block_size
        # static inputs at the largest size; the graph of a smaller size reads their first rows
        self.inputs = torch.zeros(3, self.max_size, dtype=torch.long, device=device)  # ids, positions, slots
        self.tables = torch.zeros(self.max_size, table_width, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}  # size -> (graph, its output)

    def sizes(self) -> list[int]:
        """Every padded size a step of 1..max_batch decodes runs at."""
        return sorted({decode_size(n) for n in range(1, self.max_batch + 1)})

    def run(self, token_ids: list[int], positions: list[int], slots: list[int],
            tables: list[BlockTable | list[int]]) -> torch.Tensor:
        """Hidden states (n, hidden) of ``n`` decodes, one per sequence."""
        n = len(token_ids)
        if not 0 < n <= self.max_batch:
            raise ValueError(f"a captured decode step takes 1 to {self.max_batch} sequences, got {n}")
        size = decode_size(n)
        pad = size - n
        inputs = torch.tensor([token_ids + [0] * pad, positions + [-1] * pad,
                               slots + [self.scratch_block * self.block_size] * pad])
        table = padded_tables(tables, size, self.table_width, self.scratch_block)
        self.inputs[:, :size].copy_(inputs, non_blocking=True)
        self.tables[:size].copy_(table, non_blocking=True)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def capture_all(self) -> None:
        """Capture every size now (the worker does, before it reports SERVING, as vLLM does): the first steps
        of a busy server then wait for no compiler. The buffers hold padding only, which writes nothing but
        the scratch block."""
        started = time.perf_counter()
        self.inputs[0].zero_()
        self.inputs[1].fill_(-1)
        self.inputs[2].fill_(self.scratch_block * self.block_size)
        self.tables.fill_(self.scratch_block)
        for size in reversed(self.sizes()):  # the largest first: the smaller ones reuse its memory
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
        log.info("captured %d decode graphs in %.1fs", len(self.graphs), time.perf_counter() - started)

    def _capture(self, size: int) -> tuple[Graph, torch.Tensor]:
        started = time.perf_counter()
        ids, positions, slots = self.inputs[:, :size]
        tables = self.tables[:size]
        graph = self.new_graph()
        out = graph.capture(lambda: self.forward(ids, positions, slots, tables))
        log.info("captured the decode step of %d sequences in %.1fs", size, time.perf_counter() - started)
        return graph, out
