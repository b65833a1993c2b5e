"""`bench/grpc_pingpong.py` end to end: a server process per mode, round trips, a JSON result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pingpong_measures_every_mode_on_both_links(tmp_path: Path) -> None:
    out = tmp_path / "pingpong.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.grpc_pingpong",
            "--trips",
            "20",
            "--hold-ms",
            "1",
            "0",
            "--request-bytes",
            "4096",
            "--response-bytes",
            "64",
            "--links",
            "tcp",
            "unix",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    modes = {"aio", "aio+poll", "sync", "tcp"}
    assert set(result["transport_us"]) == modes | {f"{m}/unix" for m in modes}
    for mode, q in result["transport_us"].items():
        # transport excludes the server's 1 ms hold: positive, and far below a second
        assert 0 < q["p50"] <= q["p99"] < 1e6, (mode, q)
    assert run.stdout.rstrip().splitlines()[-1].startswith("tcp/unix")  # the table comes last
