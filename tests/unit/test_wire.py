"""Wire conversions: whole round messages decode back to what was sent."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from specpair.proto.v1 import common_pb2, draft_pb2, target_pb2
from specpair.rpc.wire import (
    MalformedRequestError,
    encode_request,
    read_round,
    request_from_proto,
    request_to_proto,
    response_from_proto,
    response_to_proto,
    stats_from_proto,
    stats_to_proto,
    timings_from_proto,
)
from specpair.rpc.wire_tensor import tensor_from_proto, tensor_into
from specpair.runtime.feature_rows import Fp8Rows
from specpair.runtime.round_messages import (
    DraftInput,
    RoundRequest,
    RoundResponse,
    RoundStats,
    StageTimings,
)
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.tree import CandidateTree


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    msg = common_pb2.Tensor()
    tensor_into(msg, t[:, 1:4])  # a strided view travels as its values
    assert list(msg.shape) == [3, 3] and len(msg.data) == 9 * t.element_size()
    assert torch.equal(tensor_from_proto(msg, "x"), t[:, 1:4])
    tensor_into(msg, t[0])  # refilling replaces, never appends
    assert list(msg.shape) == [5] and torch.equal(tensor_from_proto(msg, "x"), t[0])


def test_round_request_decodes_back_to_what_was_sent() -> None:
    feats = torch.randn(2, 8).to(torch.bfloat16)
    sent = RoundRequest(
        3,
        7,
        (
            DraftInput("a", (5, 6), SamplingParams(), feats),
            # exact in float32
            DraftInput(
                "b",
                (7,),
                SamplingParams(temperature=0.5, top_p=0.75, top_k=4, seed=11),
                continues=True,
            ),
        ),
        ("gone", "left"),
    )
    wire = draft_pb2.RoundRequest.FromString(request_to_proto(sent).SerializeToString())
    got = request_from_proto(wire)
    assert (got.round_id, got.speculative_num_steps, got.released_request_ids) == (
        3,
        7,
        ("gone", "left"),
    )
    assert [(g.request_id, g.appended, g.sampling, g.continues) for g in got.inputs] == [
        (s.request_id, s.appended, s.sampling, s.continues) for s in sent.inputs
    ]
    assert [g.continues for g in got.inputs] == [False, True]
    assert got.inputs[0].features is not None and torch.equal(got.inputs[0].features, feats)
    assert got.inputs[1].features is None


def test_bad_sampling_in_a_request_names_its_input_and_field() -> None:
    msg = request_to_proto(RoundRequest(1, 3, (DraftInput("r7", (1,), SamplingParams()),)))
    msg.inputs[0].sampling.top_p = 1.5
    with pytest.raises(ValueError, match=r"^inputs\[r7\]\.sampling\.top_p"):
        request_from_proto(msg)


def test_round_response_decodes_back_and_keeps_bad_trees_apart() -> None:
    probs = torch.softmax(torch.randn(3, 10), -1)
    trees = {"a": CandidateTree((4, 2, 9), (-1, 0, 0), probs), "b": CandidateTree((1,), (-1,))}
    timings = StageTimings(draft_ms=1.5, total_ms=2.0, draft_gpu_ms=0.25)
    msg = response_to_proto(RoundResponse(1, trees, timings))
    bad = msg.trees.add(request_id="c", token_ids=[1], parents=[-1])
    bad.draft_probs.data, bad.draft_probs.dtype = bytes(3), common_pb2.D_TYPE_FLOAT32
    back = response_from_proto(draft_pb2.RoundResponse.FromString(msg.SerializeToString()))
    assert list(back.trees) == ["a", "b"] and back.timings == timings and back.error == ""
    assert back.trees["a"].tokens == (4, 2, 9) and back.trees["a"].parents == (-1, 0, 0)
    assert back.trees["a"].draft_probs is not None
    assert torch.equal(back.trees["a"].draft_probs, probs)
    assert back.trees["b"] == trees["b"]
    assert list(back.malformed) == ["c"] and "trees[c].draft_probs" in back.malformed["c"]


@pytest.mark.parametrize(
    ("ours", "proto"),
    [
        (StageTimings, common_pb2.StageTimings),
        (RoundStats, target_pb2.RoundStats),
        (RoundRequest, draft_pb2.RoundRequest),
    ],
)
def test_typed_messages_have_the_protos_fields(ours: type, proto: Any) -> None:
    names = {f.name for f in fields(ours)}
    # a probe's feature ring is the stream's, mapped before any round is decoded; feature_data
    # carries the inputs' feature bytes (each decoded into its input)
    wire_only = {"feature_ring", "feature_data"} if proto is draft_pb2.RoundRequest else set()
    assert names == set(proto.DESCRIPTOR.fields_by_name) - wire_only


def test_round_stats_travel_whole() -> None:
    stats = RoundStats(9, 3, 2, (3, 1), True, StageTimings(verify_ms=4.0), unix_time=1.0)
    msg = stats_to_proto(stats)
    assert (msg.round_id, msg.speculative_num_steps, msg.batch_size) == (9, 3, 2)
    assert list(msg.accept_lengths) == [3, 1] and msg.speculative and msg.unix_time == 1.0
    assert timings_from_proto(msg.timings) == stats.timings


def test_round_stats_decode_to_what_was_sent() -> None:
    """The controller and the benchmarks read RoundStats through `stats_from_proto`."""
    stats = RoundStats(
        round_id=7,
        speculative_num_steps=3,
        batch_size=3,
        accept_lengths=(2, 0),
        speculative=True,
        timings=StageTimings(total_ms=9.5, wait_ms=1.0),
        unix_time=2.5,
        request_ids=("a", "b"),
        request_steps=(3, 1),
        plain_request_ids=("c",),
        sampled_requests=2,
        verify_rows=24,
    )
    wire = target_pb2.RoundStats.FromString(stats_to_proto(stats).SerializeToString())
    assert stats_from_proto(wire) == stats


@pytest.mark.parametrize("shape", [[3, 4], [-2, -6], [13]])
def test_malformed_tensor_names_its_field(shape: list[int]) -> None:
    msg = common_pb2.Tensor(data=bytes(24), dtype=common_pb2.D_TYPE_FLOAT32, shape=shape)
    with pytest.raises(ValueError, match=r"inputs\[a\]\.features: 24 bytes"):
        tensor_from_proto(msg, "inputs[a].features")
    msg.dtype = 99  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"features\.dtype"):
        tensor_from_proto(msg, "inputs[a].features")


def test_float8_features_are_half_of_bfloat16_and_close_per_row() -> None:
    # rows of very different ranges: each keeps its own scale
    feats = torch.randn(5, 4096) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    sent = RoundRequest(1, 7, (DraftInput("a", (5, 6, 7, 8, 9), SamplingParams(), feats),))
    fp8 = request_to_proto(sent, fp8_features=True)
    bf16 = request_to_proto(
        RoundRequest(1, 7, (DraftInput("a", (5, 6, 7, 8, 9), SamplingParams(), feats.bfloat16()),))
    )
    assert len(fp8.feature_data) == 5 * 4096  # + 5 float32 scales, in the input's Tensor
    assert fp8.ByteSize() < 0.51 * bf16.ByteSize()
    got = request_from_proto(draft_pb2.RoundRequest.FromString(fp8.SerializeToString()))
    rows = got.inputs[0].features
    assert isinstance(rows, Fp8Rows) and rows.shape == (5, 4096)  # float8 until placed
    decoded = rows.dequantize()
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, or of 2^-9 of the row's top below
    # e4m3's normal range
    top = feats.abs().amax(-1, keepdim=True)
    bound = torch.maximum(feats.abs() / 16, top / 448 * 2.0**-9) + 1e-12
    assert torch.all((decoded - feats).abs() <= bound)
    assert torch.equal(decoded[4], torch.zeros(4096))  # an all-zero row: scale 0, exact
    assert not torch.equal(decoded, feats)  # it is lossy: the drafts may change, outputs do not


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (lambda f: f.row_scales.append(1.0), r"features\.row_scales: 3 scales for 2 rows"),
        (lambda f: f.row_scales.__setitem__(0, float("nan")), "finite and >= 0"),
        (lambda f: f.row_scales.__setitem__(1, -1.0), "finite and >= 0"),
        (lambda f: setattr(f, "data", f.data[:-1]), "do not hold float8 shape"),
        (lambda f: f.shape.insert(0, 1), r"features: float8 rows \[n, W\] expected"),
    ],
)
def test_malformed_float8_features_name_their_field(spoil, match) -> None:
    sent = RoundRequest(1, 3, (DraftInput("r7", (1, 2), SamplingParams(), torch.randn(2, 8)),))
    msg = draft_pb2.RoundRequest.FromString(encode_request(sent, True, inline=True))
    spoil(msg.inputs[0].features)
    with pytest.raises(ValueError, match=rf"inputs\[r7\]\.{match}" if "row" in match else match):
        request_from_proto(msg)


def _three_inputs() -> RoundRequest:
    g = torch.Generator().manual_seed(3)
    return RoundRequest(
        4,
        7,
        (
            DraftInput("a", (5, 6), SamplingParams(), torch.randn(2, 8, generator=g).bfloat16()),
            DraftInput("b", (7,), SamplingParams()),  # no features
            DraftInput("c", (8,), SamplingParams(), torch.randn(1, 8, generator=g)),
        ),
    )


def test_features_travel_as_one_run_after_the_message_and_decode_as_inline_ones() -> None:
    sent = _three_inputs()
    wire = draft_pb2.RoundRequest.FromString(encode_request(sent))
    assert [m.features.data for m in wire.inputs] == [b"", b"", b""]
    assert len(wire.feature_data) == 2 * 8 * 2 + 1 * 8 * 4  # bfloat16 rows, then float32
    # protobuf's own message with the same run: the appended field is the standard encoding
    inline = draft_pb2.RoundRequest.FromString(encode_request(sent, inline=True))
    assert not inline.feature_data and len(inline.inputs[0].features.data) == 32
    expected = draft_pb2.RoundRequest()
    expected.CopyFrom(inline)
    run = b""
    for m in expected.inputs:
        if m.HasField("features"):
            run += m.features.data
            m.features.data = b""
    expected.feature_data = run
    assert wire == expected
    for message in (wire, inline):
        got = request_from_proto(message).inputs
        for g, s in zip(got, sent.inputs, strict=True):
            assert (g.features is None) == (s.features is None)
            assert g.features is None or torch.equal(g.features, s.features)  # type: ignore[arg-type]


def test_a_run_and_inline_bytes_mix_in_the_order_of_inputs() -> None:
    """A peer may send some inputs' bytes in their own Tensor: those take none of the run."""
    sent = _three_inputs()
    msg = draft_pb2.RoundRequest.FromString(encode_request(sent))
    inline = draft_pb2.RoundRequest.FromString(encode_request(sent, inline=True))
    msg.inputs[0].features.data = inline.inputs[0].features.data
    msg.feature_data = inline.inputs[2].features.data
    got = request_from_proto(msg).inputs
    assert torch.equal(got[0].features, sent.inputs[0].features)  # type: ignore[arg-type]
    assert torch.equal(got[2].features, sent.inputs[2].features)  # type: ignore[arg-type]


