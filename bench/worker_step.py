"""Worker step throughput on the default model, next to Hugging Face transformers on the same weights.

    python bench/worker_step.py                 # the full table (a few minutes on 2 CPU cores)
    python bench/worker_step.py --batches 1 32 --contexts 128 --no-hf
    python bench/worker_step.py --device cuda --dtype bfloat16 --model /path/to/hf-folder --batches 1 32 256 --generate

For each (batch, context): every sequence gets a prompt of ``context`` tokens (prefilled first,
not timed), then ``--steps`` decode steps are timed; tokens/s is batch * steps / seconds. Prefill
is timed separately (one prompt of ``--prefill-len`` tokens, and a batch of them). transformers
runs the same prompts in the same dtype with its KV cache (``past_key_values``), greedy; with
``--generate`` its ``generate()`` is timed too. On a GPU the worker runs as it serves (flex attention,
decode steps replayed from CUDA graphs captured up to the largest batch; the capture happens in the
untimed warm-up) and every timing ends with a device synchronize.

    python bench/worker_step.py --numerics fast --no-hf --batches 1 8 --contexts 256 --parts

``--parts``: under each row of ours, where a timed step's time went, in ms per step: each part of the native
decoder stack (``layers.c``'s timers: norms, qkv, RoPE and the KV write, attention, o, gate/up with SwiGLU,
down, summed over layers) and the rest of the step outside it (embedding, output layer, sampling, Python).
``--quantize q8_0`` times a Hugging Face folder quantized at load, as the worker's ``--quantize``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import time

import torch

from conveyor.params import SamplingParams
from worker_svc import cpu_kernels
from worker_svc.config import ATTENTION, CPU_ISAS, KV_CACHE_DTYPES, NUMERICS, QUANTIZE_AT_LOAD
from worker_svc.graphs import CudaGraph
from worker_svc.kv_cache import KVCache, bytes_per_block
from worker_svc.loader import load_model
from worker_svc.runner import ModelRunner, SeqChunk, StepInput

GREEDY = SamplingParams(temperature=0.0)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the call that queued them returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(on: bool, parts: bool) -> dict[str, float] | None:
    """With ``parts``: the native stack's part timers (``cpu_kernels.decoder_profile``) read, then on or off."""
    return cpu_kernels.decoder_profile(on) if parts else None


def ours_decode(runner: ModelRunner, ids: torch.Tensor, steps: int, warmup: int = 2,
                parts: bool = False) -> tuple[float, float, dict[str, float] | None]:
    """Prefill every row of ``ids`` (not timed), ``warmup`` untimed decode steps, then ``steps`` timed: (tokens/s,
    seconds a step, with ``parts`` the seconds of each part of the stack a step)."""
    batch, length = ids.shape
    bs = runner.cache.block_size
    blocks_per_seq = (length + warmup + steps + bs) // bs
    next_block = 0
    last = {}
    for b in range(batch):
        table = list(range(next_block, next_block + blocks_per_seq))
        next_block += blocks_per_seq
        out = runner.step(StepInput([SeqChunk(f"s{b}", ids[b].tolist(), 0, new_block_ids=table, sample=True,
                                              sampling=GREEDY, num_prompt_tokens=length)]))
        last[f"s{b}"] = out[0].sampled.token_id
    for i in range(warmup + steps):
        if i == warmup:
            profile(True, parts)
            start = time.perf_counter()
        chunks = [SeqChunk(s, [t], length + i, new_block_ids=[], sample=True) for s, t in last.items()]
        last = {r.seq_id: r.sampled.token_id for r in runner.step(StepInput(chunks))}
    seconds = time.perf_counter() - start
    split = profile(False, parts)
    runner.step(StepInput([], free_seq_ids=list(last)))
    return batch * steps / seconds, seconds / steps, split and {k: v / steps for k, v in split.items()}


def ours_prefill(runner: ModelRunner, ids: torch.Tensor,
                 parts: bool = False) -> tuple[float, float, dict[str, float] | None]:
    batch, length = ids.shape
    bs = runner.cache.block_size
    per = (length + bs - 1) // bs
    chunks = [SeqChunk(f"p{b}", ids[b].tolist(), 0, new_block_ids=list(range(b * per, (b + 1) * per)), sample=True,
                       sampling=GREEDY, num_prompt_tokens=length)
              for b in range(batch)]
    runner.step(StepInput([SeqChunk("warm", ids[0, :16].tolist(), 0, new_block_ids=[0], sample=True, sampling=GREEDY,
                                    num_prompt_tokens=16)]))  # warm-up
    runner.step(StepInput([], free_seq_ids=["warm"]))
    profile(True, parts)
    start = time.perf_counter()
    runner.step(StepInput(chunks))
    seconds = time.perf_counter() - start
    split = profile(False, parts)
    runner.step(StepInput([], free_seq_ids=[c.seq_id for c in chunks]))
    return batch * length / seconds, seconds, split


