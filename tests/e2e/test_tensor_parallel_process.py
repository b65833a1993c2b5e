"""`specpair serve target --tensor-parallel 2` as a real process: it answers as the target in
one process does; SIGTERM stops it and its follower cleanly; a SIGKILLed follower ends it
with exit status 1 and one line naming the rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from specpair.client import SpecpairClient
from specpair.group import ServiceGroup
from tests.e2e.test_processes import free_port, service, wait_for
from tests.service.conftest import reference_greedy

pytestmark = pytest.mark.slow
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18]


def follower_of(pid: int) -> int:
    """The spawned follower among the process's children (not multiprocessing's trackers)."""
    children = [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]
    followers = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(followers) == 1, children
    return followers[0]


def test_a_tensor_parallel_target_process(ckpts: dict[str, Path], tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    target = service(
        "target", address, "target", "--model", str(ckpts["target"]), "--no-draft",
        "--tensor-parallel", "2", "--http-address", "",
    )  # fmt: skip
    expected = reference_greedy(ckpts["target"], [PROMPT], 20)[0]
    with ServiceGroup(log_dir=tmp_path, health_timeout_s=180) as group:
        proc = group.start(target)
        with SpecpairClient(address, timeout=60) as client:
            assert list(client.generate(PROMPT, max_tokens=20).token_ids) == expected
        follower = follower_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_for(lambda: not Path(f"/proc/{follower}").exists(), 10, "the follower to exit")

        (tmp_path / "target.log").unlink()
        proc = group.start(target)
        follower = follower_of(proc.pid)
        os.kill(follower, signal.SIGKILL)
        assert proc.wait(60) == 1
    errors = [
        line
        for line in (tmp_path / "target.log").read_text().splitlines()
        if line.startswith("specpair serve target: error:")
    ]
    assert errors == [
        f"specpair serve target: error: tensor-parallel rank 1 (pid {follower}) exited with "
        "code -9 while serving: the target cannot compute without it"
    ]
