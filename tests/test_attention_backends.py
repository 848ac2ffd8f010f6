"""Each attention backend alone (``worker_svc.backends``), against SDPA as the oracle, on one mixed batch:
decodes, a prompt's first chunk, a chunk that goes on mid-block, and one that starts after a prefix whose
blocks another sequence wrote; block tables in shuffled order. SDPA itself is checked against attention
written out token by token."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_kernels

from worker_svc import backends
from worker_svc.attention import BlockTable, padded_tables
from worker_svc.backends import StepBatch, slot
from worker_svc.kv_cache import KVCache
from worker_svc.loader import load_model

BLOCK = 4
NUM_BLOCKS = 40

# Two steps over five sequences: (first step: prompt length), (second step: start, new tokens). A shares its
# first two blocks (8 tokens) with B, whose second step starts there as a prefix-cache hit would.
FIRST = {"A": 10, "C": 7, "E": 5}
SECOND = {"A": (10, 1), "E": (5, 1), "B": (8, 5), "C": (7, 6), "D": (0, 9)}  # decodes first, then the chunks
# Prompt lengths: C's second chunk ends its prompt at 10 and goes on with 3 tokens it generated (recomputed after a
# preemption), so a chunk holds both kinds of token (the native kernels take them by different paths).
PROMPT = {"A": 10, "B": 13, "C": 10, "D": 9, "E": 5}


def _tables() -> dict[str, list[int]]:
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    tables = {name: take(4) for name in "ACDE"}
    tables["B"] = tables["A"][:2] + take(2)  # the shared prefix, then its own blocks
    return tables


def _tokens(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(2)
    tokens = {name: torch.randint(0, vocab, (16,), generator=g).tolist() for name in "ACDE"}
    tokens["B"] = tokens["A"][:8] + torch.randint(0, vocab, (8,), generator=g).tolist()
    return tokens


def _batch(step: dict[str, tuple[int, int]], tables, tokens) -> StepBatch:
    return StepBatch.of([(tokens[s][start : start + n], start, tables[s], PROMPT[s]) for s, (start, n) in step.items()],
                        BLOCK)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """The tiny random Llama (GQA, 4 heads of 16), packed for the native backend when the CPU kernels are here."""
    return load_model(tiny_folder)


def _backend(name: str, loaded) -> backends.Backend:
    """Over a cache of NaN, as fresh memory may hold: no backend may let a slot nobody wrote into a result."""
    cache = KVCache.allocate(loaded.config, BLOCK, NUM_BLOCKS, "cpu", torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    return backends.make(name, loaded.model, cache, loaded.max_model_len, compile_attention=False)


def _two_steps(backend: backends.Backend, tables, tokens) -> list[torch.Tensor]:
    first = _batch({s: (0, n) for s, n in FIRST.items()}, tables, tokens)
    with torch.inference_mode():
        return [backend.run(first), backend.run(_batch(SECOND, tables, tokens))]


@pytest.mark.parametrize("name", [pytest.param("native", marks=needs_kernels), "flex"])
def test_a_backend_computes_the_hidden_states_sdpa_computes(tiny, name):
    """The whole forward (the native backend is every layer in one C call) over two steps: what the second reads
    of the cache is what the first wrote, through each backend's own metadata."""
    tables, tokens = _tables(), _tokens(tiny.config.vocab_size)
    expected = _two_steps(_backend("sdpa", tiny), tables, tokens)
    got = _two_steps(_backend(name, tiny), tables, tokens)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def _by_hand(q, cache_k, cache_v, batch: StepBatch) -> torch.Tensor:
    """Each token's softmax over its sequence's keys 0..its position, looked up slot by slot."""
    group = q.shape[1] // cache_k.shape[1]
    out, token = torch.empty_like(q), 0
    for start, n, table in zip(batch.starts, batch.lengths, batch.tables):
        for pos in range(start, start + n):
            slots = [slot(table, j, BLOCK) for j in range(pos + 1)]
            keys = cache_k[slots].repeat_interleave(group, dim=1)  # (ctx, H, D)
            values = cache_v[slots].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,chd->hc", q[token], keys) / q.shape[-1] ** 0.5, dim=-1)
            out[token] = torch.einsum("hc,chd->hd", weights, values)
            token += 1
    return out


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_one_layers_attention_reads_each_context_through_its_block_table(tiny, name):
    """One layer's prepared attention on random q, k, v and a cache of random earlier context: it writes this
    step's k and v to their slots and attends exactly as written out by hand."""
    cfg, tables = tiny.config, _tables()
    batch = _batch(SECOND, tables, _tokens(cfg.vocab_size))
    g = torch.Generator().manual_seed(4)
    t = len(batch.token_ids)
    q = torch.randn(t, cfg.num_heads, cfg.head_dim, generator=g)
    k, v = (torch.randn(t, cfg.num_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
    shape = (NUM_BLOCKS + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    cache_k, cache_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    expected_k, expected_v = cache_k.view(-1, *shape[2:]).clone(), cache_v.view(-1, *shape[2:]).clone()
    expected_k[batch.slots], expected_v[batch.slots] = k, v
    step = _backend(name, tiny).prepare(batch)
    with torch.inference_mode():
        out = step(q, k, v, cache_k, cache_v)
    torch.testing.assert_close(cache_k.view(-1, *shape[2:]), expected_k, atol=0, rtol=0)
    torch.testing.assert_close(out, _by_hand(q, expected_k, expected_v, batch), atol=1e-5, rtol=1e-5)


def test_a_backend_the_model_cannot_take_is_refused_by_name(tiny_folder):
    """Native attention over dense weights, and --quantize off the native backend: each a clear error naming the
    flag, at start-up, not a wrong or slow path."""
    from conveyor.model_files import ModelFileError

    dense = load_model(tiny_folder, attention="sdpa")
    with pytest.raises(ValueError, match="--attention native: cannot run this model .* not packed"):
        _backend("native", dense)
    with pytest.raises(ModelFileError, match="--quantize q8_0 needs --attention native"):
        load_model(tiny_folder, attention="flex", quantize="q8_0")
    with pytest.raises(ValueError, match="--attention must be one of auto, native, flex, sdpa"):
        load_model(tiny_folder, attention="cuda")


def test_a_block_tables_padded_row_follows_its_ids_through_growth_and_rollback():
    """The array a step's padded tables copy from must hold exactly the table's ids: grown past its first
    capacity, cut back (a failed step's rollback), then extended over the ids it lost."""
    ids = list(range(100, 140))
    table = BlockTable(ids[:3])
    for start in range(3, len(ids), 7):
        table.extend(ids[start : start + 7])
    table.truncate(25)
    table.extend([7, 8])
    expected = ids[:25] + [7, 8]
    padded = padded_tables([table, [1, 2]], 3, 30, -1)
    assert table.ids == table.row().tolist() == expected
    assert padded[0].tolist() == expected + [-1] * 3 and padded[1].tolist() == [1, 2] + [-1] * 28
    assert padded[2].tolist() == [-1] * 30
