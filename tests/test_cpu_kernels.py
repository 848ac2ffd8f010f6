"""The CPU kernels against PyTorch and gguf-py on random data (shapes chosen to hit every tail)."""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
from helpers import needs_kernels

from worker_svc import cpu_kernels
from worker_svc.config import WIDE

pytestmark = needs_kernels
Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F32, Q.F16, Q.BF16]  # GGUF blocks, and dense rows as a checkpoint stores them
DTYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


TILED = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16]  # the types the fast numerics keep in tiles


@contextlib.contextmanager
def _kernels_for(isa: str):
    """The kernels compiled for ``isa`` while the block runs, then the best this CPU has again."""
    cpu_kernels.use_isa(isa)
    try:
        yield
    finally:
        cpu_kernels.use_isa("auto")


def _quantized(qtype, n: int, k: int, seed: int = 0, tiles: bool = False):
    """(the kernels' layout, rows or ``tiles``; the exact fp32 values it holds) of a random (n, k) weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    if qtype in DTYPES:
        stored = torch.from_numpy(w).to(DTYPES[qtype])
        rows, type_id = cpu_kernels.dense_rows(stored)
        assert type_id == int(qtype)
        return cpu_kernels.kernel_layout(rows, type_id, k, tiles), stored.float()
    blocks = gguf.quants.quantize(w, qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(n, k))
    return cpu_kernels.kernel_layout(torch.from_numpy(blocks.copy()).reshape(n, -1), int(qtype), k, tiles), dense


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_quantize_writes_the_blocks_llama_cpps_quantizer_writes(qtype):
    w = torch.randn(67, 320, generator=torch.Generator().manual_seed(5)) * 0.02
    w[3, 40:72] = 0.0  # an all-zero block: scale 0, no division by it
    expected = gguf.quants.quantize(w.numpy(), qtype).reshape(67, -1)
    assert np.array_equal(cpu_kernels.quantize(w, int(qtype)).numpy(), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_expand_to_exactly_the_gguf_values(qtype):
    qweight, dense = _quantized(qtype, 37, 96)
    rows = torch.tensor([0, 36, 5, 5])
    assert torch.equal(cpu_kernels.dequantize_rows(qweight, int(qtype), 96, rows), dense[rows])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 33])
def test_qgemm_matches_dense_matmul(qtype, m):
    n, k = 83, 160  # n not a multiple of the 4-row tile, k of 32 but not of 64
    qweight, dense = _quantized(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    torch.testing.assert_close(cpu_kernels.qgemm(x, qweight, int(qtype), n), x @ dense.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
def test_tiles_hold_exactly_the_gguf_values(qtype):
    qweight, dense = _quantized(qtype, 37, 96, tiles=True)
    assert qweight.shape[0] == 48  # 37 rows padded to whole tiles of 16
    rows = torch.tensor([0, 36, 16, 5, 5])
    assert torch.equal(cpu_kernels.dequantize_rows(qweight, int(qtype), 96, rows, tiles=True), dense[rows])


# relative error bounds per passes of x: int8 blocks (1: 8 bits, 2: ~15) and bf16 parts (1: 8 bits, 2: ~16)
FAST_ERROR = {Q.BF16: {1: 1e-2, 2: 2e-5}, "int8": {1: 2e-2, 2: 2e-4}}


@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
@pytest.mark.parametrize("passes", [1, 2])
def test_tiles_multiply_any_number_of_rows_and_a_row_does_not_depend_on_the_others(qtype, passes):
    """Every row count the fast numerics see (a decode, a batch, a verify chunk, a prefill chunk) against the
    exact product; each row of the result equals that row multiplied alone, for all the rows the integer dots
    take (more quantized rows take the fp32 product of the same weights: within fp32 rounding)."""
    n, k = 99, 320  # n not a multiple of the 16-row tile, and an odd number of them (VNNI takes two at a time)
    qweight, dense = _quantized(qtype, n, k, seed=passes, tiles=True)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(passes)) * 2
    alone = torch.cat([cpu_kernels.qgemm(x[i : i + 1], qweight, int(qtype), n, passes) for i in range(70)])
    dots = qtype == Q.BF16 or 70 <= cpu_kernels.int8_max_rows(passes)
    for m in [1, 2, 3, 4, 5, 8, 9, 13, 17, 33, 70]:
        y = cpu_kernels.qgemm(x[:m], qweight, int(qtype), n, passes)
        exact = (x[:m].double() @ dense.double().T).float()
        error = float((y - exact).norm() / exact.norm())
        if qtype == Q.BF16 or m <= cpu_kernels.int8_max_rows(passes):
            assert error < FAST_ERROR.get(qtype, FAST_ERROR["int8"])[passes], (m, error)
            assert torch.equal(y, alone[:m]), m
        else:
            assert error < 1e-6, (m, error)
            assert dots or not torch.equal(y, alone[:m])  # the fp32 product, not the integer one
    assert 1e-7 < float((alone - x @ dense.T).norm() / (x @ dense.T).norm())  # x was quantized or rounded


@pytest.mark.skipif(len(cpu_kernels.supported_isas()) < 2, reason="this CPU has one of the kernels' instruction sets")
@pytest.mark.parametrize("qtype", TILED, ids=lambda t: t.name)
@pytest.mark.parametrize("passes", [1, 2])
def test_every_instruction_set_gives_the_same_fast_product(qtype, passes):
    """x quantizes with the same operations per value (8 lanes on AVX2, 16 with AVX512), integer dots sum exactly
    and scale per block in the same order on every instruction set, so AVX2 and AVX512-VNNI give the same bits;
    bf16 dots (emulated on AVX2, AMX's tiles in their own order) the same up to the rounding of fp32 sums (each
    sum of K products within K u of the sum of their magnitudes)."""
    n, k = 50, 256
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    x[1, 32:64] = 0  # a block of zeros (its scale 0)
    results = {}
    for name in cpu_kernels.supported_isas():
        with _kernels_for(name):
            qweight, dense = _quantized(qtype, n, k, seed=7, tiles=True)
            rows = min(5, cpu_kernels.int8_max_rows(passes))
            results[name] = cpu_kernels.qgemm(x[:rows], qweight, int(qtype), n, passes)
    first = results.pop("avx2")
    for name, y in results.items():
        if qtype == Q.BF16:  # ``passes`` bf16 parts of x: passes * k products a sum
            bound = 2 * (passes * k) * 2.0**-24 * (x[: len(first)].abs() @ dense.abs().T)
            assert bool(((y[: len(first)] - first).abs() <= bound).all()), name
            assert not torch.equal(first, x[: len(first)] @ dense.T)  # x was rounded to bf16
        else:
            assert torch.equal(y[: len(first)], first), name


@pytest.mark.skipif(len(cpu_kernels.supported_isas()) < 2, reason="this CPU has one of the kernels' instruction sets")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_4bit_block_sums_are_exact_on_every_instruction_set(qtype, sign):
    """AVX2's one pass adds a block's 4-bit products in 16 bits before widening them: 31 nibbles of 15 a block against
    x at its largest (127 once quantized) bring those sums to 28,575-30,480 of int16's 32,767, and they must still
    be the int32 sums vpdpbusd makes (AVX512), and the exact product."""
    n, k = 16, 256
    if qtype == Q.Q4_0:  # d = 1 from the block's -8: 7 -> nibble 15, -8 -> 0
        w = np.full((n, k), 7.0, np.float32)
        w[:, ::32] = -8.0
    else:  # min 0, d = 1: 15 -> nibble 15
        w = np.full((n, k), 15.0, np.float32)
        w[:, ::32] = 0.0
    blocks = gguf.quants.quantize(w, qtype)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(n, k))
    assert torch.equal(dense, torch.from_numpy(w))  # the nibbles are 15 but one a block
    x = torch.full((5, k), sign)
    results = {}
    for name in cpu_kernels.supported_isas():
        with _kernels_for(name):
            qweight = cpu_kernels.kernel_layout(torch.from_numpy(blocks.copy()).reshape(n, -1), int(qtype), k, True)
            results[name] = cpu_kernels.qgemm(x, qweight, int(qtype), n, 1)
    first = results.pop("avx2")
    torch.testing.assert_close(first, x @ dense.T, rtol=1e-5, atol=0)
    for name, y in results.items():
        assert torch.equal(y, first), name


@pytest.mark.skipif("amx" not in cpu_kernels.supported_isas(), reason="this CPU has no AMX tiles")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("passes", [1, 2])
def test_amx_tiles_give_the_bits_of_the_vector_tiles_at_every_row_count(qtype, passes):
    """AMX multiplies 16 rows of x at a time (the rest of a batch goes through the vector tiles): each block's
    integer sums are exact and scaled in the same order, so every row count gives avx512bf16's bits."""
    n, k = 99, 320
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(passes)) * 2
    results = {}
    for name in ("avx512bf16", "amx"):
        with _kernels_for(name):
            assert cpu_kernels.isa() == name
            qweight, _ = _quantized(qtype, n, k, seed=passes, tiles=True)
            results[name] = {m: cpu_kernels.qgemm(x[:m], qweight, int(qtype), n, passes) for m in (15, 16, 17, 32, 47, 70)}
    for m, y in results["amx"].items():
        assert torch.equal(y, results["avx512bf16"][m]), m


