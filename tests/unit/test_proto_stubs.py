"""The committed stubs under specpair/proto/ are what `make proto` generates from protos/."""

from __future__ import annotations

from pathlib import Path

from specpair.rpc.proto_gen import ROOT, generate


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path / "proto")
    committed = ROOT / "specpair" / "proto"
    for path in fresh:
        rel = path.relative_to(tmp_path / "proto")
        assert (committed / rel).read_text() == path.read_text(), f"{rel} is stale: run make proto"
    names = {p.relative_to(tmp_path / "proto") for p in fresh}
    # Only sources count: an interpreter run without PYTHONDONTWRITEBYTECODE leaves bytecode.
    stubs = (p for p in committed.rglob("*_pb2*") if p.suffix in (".py", ".pyi"))
    extra = {p.relative_to(committed) for p in stubs} - names
    assert not extra, f"stubs without a proto: {sorted(map(str, extra))}"
