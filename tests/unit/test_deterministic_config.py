"""`--deterministic` (the batch-invariant mode) is a GPU mode: refused on the CPU naming the
field, a switch on `serve target`, passed by `up`, chains only (its kernels:
tests/gpu/test_deterministic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.config import ServerConfig, TargetConfig
from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import StateBuilder, build_target
from specpair.runtime.shape import TreeShape


def test_refused_on_the_cpu_naming_the_field(tmp_path: Path) -> None:
    server = ServerConfig(address="127.0.0.1:0")
    with pytest.raises(ValueError, match="deterministic: the batch-invariant mode is a GPU mode"):
        TargetConfig(server, Path("m"), deterministic=True)
    assert TargetConfig(server, Path("m"), device="cuda", deterministic=True).deterministic
    with pytest.raises(ValueError, match=r"deterministic: .* GPU mode"):
        build_target(tmp_path, max_requests=1, max_len=8, deterministic=True)


def test_serve_target_has_the_switch_and_up_passes_it() -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser

    parser = build_parser()
    on = parser.parse_args(["serve", "target", "--model", "m", "--deterministic"])
    off = parser.parse_args(["serve", "target", "--model", "m"])
    assert on.deterministic is True and off.deterministic is False
    services, _ = up_services(parser.parse_args(["up", "--deterministic", "--device", "cuda"]))
    assert "--deterministic" in next(s.args for s in services if s.name == "target")
    plain, _ = up_services(parser.parse_args(["up"]))
    assert "--deterministic" not in next(s.args for s in plain if s.name == "target")


def test_tree_shapes_are_refused_naming_the_field(tmp_path: Path) -> None:
    """A tree's verify sums its path's keys among its siblings': not the target alone's bits."""
    server = ServerConfig(address="127.0.0.1:0")
    with pytest.raises(ValueError, match="tree_shapes: the batch-invariant mode"):
        TargetConfig(server, Path("m"), device="cuda", deterministic=True, tree_shapes=("4x4x16",))
    chains = TargetConfig(server, Path("m"), device="cuda", deterministic=True)
    assert chains.tiers and all(t.is_chain for t in chains.tiers)
    assert TargetConfig(server, Path("m"), device="cuda", tree_shapes=("4x4x16",)).tree_shapes

    worker = build_target(make_tiny_llama(tmp_path / "t", seed=1), max_requests=1, max_len=64)
    worker.deterministic = True  # as a CUDA worker of the mode is; the check is the builder's
    builder = StateBuilder(worker)
    assert builder.build(TreeShape(3)).shape == TreeShape(3)
    with pytest.raises(ValueError, match="tree_shapes: the batch-invariant mode"):
        builder.build(TreeShape.parse("4x4x16"))
