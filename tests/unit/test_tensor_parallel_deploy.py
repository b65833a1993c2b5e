"""Where a tensor-parallel target's ranks go and what is refused before any loads: the config
(`rank_devices`, `check_gpus` with the visible count injected), `serve target` and `up` on a
machine short of GPUs (one line naming the flag), and `up`'s placement of the draft."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from specpair.cli import main as cli
from specpair.cli.launcher import placement, run_up, up_services
from specpair.config import ServerConfig, TargetConfig, describe_ranks, rank_devices

SERVER = ServerConfig("127.0.0.1:0")


def test_rank_r_runs_on_the_devices_gpu_plus_r() -> None:
    assert rank_devices("cuda", 4) == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert rank_devices("cuda:2", 2) == ("cuda:2", "cuda:3")
    assert rank_devices("cuda", 1) == ("cuda",)  # one rank: the device as given
    assert rank_devices("cpu", 2) == ("cpu", "cpu")
    assert describe_ranks("cuda:4", 4) == "cuda:4-7 (tensor-parallel 4)"
    assert describe_ranks("cpu", 2) == "cpu (tensor-parallel 2)"
    assert describe_ranks("cuda:1", 1) == "cuda:1"


def test_a_cuda_tensor_parallel_target_needs_every_ranks_gpu_visible() -> None:
    config = TargetConfig(SERVER, Path("m"), device="cuda:1", tensor_parallel=4)
    config.check_gpus(5)  # cuda:1 … cuda:4
    with pytest.raises(ValueError) as refused:
        config.check_gpus(4)
    (line,) = str(refused.value).splitlines()
    assert "--tensor-parallel 4" in line and "cuda:1 … cuda:4" in line
    assert "but 4 CUDA devices are visible" in line
    TargetConfig(SERVER, Path("m"), tensor_parallel=2).check_gpus(0)  # the CPU's: gloo
    TargetConfig(SERVER, Path("m"), device="cuda").check_gpus(0)  # one rank: not this check


def test_deterministic_is_refused_with_tensor_parallel_naming_both_flags() -> None:
    with pytest.raises(ValueError) as refused:
        TargetConfig(SERVER, Path("m"), device="cuda", tensor_parallel=2, deterministic=True)
    (line,) = str(refused.value).splitlines()
    assert line.startswith("tensor_parallel: ") and "(--deterministic)" in line, line
    TargetConfig(SERVER, Path("m"), device="cuda", deterministic=True)  # one GPU: allowed


def test_serve_target_refuses_missing_gpus_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = [
        "serve",
        "target",
        "--model",
        str(tmp_path),
        "--device",
        "cuda",
        "--tensor-parallel",
        "2",
        "--no-draft",
    ]
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("specpair serve target: error: --tensor-parallel 2 --device cuda")
    assert line.endswith("but 1 CUDA device is visible"), line


def _up(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["up", *argv])


def _flag(args: tuple[str, ...], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_up_puts_the_draft_on_rank_0s_gpu_unless_told(tmp_path: Path) -> None:
    pair = ("--target-model", str(tmp_path), "--draft-model", str(tmp_path))
    services, _ = up_services(_up("--device", "cuda:2", "--tensor-parallel", "4", *pair))
    draft, target = (next(s.args for s in services if s.name == n) for n in ("draft", "target"))
    assert _flag(draft, "--device") == "cuda:2"
    assert _flag(target, "--device") == "cuda:2" and _flag(target, "--tensor-parallel") == "4"
    assert placement(_up("--device", "cuda:2", "--tensor-parallel", "4")) == (
        "draft on cuda:2, target on cuda:2-5 (tensor-parallel 4)"
    )
    # Two GPUs, one each, as before tensor parallelism: unchanged.
    services, _ = up_services(_up("--device", "cuda", "--draft-device", "cuda:1", *pair))
    draft, target = (next(s.args for s in services if s.name == n) for n in ("draft", "target"))
    assert _flag(draft, "--device") == "cuda:1" and _flag(target, "--device") == "cuda"
    assert "--tensor-parallel" not in target
    assert placement(_up("--device", "cuda", "--draft-device", "cuda:1")) == (
        "draft on cuda:1, target on cuda"
    )
    tp2 = ("--device", "cuda", "--tensor-parallel", "2", "--draft-device")
    assert placement(_up(*tp2, "cuda:1")).endswith("; the draft shares cuda:1 with target rank 1")
    assert (
        placement(_up(*tp2, "cuda:2")) == "draft on cuda:2, target on cuda:0-1 (tensor-parallel 2)"
    )
    assert placement(_up("--tensor-parallel", "2")) == (
        "draft on cpu, target on cpu (tensor-parallel 2)"
    )


def test_up_refuses_missing_gpus_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the group's token file
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parser = cli.build_parser()
    args = _up(
        "--device",
        "cuda:1",
        "--tensor-parallel",
        "2",
        "--target-model",
        str(tmp_path),
        "--draft-model",
        str(tmp_path),
    )
    assert run_up(args, lambda argv: cli.preflight(parser.parse_args(["serve", *argv]))) == 2
    out, err = capsys.readouterr()
    assert "specpair up: draft on cuda:1, target on cuda:1-2 (tensor-parallel 2)" in out
    assert "starting" not in out, out
    (line,) = err.splitlines()
    assert line.startswith("specpair up: error: target: --tensor-parallel 2 --device cuda:1"), line
    assert "cuda:1 … cuda:2" in line and "2 CUDA devices are visible" in line
