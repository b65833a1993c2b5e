"""A target service with tensor_parallel=2 (this process is rank 0; one follower process,
gloo) over real gRPC: it answers as the one-process target does, with a draft and joiners riding
in its verifies, and stops its follower cleanly; a follower that dies takes it down with a
message naming the rank, health says NOT_SERVING, and the requests that follow are refused at
once with that message; a follower that hangs does the same within the watchdog's bound,
failing the requests in flight."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specpair.parallel.ranks import RankExitedError
from tests.service.conftest import (
    Stack,
    draft_config,
    eventually,
    reference_greedy,
    target_config,
)

pytestmark = pytest.mark.slow  # each starts a follower process: ~20 s on a loaded 2-core box
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
MAX_TOKENS = 24


async def test_a_tensor_parallel_target_answers_like_one_process(ckpts) -> None:
    stack = Stack(
        draft_config(ckpts["target"]),
        target_config(ckpts["target"], tensor_parallel=2, max_batch=4, initial_steps=3),
    )
    await stack.start()
    registry = stack.target.servicer.frontend.metrics.registry

    def joins(how: str) -> float:
        return registry.get_sample_value("specpair_target_joins_total", {"how": how}) or 0

    try:
        # the first alone; the rest join its running batch, their prompts riding in verifies
        first = asyncio.create_task(stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=40))
        await eventually(lambda: joins("prefill") == 1, timeout=30)
        outputs = await asyncio.gather(
            *(stack.generate(prompt_token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS[1:])
        )
        outputs.insert(0, await first)
        expected = reference_greedy(ckpts["target"], PROMPTS[:1], 40)
        expected += reference_greedy(ckpts["target"], PROMPTS[1:], MAX_TOKENS)
        assert [t for t, _ in outputs] == expected
        assert joins("ride") >= 1
        final = [responses[-1].speculation for _, responses in outputs]
        assert any(a == 3 for f in final for a in f.accept_lengths)  # drafts were verified
        ranks = stack.target.ranks
        assert ranks is not None and ranks.procs[0].is_alive()
    finally:
        await stack.stop()
    assert [p.exitcode for p in ranks.procs] == [0]  # told to stop, it stopped


async def test_a_follower_that_dies_takes_the_target_down(ckpts) -> None:
    stack = Stack(None, target_config(ckpts["target"], draft_address=None, tensor_parallel=2))
    await stack.start()
    try:
        tokens, _ = await stack.generate(prompt_token_ids=PROMPTS[0], max_tokens=4)
        assert len(tokens) == 4
        ranks = stack.target.ranks
        ranks.procs[0].kill()
        with pytest.raises(RankExitedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            await asyncio.wait_for(stack.target.wait(), 30)  # what `serve` waits on
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=4), 30)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # going down: try another
        assert (
            "rank 1" in failed.value.details() and "exited with code -9" in failed.value.details()
        )
        health = await stack.target.server.health.Check(health_pb2.HealthCheckRequest(), None)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await asyncio.wait_for(stack.stop(), 30)


async def test_a_hung_follower_fails_the_requests_in_flight(ckpts) -> None:
    config = target_config(
        ckpts["target"], draft_address=None, tensor_parallel=2, rank_timeout_floor_s=2.0
    )
    stack = Stack(None, config)
    await stack.start()
    ranks = stack.target.ranks
    follower = ranks.procs[0]
    try:
        flying = asyncio.ensure_future(stack.generate(prompt_token_ids=PROMPTS[1], max_tokens=400))
        while len(ranks.watchdog.rates.get("verify", ())) < 5:  # decoding, round after round
            await asyncio.sleep(0.01)
        os.kill(follower.pid, signal.SIGSTOP)
        with pytest.raises(RankExitedError, match=r"did not finish in 2\.0 s") as hung:
            await asyncio.wait_for(stack.target.wait(), 15)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(flying, 5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert failed.value.details() == str(hung.value)
        health = await stack.target.server.health.Check(health_pb2.HealthCheckRequest(), None)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(follower.pid, signal.SIGCONT)
        await asyncio.wait_for(stack.stop(), 30)
    assert follower.exitcode == -signal.SIGKILL
