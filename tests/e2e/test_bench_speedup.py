"""`bench/gpu_speedup.py` end to end on the CPU with the shipped pair: every configuration of
both deployments runs, greedy outputs agree with target-only, JSON, PNG and table come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_speedup_benchmark_runs_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "speedup.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_speedup",
            "--device",
            "cpu",
            "--shape",
            "shipped",
            "--batches",
            "1",
            "2",
            "--requests",
            "2",
            "--new-tokens",
            "6",
            "--temperatures",
            "0",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]
    configs = {(c["deployment"], c["config"]) for c in cells}
    tiers = {f"tier {t}" for t in (1, 3, 7)}
    assert configs == {("in-process", c) for c in {"target-only"} | tiers} | {
        ("services", c) for c in {"target-only", "adaptive"} | tiers
    }
    assert len(cells) == len(configs) * 2 * 2  # × workloads (code, prose greedy) × batches
    for c in cells:
        assert c["tokens"] > 0 and c["speedup"] > 0, c
        # float32 on the CPU: speculation and the services reproduce target-only exactly
        assert c["same_as_target_only"] is True, c
        assert (c["accept_mean"] is None) == (c["config"] == "target-only"), c
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert run.stdout.rstrip().splitlines()[-1].startswith("prose greedy")  # the table is last
