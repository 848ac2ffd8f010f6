"""A Hugging Face folder (bf16 safetensors, ``LlamaForCausalLM``) made from a GGUF file, for the bench peers
that read only Hugging Face folders (vLLM), so that every server runs the same weights.

    python bench/hf_from_gguf.py                       # the default model -> <cache>/bench/hf-<name>-bf16
    python bench/hf_from_gguf.py --gguf m.gguf --out /tmp/folder --dtype float32

transformers dequantizes the GGUF (its own reader, not ours) and saves the model in ``--dtype``; the folder
is then loaded back by transformers and its greedy continuation of a few prompts checked against the
in-memory model (same weights, same arithmetic: identical tokens), so a broken folder fails here, not in a
bench run. Never part of the tests or CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conveyor.cache import cache_root  # noqa: E402
from conveyor.model_files import default_model_path  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def greedy(model, tokenizer, prompt: str, tokens: int = 24) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def write_folder(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """``out`` holding the GGUF's weights in ``dtype`` (kept when its config is already there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=DTYPES[dtype])
    config = loaded.config  # marked as GGUF-quantized, which save_pretrained refuses: a plain model of it
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).eval()
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=DTYPES[dtype]).eval()
    for prompt in PROMPTS:
        expected, got = greedy(model, tokenizer, prompt), greedy(reloaded, tokenizer, prompt)
        if expected != got:
            raise SystemExit(f"the saved folder does not reproduce the model on {prompt!r}: {got} != {expected}")
    tmp.rename(out)
    print(f"wrote {out} ({dtype}); greedy output of {len(PROMPTS)} prompts checked against transformers")
    return out


def default_folder(dtype: str = "bfloat16") -> Path:
    gguf = default_model_path()
    return write_folder(gguf, cache_root() / "bench" / f"hf-{gguf.stem}-{dtype}", dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="a .gguf file (default: the default model's)")
    parser.add_argument("--out", type=Path, default=None, help="the folder to write (default: under the bench cache)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    if args.gguf is None and args.out is None:
        print(default_folder(args.dtype))
        return
    gguf = args.gguf or default_model_path()
    print(write_folder(gguf, args.out or cache_root() / "bench" / f"hf-{gguf.stem}-{args.dtype}", args.dtype))


if __name__ == "__main__":
    main()
