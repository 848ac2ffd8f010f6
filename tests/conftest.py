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
    """The default model on the pure PyTorch path (dense fp32 weights, PyTorch layers, SDPA attention)."""
    from worker_svc.loader import load_model

    return load_model("default", attention="sdpa")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A Hugging Face folder of a tiny random Llama (``helpers.tiny_llama``: 3 layers, GQA, Llama-3 rope), for
    tests of the machinery around the model (attention backends, captured graphs), where the default model's
    size buys nothing."""
    from helpers import save_hf, tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_hf(tiny_llama(), folder)
    return folder


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




@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A private redis-server on a free port (the Debian package), stopped at the end."""
    import shutil
    import subprocess

    import redis
    from helpers import free_port

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (apt-get install -y redis-server)"
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            import time

            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait()


# ---------------------------------------------------------------- the HTTP API of a module's own ``stack``


@pytest.fixture(scope="module")
def api_key() -> str:
    """The key the module's ``client`` sends (a module whose stack has keys overrides this)."""
    return "none"


@pytest.fixture(scope="module")
def base(stack) -> str:
    return stack.http_endpoint


@pytest.fixture(scope="module")
def client(base, api_key):
    """The ``openai`` SDK on the module's stack, as users run it."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def keyed(request, stack, tmp_path_factory):
    """A frontend with the module's API keys (its ``KEYS``: name -> key) on the same stack; its public address."""
    from helpers import extra_frontend, stop

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in request.module.KEYS.items()))
    proc, address = extra_frontend(stack, "--api-keys-file", str(keys))
    yield address
    stop(proc)