SHORT_RUN = (
    r"feature_data: 63 bytes, too few for inputs\[c\]\.features \(shape \[1, 8\] from byte 32\)"
)


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (lambda m: setattr(m, "feature_data", m.feature_data[:-1]), SHORT_RUN),
        (lambda m: setattr(m, "feature_data", m.feature_data + b"x"), "1 bytes left over"),
        (lambda m: m.inputs[2].features.shape.append(2), r"too few for inputs\[c\]"),
        (lambda m: setattr(m.inputs[0].features, "dtype", 99), r"inputs\[a\]\.features\.dtype"),
    ],
)
def test_a_bad_feature_run_names_its_field_and_keeps_the_ids(spoil, match) -> None:
    msg = draft_pb2.RoundRequest.FromString(encode_request(_three_inputs()))
    spoil(msg)
    with pytest.raises(MalformedRequestError, match=match) as err:
        request_from_proto(msg)
    assert [i.request_id for i in err.value.request.inputs] == ["a", "b", "c"]


def test_the_draft_reads_the_run_as_a_view_of_what_arrived() -> None:
    sent = _three_inputs()
    data = encode_request(sent)
    got = read_round(data)
    assert not got.message.feature_data and got.feature_data.obj is data  # a view, not a copy
    whole = draft_pb2.RoundRequest.FromString(data)
    assert bytes(got.feature_data) == whole.feature_data
    whole.ClearField("feature_data")
    assert got.message == whole
    decoded = request_from_proto(got.message, None, got.feature_data).inputs
    assert torch.equal(decoded[0].features, sent.inputs[0].features)  # type: ignore[arg-type]
    # given twice, the last run is the field's value, as protobuf reads it
    twice = read_round(data + bytes([0x42, 2]) + b"xy")
    assert bytes(twice.feature_data) == b"xy" and twice.message == got.message
    # without a run it is protobuf's own parse
    bare = encode_request(RoundRequest(2, 3, (DraftInput("a", (1,), SamplingParams()),)))
    assert read_round(bare).message == draft_pb2.RoundRequest.FromString(bare)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (bytes([0x08, 0x80]), "byte 2: a varint runs past"),  # round_id's varint cut short
        (bytes([0x42, 5, 1, 2]), "byte 0: a field numbered 0 or running past"),
        (bytes([0x0B]), "wire type 3"),  # a group: no RoundRequest field is one
        (bytes([0x00, 0x01]), "numbered 0"),
    ],
)
def test_bytes_that_are_not_a_round_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_round(data)


