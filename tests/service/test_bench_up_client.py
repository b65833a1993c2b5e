"""`bench/up_client.py` end to end on the CPU: `specpair up` with the shipped pair and its
EAGLE head, driven by the `openai` client and the SDK under SGLang's rule, goodput and pins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.up_client import main
from specpair.cli.launcher import READY

pytestmark = pytest.mark.slow


def test_up_client_measures_every_configuration_through_both_doors(tmp_path: Path) -> None:
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
    configs = ("sglang", "goodput", "tier 0", "tier 3")
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
    assert out.with_suffix(".png").stat().st_size > 0
    assert READY in out.with_suffix(".log").read_text()
