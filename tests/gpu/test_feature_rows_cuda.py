"""EAGLE features on a GPU: the target's read-back of a verify's rows, and float8 features
quantized together on the target's device, placed on the draft's through pinned memory and
dequantized there, to the bit of the host decode."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import encode_request, request_from_proto
from specpair.runtime.engine import GREEDY
from specpair.runtime.feature_rows import FP8, Fp8Rows, place_features
from specpair.runtime.gpu.staging import Staging
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.target.features import PINNED_READ_BYTES, host_rows
from specpair.runtime.target.worker import kept_rows

W = 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float8_rows_from_a_gpu_place_on_a_gpu_as_the_host_decode(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    feats = [
        torch.randn(n, W, device="cuda", generator=gen, dtype=torch.bfloat16) for n in (127, 5, 1)
    ]
    inputs = tuple(
        DraftInput(f"r{b}", tuple(range(len(f) + 1)), GREEDY, f) for b, f in enumerate(feats)
    )
    # inline: each input's bytes in its own Tensor, read below
    msg = draft_pb2.RoundRequest.FromString(
        encode_request(RoundRequest(1, 3, inputs), True, inline=True)
    )
    rows = [i.features for i in request_from_proto(msg).inputs]
    assert all(isinstance(r, Fp8Rows) for r in rows)
    want = torch.full((3, 128, W), 7.0, dtype=dtype)
    for b, m in enumerate(msg.inputs):
        q = torch.frombuffer(bytearray(m.features.data), dtype=torch.uint8).view(FP8)
        scales = torch.tensor(list(m.features.row_scales), dtype=torch.float32)
        want[b, : len(scales)] = (q.float().view(len(scales), W) * scales[:, None]).to(dtype)
    got = place_features(torch.full((3, 128, W), 7.0, dtype=dtype, device="cuda"), rows)
    assert torch.equal(got.cpu(), want)
    staged = torch.full((3, 128, W), 7.0, dtype=dtype, device="cuda")
    Staging().copy_rows(staged, rows)
    torch.cuda.synchronize()
    assert torch.equal(staged.cpu(), want)
    # the float8 values are a close copy of what the target computed
    err = (got[0, :127].float() - feats[0].float()).abs().max() / feats[0].float().abs().max()
    assert err < 0.07


def test_a_verifys_rows_read_back_into_pinned_memory_and_a_wave_into_pageable() -> None:
    hidden = torch.randn(8, 8, 3 * W, device="cuda", dtype=torch.bfloat16)
    keeps = [list(range(b % 8 + 1)) for b in range(8)]
    rows = kept_rows(hidden, keeps)
    assert all(r.is_pinned() for r in rows)
    for b, keep in enumerate(keeps):
        assert torch.equal(rows[b], hidden[b, keep].cpu())
    wave = torch.randn(PINNED_READ_BYTES // (2 * 3 * W) + 1, 3 * W, device="cuda").bfloat16()
    host = host_rows(wave)
    assert not host.is_pinned() and torch.equal(host, wave.cpu())