@settings(max_examples=300, deadline=None)
@given(head=st.binary(max_size=40), run=st.binary(max_size=40), tail=st.binary(max_size=8))
def test_read_round_reads_what_protobuf_reads_or_refuses(
    head: bytes, run: bytes, tail: bytes
) -> None:
    """Any bytes: the message and run protobuf would read, or an error (never another fault)."""
    data = head + bytes([0x42, len(run)]) + run + tail
    try:
        whole = draft_pb2.RoundRequest.FromString(data)
    except DecodeError:
        whole = None
    try:
        got = read_round(data)
    except DecodeError:
        assert whole is None
        return
    except ValueError as exc:  # protobuf also reads a group, which no RoundRequest field is
        assert whole is None or "wire type 3" in str(exc), exc
        return
    assert whole is not None
    assert bytes(got.feature_data) == whole.feature_data
    whole.ClearField("feature_data")
    assert got.message == whole


def test_a_bad_round_shape_names_the_field_and_keeps_the_ids_to_release() -> None:
    msg = request_to_proto(RoundRequest(1, 3, (DraftInput("r7", (1,), SamplingParams()),)))
    msg.shape = "3x2"
    with pytest.raises(MalformedRequestError, match=r"^shape: a tree shape is") as err:
        request_from_proto(msg)
    assert [i.request_id for i in err.value.request.inputs] == ["r7"]
    msg.shape = "3x2x6"
    assert request_from_proto(msg).tier == TreeShape(3, 2, 6)


