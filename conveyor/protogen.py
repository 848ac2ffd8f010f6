"""Generate the Python gRPC code from ``protos/conveyor/v1/*.proto``: ``python -m conveyor.protogen``.

The generated modules land in ``conveyor/v1/`` (the proto package ``conveyor.v1`` maps onto this
package), and are committed; ``tests/test_protos.py`` fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    """The ``.proto`` files of the API, sorted."""
    return sorted((PROTO_DIR / "conveyor" / "v1").glob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` under ``out_dir/conveyor/v1``."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    package = out_dir / "conveyor" / "v1"
    (package / "__init__.py").write_text('"""Generated from protos/conveyor/v1 by `python -m conveyor.protogen`."""\n')
    return sorted(package.glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
