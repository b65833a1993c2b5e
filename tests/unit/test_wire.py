"""Wire conversions: messages filled in place decode back to what was sent."""

from __future__ import annotations

import pytest
import torch

from specpair.proto.v1 import common_pb2, draft_pb2
from specpair.runtime.draft import DraftInput
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.tree import CandidateTree
from specpair.wire import (
    draft_input_from_proto,
    draft_input_into,
    tensor_from_proto,
    tensor_into,
    tree_from_proto,
    tree_into,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    msg = common_pb2.Tensor()
    tensor_into(msg, t[:, 1:4])  # a strided view travels as its values
    assert list(msg.shape) == [3, 3] and len(msg.data) == 9 * t.element_size()
    assert torch.equal(tensor_from_proto(msg, "x"), t[:, 1:4])
    tensor_into(msg, t[0])  # refilling replaces, never appends
    assert list(msg.shape) == [5] and torch.equal(tensor_from_proto(msg, "x"), t[0])


def test_draft_inputs_filled_in_place_decode_back() -> None:
    feats = torch.randn(2, 8).to(torch.bfloat16)
    sent = [
        DraftInput("a", (5, 6), SamplingParams(), feats),
        DraftInput(
            "b", (7,), SamplingParams(temperature=0.5, top_p=0.75, top_k=4, seed=11)
        ),  # exact in float32
    ]
    message = draft_pb2.SpeculateRequest(round_id=3, speculative_num_steps=3)
    for item in sent:
        draft_input_into(message.inputs.add(), item)
    parsed = draft_pb2.SpeculateRequest.FromString(message.SerializeToString())
    got = [draft_input_from_proto(m) for m in parsed.inputs]
    assert [(g.request_id, g.appended, g.sampling) for g in got] == [
        (s.request_id, s.appended, s.sampling) for s in sent
    ]
    assert got[0].features is not None and torch.equal(got[0].features, feats)
    assert got[1].features is None


def test_trees_filled_in_place_decode_back() -> None:
    probs = torch.softmax(torch.randn(3, 10), -1)
    trees = [CandidateTree((4, 2, 9), (-1, 0, 0), probs), CandidateTree((1,), (-1,), None)]
    response = draft_pb2.SpeculateResponse(round_id=1)
    for rid, tree in zip(("a", "b"), trees, strict=True):
        tree_into(response.trees.add(), rid, tree)
    parsed = draft_pb2.SpeculateResponse.FromString(response.SerializeToString())
    assert [t.request_id for t in parsed.trees] == ["a", "b"]
    back = [tree_from_proto(t) for t in parsed.trees]
    assert back[0].tokens == (4, 2, 9) and back[0].parents == (-1, 0, 0)
    assert back[0].draft_probs is not None and torch.equal(back[0].draft_probs, probs)
    assert back[1] == CandidateTree((1,), (-1,), None)


@pytest.mark.parametrize("shape", [[3, 4], [-2, -6], [13]])
def test_malformed_tensor_names_its_field(shape: list[int]) -> None:
    msg = common_pb2.Tensor(data=bytes(24), dtype=common_pb2.D_TYPE_FLOAT32, shape=shape)
    with pytest.raises(ValueError, match=r"inputs\[a\]\.features: 24 bytes"):
        tensor_from_proto(msg, "inputs[a].features")
    msg.dtype = 99  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"features\.dtype"):
        tensor_from_proto(msg, "inputs[a].features")
