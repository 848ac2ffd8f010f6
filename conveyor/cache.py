"""An on-disk cache of things derived from a model file (its tokenizer, its dequantized weights).

Parsing a GGUF file's metadata with the ``gguf`` package takes seconds, and every process that
needs the tokenizer would pay it. Derived files are stored under ``cache_root()`` in a folder
named after the source file's path, size and modification time, so a changed file misses.
Writes go to a temporary name and are renamed into place: processes that start together never
read a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_FORMAT = 1  # bump when what is cached changes shape


def cache_root() -> Path:
    """``$CONVEYOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/conveyor``, else ``~/.cache/conveyor``."""
    if os.environ.get("CONVEYOR_CACHE_DIR"):
        return Path(os.environ["CONVEYOR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "conveyor"


def cache_dir_for(source: Path) -> Path:
    """The cache folder of one source file (not created)."""
    stat = source.stat()
    ident = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_FORMAT}"
    return cache_root() / f"{source.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` then rename the result to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, os.stat(tmp).st_mode | 0o644)  # mkstemp makes 0600; others may share the cache
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
