"""Float8 EAGLE features stay float8 until placed on the draft's device, and place exactly the
values the host decode to float32 gave (so a draft reads the same features as before)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpair.parallel.lockstep import GraphLoad, Replay, Step, decode, encode
from specpair.proto.v1 import common_pb2, draft_pb2
from specpair.rpc.wire import encode_request, request_from_proto
from specpair.runtime.build import build_drafter, build_states
from specpair.runtime.engine import GREEDY
from specpair.runtime.feature_rows import (
    FP8,
    Fp8Rows,
    place_features,
    quantize_rows,
    quantize_together,
)
from specpair.runtime.gpu.staging import Staging
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.shape import TreeShape

W = 64
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def inline_message(request: RoundRequest) -> draft_pb2.RoundRequest:
    return draft_pb2.RoundRequest.FromString(encode_request(request, True, inline=True))


def float32_decode(msg: common_pb2.Tensor) -> torch.Tensor:
    """The draft's decode before float8 rows stayed float8: e4m3 bytes times their scales, in
    float32 on the host (the reference every placement must match to the bit)."""
    q = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(FP8)
    scales = torch.tensor(list(msg.row_scales), dtype=torch.float32)
    return (q.float().view(len(scales), -1) * scales[:, None]).view(tuple(msg.shape))


def features(rows: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in rows:  # rows of very different ranges, one all zero
        ranges = torch.tensor([10.0 ** (i % 7 - 3) for i in range(n)])
        out.append(torch.randn(n, W, generator=gen) * ranges[:, None])
    out[0][-1] = 0
    return out


def sent(feats: list[torch.Tensor]) -> draft_pb2.RoundRequest:
    inputs = tuple(
        DraftInput(f"r{b}", tuple(range(len(f) + 1)), GREEDY, f) for b, f in enumerate(feats)
    )
    # inline: each input's bytes in its own Tensor, which `float32_decode` reads
    return inline_message(RoundRequest(1, 3, inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float8_rows_place_the_bits_the_float32_decode_gave(dtype: torch.dtype) -> None:
    msg = sent(features([5, 1, 3], seed=0))
    rows = [i.features for i in request_from_proto(msg).inputs]
    assert all(isinstance(r, Fp8Rows) and r.q.dtype == torch.uint8 for r in rows)
    assert [r.shape for r in rows if r is not None] == [(5, W), (1, W), (3, W)]
    want = torch.full((3, 6, W), 7.0, dtype=dtype)  # 7: padding must be left as it is
    for b, m in enumerate(msg.inputs):
        want[b, : len(m.features.row_scales)].copy_(float32_decode(m.features))
    got = place_features(torch.full((3, 6, W), 7.0, dtype=dtype), rows)
    assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
    # the graphs' staging places float8 rows the same way (straight into the static buffer)
    staged = torch.full((4, 6, W), 7.0, dtype=dtype)
    Staging().copy_rows(staged, rows)
    assert torch.equal(staged[:3].view(BITS[dtype]), want.view(BITS[dtype]))
    assert torch.all(staged[3] == 7)
    first = rows[0]
    assert isinstance(first, Fp8Rows)
    assert torch.equal(
        first.dequantize(dtype=dtype).view(BITS[dtype]), want[0, :5].view(BITS[dtype])
    )


def test_plain_and_float8_rows_place_side_by_side() -> None:
    plain, fp8 = features([2, 3], seed=1)
    (rows,) = quantize_rows([fp8])
    got = place_features(torch.zeros(2, 3, W), [plain, rows])
    assert torch.equal(got[0, :2], plain) and torch.equal(got[1], rows.dequantize())


def test_quantizing_a_round_together_writes_the_bytes_each_alone_did() -> None:
    feats = features([4, 1, 6], seed=2)
    together = quantize_together(feats)  # a GPU's path: one tensor, one copy to the host
    for f, rows in zip(feats, together, strict=True):
        (alone,) = quantize_rows([f])
        assert torch.equal(rows.q, alone.q) and torch.equal(rows.scale, alone.scale)
    # the wire holds the same: an older draft decodes it as it always did
    msg = sent(feats)
    for f, m in zip(feats, msg.inputs, strict=True):
        (alone,) = quantize_rows([f])
        assert m.features.data == alone.q.numpy().tobytes() and list(m.features.shape) == [
            len(f),
            W,
        ]
        assert torch.equal(torch.tensor(list(m.features.row_scales)), alone.scale)


def test_float8_rows_cross_the_lockstep_as_bytes() -> None:
    (rows,) = quantize_rows(features([3], seed=3))
    step = decode(encode(Step((GraphLoad(0, "features", (rows,)),), Replay(0))))
    load = step.changes[0]
    assert isinstance(load, GraphLoad) and isinstance(load.src, tuple)
    (back,) = load.src
    assert isinstance(back, Fp8Rows)
    assert torch.equal(back.q, rows.q) and torch.equal(back.scale, rows.scale)


@pytest.mark.parametrize("tier", [3, TreeShape(3, 2, 6)])
def test_an_eagle_draft_from_float8_rows_drafts_the_trees_the_float32_decode_did(
    ckpts: dict[str, Path], tier: int | TreeShape
) -> None:
    def drafter() -> tuple:
        d = build_drafter(
            ckpts["eagle"],
            target_path=ckpts["target"],
            max_requests=2,
            max_len=64,
            dtype=torch.bfloat16,
        )
        return d, build_states([tier], drafter=d)[tier]

    (fp8, fp8_state), (ref, ref_state) = drafter(), drafter()
    width = fp8.feature_width
    gen = torch.Generator().manual_seed(4)
    rounds = [
        [((5, 6, 7, 8), 3), ((40, 41, 42), 2)],  # first round: a row fewer than tokens
        [((9, 10), 2), ((43,), 1)],
    ]
    for appended in rounds:
        inputs = tuple(
            DraftInput(f"r{b}", toks, GREEDY, 4 * torch.randn(n, width, generator=gen))
            for b, (toks, n) in enumerate(appended)
        )
        msg = inline_message(RoundRequest(1, 3, inputs))
        kept = request_from_proto(msg).inputs
        assert all(isinstance(i.features, Fp8Rows) for i in kept)
        decoded = [
            DraftInput(i.request_id, i.appended, i.sampling, float32_decode(m.features))
            for i, m in zip(kept, msg.inputs, strict=True)
        ]
        trees = fp8.draft(list(kept), fp8_state)
        assert trees == ref.draft(decoded, ref_state)
        assert all(len(t.tokens) == 3 if tier == 3 else len(t.tokens) == 6 for t in trees)
