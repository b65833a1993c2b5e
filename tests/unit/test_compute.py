"""Where services run model compute: inline on the event loop for CUDA, one thread on the CPU."""

import asyncio
import threading
import time
from pathlib import Path

import pytest

from specpair.config import DraftConfig, ServerConfig
from specpair.rpc.serving import (
    SETTLE_BUDGET_S,
    Compute,
    busy_wait,
    on_device,
    settle,
    settle_budget,
)


@pytest.mark.parametrize(("device", "inline"), [("cuda", True), ("cuda:1", True), ("cpu", False)])
def test_compute_runs_inline_only_for_cuda(device: str, inline: bool) -> None:
    compute = Compute("test-compute", 1, device)

    async def main() -> tuple[int, int, int]:
        total = await compute(lambda a, b: a + b, 1, 2)
        return total, threading.get_ident(), await compute(threading.get_ident)

    try:
        total, loop_thread, compute_thread = asyncio.run(main())
    finally:
        compute.shutdown()
    assert total == 3
    assert (loop_thread == compute_thread) is inline


def test_busy_wait_polls_only_within_its_budget() -> None:
    """Polling keeps the loop thread on the CPU; past the budget (or with none) it sleeps."""

    async def answer(after_s: float) -> int:
        await asyncio.sleep(after_s)
        return 7

    def cpu_ms(after_s: float, budget_s: float) -> float:
        start = time.process_time()
        assert asyncio.run(busy_wait(answer(after_s), budget_s)) == 7
        return 1e3 * (time.process_time() - start)

    assert cpu_ms(0.1, budget_s=1.0) > 40  # polled all 100 ms
    assert cpu_ms(0.1, budget_s=0.0) < 30  # slept
    assert cpu_ms(0.3, budget_s=0.02) < 150  # polled 20 ms, then slept 280


def test_settle_runs_a_streams_chain_of_passes_within_a_budget_that_grows_with_the_batch() -> None:
    """A stream's delta takes a chain of loop passes (event, write, completion): settle runs
    such chains to their end while its budget lasts, then returns to the round."""
    assert settle_budget(1) == SETTLE_BUDGET_S and settle_budget(64) == pytest.approx(9.6e-3)

    async def passes_within(budget_s: float, chain: int) -> int:
        done = 0

        async def stream() -> None:
            nonlocal done
            for _ in range(chain):
                await asyncio.sleep(0)
                done += 1

        task = asyncio.ensure_future(stream())
        await settle(budget_s=budget_s)
        ran = done
        task.cancel()
        return ran

    assert asyncio.run(passes_within(1.0, 200)) == 200  # all of it, then 100 µs idle
    assert asyncio.run(passes_within(1e-9, 200_000)) < 200_000  # the budget ends it


def test_busy_poll_defaults_to_cuda_only() -> None:
    def poll(ms: float | None, device: str) -> float:
        return DraftConfig(
            ServerConfig("127.0.0.1:0"), Path("m"), busy_poll_ms=ms, device=device
        ).busy_poll_s

    assert poll(None, "cuda:0") > 0
    assert poll(None, "cpu") == 0
    assert poll(5, "cpu") == 0.005


@pytest.mark.parametrize(
    ("device", "bound"), [("cpu", None), ("cuda", None), ("cuda:0", 0), ("cuda:1", 1)]
)
def test_a_service_binds_only_an_indexed_cuda_device(monkeypatch, device: str, bound) -> None:
    """`--device cuda:1` becomes the current device of each thread that runs model work (Triton
    and graphs launch on the current device); plain `cuda` is the current device already, and
    torch refuses to set a device without an index."""
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d).index))
    on_device(device, lambda: None)()
    assert calls == ([] if bound is None else [bound])
