"""`bench/two_gpus.py` and `bench/cold_start.py` end to end on the CPU with the shipped pair: the
harnesses a GPU call runs (`specpair up` as a user starts it, several side by side, the SDK,
the ops API with the group's token) work before device time is spent on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(module: str, *args: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", module, "--device", "cpu", "--shape", "shipped", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def test_two_gpus_measures_each_deployment_beside_the_one_gpu_cell(tmp_path: Path) -> None:
    out = tmp_path / "two.json"
    bench(
        "bench.two_gpus",
        "--draft-kind",
        "eagle3",
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
    )
    cells = json.loads(out.read_text())["cells"]
    keys = {(c["deployment"], c["clients"]) for c in cells}
    assert keys == {(d, n) for d in ("1 GPU", "2 GPUs", "target alone") for n in (1, 2)}
    for c in cells:
        one = next(o for o in cells if o["deployment"] == "1 GPU" and o["clients"] == c["clients"])
        assert c["x_one_gpu"] == pytest.approx(c["tokens_per_s"] / one["tokens_per_s"])
        if c["deployment"] != "target alone":  # the round account came from RoundStats
            assert c["account"]["rounds"] > 0 and c["account"]["verify_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_cold_start_times_two_starts_and_the_first_requests(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    bench(
        "bench.cold_start",
        "--requests",
        "2",
        "--new-tokens",
        "6",
        "--caches",
        str(tmp_path / "caches"),
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    assert len(report["starts_s"]) == 2 and all(s > 0 for s in report["starts_s"])
    first, alone = report["passes"]
    assert first["name"] == "first requests" and alone["name"] == "target alone"
    assert first["tokens"] == alone["tokens"] == 12
    assert first["accept"] is not None and alone["accept"] is None  # tier 0: no drafts
