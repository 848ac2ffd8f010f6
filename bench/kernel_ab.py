"""The CPU kernels of two revisions side by side in one process, their calls alternating: a kernel change measured
on a machine whose speed drifts by 20 % within minutes (a 2-core VM), where two whole-step runs minutes apart say
little. Each round times both builds on the same inputs, one right after the other; the table gives medians
and whether the outputs are bit for bit the same.

    python bench/kernel_ab.py                              # HEAD's kernels against the working tree's
    python bench/kernel_ab.py --before HEAD~3 --what attention --batches 8 32
    python bench/kernel_ab.py --what gemm --rows 1 8 32 512 --types q4_0 q8_0 --passes 1 2
    python bench/kernel_ab.py --what prefill --prompts 256 512
    python bench/kernel_ab.py --isa avx2 --what attention  # the AVX2 fallback's kernels, on an AVX512 CPU too

``--before`` and ``--after`` name git revisions (``worktree``: the files as they are now); only
``worker_svc/cpu_kernels/`` is taken from them, each compiled as the worker compiles it (cached under the
bench cache's ``kernels/``). What is timed:
  - ``attention``: a decode's paged attention, ``--batches`` sequences of ``--context`` keys, the default model's
    heads (9 of 64 values, 3 KV heads), fp16 caches, 30 layers' worth (each its own cache, the blocks in random
    order, as a long-running server's), one call per layer; ``--layers 1`` calls one layer's cache 30 times (it
    stays in the caches: the arithmetic without the wait for memory);
  - ``prefill``: a prompt's attention (``--prompts`` tokens of one sequence attending causally to themselves, the
    flash path), the same heads and cache, one layer's call 30 times;
  - ``gemm``: the fast numerics' tiled product (``tile_gemm``) on the default model's four shapes (qkv, o, gate/up,
    down), random weights of ``--types``, 8 weights a shape (past the caches), for each of ``--rows`` and ``--passes``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNELS = "worker_svc/cpu_kernels"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30  # the default model's attention
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate/up", 3072, 576), ("down", 576, 1536)]  # (name, N, K)


def kernels_of(revision: str, into: Path, isa: str = "auto"):
    """``worker_svc.cpu_kernels`` as of ``revision`` (``worktree``: as the files are now), imported under a name of
    its own, its library compiled for ``isa`` (as ``--cpu-isa``) and loaded."""
    if revision == "worktree":
        folder = ROOT / KERNELS
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, KERNELS], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
        folder = into / KERNELS
    name = f"kernels_{len(sys.modules)}"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    module.use_isa(isa)  # the module's own calls (quantize, kernel_layout) on the same build as the timed ones
    lib, why, _ = module._library(isa)
    if lib is None:
        raise SystemExit(f"{revision}: the kernels cannot run here: {why}")
    return module, lib


def alternate(calls, rounds: int) -> tuple[list[float], bool]:
    """Each call (a function returning its output tensor) timed ``rounds`` times, the calls taking turns: their
    medians in seconds, and whether every call's first output equals the first call's."""
    times: list[list[float]] = [[] for _ in calls]
    outs = []
    for r in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            out = call()
            times[i].append(time.perf_counter() - start)
            if r == 0:
                outs.append(out.clone())
    return [statistics.median(t) for t in times], all(torch.equal(outs[0], o) for o in outs[1:])


def attention_rows(libs, batches: list[int], context: int, layers: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        per = (context + BLOCK - 1) // BLOCK
        caches = [tuple(torch.randn(batch * per, BLOCK, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(2))
                  for _ in range(layers)]
        tables = torch.randperm(batch * per, generator=g).view(batch, per).to(torch.int32).contiguous()
        q = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
        seq = torch.arange(batch, dtype=torch.int32)
        pos = torch.full((batch,), context - 1, dtype=torch.int32)

        def call(lib):
            out = torch.empty(batch, HEADS * HEAD_DIM)
            for k, v in caches * (LAYERS // layers):
                lib.paged_attention(q.data_ptr(), q.shape[1], k.data_ptr(), v.data_ptr(), tables.data_ptr(), per,
                                    seq.data_ptr(), pos.data_ptr(), None, batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                                    HEAD_DIM ** -0.5, out.data_ptr(), 1)
            return out

        medians, same = alternate([lambda lib=lib: call(lib) for lib in libs], rounds)
        gbs = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS / 1e9
        print(f"attention, decode {batch} x {context} keys, {LAYERS} calls over {layers} layers' caches: "
              f"{medians[0] * 1e3:.2f} -> "
              f"{medians[1] * 1e3:.2f} ms ({medians[1] / medians[0]:.3f}; K and V {gbs / medians[0]:.1f} -> "
              f"{gbs / medians[1]:.1f} GB/s); same bits: {same}", flush=True)


def prefill_rows(libs, prompts: list[int], rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    for length in prompts:
        per = (length + BLOCK - 1) // BLOCK
        k, v = (torch.randn(per, BLOCK, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(2))
        table = torch.randperm(per, generator=g).to(torch.int32).view(1, per)
        q = torch.randn(length, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
        seq = torch.zeros(length, dtype=torch.int32)
        pos = torch.arange(length, dtype=torch.int32)
        prompt = torch.ones(length, dtype=torch.uint8)

        def call(lib):
            out = torch.empty(length, HEADS * HEAD_DIM)
            for _ in range(LAYERS):
                lib.paged_attention(q.data_ptr(), q.shape[1], k.data_ptr(), v.data_ptr(), table.data_ptr(), per,
                                    seq.data_ptr(), pos.data_ptr(), prompt.data_ptr(), length, HEADS, KV_HEADS,
                                    HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, out.data_ptr(), 1)
            return out

        medians, same = alternate([lambda lib=lib: call(lib) for lib in libs], rounds)
        flops = 2 * 2 * HEADS * length * (length + 1) / 2 * HEAD_DIM * LAYERS / 1e9  # the causal products
        print(f"attention, a prompt of {length} tokens, {LAYERS} calls: {medians[0] * 1e3:.2f} -> {medians[1] * 1e3:.2f} "
              f"ms ({medians[1] / medians[0]:.3f}; {flops / medians[0]:.0f} -> {flops / medians[1]:.0f} GFLOP/s); "
              f"same bits: {same}", flush=True)


def gemm_rows(module, libs, rows: list[int], types: list[str], passes: list[int], rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    for name in types:
        qtype = module.QUANTIZE[name]
        weights = {shape: [module.kernel_layout(module.quantize(torch.randn(n, k, generator=g) * 0.05, qtype), qtype, k,
                                                tiles=True) for _ in range(8)] for shape, n, k in SHAPES}
        for m in rows:
            xs = {shape: torch.randn(m, k, generator=g) for shape, _, k in SHAPES}
            for p in passes:
                def call(lib):
                    out = []
                    for shape, n, k in SHAPES:
                        y = torch.empty(m, n)
                        for w in weights[shape]:
                            lib.tile_gemm(qtype, xs[shape].data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), p, None)
                        out.append(y.view(-1))
                    return torch.cat(out)

                medians, same = alternate([lambda lib=lib: call(lib) for lib in libs], rounds)
                macs = sum(m * n * k for _, n, k in SHAPES) * 8 * p / 1e9
                print(f"gemm {name}, {m} rows, {p} pass{'es' if p > 1 else ''}: {medians[0] * 1e3:.2f} -> "
                      f"{medians[1] * 1e3:.2f} ms ({medians[1] / medians[0]:.3f}; {macs / medians[0]:.0f} -> "
                      f"{macs / medians[1]:.0f} G int8 multiply-adds/s); same bits: {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--after", default="worktree")
    parser.add_argument("--what", nargs="+", choices=("attention", "prefill", "gemm"),
                        default=["attention", "prefill", "gemm"])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="attention: decoding sequences")
    parser.add_argument("--context", type=int, default=288, help="attention: keys a sequence has")
    parser.add_argument("--layers", type=int, choices=(1, LAYERS), default=LAYERS,
                        help="attention: 1 calls one layer's cache every time (it stays in the CPU's caches)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 512], help="prefill: prompt lengths")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 512], help="gemm: rows of x")
    parser.add_argument("--types", nargs="+", choices=("q4_0", "q8_0"), default=["q4_0", "q8_0"])
    parser.add_argument("--passes", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                        help="gemm: x's int8 passes (int8: 1, fast: 2)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--isa", default="auto", help="the instruction set both builds are compiled for, as the "
                        "worker's --cpu-isa (avx2: the fallback's paths on an AVX512 CPU)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (before, lib_before), (_, lib_after) = (kernels_of(rev, Path(tmp) / str(i), args.isa)
                                                for i, rev in enumerate((args.before, args.after)))
        print(f"{args.before} -> {args.after}, {args.isa} kernels, {torch.get_num_threads()} threads; medians of "
              f"{args.rounds} rounds")
        libs = [lib_before, lib_after]
        if "attention" in args.what:
            attention_rows(libs, args.batches, args.context, args.layers, args.rounds)
        if "prefill" in args.what:
            prefill_rows(libs, args.prompts, args.rounds)
        if "gemm" in args.what:
            gemm_rows(before, libs, args.rows, args.types, args.passes, args.rounds)


if __name__ == "__main__":
    main()
