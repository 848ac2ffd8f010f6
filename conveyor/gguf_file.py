"""Reading a GGUF file with the ``gguf`` package: metadata as Python values, tensors by name."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import gguf


class GGUFFile:
    """One memory-mapped GGUF file. ``get(key)`` returns metadata; ``tensors`` maps name -> tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = gguf.GGUFReader(self.path)

    def get(self, key: str, default=None):
        """Metadata value: int/float/bool/str, or a list for arrays; ``default`` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @cached_property
    def tensors(self) -> dict[str, gguf.ReaderTensor]:
        return {t.name: t for t in self.reader.tensors}

    @property
    def architecture(self) -> str:
        return self.get("general.architecture")
