"""Conveyor next to llama.cpp's llama-server on this machine, in one run, same model file, same client.

    python bench/side_by_side.py                  # workloads (a)-(c) and prefill against llama-bench pp512
    python bench/side_by_side.py --workloads a    # one stream only

llama.cpp is built on first use from the source vendored in the PyPI sdist ``llama-cpp-python``
(``pip download``, then cmake: CPU, native, no network at build or run time), cached under
``~/.cache/conveyor/bench/`` (``CONVEYOR_CACHE_DIR``); never part of the tests or CI.

Workloads (greedy, ``ignore_eos``, exact prompt lengths in tokens; one server at a time):
  (a) 1 stream, 128 prompt / 128 output tokens, 8 requests
  (b) 8 streams, 128 / 128, 16 requests
  (c) 32 streams, 256 / 64, 64 requests
Both servers are driven by ``conveyor bench``'s client (Conveyor through its gRPC SDK, llama-server
through its OpenAI ``/v1/completions`` stream) and get the same prompts. llama-server runs with
``-t <cores> -np 32 -c 32768`` and every request asks ``cache_prompt: false``. Prefill: our worker's
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

WORKLOADS = {  # name: (streams, prompt tokens, output tokens, requests)
    "a": (1, 128, 128, 8),
    "b": (8, 128, 128, 16),
    "c": (32, 256, 64, 64),
}
SDIST = "llama-cpp-python"


def build_llama_cpp() -> Path:
    """The folder holding llama-server and llama-bench, built once from the PyPI sdist."""
    root = cache_root() / "bench"
    built = sorted(root.glob("llama.cpp-*/build/bin/llama-server"))
    if built:
        return built[-1].parent
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building llama.cpp from the {SDIST} sdist (once; a few minutes) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp, SDIST],
                       check=True, capture_output=True)
        archive = next(Path(tmp).glob("*.tar.gz"))
        version = archive.name.removesuffix(".tar.gz").rsplit("-", 1)[-1]
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("*/vendor/llama.cpp"))
        target = root / f"llama.cpp-{version}"
        shutil.move(str(source), target)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",  # nothing fetched
             "-DBUILD_SHARED_LIBS=OFF"]
    subprocess.run(["cmake", "-S", str(target), "-B", str(target / "build"), *flags], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(target / "build"), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-server", "llama-bench"], check=True, capture_output=True)
    return target / "build" / "bin"


def start_llama_server(bin_dir: Path, model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-np", "32",
                             "-c", "32768", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy within 120 s")


def run_workloads(backend, names: list[str], base: BenchConfig) -> dict[str, dict]:
    out = {}
    for name in names:
        streams, prompt, output, requests = WORKLOADS[name]
        cfg = replace(base, concurrency=[streams], prompt_tokens=prompt, max_tokens=output, num_requests=requests,
                      warmup=min(streams, 4))
        (_, results, wall), = sweep(backend, cfg)
        out[name] = summarize(results, wall)
    return out


def prefill_rates(bin_dir: Path, model: Path, threads: int, numerics: str) -> tuple[float, float]:
    """(ours, llama-bench) prompt tokens/s at 512 tokens."""
    import torch

    from worker_svc.kv_cache import KVCache
    from worker_svc.loader import load_model
    from worker_svc.runner import ModelRunner, SeqChunk, StepInput
    from worker_svc.sampling import SamplingParams

    loaded = load_model("default", numerics=numerics)
    runner = ModelRunner(loaded.model, KVCache.allocate(loaded.config, 16, 40, "cpu", torch.float32),
                         loaded.max_model_len, seed=0)
    ids = torch.randint(100, loaded.config.vocab_size - 100, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    rates = []
    for i in range(4):
        start = time.perf_counter()
        runner.step(StepInput([SeqChunk(f"p{i}", ids, 0, list(range(33)), True, SamplingParams(temperature=0.0), 512)]))
        rates.append(512 / (time.perf_counter() - start))
        runner.step(StepInput([], free_seq_ids=[f"p{i}"]))
    done = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "512", "-n", "0",
                           "-r", "3", "-o", "csv"], check=True, capture_output=True, text=True)
    rows = [line.split(",") for line in done.stdout.strip().splitlines()]
    header = [h.strip('"') for h in rows[0]]
    theirs = float(rows[-1][header.index("avg_ts")].strip('"'))
    return max(rates[1:]), theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--numerics", choices=("exact", "fast"), default="fast", help="Conveyor's worker --numerics")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill comparison")
    args = parser.parse_args()

    model = default_model_path()
    bin_dir = build_llama_cpp()
    base = BenchConfig(timeout=1200)
    stack = start(UpConfig(port=free_port(), worker_port=0, scheduler_port=0, detokenizer_port=0, deliver_port=0,
                           log_level="WARNING", numerics=args.numerics,
                           **{f"{n}_metrics_port": 0 for n in ("frontend", "scheduler", "worker", "detokenizer")}))
    try:
        with Client(stack.endpoint, timeout=1200) as client:
            ours = run_workloads(ConveyorBackend(client, replace(base, target=stack.endpoint)), args.workloads, base)
    finally:
        stack.stop()
    server, url = start_llama_server(bin_dir, model, args.threads)
    try:
        theirs = run_workloads(OpenAIBackend(replace(base, backend="openai", target=url)), args.workloads, base)
    finally:
        server.terminate()
        server.wait()

    print(f"\n{model.name}, {args.threads} threads, Conveyor --numerics {args.numerics}; C = Conveyor, L = llama-server")
    print(f"{'workload':<26}{'C tok/s':>9}{'L tok/s':>9}{'ratio':>7}{'ITL p50 ms C / L':>20}{'TTFT p99 ms C / L':>21}")
    for name in args.workloads:
        streams, prompt, output, _ = WORKLOADS[name]
        c, l = ours[name], theirs[name]
        ratio = c["output_tokens_per_second"] / l["output_tokens_per_second"]
        itl = f"{c['itl']['p50'] * 1e3:.1f} / {l['itl']['p50'] * 1e3:.1f}"
        ttft = f"{c['ttft']['p99'] * 1e3:.0f} / {l['ttft']['p99'] * 1e3:.0f}"
        label = f"({name}) {streams} x {prompt} / {output}"
        print(f"{label:<26}{c['output_tokens_per_second']:9.1f}{l['output_tokens_per_second']:9.1f}{ratio:7.2f}"
              f"{itl:>20}{ttft:>21}")
    if not args.no_prefill:
        mine, bench = prefill_rates(bin_dir, model, args.threads, args.numerics)
        print(f"{'prefill 512 tokens':<26}{mine:9.1f}{bench:9.1f}{mine / bench:7.2f}   (prompt tok/s; L = llama-bench pp512)")


if __name__ == "__main__":
    main()
