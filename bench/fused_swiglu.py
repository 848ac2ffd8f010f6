"""The fused gate/up product with silu_mul (``tile_gemm_swiglu``) against the product, then ``silu_mul``.

    python bench/fused_swiglu.py                        # the default model's shapes, q4_0 and q8_0, fast and int8
    python bench/fused_swiglu.py --rows 16 512 --types q8_0

A layer's fused gate/up weight ([gate; up], 2I rows, random values quantized as llama.cpp does, in the kernels'
tiles) is multiplied by M rows of x. ``--layers`` different weights are taken in turn, so that (at the default 30)
they do not fit in L3 and come from memory, as in a model. The two ways alternate in one process, and each
figure is the median of ``--reps`` passes over the layers, in ms per layer. Both give the same bits
(``tests/test_cpu_kernels.py``). The unfused way allocates its outputs in torch; the decoder stack does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker_svc import cpu_kernels  # noqa: E402
from worker_svc.config import NUMERICS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 512])
    parser.add_argument("--types", nargs="+", choices=sorted(cpu_kernels.QUANTIZE), default=["q4_0", "q8_0"])
    parser.add_argument("--numerics", nargs="+", choices=("fast", "int8"), default=["fast", "int8"])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()

    k, i = args.hidden, args.intermediate
    print(f"{cpu_kernels.isa()}, {torch.get_num_threads()} threads, K {k}, I {i}, {args.layers} layers; ms per layer")
    for name in args.types:
        qtype = cpu_kernels.QUANTIZE[name]
        g = torch.Generator().manual_seed(0)
        weights = [cpu_kernels.kernel_layout(cpu_kernels.quantize(torch.randn(2 * i, k, generator=g) * 0.05, qtype),
                                             qtype, k, tiles=True) for _ in range(args.layers)]
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            for numerics in args.numerics:
                passes = NUMERICS[numerics]
                if cpu_kernels.swiglu_gemm(x, weights[0], qtype, i, passes) is None:
                    print(f"{name} {numerics} M={m}: not fused on this CPU at this row count")
                    continue
                times = {"fused": [], "product + silu_mul": []}
                for _ in range(args.reps):
                    for way in times:
                        start = time.perf_counter()
                        for w in weights:
                            if way == "fused":
                                cpu_kernels.swiglu_gemm(x, w, qtype, i, passes)
                            else:
                                cpu_kernels.silu_mul(cpu_kernels.qgemm(x, w, qtype, 2 * i, passes))
                        times[way].append((time.perf_counter() - start) / args.layers * 1e3)
                fused, split = (statistics.median(t) for t in times.values())
                print(f"{name} {numerics} M={m}: fused {fused:.3f}, product + silu_mul {split:.3f} ({split / fused:.2f}x)",
                      flush=True)


if __name__ == "__main__":
    main()
