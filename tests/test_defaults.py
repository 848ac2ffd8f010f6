"""Sampling defaults for fields a request leaves unset: the model's own generation defaults, else Conveyor's."""

from __future__ import annotations

import json

from conveyor.params import SamplingDefaults, sampling_defaults
from conveyor.params import Limits
from tokenizer_svc.validation import GenerateInput, build_params


def _hf_folder(path, generation_config=None):
    path.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_a_hugging_face_models_generation_config_fills_what_it_sets(tmp_path):
    folder = _hf_folder(tmp_path / "m", {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "max_length": 99})
    d = sampling_defaults(str(folder))
    assert (d.temperature, d.top_p, d.source) == (0.6, 0.9, "generation_config.json")
    assert (d.top_k, d.min_p) == (SamplingDefaults().top_k, SamplingDefaults().min_p)  # not set there: ours
    greedy = sampling_defaults(str(_hf_folder(tmp_path / "g", {"do_sample": False, "temperature": 0.6})))
    assert greedy.temperature == 0.0


def test_without_model_defaults_conveyors_chat_friendly_ones_apply():
    assert sampling_defaults("default") == SamplingDefaults()  # the default GGUF carries no general.sampling keys
    assert SamplingDefaults().temperature < 1.0 and SamplingDefaults().top_p < 1.0


def test_unset_fields_take_the_defaults_and_set_ones_win():
    limits = Limits(max_model_len=100, vocab_size=1000)
    defaults = SamplingDefaults(temperature=0.3, top_k=7, top_p=0.5, min_p=0.1, repetition_penalty=1.1)
    s = build_params(GenerateInput(prompt="x"), 3, limits, defaults).sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (0.3, 7, 0.5, 0.1, 1.1)
    c = build_params(GenerateInput(prompt="x", sampling={"temperature": 0.0, "top_k": -1, "top_p": 1.0}), 3, limits,
                     defaults).sampling
    assert (c.temperature, c.top_k, c.top_p) == (0.0, -1, 1.0)
