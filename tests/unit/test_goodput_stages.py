"""`bench.goodput_sim stages`: goodput replayed on a recorded run's per-cell stage times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import read_json
from bench.goodput_sim import expected, fit_rate, stages, stages_main, tier_of
from specpair.runtime.shape import TreeShape

RUN = Path("bench/results/gpu_trees_eagle_h100_large.json")


def test_a_fitted_rate_gives_the_cells_mean_accept_length() -> None:
    rate = fit_rate(0.82, 7, 2.76)
    assert expected(0.82, rate, 7) == pytest.approx(2.76, abs=1e-6)
    assert rate == pytest.approx(0.738, abs=0.001)


def test_the_runs_cells_become_stages_per_batch_and_tier() -> None:
    table = stages(read_json(RUN))
    assert set(table) == {16, 64}
    assert tier_of("tree 7x4x16") in table[16] and TreeShape(0) in table[64]
    tier7 = table[16][TreeShape(7)]
    assert tier7.first == pytest.approx(0.82, abs=0.01)  # tier 1's mean accept at batch 16
    assert table[16][TreeShape(0)].draft == 0.0


def test_replay_reports_goodput_against_the_best_static_tier(tmp_path: Path) -> None:
    out = tmp_path / "stages.json"
    stages_main(
        ["--run", str(RUN), "--rounds", "80", "--seeds", "1", "--profile", "--out", str(out)]
    )
    report = json.loads(out.read_text())["batches"]
    assert report["16"]["best"] == "3" and report["64"]["best"] == "0"
    for b in ("16", "64"):
        assert 0.5 < report[b]["ratios"][0] < 1.1