def _sparse(n: int, k: int, seed: int) -> CandidateTree:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(500, generator=gen)[:k] for _ in range(n)])
    probs = torch.softmax(torch.randn(n, k, generator=gen), -1)
    return CandidateTree(tuple(ids[:, 0].tolist()), tuple(range(-1, n - 1)), probs, ids)


def test_a_sampled_rounds_q_travels_in_one_tensor_and_decodes_per_tree() -> None:
    trees = {"a": _sparse(3, 8, 1), "b": _sparse(1, 8, 2), "c": _sparse(7, 8, 3)}
    msg = response_to_proto(RoundResponse(4, trees))
    assert msg.HasField("draft_probs") and list(msg.draft_probs.shape) == [11, 8]
    assert not any(t.HasField("draft_probs") or t.HasField("draft_token_ids") for t in msg.trees)
    back = response_from_proto(draft_pb2.RoundResponse.FromString(msg.SerializeToString()))
    assert not back.malformed
    for rid, tree in trees.items():
        got = back.trees[rid]
        assert got.tokens == tree.tokens and got.draft_ids is not None
        assert torch.equal(got.draft_probs, tree.draft_probs)
        assert torch.equal(got.draft_ids, tree.draft_ids)
    per_tree = response_from_proto(response_to_proto(RoundResponse(4, trees), round_q=False))
    assert all(torch.equal(per_tree.trees[r].draft_ids, back.trees[r].draft_ids) for r in trees)
    # a round's q rows are counted over every tree, also those dropped unread (not its own)
    only_c = response_from_proto(msg, max_nodes=7, request_ids={"c"})
    assert torch.equal(only_c.trees["c"].draft_probs, trees["c"].draft_probs)


def test_trees_of_mixed_q_keep_their_own() -> None:
    trees = {"a": _sparse(2, 8, 1), "g": CandidateTree((5, 6), (-1, 0)), "b": _sparse(2, 4, 2)}
    msg = response_to_proto(RoundResponse(4, trees))
    assert not msg.HasField("draft_probs")
    back = response_from_proto(msg)
    assert back.trees["g"].draft_probs is None
    assert torch.equal(back.trees["b"].draft_ids, trees["b"].draft_ids)


def test_a_rounds_q_that_does_not_match_its_trees_is_named() -> None:
    trees = {"a": _sparse(3, 8, 1), "b": _sparse(2, 8, 2)}
    msg = response_to_proto(RoundResponse(4, trees))
    tensor_into(msg.draft_probs, torch.rand(4, 8))  # a row short
    back = response_from_proto(msg)
    assert not back.trees and set(back.malformed) == {"a", "b"}
    assert "must both be [5, K]" in back.malformed["a"]
    msg = response_to_proto(RoundResponse(4, trees))
    tensor_into(msg.trees[1].draft_probs, trees["b"].draft_probs)  # its own beside the round's
    back = response_from_proto(msg)
    assert list(back.trees) == ["a"] and "a q of its own beside the round's" in back.malformed["b"]
    msg = response_to_proto(RoundResponse(4, trees))
    tensor_into(msg.draft_token_ids, torch.zeros(5, 8))  # float ids
    assert "int32 ids expected" in response_from_proto(msg).malformed["a"]
