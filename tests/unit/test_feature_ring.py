"""The feature ring: its FIFO of regions, the target's writes read by a draft mapping it (in
this process and in another), and the wire's spans of it checked like any peer input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import MalformedRequestError, request_from_proto, request_to_proto
from specpair.rpc.wire_tensor import ring_from_proto, ring_into, tensor_into
from specpair.runtime.feature_ring import FeatureRing, RingSpace, RingView
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.sampling import SamplingParams

CPU = torch.device("cpu")


def test_regions_are_a_fifo_that_wraps() -> None:
    space = RingSpace(10)
    assert space.alloc(1, 6) == 0 and space.alloc(2, 3) == 6
    assert space.room() == 1  # rows 9, and nothing before row 0's region
    space.release(1)
    assert space.room() == 6  # rows 0–5 (row 9 alone is smaller)
    assert space.alloc(3, 5) == 0  # wrapped
    assert space.alloc(4, 2) is None  # rows 5 and 9 are free, but apart
    assert space.alloc(4, 1) == 5
    space.release(3)  # seq 2 and 3 (and 4's region stays)
    assert space.room() == 5 and space.alloc(5, 4) == 6
    space.reset()
    assert space.room() == 10 and space.alloc(6, 10) == 0 and space.alloc(7, 1) is None


def test_rows_larger_than_the_ring_or_empty_get_no_region() -> None:
    space = RingSpace(4)
    assert space.alloc(1, 5) is None and space.alloc(1, 0) is None and space.room() == 4


def test_a_mapped_ring_reads_what_the_target_wrote() -> None:
    ring = FeatureRing(10, 8, torch.float32, CPU)
    view = RingView(ring.handle, CPU)
    assert view.token == ring.token  # the probe's proof that both map the same memory
    a, b, c = torch.randn(6, 8), torch.randn(3, 8), torch.randn(5, 8)
    starts = ring.put(1, [a, None, b, c])
    assert starts == [0, None, 6, None]  # c does not fit beside a and b: sent as bytes
    got = view.take([(0, 6), (6, 3)], ["x", "y"])
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    ring.put(2, [torch.zeros(1, 8)])  # overwrites nothing read: rows 9
    assert torch.equal(got[0], a)  # take copies: a later write never reaches what was read
    ring.release(1)
    assert ring.put(3, [c]) == [0]
    assert torch.equal(view.take([(0, 5)], ["z"])[0], c)


def test_rows_of_another_shape_or_dtype_are_sent_as_bytes() -> None:
    ring = FeatureRing(10, 8, torch.float32, CPU)
    starts = ring.put(1, [torch.randn(2, 4), torch.randn(2, 8).double(), torch.randn(2, 8)])
    assert starts == [None, None, 0]


def test_another_process_maps_the_ring_and_reads_its_rows() -> None:
    ring = FeatureRing(4, 8, torch.bfloat16, CPU)
    rows = torch.arange(16, dtype=torch.bfloat16).view(2, 8)
    assert ring.put(1, [rows]) == [0]
    script = (
        "import sys, torch\n"
        "from specpair.runtime.feature_ring import RingHandle, RingView\n"
        "view = RingView(RingHandle(4, 8, torch.bfloat16, path=sys.argv[1]), torch.device('cpu'))\n"
        "print(view.token.hex(), view.take([(0, 2)], ['f'])[0].float().sum().item())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, ring.handle.path],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    assert out == [ring.token.hex(), str(float(rows.float().sum()))]


def test_a_handle_crosses_the_wire_and_a_bad_one_is_named() -> None:
    ring = FeatureRing(4, 8, torch.float32, CPU)
    msg = draft_pb2.FeatureRing()
    ring_into(msg, ring.handle)
    assert ring_from_proto(msg) == ring.handle
    msg.dtype = 4  # int32
    with pytest.raises(ValueError, match=r"feature_ring\.dtype"):
        ring_from_proto(msg)
    with pytest.raises(ValueError, match="neither a path nor a CUDA buffer"):
        ring_from_proto(draft_pb2.FeatureRing(rows=4, width=8, dtype=1))
    other = draft_pb2.FeatureRing(rows=4, width=8, dtype=1)
    with open(__file__) as f, pytest.raises(ValueError, match="not a feature ring's memfd"):
        other.path = f"/proc/self/fd/{f.fileno()}"  # any other file the draft can read
        RingView(ring_from_proto(other), CPU)
    with pytest.raises(FileNotFoundError):
        RingView(
            ring_from_proto(draft_pb2.FeatureRing(rows=4, width=8, dtype=1, path="/nonexistent")),
            CPU,
        )
    with pytest.raises(ValueError, match="not the ring's"):  # the right file, another shape
        RingView(
            ring_from_proto(draft_pb2.FeatureRing(rows=5, width=8, dtype=1, path=ring.handle.path)),
            CPU,
        )


def _request(*features: torch.Tensor) -> RoundRequest:
    inputs = tuple(
        DraftInput(f"r{i}", tuple(range(len(f))), SamplingParams(), f)
        for i, f in enumerate(features)
    )
    return RoundRequest(3, 3, inputs)


def test_spans_on_the_wire_decode_to_the_rows_they_name() -> None:
    ring = FeatureRing(10, 8, torch.float32, CPU)
    view = RingView(ring.handle, CPU)
    request = _request(torch.randn(2, 8), torch.randn(9, 8))
    starts = ring.put(1, [i.features for i in request.inputs])
    assert starts == [0, None]
    msg = request_to_proto(request, shared=starts)
    assert msg.inputs[0].HasField("shared_features") and not msg.inputs[0].HasField("features")
    assert msg.inputs[1].HasField("features") and not msg.inputs[1].HasField("shared_features")
    decoded = request_from_proto(msg, view)
    for sent, got in zip(request.inputs, decoded.inputs, strict=True):
        assert isinstance(got.features, torch.Tensor) and torch.equal(got.features, sent.features)


def test_a_span_outside_the_ring_or_without_one_is_named() -> None:
    ring = FeatureRing(10, 8, torch.float32, CPU)
    view = RingView(ring.handle, CPU)
    msg = request_to_proto(_request(torch.randn(2, 8)), shared=[0])
    with pytest.raises(
        MalformedRequestError,
        match=r"inputs\[r0\].shared_features: this stream has no feature ring",
    ):
        request_from_proto(msg)
    msg.inputs[0].shared_features.start = 9  # rows 9, 10: one past the end
    with pytest.raises(
        MalformedRequestError, match=r"inputs\[r0\].shared_features: rows \[9, 11\) outside"
    ):
        request_from_proto(msg, view)
    msg.inputs[0].shared_features.start = 0
    tensor_into(msg.inputs[0].features, torch.randn(2, 8))
    with pytest.raises(MalformedRequestError, match="sent beside features"):
        request_from_proto(msg, view)