_BF16_DOTS = [name for name in ("avx512bf16", "amx") if name in cpu_kernels.supported_isas()]


@pytest.mark.skipif(not _BF16_DOTS, reason="this CPU has no bf16 dot products (AVX512-BF16 or AMX)")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_the_bf16_numerics_widen_quantized_weights_to_bf16_from_16_rows(qtype):
    """--numerics bf16: below 16 rows of x the fast product (its bits); from 16 rows each weight's exact value
    rounded to bf16 times x rounded to bf16, fp32 sums (within K u of the sum of the products' magnitudes), and
    a row still the same in any batch of 16 or more; with AMX's tiles and with vdpbf16ps alike."""
    n, k = 99, 320
    qweight, dense = _quantized(qtype, n, k, seed=11, tiles=True)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(11)) * 2
    wide = 2 | WIDE
    xb, wb = x.to(torch.bfloat16).double(), dense.to(torch.bfloat16).double()
    for name in _BF16_DOTS:
        with _kernels_for(name):
            assert cpu_kernels.isa() == name
            results = {}
            for m in (1, 15, 16, 17, 33, 70):
                y = cpu_kernels.qgemm(x[:m], qweight, int(qtype), n, wide)
                fast = cpu_kernels.qgemm(x[:m], qweight, int(qtype), n, 2)
                if m < 16:
                    assert torch.equal(y, fast), (name, m)
                    continue
                bound = k * 2.0**-24 * (xb[:m].abs() @ wb.abs().T)
                assert bool(((y.double() - xb[:m] @ wb.T).abs() <= bound).all()), (name, m)
                assert not torch.equal(y, fast), (name, m)
                results[m] = y
            assert torch.equal(results[70][:33], results[33]) and torch.equal(results[33][:17], results[17]), name
            assert torch.equal(results[17][:16], results[16]), name


