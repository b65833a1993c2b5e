"""`bench/pipeline.py` end to end on the CPU with the shipped pair: in-process sequential and
pipelined rows, both services deployments at every tier and adaptive, outputs equal to the
target alone, the pipelined cells' hit rates accounted, the table last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_pipeline_benchmark_runs_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--device", "cpu", "--shape", "shipped",
         "--requests", "1", "--new-tokens", "12", "--width", "8", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]
    configs = {(c["deployment"], c["config"]) for c in cells}
    tiers = [f"tier {t}" for t in (1, 3, 7)]
    assert configs == (
        {("in-process", c) for c in ["target-only", *tiers, *(f"{t} pre" for t in tiers)]}
        | {(f"svc 1 GPU {m}", c) for m in ("pipe", "seq") for c in [*tiers, "adaptive"]}
    )
    for c in cells:
        assert c["tokens"] > 0 and c["same"] is True, c  # float32: everything equals target-only
        pipelined = c["deployment"] == "svc 1 GPU pipe" or c["config"].endswith("pre")
        assert (c["hit_rate"] is not None) == pipelined, c
        if c["deployment"].startswith("svc"):
            assert c["x_seq"] > 0 and c["round_ms"] > 0, c
    assert run.stdout.rstrip().splitlines()[-1].startswith("svc 1 GPU seq")  # the table is last
