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

from specpair.runtime.gpu import capture as graphs
from specpair.runtime.kv_cache import KVCache


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = graphs.torch.cuda
    monkeypatch.setattr(cuda, "Stream", _Stub)
    monkeypatch.setattr(cuda, "Event", _Stub)
    monkeypatch.setattr(cuda, "current_stream", lambda *a, **k: _Stub())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", _Stub)
    monkeypatch.setattr(cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: None)


def _captured_gather(
    builder: graphs.GraphCapture,
) -> tuple[graphs.StageGraph, weakref.ref[torch.Tensor]]:
    hidden = torch.arange(12.0).view(2, 3, 2)
    last = torch.tensor([2, 0])
    rows = torch.arange(2)  # made outside the capture, read only by the closure

    def body() -> dict[str, torch.Tensor]:
        return {"hidden": hidden[rows, last][:, None]}

    graph = builder.capture(body, {"last": last}, [])
    return graph, weakref.ref(rows)


def test_captured_graph_keeps_closure_tensors_alive(fake_cuda: None) -> None:
    cache = KVCache(
        num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2, max_requests=2, max_len=8
    )
    builder = graphs.GraphCapture(cache, max_batch=2, owner="test")
    assert builder.buckets == [1, 2] and builder.captures == 0
    graph, rows = _captured_gather(builder)
    gc.collect()
    assert rows() is not None, "a tensor the graph reads was freed after capture"
    assert builder.captures == 1  # counted on the builder the services report from
    assert graph.outputs["hidden"].shape == (2, 1, 2)
    assert graph.staging is builder.staging  # one pinned staging per builder
    assert builder.graphs == [graph]  # indexed: a tensor-parallel follower replays by index
    del graph, builder
    gc.collect()
    assert rows() is None  # and released with the graph and its builder