_AVX512 = [name for name in ("avx512", "avx512bf16", "amx") if name in cpu_kernels.supported_isas()]


@pytest.mark.skipif(not _AVX512, reason="this CPU has no AVX512 (the fused SwiGLU's tiles)")
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_the_fused_swiglu_gives_the_bits_of_the_product_then_silu_mul(qtype):
    """An item multiplies a gate group of a fused gate/up weight with its up group and writes silu(gate) * up
    itself: the bits of the (M, 2I) product followed by silu_mul. AMX's bf16 tiles do it at every row count
    (bf16 weights; quantized ones under the bf16 numerics, where the CPU has bf16 dots); AVX512's strips from 16
    rows, with bf16 dots and with integer ones (quantized weights under fast and int8), but not where AMX's
    integer tiles take the rows; elsewhere it declines (None)."""
    intermediate, k = 48, 320
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(13)) * 2
    for name in _AVX512:
        with _kernels_for(name):
            qweight, _ = _quantized(qtype, 2 * intermediate, k, seed=13, tiles=True)
            bf16_dots = name != "avx512"  # quantized weights are widened only where the CPU has bf16 dots
            for passes in ([1] if qtype == Q.BF16 else [2 | WIDE, 2, 1]):
                widened = qtype == Q.BF16 or (passes & WIDE and bf16_dots)
                for m in (1, 15, 16, 17, 33, 40):
                    fused = cpu_kernels.swiglu_gemm(x[:m], qweight, int(qtype), intermediate, passes)
                    applies = name == "amx" or m >= 16 if widened else name != "amx" and m >= 16
                    assert (fused is not None) == applies, (name, passes, m)
                    if fused is not None:
                        product = cpu_kernels.qgemm(x[:m], qweight, int(qtype), 2 * intermediate, passes)
                        assert torch.equal(fused, cpu_kernels.silu_mul(product)), (name, passes, m)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values (..., D) as a cache of ``dtype`` holds them: rounded to fp16 or bf16, or as int8 in blocks of 32 with
    their scales after the row (``cpu_kernels.kv_width``), what attention.c's store_i8 computes: scale = max |x| /
    127, q = x * (127 / max |x|) rounded to nearest even (the same fp32 operations)."""
    if dtype != torch.int8:
        return x.to(dtype)
    blocks = x.unflatten(-1, (-1, cpu_kernels.I8_BLOCK))
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(blocks * inv).to(torch.int8).flatten(-2)
    return torch.cat([q, (top / 127.0).view(torch.int8).flatten(-2)], dim=-1)


def _from_cache(c: torch.Tensor, dtype: torch.dtype, d: int) -> torch.Tensor:
    """The fp32 values (..., d) a cache of ``dtype`` holds (int8: q times its block's scale)."""
    if dtype != torch.int8:
        return c.float()
    scales = c[..., d:].contiguous().view(torch.float32)
    return (c[..., :d].float().unflatten(-1, (-1, cpu_kernels.I8_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


def _reference_attention(q, k_cache, v_cache, tables, token_seq, token_pos):
    """Token by token: gather the context through the block table, softmax(q k^T / sqrt(d)) v."""
    _, block_size, hkv, d = k_cache.shape
    heads = q.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        positions = torch.arange(int(token_pos[t]) + 1)
        slots = tables[token_seq[t]].long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache.view(-1, hkv, d)[slots].repeat_interleave(heads // hkv, dim=1)  # (ctx, H, D)
        values = v_cache.view(-1, hkv, d)[slots].repeat_interleave(heads // hkv, dim=1)
        weights = torch.softmax(torch.einsum("hd,chd->hc", q[t], keys) / d**0.5, dim=-1)
        out[t] = torch.einsum("hc,chd->hd", weights, values)
    return out


def _check_attention(d, heads, hkv, token_seq, token_pos, block_size=4, num_blocks=64, seed=0, prompt=None,
                     dtype=torch.float32):
    """RoPE, the cache write and attention for the tokens given (``prompt``: which are prompt tokens), against
    PyTorch; the cache in ``dtype`` (fp16: each K and V value rounded to nearest as PyTorch rounds it, the
    reference attending to those values in fp32; bf16 likewise; int8: each row as store_i8 quantizes it)."""
    if dtype == torch.int8 and d % cpu_kernels.I8_BLOCK:  # int8 rows are blocks of 32 values with a scale each
        with pytest.raises(ValueError, match="multiple of 32"):
            cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=torch.int8)
            cpu_kernels.attention(torch.zeros(len(token_seq), (heads + 2 * hkv) * d), heads, torch.zeros(64, d),
                                  torch.zeros(64, d), cache, cache.clone(), torch.zeros(len(token_seq), dtype=torch.long),
                                  torch.zeros(3, 1, dtype=torch.int32), torch.tensor(token_seq, dtype=torch.int32),
                                  torch.zeros(len(token_seq), dtype=torch.int32))
        return
    g = torch.Generator().manual_seed(seed)
    k_cache = _to_cache(torch.randn(num_blocks, block_size, hkv, d, generator=g), dtype)
    v_cache = _to_cache(torch.randn(num_blocks, block_size, hkv, d, generator=g), dtype)
    per_seq = num_blocks // 3
    tables = torch.randperm(num_blocks, generator=g)[: 3 * per_seq].to(torch.int32).view(3, per_seq)
    token_seq = torch.tensor(token_seq, dtype=torch.int32)
    token_pos = torch.tensor(token_pos, dtype=torch.int32)
    T = len(token_seq)
    qkv = torch.randn(T, (heads + 2 * hkv) * d, generator=g)
    positions = torch.arange(per_seq * block_size, dtype=torch.float32)
    freqs = torch.outer(positions, torch.rand(d // 2, generator=g))
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    slots = tables[token_seq].long().gather(1, (token_pos.long() // block_size).unsqueeze(1)).squeeze(1)
    slots = slots * block_size + token_pos.long() % block_size
    # expected: RoPE in PyTorch, k/v written to the cache, then the reference attention
    q, k, v = qkv.split([heads * d, hkv * d, hkv * d], dim=-1)

    def rope(x, n):
        x = x.view(T, n, d)
        c, s = cos[token_pos.long()].unsqueeze(1), sin[token_pos.long()].unsqueeze(1)
        return x * c + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * s

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, hkv, k_cache.shape[-1])[slots] = _to_cache(rope(k, hkv), dtype)
    v_ref.view(-1, hkv, v_cache.shape[-1])[slots] = _to_cache(v.view(T, hkv, d), dtype)
    k_values, v_values = _from_cache(k_ref, dtype, d), _from_cache(v_ref, dtype, d)
    expected = _reference_attention(rope(q, heads), k_values, v_values, tables, token_seq, token_pos)
    flags = None if prompt is None else torch.tensor(prompt, dtype=torch.uint8)
    out = cpu_kernels.attention(qkv.clone(), heads, cos, sin, k_cache, v_cache, slots, tables, token_seq, token_pos,
                                flags)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    out = out.view(T, heads, d)
    if dtype in (torch.bfloat16, torch.int8) and prompt is not None and cpu_kernels.isa() == "amx" and d % 32 == 0:
        # prompt tokens against a bf16 or int8 cache in AMX-BF16 tiles: q (scaled) and K and V rounded to bf16
        # (an int8 cache's values times their scale), then the softmax's weights, each within 2^-9 of itself (the
        # sum they are divided by is not rounded): the output is within 2^-9 max |v| of the same attention with
        # those q, K and V
        tiles = torch.tensor(prompt, dtype=torch.bool)
        q_tiles = (rope(q, heads) * d**-0.5).bfloat16().float() * d**0.5
        k_tiles, v_tiles = k_values.bfloat16().float(), v_values.bfloat16().float()
        expected_tiles = _reference_attention(q_tiles, k_tiles, v_tiles, tables, token_seq, token_pos)
        bound = 2**-9 * v_tiles.abs().max().item() + 1e-5
        torch.testing.assert_close(out[tiles], expected_tiles[tiles], atol=bound, rtol=0)
        out, expected = out[~tiles], expected[~tiles]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", cpu_kernels.supported_isas())
@pytest.mark.parametrize("dtype", cpu_kernels.KV_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 40])
def test_attention_reads_the_paged_cache_like_a_gather(d, dtype, isa):
    # a decode at position 41 (past AHEAD keys: its rows are prefetched as it goes), a prefill chunk at positions
    # 9..13 (attending to earlier context), a fresh token; as decodes, then as prompt tokens; on every instruction
    # set this CPU has (AVX2's 8-lane paths too)
    with _kernels_for(isa):
        _check_attention(d, 6, 2, [0, 1, 1, 1, 1, 1, 2], [41, 9, 10, 11, 12, 13, 0], seed=d, dtype=dtype)
        _check_attention(d, 6, 2, [0, 1, 1, 1, 1, 1, 2], [41, 9, 10, 11, 12, 13, 0], seed=d,
                         prompt=[0, 1, 1, 1, 1, 1, 1], dtype=dtype)


@pytest.mark.parametrize("dtype", cpu_kernels.KV_DTYPES, ids=str)
@pytest.mark.parametrize("d, heads, hkv, block_size", [(64, 9, 3, 16), (128, 4, 1, 4), (40, 8, 2, 8), (64, 16, 1, 16),
                                                     (64, 2, 2, 16), (32, 6, 1, 8), (64, 9, 3, 12)])
def test_prompt_chunks_match_a_gather_however_their_tokens_group(d, heads, hkv, block_size, dtype):
    """A prompt's tokens go in runs of consecutive tokens that share their keys (16 query rows at a time where the
    kernels have AVX512): a long chunk mid-context, a chunk from position 0 whose last key tile is partial, a
    decode between them, a run of two and a lone prompt token; 1, 3, 4 and 6 heads per KV head, and 16 (runs of
    one token; decodes weigh values 4 heads at a time, so 6 leaves a group of 2); blocks of 12 tokens (not a power
    of two). The last chunk's prompt ends
    mid-chunk: its last tokens were generated (recomputed) and take the row path."""
    seqs = [0] * 45 + [1] + [2] * 23 + [1, 1] + [1]
    positions = list(range(70, 115)) + [60] + list(range(23)) + [61, 62] + [90]
    prompt = [1] * 45 + [0] + [1] * 20 + [0] * 3 + [1, 1] + [1]
    _check_attention(d, heads, hkv, seqs, positions, block_size=block_size, num_blocks=3 * (128 // block_size),
                     prompt=prompt, dtype=dtype)


@pytest.mark.parametrize("dtype", cpu_kernels.KV_DTYPES, ids=str)
def test_a_prompt_tokens_attention_does_not_depend_on_the_tokens_beside_it(dtype):
    """A prompt token's attention has the bits it gets in a call of its own: the run it shares with its neighbours
    (up to 16 query rows, or with AMX and a bf16 cache 64 rows in tiles of 16) and where that run starts do not
    change them. A 70-token prompt in one call, then in four calls splitting it at 5, 37 and 38."""
    g = torch.Generator().manual_seed(3)
    d, heads, hkv, block_size, n = 64, 9, 3, 16, 70
    k_cache = _to_cache(torch.zeros(8, block_size, hkv, d), dtype)
    v_cache = _to_cache(torch.zeros(8, block_size, hkv, d), dtype)
    tables = torch.randperm(8, generator=g).to(torch.int32).view(1, 8)
    pos = torch.arange(n, dtype=torch.int32)
    seq = torch.zeros(n, dtype=torch.int32)
    slots = tables[0].long()[pos.long() // block_size] * block_size + pos.long() % block_size
    qkv = torch.randn(n, (heads + 2 * hkv) * d, generator=g)
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), torch.rand(d // 2, generator=g))
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    prompt = torch.ones(n, dtype=torch.uint8)

    def attend(part):
        return cpu_kernels.attention(qkv[part].clone(), heads, cos, sin, k_cache, v_cache, slots[part], tables,
                                     seq[part], pos[part], prompt[part])

    whole = attend(slice(0, n))
    parts = [attend(slice(a, b)) for a, b in [(0, 5), (5, 37), (37, 38), (38, n)]]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("hkv", [1, 3])
def test_a_few_long_decodes_split_their_keys_over_threads_and_merge_exactly(hkv):
    """Fewer (token, KV head) items than threads can share, long contexts: each item's keys are split into
    ranges that are merged afterwards; a context shorter than the ranges leaves some empty."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the split happens when items < 2 x threads
    try:
        _check_attention(64, 3 * hkv, hkv, [0], [1500], block_size=16, num_blocks=300)
        _check_attention(64, 3 * hkv, hkv, [0, 1], [1100, 0], block_size=16, num_blocks=300, seed=1,
                         dtype=torch.float16)
        _check_attention(64, 3 * hkv, hkv, [1, 0], [900, 700], block_size=16, num_blocks=300, seed=2, dtype=torch.int8)
    finally:
        torch.set_num_threads(before)


def test_add_rms_norm_and_silu_mul_match_pytorch():
    g = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(9, 100, generator=g), torch.randn(9, 100, generator=g), torch.randn(100, generator=g)
    stream = x.clone()
    normed = cpu_kernels.add_rms_norm(stream, delta, w, 1e-5)
    expected_stream = x + delta
    expected = w * (expected_stream * torch.rsqrt(expected_stream.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(stream, expected_stream, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(5, 2 * 77, generator=g) * 30  # large values exercise exp's clamping
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 49_152, 100_003])
def test_argmax_picks_what_torch_max_picks_ties_nans_and_infinities_included(n):
    """Greedy sampling's pick on every instruction set: each row's first largest value, a NaN counting as the largest
    (its first one), a row of -inf giving 0, -0.0 equal to 0.0; rows at the vector width's tails, and enough rows
    that the threads share them."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    x[1] = torch.round(x[1] * 2) / 2  # many ties
    x[1, -1] = x[1].max() if n > 1 else x[1, -1]  # a tie at the last lane too
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, n // 2] = -0.0
    x[4, n // 3] = float("nan")
    x[4, n - 1] = float("nan")
    x[5, n - 1] = float("inf")
    x[6, 0] = 1e30
    expected = x.max(dim=-1).indices
    assert expected[4] == n // 3  # torch's own rule for NaN, which the kernel follows
    for name in cpu_kernels.supported_isas():
        with _kernels_for(name):
            assert torch.equal(cpu_kernels.argmax(x), expected), name
            assert torch.equal(cpu_kernels.argmax(x[:1]), expected[:1]), name  # one row: no threads
