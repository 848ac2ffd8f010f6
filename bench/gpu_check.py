"""Helpers of ``bench/gpu_check.sh``: what a GPU machine needs that it may lack, and the model it runs.

    python bench/gpu_check.py prepare bench/.gpu_check   # on a machine with the network (and the default model)
    python bench/gpu_check.py missing                    # the project's requirements this Python lacks
    python bench/gpu_check.py model FOLDER [--tokenizer DIR]

``prepare`` packs, for a GPU machine with no network (about 50 MB, under the 64 MiB a device run
carries): wheels of the project's runtime requirements and of pytest and transformers, except
PyTorch and what it depends on (the machine has its CUDA build); the default model's tokenizer as a
Hugging Face folder (the model's 98 MB file is not carried); and ``redis-server`` with the shared
libraries it links that a base system may lack. ``model`` writes a
Hugging Face folder with the default model's shapes (SmolLM2-135M: 30 layers, hidden 576, 9 heads,
3 KV heads) and random bf16 weights: a step costs what the real model's costs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3}
CHECK_EXTRAS = ("pytest", "pytest-timeout", "transformers")
# a GPU machine has its own CUDA build of PyTorch, and what it depends on
NOT_CARRIED = ("torch", "nvidia", "triton", "cuda", "sympy", "mpmath", "networkx")
MAX_WHEEL = 16 << 20
REDIS_LIBS = ("libjemalloc", "liblzf", "libatomic", "libsystemd")  # what redis-server links beyond a base system


def _requirement(line: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare Python: pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(line)


def requirements() -> list[str]:
    """The project's runtime requirements, and of its dev ones those the check runs (tests, transformers)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = [r for r in project["optional-dependencies"]["dev"] if _requirement(r.split("#")[0]).name in CHECK_EXTRAS]
    return [r.split("#")[0].strip() for r in project["dependencies"] + dev]


def missing() -> list[str]:
    """Requirements not installed in a version that satisfies them."""
    lacking = []
    for line in requirements():
        req = _requirement(line)
        try:
            if req.specifier.contains(importlib.metadata.version(req.name), prereleases=True):
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        lacking.append(line)
    return lacking


def prepare(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = folder / "wheels"
    reqs = [r for r in requirements() if not r.startswith(NOT_CARRIED)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(wheels), *reqs],
                   check=True)
    for wheel in wheels.iterdir():
        if wheel.name.startswith(NOT_CARRIED) or wheel.stat().st_size > MAX_WHEEL:
            wheel.unlink()
    from conveyor.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    (folder / "tokenizer").mkdir(exist_ok=True)
    tok.tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template}))
    (folder / "tokenizer" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(tok.eos_token_ids), "bos_token_id": tok.bos_token_id}))
    _pack_redis(folder)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"{folder}: {size / 2**20:.1f} MiB ({len(list(wheels.iterdir()))} wheels, tokenizer, redis-server)")


def _pack_redis(folder: Path) -> None:
    server = shutil.which("redis-server")
    if server is None:
        print("no redis-server here: the GPU machine needs its own")
        return
    (folder / "bin").mkdir(exist_ok=True)
    (folder / "lib").mkdir(exist_ok=True)
    shutil.copy2(server, folder / "bin" / "redis-server")
    for line in subprocess.run(["ldd", server], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and parts[0].strip().startswith(REDIS_LIBS):
            path = parts[1].split("(")[0].strip()
            if path:
                shutil.copy2(path, folder / "lib" / Path(path).name)


def make_model(folder: Path, tokenizer: str) -> None:
    from pipeline_ceiling import make_tiny_model

    from conveyor.tokenizer import tokenizer_from_hf_folder

    source = Path(tokenizer)
    if (source / "tokenizer.json").is_file() and not (source / "config.json").is_file():  # what prepare wrote
        tokenizer = tokenizer_from_hf_folder(source)
    make_tiny_model(folder, tokenizer, SMOLLM2_135M, std=0.02)
    print(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("folder", type=Path)
    sub.add_parser("missing")
    model = sub.add_parser("model")
    model.add_argument("folder", type=Path)
    model.add_argument("--tokenizer", default="default", help="a --model whose tokenizer it takes (a folder too)")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.folder)
    elif args.command == "missing":
        print("\n".join(missing()))
    else:
        make_model(args.folder, args.tokenizer)


if __name__ == "__main__":
    main()