def _cache_kwarg(model) -> str:
    """transformers 5 renamed ``past_key_values`` to ``cache``; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_decode(model, ids: torch.Tensor, steps: int, warmup: int = 2) -> float:
    """Prefill (not timed), ``warmup`` untimed decode steps, then ``steps`` timed ones."""
    kw = _cache_kwarg(model)
    out = model(input_ids=ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(warmup + steps):
        if i == warmup:
            sync(ids.device)
            start = time.perf_counter()
        out = model(input_ids=nxt, use_cache=True, **{kw: past})
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(ids.device)
    return ids.shape[0] * steps / (time.perf_counter() - start)


@torch.inference_mode()
def hf_generate(model, ids: torch.Tensor, steps: int) -> float:
    """Decode tokens/s of ``generate()`` (greedy): the time of ``steps + 1`` new tokens less that of one."""

    def timed(new_tokens: int) -> float:
        sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
        sync(ids.device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return ids.shape[0] * steps / (timed(steps + 1) - timed(1))


@torch.inference_mode()
def hf_prefill(model, ids: torch.Tensor) -> float:
    model(input_ids=ids[:, :16], use_cache=True, logits_to_keep=1)  # warm-up
    sync(ids.device)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    sync(ids.device)
    return ids.numel() / (time.perf_counter() - start)


def load_hf(model: str, dtype: torch.dtype, device: torch.device):
    """transformers on the same weights: the default model's GGUF, or the same Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    from conveyor.model_files import default_model_path

    if model == "default":
        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return hf.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per (batch, context)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers (ours only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face folder")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--numerics", choices=tuple(NUMERICS), default="exact",
                        help="the worker's --numerics (transformers always computes the exact product)")
    parser.add_argument("--attention", choices=ATTENTION, default="auto", help="the worker's --attention")
    parser.add_argument("--cpu-isa", choices=CPU_ISAS, default="auto", help="the worker's --cpu-isa")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the worker's --kv-cache-dtype")
    parser.add_argument("--quantize", choices=QUANTIZE_AT_LOAD, default="none", help="the worker's --quantize")
    parser.add_argument("--parts", action="store_true",
                        help="under each row of ours, the ms a step spent in each part of the native decoder stack")
    parser.add_argument("--no-graphs", action="store_true", help="on a GPU: every decode step eager (--no-cuda-graphs)")
    parser.add_argument("--generate", action="store_true",
                        help="also time transformers' generate() per decoded token (the issue's batch-1 yardstick)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.use_isa(args.cpu_isa)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    loaded = load_model(args.model, device=device, dtype=dtype, attention=args.attention, numerics=args.numerics,
                        quantize=args.quantize)
    need = max(args.batches) * ((max(args.contexts) + args.steps + 2 + 16) // 16 + 1)
    need = max(need, args.prefill_batch * (args.prefill_len // 16 + 1))
    cache_dtype = loaded.kv_dtype(args.kv_cache_dtype, args.attention)
    cache = KVCache.allocate(loaded.config, 16, need, device, cache_dtype)
    graphs = CudaGraph.factory() if device.type == "cuda" and not args.no_graphs else None
    runner = ModelRunner(loaded.model, cache, loaded.max_model_len, seed=0, attention=args.attention, graphs=graphs,
                         max_graph_batch=max(args.batches))
    hf = None if args.no_hf else load_hf(args.model, dtype, device)
    vocab = loaded.config.vocab_size
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    path = f"CPU kernels ({cpu_kernels.isa()}, {args.numerics})" if runner.attention == "native" else f"{runner.attention} attention" + \
        (", CUDA graphs" if runner.graphs else "")
    print(f"model {loaded.name}, {dtype}, {device} ({where}), {path}, KV {need} blocks x "
          f"{bytes_per_block(loaded.config, 16, cache_dtype)} B of {str(cache_dtype).removeprefix('torch.')}")
    print(f"{'phase':<8}{'batch':>6}{'context':>9}{'conveyor tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}"
          + (f"{'generate tok/s':>16}{'ratio':>8}" if args.generate else ""))

    def row(phase, batch, ctx, ours, ref, generate=None):
        ref_s = f"{ref:20.1f}" if ref else f"{'-':>20}"
        ratio = f"{ours / ref:8.2f}" if ref else f"{'-':>8}"
        gen = f"{generate:16.1f}{ours / generate:8.2f}" if generate else ""
        print(f"{phase:<8}{batch:>6}{ctx:>9}{ours:16.1f}{ref_s}{ratio}{gen}", flush=True)

    def split(step: float, parts: dict[str, float] | None) -> None:
        if parts is None:
            return
        stack = sum(parts.values())
        if not stack:
            print("  parts: this model does not run the native decoder stack")
            return
        print("  ms a step: " + ", ".join(f"{name} {s * 1e3:.2f}" for name, s in parts.items())
              + f"; the stack {stack * 1e3:.2f} of {step * 1e3:.2f} (the rest: embedding, output layer, sampling, Python)",
              flush=True)

    for ctx in args.contexts:
        for batch in args.batches:
            ids = prompts(batch, ctx, vocab).to(device)
            ours, step, parts = ours_decode(runner, ids, args.steps, parts=args.parts)
            ref = hf_decode(hf, ids, args.steps) if hf is not None else None
            generate = hf_generate(hf, ids, args.steps) if hf is not None and args.generate else None
            row("decode", batch, ctx, ours, ref, generate)
            split(step, parts)
            gc.collect()
    for batch in (1, args.prefill_batch):
        ids = prompts(batch, args.prefill_len, vocab, seed=1).to(device)
        ours, step, parts = ours_prefill(runner, ids, parts=args.parts)
        ref = hf_prefill(hf, ids) if hf is not None else None
        row("prefill", batch, args.prefill_len, ours, ref)
        split(step, parts)


if __name__ == "__main__":
    main()
