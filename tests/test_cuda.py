"""The worker on a CUDA GPU: fused paged attention, captured decode steps, bf16, loading and sizing.

These need a GPU; ``bench/gpu_check.sh`` runs them on a GPU machine. Elsewhere pytest reports each as
skipped, with the reason. Their CPU counterparts (the same code: flex attention fused by the CPU's
compiler, the capture logic under a stand-in for CUDA graphs) run everywhere. The models are made
here (a GPU machine may lack the default model's package): a Llama whose 4 query heads share 2 KV
heads (flex attention's decoding kernel takes it) and a Qwen2 with 6 over 2 (its main kernel does).
"""

from __future__ import annotations

import pytest
import torch
from helpers import TinyScheduler, hf_logits, make_runner, save_hf, tiny_llama, tiny_qwen2

from worker_svc.graphs import CudaGraph
from worker_svc.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (bench/gpu_check.sh runs these on a GPU machine)")


@pytest.fixture(scope="module", params=[tiny_llama, tiny_qwen2], ids=["llama-gqa2", "qwen2-gqa3"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.__name__)
    reference = request.param()
    save_hf(reference, path)
    return path, reference


def _ids(reference, n: int = 300, seed: int = 3) -> list[int]:
    return torch.randint(0, reference.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _score(loaded, ids, **options) -> torch.Tensor:
    num_blocks = len(ids) // 16 + 2
    runner = make_runner(loaded, num_blocks=num_blocks, **options)
    return runner.score(ids, list(range(num_blocks - 1, 0, -1))).float().cpu()


def test_flex_on_the_gpu_matches_transformers_in_fp32(folder):
    path, reference = folder
    ours = load_model(path, device="cuda", dtype=torch.float32)
    assert make_runner(ours, num_blocks=4).attention == "flex"  # the GPU's default
    ids = _ids(reference)
    torch.testing.assert_close(_score(ours, ids), hf_logits(reference, ids), atol=1e-3, rtol=1e-3)


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(folder):
    """bf16 weights and KV: our logits stray from the fp32 reference no further than transformers' own bf16
    run on the same GPU does (the two round differently, so the check is on the size of the error)."""
    path, reference = folder
    ids = _ids(reference)
    truth = hf_logits(reference, ids)
    ours = _score(load_model(path, device="cuda", dtype=torch.bfloat16), ids)
    theirs_model = reference.to(device="cuda", dtype=torch.bfloat16)
    try:
        with torch.inference_mode():
            theirs = theirs_model(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    finally:
        reference.to(device="cpu", dtype=torch.float32)
    ours_error, their_error = (ours - truth).abs().mean(), (theirs - truth).abs().mean()
    assert ours_error <= 2 * their_error + 1e-3, f"ours {ours_error:.4f}, transformers bf16 {their_error:.4f}"


def test_captured_decode_steps_equal_the_eager_steps(folder):
    path, reference = folder
    ours = load_model(path, device="cuda", dtype=torch.float32)
    prompts = [_ids(reference, n, seed) for n, seed in ((5, 1), (40, 2), (17, 3), (90, 4), (33, 5))]
    runs = []
    for graphs in (None, CudaGraph.factory()):
        runner = make_runner(ours, num_blocks=256, graphs=graphs, max_graph_batch=8)
        if runner.graphs is not None:
            with torch.inference_mode():
                runner.graphs.capture_all()
        scheduler = TinyScheduler(runner, chunk_sizes=[5, 12])
        scheduler.free_blocks.reverse()
        runs.append(scheduler.run(prompts, 24, together=True))
        assert (runner.graphs is not None) == (graphs is not None)
    (eager_tokens, eager_lp), (graph_tokens, graph_lp) = runs
    assert graph_tokens == eager_tokens
    for got, want in zip(graph_lp, eager_lp):
        assert got == pytest.approx(want, abs=1e-3)


def test_speculation_on_the_gpu_gives_plain_decodings_tokens(folder):
    """Verify chunks run eager beside captured 1-token decodes: with drafts (prompts that repeat a pattern, so
    prompt lookup proposes), greedy tokens and logprobs equal plain decoding's; the measured cost model is
    printed (bench/gpu_check.sh keeps the output)."""
    path, reference = folder
    ours = load_model(path, device="cuda", dtype=torch.float32)
    pattern = _ids(reference, 12, 7)
    prompts = [pattern * 4, _ids(reference, 30, 8) + pattern * 3, (pattern[:5] * 9)[:40]]
    runs = []
    for drafts in (0, 4):
        runner = make_runner(ours, num_blocks=256, graphs=CudaGraph.factory(), max_graph_batch=8)
        with torch.inference_mode():
            runner.graphs.capture_all()
        if drafts:
            cost = runner.verify_cost(8)
            print("verify cost (drafts 0..8):", " ".join(f"{c:.2f}" for c in cost))
            assert cost[0] == 1.0 and cost == sorted(cost)
        scheduler = TinyScheduler(runner)
        runs.append(scheduler.run(prompts, 24, max_drafts=drafts))
        print(f"drafts {drafts}: {scheduler.accepted} tokens from confirmed drafts")
    (plain_tokens, plain_lp), (spec_tokens, spec_lp) = runs
    assert spec_tokens == plain_tokens
    for got, want in zip(spec_lp, plain_lp):
        assert got == pytest.approx(want, abs=1e-3)


def test_a_hf_folder_loads_straight_onto_the_gpu_in_bf16(folder):
    path, _ = folder
    loaded = load_model(path, device="cuda", dtype=torch.bfloat16)
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_gpu_memory_utilization_sizes_the_kv_cache(folder):
    from worker_svc.config import WorkerConfig
    from worker_svc.server import build_runner

    path, _ = folder
    total = torch.cuda.mem_get_info()[1]
    runner, _, info = build_runner(WorkerConfig(model=str(path), device="cuda", gpu_memory_utilization=0.2,
                                                profile_tokens=1024, max_graph_batch=8))
    cache = info.num_blocks * info.block_bytes
    assert 0.1 * total < cache <= 0.2 * total  # a tiny model leaves nearly all of its share to the cache
    assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]  # captured before serving
    del runner
    torch.cuda.empty_cache()
