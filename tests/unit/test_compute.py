"""Where services run model compute: inline on the event loop for CUDA, one thread on the CPU."""

import asyncio
import threading

import pytest

from specpair.serving import Compute


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
