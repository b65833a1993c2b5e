"""Small sums over peer memory on every rank or on none (`parallel/ranks.peer_reduce`): the
graphs capture each rank's sums, so a rank whose buffer could not be mapped must send every
rank back to NCCL, or its NCCL sums would wait forever for peers spinning at a peer-memory
barrier. Two gloo ranks on the CPU, each told whether its mapping works."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch.distributed as dist

from bench.common import free_port
from specpair.models import parallel
from specpair.parallel import ranks

MAPPED = object()  # stands for a mapped `PeerReduce` on this CPU-only machine


def _rank(rank: int, port: int, maps: tuple[bool, bool], env: str, answer: Connection) -> None:
    if env:
        os.environ[ranks.ALL_REDUCE_ENV] = env
    calls = []

    def start(device: object, max_bytes: int = 0) -> str:
        calls.append(device)
        if maps[rank]:
            parallel._peer = MAPPED  # type: ignore[assignment]
            return ""
        return "RuntimeError: no peer access between these GPUs"

    ranks.start_peer_reduce = start  # type: ignore[assignment]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    spec = ranks.ShardSpec(Path("unused"), world=2, max_requests=1, max_len=8)
    ranks.peer_reduce(spec, rank, None)
    answer.send((parallel._peer is MAPPED, len(calls)))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run(maps: tuple[bool, bool], env: str = "") -> list[tuple[bool, int]]:
    """Each rank's (peer memory in use, mapping attempts) after joining."""
    context = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    for rank in range(2):
        answer, send = context.Pipe(duplex=False)
        proc = context.Process(target=_rank, args=(rank, port, maps, env, send))
        proc.start()
        send.close()
        pipes.append(answer)
        procs.append(proc)
    try:
        results = []
        for answer in pipes:
            assert answer.poll(120), "a rank did not answer"
            results.append(answer.recv())
        return results
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


@pytest.mark.parametrize(
    ("maps", "used"),
    [((True, True), True), ((True, False), False), ((False, True), False)],
)
def test_peer_memory_is_used_on_every_rank_or_on_none(maps: tuple[bool, bool], used: bool) -> None:
    assert run(maps) == [(used, 1), (used, 1)]


def test_the_nccl_switch_maps_nothing() -> None:
    assert run((True, True), env="nccl") == [(False, 0), (False, 0)]
