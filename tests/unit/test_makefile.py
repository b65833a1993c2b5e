"""`make`'s torch step, run for real with a stand-in `pip` that records what it was asked: where
no NVIDIA GPU is, the CPU build from PyTorch's CPU index when that index answers, else plain pip
(this machine's and CI's: a local CPU wheel) within seconds; where a GPU is, PyPI's build."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """A PEP 503 index on loopback with a `torch/` page, as PyTorch's CPU index has."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    def handler(*args: object) -> Quiet:
        return Quiet(*args, directory=str(tmp_path / "index"))  # type: ignore[arg-type]

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def make_torch(tmp_path: Path, cpu_index: str, gpu: bool = False) -> tuple[list[str], float]:
    """`make torch` with a recording pip; returns pip's arguments and the seconds it took."""
    bin_dir, tools = tmp_path / "venv-bin", tmp_path / "tools"
    bin_dir.mkdir(exist_ok=True)
    tools.mkdir(exist_ok=True)
    record = tmp_path / "pip-args"
    (bin_dir / "pip").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "pip").chmod(0o755)
    (bin_dir / "python").unlink(missing_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    if gpu:  # an `nvidia-smi -L` that lists a GPU
        (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        (tools / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin"}
    env.pop("MAKEFLAGS", None)
    t0 = time.monotonic()
    done = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "torch", f"BIN={bin_dir}", f"TORCH_CPU_INDEX={cpu_index}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return record.read_text().split(), time.monotonic() - t0


def test_without_a_gpu_torch_comes_from_the_cpu_index(tmp_path: Path, index: str) -> None:
    args, _ = make_torch(tmp_path, index)
    assert args[-1] == "torch==2.13.0"
    assert args[args.index("--extra-index-url") + 1] == index


def test_an_unreachable_cpu_index_falls_back_to_plain_pip_at_once(tmp_path: Path) -> None:
    args, took = make_torch(tmp_path, f"http://127.0.0.1:{free_port()}")
    assert args[-1] == "torch==2.13.0" and "--extra-index-url" not in args
    assert took < 30


def test_with_a_gpu_torch_is_pypis_cuda_build(tmp_path: Path, index: str) -> None:
    args, _ = make_torch(tmp_path, index, gpu=True)
    assert args[-1] == "torch==2.13.0" and "--extra-index-url" not in args
