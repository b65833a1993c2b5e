"""`specpair serve target --tensor-parallel 2` as a real process: it answers as the target in
one process does; SIGTERM stops it and its follower cleanly; a SIGKILLed follower ends it
with exit status 1 and one line naming the rank; a stopped (hung) follower does too, within
the watchdog's bound, and its requests in flight get the line; a SIGKILLed rank 0 leaves no
follower behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import free_address
from specpair.cli.group import Service, ServiceGroup
from specpair.client import SpecpairClient
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from tests.e2e.test_processes import service, wait_for
from tests.service.conftest import reference_greedy
from tests.unit.test_tensor_parallel_watchdog import alive

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


def tp_target(ckpts: dict[str, Path], address: str, *extra: str) -> Service:
    """The tiny target at --tensor-parallel 2, without a draft or the HTTP API."""
    return service(
        "target",
        address,
        "target",
        "--model",
        str(ckpts["target"]),
        "--no-draft",
        "--tensor-parallel",
        "2",
        "--http-address",
        "",
        *extra,
    )


def test_a_tensor_parallel_target_process(ckpts: dict[str, Path], tmp_path: Path) -> None:
    address = free_address()
    target = tp_target(ckpts, address)
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


FLOOR_S = 2.0  # the test's bound: every healthy step of the tiny model takes milliseconds


def test_a_hung_follower_fails_its_requests_and_ends_the_target(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """SIGSTOP the follower while a stream is in flight: within the floor and a few seconds
    the stream ends with UNAVAILABLE and the watchdog's line, health stops saying SERVING,
    and the process exits 1 with that one line; without the watchdog it waits out gloo."""
    address = free_address()
    target = tp_target(ckpts, address, "--rank-timeout-floor", str(FLOOR_S))
    with ServiceGroup(log_dir=tmp_path, health_timeout_s=180) as group:
        proc = group.start(target)
        follower = follower_of(proc.pid)
        channel = grpc.insecure_channel(address)
        try:
            stream = target_pb2_grpc.TargetServiceStub(channel).Generate(
                target_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=400),
                timeout=60,
            )
            next(stream)  # the prompt is in: rounds follow one another
            os.kill(follower, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                for _ in stream:
                    pass
            waited = time.monotonic() - stopped
            health = health_pb2_grpc.HealthStub(channel)
            with contextlib.suppress(grpc.RpcError):  # or the process is gone already
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status != health_pb2.HealthCheckResponse.SERVING
        finally:
            channel.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGCONT)
        assert proc.wait(30) == 1
        assert not Path(f"/proc/{follower}").exists()  # killed on the way out
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    hung = re.compile(
        r"tensor-parallel step (prefill|verify) \(\d+ tokens\) did not finish in \d+\.\d s "
        r"\(bound \d+\.\d s: .*\): a rank is hung; the target exits"
    )
    assert hung.fullmatch(failed.value.details())
    assert waited < FLOOR_S + 8
    errors = [
        line
        for line in (tmp_path / "target.log").read_text().splitlines()
        if line.startswith("specpair serve target: error:")
    ]
    assert errors == [f"specpair serve target: error: {failed.value.details()}"]


def test_a_killed_rank_0_leaves_no_follower(ckpts: dict[str, Path], tmp_path: Path) -> None:
    address = free_address()
    target = tp_target(ckpts, address)
    with ServiceGroup(log_dir=tmp_path, health_timeout_s=180) as group:
        proc = group.start(target)
        follower = follower_of(proc.pid)
        proc.kill()  # no `stop`, no Stop step: the follower must notice by itself
        proc.wait(10)
        wait_for(lambda: not alive(follower), 10, "the follower to exit")
