"""Service addresses: HOST:PORT or unix:PATH for gRPC, HOST:PORT for the metrics endpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.config import ControllerConfig, ServerConfig, TargetConfig, check_grpc_address


@pytest.mark.parametrize(
    "address", ["127.0.0.1:50051", "[::1]:7", "draft:50052", "unix:/run/specpair/draft.sock"]
)
def test_grpc_addresses_accepted(address: str) -> None:
    assert check_grpc_address(address) == address
    assert ServerConfig(address).address == address


@pytest.mark.parametrize("address", ["draft", "draft:port", ":", "unix:", "unix:///"])
def test_bad_grpc_address_is_named(address: str) -> None:
    with pytest.raises(ValueError, match="address"):
        check_grpc_address(address)
    with pytest.raises(ValueError, match=repr(address).replace("[", r"\[")):
        TargetConfig(ServerConfig("127.0.0.1:0"), Path("m"), draft_address=address)
    with pytest.raises(ValueError, match="address"):
        ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(address,))


def test_metrics_endpoint_stays_host_port() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        ServerConfig("127.0.0.1:0", metrics_address="unix:/tmp/metrics.sock")


def test_http_api_address_defaults_on_for_the_cli_and_empty_disables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specpair.cli.main import build_parser, config_from_args

    monkeypatch.delenv("SPECPAIR_HTTP_ADDRESS", raising=False)
    base = ["serve", "target", "--model", "m"]
    config = config_from_args(build_parser().parse_args(base))
    assert isinstance(config, TargetConfig) and config.http_address == "127.0.0.1:8000"
    off = config_from_args(build_parser().parse_args([*base, "--http-address", ""]))
    assert isinstance(off, TargetConfig) and off.http_address == ""
    with pytest.raises(ValueError, match="HOST:PORT"):
        config_from_args(build_parser().parse_args([*base, "--http-address", "unix:/x.sock"]))
    assert TargetConfig(ServerConfig("127.0.0.1:0"), Path("m")).http_address == ""


def test_tier_zero_is_a_candidate_when_asked_for() -> None:
    """The default stays [1, 3, 7]; tier 0 (target-only rounds) is built when listed."""
    server = ServerConfig("127.0.0.1:0")
    assert TargetConfig(server, Path("m")).candidate_steps == (1, 3, 7)
    config = TargetConfig(server, Path("m"), candidate_steps=(0, 1, 3), initial_steps=0)
    assert config.candidate_steps == (0, 1, 3) and config.initial_steps == 0
    with pytest.raises(ValueError, match="candidate_steps must be sorted distinct ints >= 0"):
        TargetConfig(server, Path("m"), candidate_steps=(-1, 3))


def test_the_front_door_settings_are_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from specpair.config import DraftConfig

    def target(**kw: object) -> TargetConfig:
        return TargetConfig(ServerConfig("127.0.0.1:0"), Path("m"), **kw)  # type: ignore[arg-type]

    assert target(api_key="").api_key is None  # SPECPAIR_API_KEY="" as compose passes it
    assert target(api_key="k").api_key == "k"
    for bad in (
        {"http_read_timeout_s": 0},
        {"http_read_timeout_s": 1e9},
        {"max_watchers": 0},
        {"stats_log_interval_s": -1},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            target(**bad)
    draft = DraftConfig(ServerConfig("127.0.0.1:0"), Path("d"), max_requests=8)
    assert draft.max_target_requests == 4  # 0 without a token: half, no one host takes all
    token = ServerConfig("127.0.0.1:0", ops_token="t")
    assert DraftConfig(token, Path("d"), max_requests=8).max_target_requests == 8  # every slot
    for bad in ({"draft_timeout_s": 0}, {"draft_deadline_floor_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            target(**bad)
    with pytest.raises(ValueError, match="max_target_requests must be in"):
        DraftConfig(ServerConfig("127.0.0.1:0"), Path("d"), max_requests=8, max_target_requests=9)
    for rows in (-1, 257):
        with pytest.raises(ValueError, match=r"handoff_rows must be in \[0, 256\]"):
            DraftConfig(ServerConfig("127.0.0.1:0"), Path("d"), handoff_rows=rows)


def test_the_api_key_is_an_option_whose_value_help_never_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specpair.cli.main import build_parser, config_from_args

    monkeypatch.setenv("SPECPAIR_API_KEY", "sk-from-the-environment")
    parser = build_parser()
    config = config_from_args(parser.parse_args(["serve", "target", "--model", "m"]))
    assert isinstance(config, TargetConfig) and config.api_key == "sk-from-the-environment"
    flag = parser.parse_args(["serve", "target", "--model", "m", "--api-key", "sk-flag"])
    assert config_from_args(flag).api_key == "sk-flag"  # type: ignore[union-attr]
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "target", "--help"])
    shown = capsys.readouterr().out
    assert "--api-key" in shown and "sk-from-the-environment" not in shown


def test_several_drafts_and_several_targets_are_comma_lists() -> None:
    server = ServerConfig("127.0.0.1:0")
    target = TargetConfig(server, Path("m"), draft_address="a:1, b:2,unix:/tmp/d.sock")
    assert target.draft_addresses == ("a:1", "b:2", "unix:/tmp/d.sock")
    assert TargetConfig(server, Path("m"), draft_address=None).draft_addresses == ()
    with pytest.raises(ValueError, match="'b' must be HOST:PORT"):
        TargetConfig(server, Path("m"), draft_address="a:1,b")
    with pytest.raises(ValueError, match="appears twice"):
        TargetConfig(server, Path("m"), draft_address="a:1,a:1")
    with pytest.raises(ValueError, match="draft_address: no address"):
        TargetConfig(server, Path("m"), draft_address=",")
    # `--target a,b`, repeated `--target`, or both
    controller = ControllerConfig(server, targets=("a:1,b:2", "c:3"))
    assert controller.targets == ("a:1", "b:2", "c:3")
    with pytest.raises(ValueError, match="appears twice"):
        ControllerConfig(server, targets=("a:1,a:1",))


def test_join_group_defaults_to_an_eighth_of_the_batch_and_is_checked() -> None:
    def config(**kw: int) -> TargetConfig:
        return TargetConfig(ServerConfig("127.0.0.1:0"), Path("m"), **kw)  # type: ignore[arg-type]

    assert [config(max_batch=b).joins for b in (1, 8, 16, 64)] == [1, 1, 2, 8]
    assert config(max_batch=64, join_group=1).joins == 1
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="join_group"):
            config(join_group=bad)


def test_join_wait_is_checked() -> None:
    def config(**kw: float) -> TargetConfig:
        return TargetConfig(ServerConfig("127.0.0.1:0"), Path("m"), **kw)  # type: ignore[arg-type]

    assert config().join_wait_ms == 100 and config(join_wait_ms=0).join_wait_ms == 0
    with pytest.raises(ValueError, match="join_wait_ms"):
        config(join_wait_ms=-1)
