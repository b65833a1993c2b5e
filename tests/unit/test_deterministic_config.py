"""`--deterministic` (the batch-invariant mode) is a GPU mode: refused on the CPU naming the
field, a switch on `serve target`, passed by `up` (its kernels: tests/gpu/test_deterministic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.config import ServerConfig, TargetConfig
from specpair.runtime.build import build_target


def test_refused_on_the_cpu_naming_the_field(tmp_path: Path) -> None:
    server = ServerConfig(address="127.0.0.1:0")
    with pytest.raises(ValueError, match="deterministic: the batch-invariant mode is a GPU mode"):
        TargetConfig(server, Path("m"), deterministic=True)
    assert TargetConfig(server, Path("m"), device="cuda", deterministic=True).deterministic
    with pytest.raises(ValueError, match=r"deterministic: .* GPU mode"):
        build_target(tmp_path, max_requests=1, max_len=8, deterministic=True)


def test_serve_target_has_the_switch_and_up_passes_it() -> None:
    from specpair.cli import build_parser
    from specpair.launcher import up_services

    parser = build_parser()
    on = parser.parse_args(["serve", "target", "--model", "m", "--deterministic"])
    off = parser.parse_args(["serve", "target", "--model", "m"])
    assert on.deterministic is True and off.deterministic is False
    services, _ = up_services(parser.parse_args(["up", "--deterministic", "--device", "cuda"]))
    assert "--deterministic" in next(s.args for s in services if s.name == "target")
    plain, _ = up_services(parser.parse_args(["up"]))
    assert "--deterministic" not in next(s.args for s in plain if s.name == "target")
