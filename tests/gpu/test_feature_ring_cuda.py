"""The feature ring on a GPU: a CUDA IPC handle that another process maps, reading the rows
the target wrote (to the bit), and refusing a ring on a GPU it is not on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire_tensor import ring_into
from specpair.runtime.feature_ring import FeatureRing, RingView

CHILD = """
import sys, torch
from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire_tensor import ring_from_proto
from specpair.runtime.feature_ring import RingView
msg = draft_pb2.FeatureRing.FromString(bytes.fromhex(sys.stdin.read()))
view = RingView(ring_from_proto(msg), torch.device("cuda:0"))
a, b = view.take([(0, 7), (7, 2)], ["a", "b"])
print(view.token.hex(), a.float().sum().item(), b.float().sum().item(), a.is_cuda)
"""


def test_another_process_maps_the_gpu_ring_and_reads_the_rows() -> None:
    ring = FeatureRing(64, 4096, torch.bfloat16, torch.device("cuda:0"))
    a = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    assert ring.put(1, [a, b]) == [0, 7]
    msg = draft_pb2.FeatureRing()
    ring_into(msg, ring.handle)
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=msg.SerializeToString().hex(),
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.split()
    want = [ring.token.hex(), str(a.float().sum().item()), str(b.float().sum().item()), "True"]
    assert out == want


def test_a_ring_in_this_process_reads_back_and_a_cpu_draft_refuses_it() -> None:
    ring = FeatureRing(8, 64, torch.bfloat16, torch.device("cuda:0"))
    rows = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    assert ring.put(1, [rows]) == [0]
    with pytest.raises(ValueError, match="this draft runs on the CPU"):
        RingView(ring.handle, torch.device("cpu"))
