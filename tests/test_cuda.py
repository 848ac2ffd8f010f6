"""The worker on a CUDA GPU: fused paged attention, captured decode steps, bf16, loading and sizing.

These need a GPU; ``bench/gpu_check.sh`` runs them on a GPU machine. Elsewhere pytest reports each as
skipped, with the reason. Their CPU counterparts (the same code: flex attention fused by the CPU's
compiler, the capture logic under a stand-in for CUDA graphs) run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TinyScheduler, hf_logits, make_runner, save_hf, tiny_llama

from worker_svc.graphs import CudaGraph
from worker_svc.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (bench/gpu_check.sh runs these on a GPU machine)")

PROMPTS = ["The capital of France is", "def quicksort(xs):\n    ", "안녕하세요! 오늘 날씨는", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny_llama()
    save_hf(reference, path)
    return path, reference


def _score(loaded, ids, **options):
    num_blocks = len(ids) // 16 + 2
    runner = make_runner(loaded, num_blocks=num_blocks, **options)
    return runner.score(ids, list(range(num_blocks - 1, 0, -1)))


def test_flex_on_the_gpu_matches_transformers_in_fp32(folder):
    path, reference = folder
    ours = load_model(path, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    got = _score(ours, ids, attention="flex").cpu()
    torch.testing.assert_close(got, hf_logits(reference, ids), atol=1e-3, rtol=1e-3)
    assert make_runner(ours, num_blocks=4).attention == "flex"  # the GPU's default


def test_bf16_logits_follow_transformers_bf16_on_the_same_gpu(hf_model, hf_tokenizer):
    """The default model in bf16 (weights and KV) against transformers in bf16 on the same GPU: the two
    round differently, so the check is on agreement, not bits."""
    ours = load_model("default", device="cuda", dtype=torch.bfloat16)
    theirs = hf_model.to(device="cuda", dtype=torch.bfloat16)
    try:
        for prompt in PROMPTS:
            ids = ours.tokenizer.encode(prompt)
            got = _score(ours, ids).float().cpu()
            with torch.inference_mode():
                want = theirs(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
            assert (got - want).abs().mean() < 0.05 * want.abs().mean()
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    finally:
        hf_model.to(device="cpu", dtype=torch.float32)


def test_captured_decode_steps_equal_the_eager_steps():
    ours = load_model("default", device="cuda", dtype=torch.float32)
    tok = ours.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    runs = []
    for graphs in (None, CudaGraph.factory()):
        runner = make_runner(ours, num_blocks=256, graphs=graphs, max_graph_batch=8)
        scheduler = TinyScheduler(runner, chunk_sizes=[5, 12])
        scheduler.free_blocks.reverse()
        runs.append(scheduler.run(prompts, 24, together=True))
        assert (runner.graphs is not None) == (graphs is not None)
    (eager_tokens, eager_lp), (graph_tokens, graph_lp) = runs
    assert graph_tokens == eager_tokens
    for got, want in zip(graph_lp, eager_lp):
        assert got == pytest.approx(want, abs=1e-3)


def test_a_hf_folder_loads_straight_onto_the_gpu_in_bf16(folder):
    path, _ = folder
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    params = list(loaded.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)


def test_gpu_memory_utilization_sizes_the_kv_cache(folder):
    from worker_svc.config import WorkerConfig
    from worker_svc.server import build_runner

    path, _ = folder
    total = torch.cuda.mem_get_info()[1]
    runner, _, info = build_runner(WorkerConfig(model=str(path), device="cuda", gpu_memory_utilization=0.2,
                                                profile_tokens=1024))
    cache = info.num_blocks * info.block_bytes
    assert 0 < cache <= 0.2 * total
    assert cache > 0.1 * total  # a tiny model leaves nearly all of its share to the cache
    del runner
