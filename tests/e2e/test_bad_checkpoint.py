"""`specpair serve` with a checkpoint it cannot serve: one line naming the file and the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from specpair.models.tiny import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "specpair.cli",
            "serve",
            *args,
            "--address",
            "127.0.0.1:0",
            "--metrics-address",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("service", ["target", "draft"])
def test_bad_checkpoint_is_one_line_and_exit_1(tmp_path: Path, service: str) -> None:
    path = make_tiny_llama(tmp_path / "m", seed=1)
    if service == "target":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "quick_gelu"}))
        result = serve("target", "--model", str(path), "--http-address", "")
        expected = f"{path / 'config.json'}: hidden_act 'quick_gelu' is not implemented"
    else:
        tensors = load_file(path / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, str(path / "model.safetensors"))
        result = serve("draft", "--model", str(path))
        expected = "missing ['model.layers.1.mlp.up_proj.weight']"
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        line for line in errors if line.startswith(f"specpair serve {service}: error: ")
    ]
    assert len(errors) == 1 and expected in errors[0], output
    assert "Traceback" not in output and "Event loop is closed" not in output, output
