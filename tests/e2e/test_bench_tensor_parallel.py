"""`bench/tensor_parallel.py` end to end on the CPU with the shipped pair at --tp 2 (gloo
ranks): `specpair up --tensor-parallel 2` beside `up` at one rank, speculating then pinned to
the target alone, the round account, the start-up times and the greedy lossless check in its
JSON, before device time is spent on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bench_two_gpus import bench

pytestmark = pytest.mark.slow


def test_tensor_parallel_measures_tp2_beside_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    bench(
        "bench.tensor_parallel",
        *(
            "--tp",
            "1",
            "2",
            "--batches",
            "1",
            "--requests",
            "2",
            "--new-tokens",
            "6",
            "--warmup",
            "0",
        ),
        *("--temperatures", "0", "--out", str(out)),
    )
    report = json.loads(out.read_text())
    assert set(report["start_s"]) == {"TP=1", "TP=2"} and min(report["start_s"].values()) > 0
    assert "--tensor-parallel" in report["commands"]["TP=2"]
    cells = {(c["deployment"], c["mode"]): c for c in report["cells"]}
    alones = {(f"TP={n}", "target alone") for n in (1, 2)}
    assert set(cells) == {("TP=2", "speculating")} | alones
    spec, alone = cells["TP=2", "speculating"], cells["TP=2", "target alone"]
    assert spec["account"]["rounds"] > 0 and spec["account"]["verify_ms"] > 0
    assert spec["x_alone"] == pytest.approx(spec["tokens_per_s"] / alone["tokens_per_s"])
    assert alone["account"]["rounds"] == 0 and alone["account"]["plain_verify_ms"] > 0
    tp1 = cells["TP=1", "target alone"]
    assert alone["x_tp1"] == pytest.approx(alone["tokens_per_s"] / tp1["tokens_per_s"])
    for name in ("TP=1", "TP=2"):  # float32 on the CPU: no ties to part them
        assert report["lossless"][name] == {"checked": 2, "identical": 2, "parted_at": []}
    assert report["gpu_memory"] == []  # no GPU here
    assert out.with_suffix(".png").stat().st_size > 0
