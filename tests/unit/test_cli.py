"""`specpair ctl policy`: a bad KEY=VALUE is a one-line error and exit status 2, offline."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.common import free_address
from specpair.cli.main import main
from specpair.rpc import gc_heap


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("bogus=1", "unknown policy key 'bogus'"),
        ("update_interval=abc", "update_interval: expected int, got 'abc'"),
        ("update_interval=2.5", "update_interval: expected int, got 2.5"),
        ("warmup_batches=[1]", "warmup_batches: expected int"),
        ("candidate_steps=1,x", "candidate_steps: expected int, got 'x'"),
        ("ema_alpha", "must be KEY=VALUE"),
        ("=3", "must be KEY=VALUE"),
    ],
)
def test_bad_policy_change_is_one_line_and_exit_2(
    change: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An address nothing listens on: the change must be refused before any connection.
    argv = ["ctl", "--address", "unix:/nonexistent/specpair-ctl.sock", "policy", change]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("specpair ctl policy: error: ") and message in err, err


def test_serve_on_a_taken_port_is_one_line_naming_it(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:

    import specpair.logging

    monkeypatch.setattr(specpair.logging, "configure_logging", lambda *a, **k: None)
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory that never loads
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        argv = [
            "serve",
            "draft",
            "--model",
            str(tmp_path),
            "--address",
            address,
            "--metrics-address",
            "",
        ]
        assert main(argv) == 1
    err = capsys.readouterr().err
    expected = f"cannot listen on {address}: address in use or unavailable"
    assert err == f"specpair serve draft: error: {expected}\n"
    # nor does it leave the heap freeze armed for whatever serves next in this process
    assert gc_heap.serving() is None


def test_up_refuses_an_address_another_process_serves(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal
    import subprocess

    from specpair.cli.launcher import run_up
    from specpair.cli.main import build_parser

    handler = signal.getsignal(signal.SIGTERM)  # run_up takes SIGTERM over; pytest's returns

    def no_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("started a service on a taken address")

    monkeypatch.setattr(subprocess, "Popen", no_start)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where a tiny pair may be generated
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        monkeypatch.setenv("SPECPAIR_DRAFT_ADDRESS", address)
        try:
            assert run_up(build_parser().parse_args(["up"]), lambda argv: None) == 1
        finally:
            signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert f"draft: {address} is already in use by another process" in err


def test_serve_options_come_from_the_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from specpair.cli.main import build_parser, config_from_args
    from specpair.config import DraftConfig, DraftKind, DType, ServerConfig, TargetConfig

    monkeypatch.delenv("SPECPAIR_DRAFT_ADDRESS", raising=False)
    parse = build_parser().parse_args
    base = ["serve", "target", "--model", "m"]
    target = config_from_args(parse(base))
    library = TargetConfig(ServerConfig("127.0.0.1:0"), Path("m"))
    assert isinstance(target, TargetConfig)
    shared = (
        "max_len",
        "initial_steps",
        "max_batch",
        "max_queue",
        "draft_timeout_s",
        "candidate_steps",
        "draft_address",
        "threads",
        "dtype",
        "busy_poll_ms",
    )
    for name in shared:
        assert getattr(target, name) == getattr(library, name), name
    off = config_from_args(parse([*base, "--no-draft", "--draft-timeout", "2.5"]))
    assert isinstance(off, TargetConfig)
    assert off.draft_address is None and off.draft_timeout_s == 2.5
    with pytest.raises(ValueError, match="initial_steps 4"):
        config_from_args(parse([*base, "--initial-steps", "4"]))

    argv = [
        "serve",
        "draft",
        "--model",
        "h",
        "--draft-kind",
        "eagle",
        "--target-model",
        "t",
        "--max-len",
        "100",
        "--candidate-steps",
        "1,2",
        "--device",
        "cuda:1",
    ]
    draft = config_from_args(parse(argv))
    assert isinstance(draft, DraftConfig)
    # max_len is the context served, as the target's; the draft adds its own headroom.
    assert draft.max_len == 100 and draft.cache_len == 102
    assert draft.draft_kind is DraftKind.EAGLE and draft.dtype is DType.BFLOAT16
    assert draft.busy_poll_s > 0  # "auto" resolved for a CUDA device
    with pytest.raises(SystemExit):
        parse(["serve", "draft", "--model", "h", "--draft-kind", "medusa"])


def test_controller_targets_repeat_and_default_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specpair.cli.main import build_parser, config_from_args
    from specpair.config import ControllerConfig

    monkeypatch.setenv("SPECPAIR_TARGET_ADDRESS", "10.0.0.2:7000")
    parse = build_parser().parse_args
    config = config_from_args(parse(["serve", "controller"]))
    assert isinstance(config, ControllerConfig) and config.targets == ("10.0.0.2:7000",)
    both = config_from_args(parse(["serve", "controller", "--target", "a:1", "--target", "b:2"]))
    assert isinstance(both, ControllerConfig) and both.targets == ("a:1", "b:2")


def test_controller_policy_imports_without_grpc() -> None:
    import subprocess
    import sys

    code = (
        "import sys, controller.policies.sglang; assert 'grpc' not in sys.modules, 'grpc imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_finds_services_in_a_checkout_without_installed_metadata(monkeypatch) -> None:
    # Run from a source tree through PYTHONPATH (no `pip install`), the entry points come from
    # the checkout's pyproject.toml; a name in neither place is refused by name.
    import specpair.cli.main as cli
    from draft_service.server import serve as serve_draft

    monkeypatch.setattr(cli, "entry_points", lambda **_: [])
    assert cli._service_entry("draft") is serve_draft
    with pytest.raises(RuntimeError, match="no 'nope' service"):
        cli._service_entry("nope")


def test_serve_prefers_the_checkouts_entries_to_stale_installed_metadata(monkeypatch) -> None:
    # An editable install made before `controller.server` moved to `controller.service.server`
    # still lists the old module: the checkout's pyproject.toml names the code that runs.
    from importlib.metadata import EntryPoint

    import specpair.cli.main as cli
    from controller.service.server import serve

    stale = EntryPoint("controller", "controller.server:serve", cli.SERVICES_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda **_: [stale])
    assert cli._service_entry("controller") is serve


def test_version_and_a_bad_log_level_are_one_line(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == "specpair 0.1.0\n"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as bad:
        main(["serve", "draft", "--model", str(tmp_path), "--log-level", "bogus"])
    err = capsys.readouterr().err
    assert bad.value.code == 2 and "Traceback" not in err
    assert "argument --log-level: invalid choice: 'BOGUS'" in err.splitlines()[-1]


def _options(parser: argparse.ArgumentParser, path: str = "specpair") -> Iterator[tuple[str, Any]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction):
            yield path, action


def test_every_option_has_help_and_shows_its_default() -> None:
    from specpair.cli.main import build_parser

    options = list(_options(build_parser()))
    assert len(options) > 60
    for path, action in options:
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"{path} {name}: no help"
        shown = action.default not in (None, False, "") and action.option_strings
        if shown and not name.startswith("--api-key"):
            assert "default" in action.help, f"{path} {name}: default {action.default!r} hidden"


def _specpair(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `specpair` command as a user runs it, in a process of its own."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "specpair.cli", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (None, "cannot read policy config"),  # README's example once named a missing file
        ({"ema_alpha": 5}, "ema_alpha must be in (0, 1], got 5"),
        ({"kind": "goodput", "min_gain": "x"}, "min_gain must be a finite number, got 'x'"),
    ],
)
def test_serve_controller_with_a_bad_policy_file_is_one_line_naming_the_key(
    tmp_path: Path, policy: dict[str, Any] | None, message: str
) -> None:
    path = tmp_path / "policy.json"  # None: a file that does not exist
    if policy is not None:
        path.write_text(json.dumps(policy))
    done = _specpair(
        "serve",
        "controller",
        "--policy",
        str(path),
        "--address",
        "127.0.0.1:0",
        "--metrics-address",
        "",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("specpair serve controller: error: "), done.stderr
    assert message in done.stderr and str(path) in done.stderr


def test_up_checks_the_policy_before_any_model_loads(tmp_path: Path) -> None:
    bad = tmp_path / "policy.json"
    bad.write_text(json.dumps({"warmup_batches": -1}))
    env = {f"SPECPAIR_{name}_ADDRESS": free_address() for name in ("DRAFT", "TARGET", "CONTROLLER")}
    done = _specpair("up", "--policy", str(bad), env=env | {"XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert "starting" not in done.stdout, done.stdout  # no service was started
    (line,) = done.stderr.splitlines()
    assert line.startswith("specpair up: error: controller: policy config") and (
        "warmup_batches" in line
    ), line


def test_the_readme_policy_example_is_a_valid_policy() -> None:
    from controller.service.server import load_policy

    shipped = Path(__file__).resolve().parents[2] / "deploy" / "policy.json"
    spec = load_policy(shipped)
    assert spec.to_dict()["kind"] == "goodput"
    readme = (shipped.parents[1] / "README.md").read_text()
    assert "--policy deploy/policy.json" in readme


def test_up_names_the_models_it_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, b = tmp_path / "a", tmp_path / "b"
    args = build_parser().parse_args(["up", "--target-model", str(a), "--draft-model", str(b)])
    services, note = up_services(args)
    assert note == f"model pair (target {a}, draft {b})"
    draft = next(s for s in services if s.name == "draft")
    assert draft.args[draft.args.index("--model") + 1] == str(b)
    assert not (tmp_path / "specpair").exists()  # a pair given whole generates nothing


def test_up_passes_max_batch_to_the_target_and_its_config_reads_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser, config_from_args

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = build_parser()
    services, _ = up_services(parser.parse_args(["up", "--max-batch", "64"]))
    target = next(s for s in services if s.name == "target")
    config = config_from_args(parser.parse_args(["serve", *target.args]))
    assert config.max_batch == 64
    services, _ = up_services(parser.parse_args(["up"]))
    assert "--max-batch" not in next(s for s in services if s.name == "target").args
    services, _ = up_services(parser.parse_args(["up", "--device", "cuda"]))
    target = next(s for s in services if s.name == "target")
    assert config_from_args(parser.parse_args(["serve", *target.args])).max_batch == 64


def test_up_passes_its_feature_dtype_to_the_target(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser, config_from_args
    from specpair.config.target import FeatureDType

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = build_parser()
    for given, expected in (
        (["--feature-dtype", "float8"], FeatureDType.FLOAT8),
        ([], FeatureDType.AUTO),
    ):
        services, _ = up_services(parser.parse_args(["up", *given]))
        target = next(s for s in services if s.name == "target")
        assert (
            config_from_args(parser.parse_args(["serve", *target.args])).feature_dtype == expected
        )


def test_up_keeps_compiled_kernels_under_its_cache_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")  # an operator's: kept
    services, _ = up_services(build_parser().parse_args(["up"]))
    for service in services[:2]:  # draft, target
        assert service.env is not None, service.name
        assert service.env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "specpair" / "flashinfer")
        assert service.env["TRITON_CACHE_DIR"] == "/elsewhere/triton"


def test_lab_switches_are_environment_variables_not_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A switch that only measures (`config.option.lab`) is no `serve` flag: it is read from
    its SPECPAIR_LAB_ variable where the config is built, and ARCHITECTURE.md lists it."""
    from pathlib import Path

    from specpair.cli.main import build_parser, config_from_args
    from specpair.cli.options import lab_fields
    from specpair.config import DraftConfig, TargetConfig
    from specpair.config.option import lab_variable

    parse = build_parser().parse_args
    base = ["serve", "target", "--model", "m"]
    for flag in ("--no-prompt-handoff", "--busy-poll-ms=3"):
        with pytest.raises(SystemExit):
            parse([*base, flag])
    capsys.readouterr()
    plain = config_from_args(parse(base))
    assert isinstance(plain, TargetConfig)
    assert not plain.no_prompt_handoff and plain.busy_poll_ms == 0.0
    monkeypatch.setenv("SPECPAIR_LAB_NO_PROMPT_HANDOFF", "1")
    monkeypatch.setenv("SPECPAIR_LAB_BUSY_POLL_MS", "2.5")
    lab = config_from_args(parse(base))
    assert isinstance(lab, TargetConfig)
    assert lab.no_prompt_handoff and lab.busy_poll_ms == 2.5
    draft = config_from_args(parse(["serve", "draft", "--model", "d"]))
    assert isinstance(draft, DraftConfig) and draft.busy_poll_ms == 2.5
    monkeypatch.setenv("SPECPAIR_LAB_NO_PROMPT_HANDOFF", "maybe")
    with pytest.raises(ValueError, match="SPECPAIR_LAB_NO_PROMPT_HANDOFF: expected 1 or 0"):
        config_from_args(parse(base))

    architecture = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text()
    fields = [f.name for cls in (TargetConfig, DraftConfig) for f in lab_fields(cls)]
    assert {"no_prompt_handoff", "busy_poll_ms"} <= set(fields)
    for name in fields:
        assert f"`{lab_variable(name)}" in architecture, name
    with pytest.raises(SystemExit):
        parse([*base, "--help"])
    out = capsys.readouterr().out
    assert "SPECPAIR_LAB_NO_PROMPT_HANDOFF" in out and "--no-prompt-handoff" not in out


@pytest.mark.parametrize(
    ("argv", "window"),
    [
        (["--device", "cuda", "--draft-kind", "eagle"], 32),  # UP_GPU_EAGLE_DRAFT_WINDOW
        (["--device", "cuda", "--draft-kind", "eagle", "--draft-window", "0"], 0),
        (["--device", "cuda"], 0),  # a draft LM: the whole history
        (["--draft-kind", "eagle"], 0),  # the CPU
        (["--draft-window", "8"], 8),
    ],
)
def test_up_gives_the_target_its_draft_window_and_the_draft_graphs_of_its_width(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], window: int
) -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser, config_from_args

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parser = build_parser()
    services, _ = up_services(parser.parse_args(["up", *argv]))
    target, draft = (next(s for s in services if s.name == n) for n in ("target", "draft"))
    assert config_from_args(parser.parse_args(["serve", *target.args])).draft_window == window
    # the draft extends the window's hand-offs in CUDA graphs of its width
    assert config_from_args(parser.parse_args(["serve", *draft.args])).handoff_rows == window
