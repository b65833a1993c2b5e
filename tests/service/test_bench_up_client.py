"""`bench/up_client.py` end to end on the CPU: `specpair up` with the shipped pair and its
EAGLE head, driven by the `openai` client and the SDK under SGLang's rule, goodput and pins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import up_client
from bench.up_client import main
from specpair.cli.launcher import READY

pytestmark = pytest.mark.slow


def test_up_client_measures_every_configuration_through_both_doors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "up.json"
    main(
        [
            "--device",
            "cpu",
            "--shape",
            "shipped",
            "--draft-kind",
            "eagle",
            "--batches",
            "1",
            "2",
            "--requests",
            "2",
            "--new-tokens",
            "6",
            "--temperatures",
            "0",
            "--tiers",
            "3",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    cells = report["cells"]
    keys = {(c["config"], c["door"], c["batch"]) for c in cells}
    configs = ("sglang", "verbatim", "goodput", "tier 0", "tier 3")
    # two turns: the configurations in order, then backwards (`up`'s policy set again from 3)
    printed = [line for line in capsys.readouterr().out.splitlines() if line in configs]
    assert printed == [*configs, *reversed(configs)]
    assert keys == {(c, d, b) for c in configs for d in ("openai", "http", "sdk") for b in (1, 2)}
    assert report["command"][3:5] == ["up", "--device"]  # `specpair up` itself ran
    for c in cells:
        assert len(c["runs"]) == 2
        assert c["speedup"] == pytest.approx(
            c["tokens_per_s"]
            / next(
                a["tokens_per_s"]
                for a in cells
                if a["config"] == "tier 0" and (a["door"], a["batch"]) == (c["door"], c["batch"])
            )
        )
    # Greedy is lossless through either door: each cell produced the same tokens (no request
    # stopped early on one door and ran on at another configuration).
    assert len({c["tokens"] for c in cells if c["batch"] == 1}) == 1
    # one client, 2 requests: the window is the first request's (ended when the second
    # started); 2 clients, 2 requests: both start at once, no window
    for c in cells:
        if c["batch"] == 1:
            assert c["steady_tokens_per_s"] > 0 and c["steady_speedup"] is not None
        else:
            assert c["steady_tokens_per_s"] is None and c["steady_speedup"] is None
    # the rows a verify computed: one a request at tier 0, the drafts' too at tier 3 (the CPU's
    # eager verify pads nothing; a policy may run either)
    rows = {(c["config"], c["door"], c["batch"]): c["rounds"] for c in cells if c["rounds"]}
    assert {config for config, _, _ in rows} >= {"tier 0", "tier 3"}
    for (config, door, batch), cell in rows.items():
        assert cell["verify_rows"] >= cell["batch"], (config, door, batch, cell)
        if config == "tier 0":
            assert cell["verify_rows"] == pytest.approx(cell["batch"])
        elif config == "tier 3":
            assert cell["verify_rows"] > cell["batch"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert READY in out.with_suffix(".log").read_text()


def test_a_run_cut_short_keeps_the_cells_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device call's time limit kills the bench mid-configuration: the cells finished before
    are in the JSON already, not lost with the configuration's unfinished ones."""
    calls = 0
    real_door = up_client.sdk_door

    def failing_door(up: up_client.Up) -> up_client.Door:
        one = real_door(up)

        def counted(*args: object) -> int:
            nonlocal calls
            calls += 1
            if calls > 3:  # the warm-up request and batch 1's two; batch 2's first fails
                raise RuntimeError("cut short")
            return one(*args)  # type: ignore[arg-type]

        return counted

    monkeypatch.setattr(up_client, "sdk_door", failing_door)
    out = tmp_path / "up.json"
    args = ["--device", "cpu", "--shape", "shipped", "--draft-kind", "eagle", "--doors", "sdk"]
    args += ["--batches", "1", "2", "--requests", "2", "--new-tokens", "4", "--temperatures", "0"]
    with pytest.raises(RuntimeError, match="cut short"):
        main([*args, "--skip", "goodput", "--repeats", "1", "--out", str(out)])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["config"], c["batch"], len(c["runs"])) for c in cells] == [("sglang", 1, 1)]
    assert cells[0]["tokens"] == 8
