"""The generated gRPC code in conveyor/v1 is what `python -m conveyor.protogen` makes now."""

from __future__ import annotations

from conveyor import protogen


def test_generated_code_is_not_stale(tmp_path):
    generated = protogen.generate(tmp_path)
    assert generated, "no .proto files found"
    committed = protogen.ROOT / "conveyor" / "v1"
    for path in generated:
        current = committed / path.name
        assert current.is_file(), f"{path.name} is missing: run `python -m conveyor.protogen`"
        assert current.read_text() == path.read_text(), f"{path.name} is stale: run `python -m conveyor.protogen`"
    stray = {p.name for p in committed.glob("*_pb2*.py*")} - {p.name for p in generated}
    assert not stray, f"generated files without a .proto: {sorted(stray)}"


def test_every_field_has_a_comment():
    for proto in protogen.proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            text = line.strip()
            is_field = text.endswith(";") and "=" in text and not text.startswith(("syntax", "package", "option", "//"))
            if is_field and not lines[i - 1].strip().startswith("//"):
                raise AssertionError(f"{proto.name}:{i + 1}: field without a comment: {text}")
