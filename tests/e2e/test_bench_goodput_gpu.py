"""`bench/goodput_gpu.py` end to end on the CPU with the shipped pair, at tiny sizes: every
phased run and sweep cell produces tokens, greedy outputs equal the target alone's, each kind
starts at tier 3, the JSON carries the goals' ratios, and `--replot` redraws from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.goodput_gpu import PHASED_RUNS, SWEEP_CONFIGS, TARGET_ALONE
from controller.policies.bands import PolicySpec
from controller.policies.interface import RegimePolicy

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.goodput_gpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_goodput_benchmark_measures_every_goal(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    run = bench(
        "--device",
        "cpu",
        "--shape",
        "shipped",
        "--per-phase",
        "1",
        "--phase-tokens",
        "6",
        "--batches",
        "1",
        "2",
        "--min-requests",
        "2",
        "--per-client",
        "1",
        "--new-tokens",
        "6",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())

    runs = report["phased"]["runs"]
    assert list(runs) == list(PHASED_RUNS)
    for name, r in runs.items():
        assert len(r["phase_tokens"]) == 4 and min(r["phase_tokens"]) > 0, name
    for kind in ("goodput", "sglang"):
        # a kind switched in while tier 3 is pinned starts there (the sweep is greedy)
        assert report["sweep"]["rounds"][kind][0]["tier"] == 3, kind
    assert runs["sglang"]["rounds"][0]["tier"] == 3
    # goodput's regime tiers go out with the unpin: the phased run's first batch (sampled)
    # runs from its first round at the tier the start-up profile predicts for that regime
    fresh = PolicySpec.from_mapping(report["policies"]["goodput"]).build(3)
    assert isinstance(fresh, RegimePolicy)
    first, regimes = runs["goodput"]["rounds"][0], fresh.regime_steps
    assert regimes is not None and first["sampled"] and first["tier"] == regimes.sampled.steps
    assert {r["tier"] for r in runs["static-0"]["rounds"]} == {0}
    assert {r["tier"] for r in runs["static-7"]["rounds"]} == {7}

    cells = report["sweep"]["cells"]
    assert sorted((c["config"], c["batch"]) for c in cells) == sorted(
        (c, b) for c in SWEEP_CONFIGS for b in (1, 2)
    )
    for c in cells:
        assert c["tokens"] > 0 and c["tokens_per_s"] > 0, c
        # float32 on the CPU: every configuration reproduces the target alone exactly
        assert c["same_as_target_alone"] is (None if c["config"] == TARGET_ALONE else True), c

    summary = report["summary"]
    for key in (
        "goodput_vs_best_static",
        "goodput_vs_oracle",
        "sglang_vs_best_static",
        "sglang_vs_oracle",
    ):
        assert summary["phased"][key] > 0, key
    assert set(summary["phased"]["goals_met"]) == {"vs_best_static", "vs_oracle"}
    rows = summary["sweep"]["batches"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["goodput_vs_best"] > 0 and r["sglang_vs_best"] > 0 and r["tier0_vs_target_alone"]
        assert r["best"] in {TARGET_ALONE, "tier 0", "tier 1", "tier 3", "tier 7"}
        assert abs(sum(r["goodput_tiers"].values()) - 1.0) < 1e-9
    for part in ("phased", "sweep"):
        assert (tmp_path / f"goodput_{part}.png").stat().st_size > 10_000
    assert run.stdout.rstrip().splitlines()[-1].startswith("2 ")  # the sweep table is last

    (tmp_path / "goodput_sweep.png").unlink()
    again = bench("--replot", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.rstrip().splitlines()[-1] == run.stdout.rstrip().splitlines()[-1]
    assert (tmp_path / "goodput_sweep.png").stat().st_size > 10_000
