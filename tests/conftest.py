"""Shared fixtures: the real default model (ours, both compute paths) and the transformers reference."""

from __future__ import annotations

import pytest
import torch

@pytest.fixture(scope="session")
def default_model():
    """The default model as the worker runs it on a CPU (quantized weights + CPU kernels when available)."""
    from worker_svc.loader import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def dense_model():
    """The default model on the pure PyTorch path (dense fp32 weights, SDPA): the code CUDA runs."""
    from worker_svc.loader import load_model

    return load_model("default", cpu_kernels="off")


@pytest.fixture(scope="session")
def hf_model():
    """transformers' LlamaForCausalLM loaded from the same GGUF file, fp32."""
    from transformers import AutoModelForCausalLM

    from conveyor.model_files import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from conveyor.model_files import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


