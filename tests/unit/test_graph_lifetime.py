"""CUDA-graph lifetime bookkeeping, on CPU: whatever a captured graph reads must outlive capture.

A graph replays kernels over the addresses it saw at capture. The LM drafter's extend graph
gathered `hidden[rows, last]` with a `rows = arange(B)` that only the captured closure
referenced: freed after capture, its memory reused, the replay indexed with garbage (device-side
`index out of bounds`). The stream / graph calls are stubbed so the bookkeeping runs without CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
import torch

from specpair.runtime import cuda_graphs


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = cuda_graphs.torch.cuda
    monkeypatch.setattr(cuda, "Stream", _Stub)
    monkeypatch.setattr(cuda, "current_stream", lambda *a, **k: _Stub())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", _Stub)
    monkeypatch.setattr(cuda, "graph", lambda g, pool=None: contextlib.nullcontext())


def _captured_gather() -> tuple[cuda_graphs.StageGraph, weakref.ref[torch.Tensor]]:
    hidden = torch.arange(12.0).view(2, 3, 2)
    last = torch.tensor([2, 0])
    rows = torch.arange(2)  # made outside the capture, read only by the closure

    def body() -> dict[str, torch.Tensor]:
        return {"hidden": hidden[rows, last][:, None]}

    graph = cuda_graphs.capture(body, {"last": last}, [], pool=None)
    return graph, weakref.ref(rows)


def test_captured_graph_keeps_closure_tensors_alive(fake_cuda: None) -> None:
    before = cuda_graphs.captures()
    graph, rows = _captured_gather()
    gc.collect()
    assert rows() is not None, "a tensor the graph reads was freed after capture"
    assert cuda_graphs.captures() == before + 1
    assert graph.outputs["hidden"].shape == (2, 1, 2)
    del graph
    gc.collect()
    assert rows() is None  # and released with the graph
