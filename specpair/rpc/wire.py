"""Conversions between the wire messages (protos) and the round's typed messages.

Whole messages cross here: `encode_request` / `read_round` (a RoundRequest's wire bytes),
`request_to_proto` / `request_from_proto` (RoundRequest),
`response_to_proto` / `response_from_proto` (RoundResponse), `stats_to_proto` /
`stats_from_proto` (RoundStats), and the tiers of an ApplyTier (`apply_tier_to_proto` /
`apply_tier_from_proto`). Decoding names the field of anything malformed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from specpair.logging import bounded
from specpair.proto.v1 import common_pb2, draft_pb2, target_pb2
from specpair.rpc.wire_tensor import (
    DataSink,
    data_size,
    feature_rows_from_proto,
    feature_rows_into,
    float_tensor,
    tensor_from_proto,
    tensor_into,
)
from specpair.runtime.feature_ring import RingView
from specpair.runtime.feature_rows import quantize_rows
from specpair.runtime.round_messages import (
    DraftInput,
    RoundRequest,
    RoundResponse,
    RoundStats,
    StageTimings,
)
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape, tier_from_wire, tier_name
from specpair.runtime.tree import CandidateTree
from specpair.tier_estimate import RegimeSteps


def sampling_into(msg: common_pb2.SamplingParams, p: SamplingParams) -> None:
    msg.temperature, msg.top_p, msg.top_k, msg.min_p = p.temperature, p.top_p, p.top_k, p.min_p
    if p.seed is not None:
        msg.seed = p.seed


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (temperature, top_p, top_k, min_p)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
    )


# RoundRequest.feature_data's key (field 8, length-delimited): written by hand after the rest
# of the message, which protobuf reads as that field wherever it comes.
_FEATURE_DATA_KEY = bytes([draft_pb2.RoundRequest.FEATURE_DATA_FIELD_NUMBER << 3 | 2])


def encode_request(
    request: RoundRequest,
    fp8_features: bool = False,
    shared: Sequence[int | None] = (),
    *,
    inline: bool = False,
) -> bytes:
    """The RoundRequest's wire bytes. Its inputs' features go out as one run, `feature_data`,
    appended after the rest of the message: each row's bytes are copied once (into the
    result), where a message holding them would copy them into each input's Tensor and again
    in its serializer. E.g. 64 requests × 5 rows of EAGLE-3 features (7.9 MB): two copies, not
    four (`bench.wire_round`). `inline`: each input's bytes in its own Tensor.data, as
    `feature_data`'s readers also take them.

    `fp8_features`: EAGLE features as float8 scaled per row (`quantize_rows`). `shared[i]`:
    input i's features lie in the stream's feature ring from that row (`FeatureRing.put`),
    sent as a span instead of bytes."""
    data: DataSink = None if inline else []
    head = _request_message(request, fp8_features, shared, data).SerializeToString()
    if not data:
        return head
    size = sum(view.nbytes for view in data)
    return b"".join([head, _FEATURE_DATA_KEY, _varint(size), *data])


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint, low 7 bits first: 300 -> bytes [0xAC, 0x02]."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def request_to_proto(
    request: RoundRequest, fp8_features: bool = False, shared: Sequence[int | None] = ()
) -> draft_pb2.RoundRequest:
    """The message a draft parses from `encode_request`'s bytes."""
    return draft_pb2.RoundRequest.FromString(encode_request(request, fp8_features, shared))


def _request_message(
    request: RoundRequest, fp8_features: bool, shared: Sequence[int | None], data: DataSink
) -> draft_pb2.RoundRequest:
    """The message without `feature_data`: the inputs' feature bytes go to `data` (None:
    into each input's Tensor)."""
    msg = draft_pb2.RoundRequest(
        round_id=request.round_id,
        speculative_num_steps=request.speculative_num_steps,
        released_request_ids=request.released_request_ids,
        shape=tier_name(request.tier),
    )
    # input index -> (first row, rows) of its features in the ring
    spans = {
        i: (start, len(features))
        for i, start in enumerate(shared)
        if start is not None and (features := request.inputs[i].features) is not None
    }
    inputs = request.inputs
    if spans:
        inputs = tuple(
            replace(item, features=None) if i in spans else item for i, item in enumerate(inputs)
        )
    if fp8_features:
        inputs = _quantized(inputs)
    for i, item in enumerate(inputs):
        item_msg = msg.inputs.add()
        _draft_input_into(item_msg, item, fp8_features, data)
        if i in spans:
            item_msg.shared_features.start, item_msg.shared_features.rows = spans[i]
    return msg


def _quantized(inputs: tuple[DraftInput, ...]) -> tuple[DraftInput, ...]:
    """`inputs` with their features as host float8 rows, all quantized together: one device
    sync a round (their copy to the host), not one or two a request."""
    feats = {i: f for i, item in enumerate(inputs) if isinstance(f := item.features, Tensor)}
    rows = dict(zip(feats, quantize_rows(list(feats.values())), strict=True))
    return tuple(
        replace(item, features=rows[i]) if i in rows else item for i, item in enumerate(inputs)
    )


@dataclass(frozen=True, slots=True)
class WireRound:
    """A RoundRequest as a draft reads it (`read_round`): the message, and its inputs' feature
    bytes apart, a view of the bytes that arrived."""

    message: draft_pb2.RoundRequest
    feature_data: memoryview


def read_round(data: bytes) -> WireRound:
    """A RoundRequest's wire bytes, its `feature_data` taken out as a view, not parsed:
    protobuf would copy the run into the message and again at each read of the field (8
    prompts of 110 rows, 21.6 MB: 3.4 ms each on a dev CPU). The draft's Round deserializer.
    Raises ValueError, or protobuf's DecodeError, for bytes that are not a RoundRequest."""
    view = memoryview(data)
    keep: list[memoryview] = []
    run = view[:0]
    for number, wire_type, start, payload, end in _top_fields(view):
        if number == draft_pb2.RoundRequest.FEATURE_DATA_FIELD_NUMBER and wire_type == 2:
            run = view[payload:end]  # a field given twice: the last one, as protobuf reads it
        else:
            keep.append(view[start:end])
    if not run:
        return WireRound(draft_pb2.RoundRequest.FromString(data), run)
    return WireRound(draft_pb2.RoundRequest.FromString(b"".join(keep)), run)


def _top_fields(view: memoryview) -> Iterator[tuple[int, int, int, int, int]]:
    """A message's fields, not descended into: (number, wire type, start, payload, end)."""
    i = 0
    while i < len(view):
        key, payload = _varint_at(view, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            end = _varint_at(view, payload)[1]
        elif wire_type == 2:
            size, payload = _varint_at(view, payload)
            end = payload + size
        elif wire_type in (1, 5):
            end = payload + (8 if wire_type == 1 else 4)
        else:
            raise ValueError(f"byte {i}: wire type {wire_type} is not a RoundRequest field's")
        if number == 0 or end > len(view):
            raise ValueError(f"byte {i}: a field numbered 0 or running past the message")
        yield number, wire_type, i, payload, end
        i = end


def _varint_at(view: memoryview, i: int) -> tuple[int, int]:
    """The varint at byte i, and the byte after it."""
    value = shift = 0
    while i < len(view) and shift < 64:
        byte = view[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i
    raise ValueError(f"byte {i}: a varint runs past the message")


class MalformedRequestError(ValueError):
    """A RoundRequest with an input that cannot be decoded; the message names its field.
    `request` holds what can be: the round, its releases and each input's id (nothing else)."""

    def __init__(self, why: str, request: RoundRequest) -> None:
        super().__init__(why)
        self.request = request


def request_from_proto(
    msg: draft_pb2.RoundRequest,
    ring: RingView | None = None,
    feature_data: memoryview | None = None,
) -> RoundRequest:
    """Raises MalformedRequestError naming the malformed field (`inputs[r7].sampling.top_p:
    ...`, `shape: ...`). Features sent as spans of the stream's feature ring are read from
    `ring` (copied out: the target reuses the rows once this round is answered).
    `feature_data`: the run `read_round` took off the message (default the message's own)."""
    tree = None
    try:  # a ShapeError is a ValueError
        shape = tier_from_wire(msg.speculative_num_steps, msg.shape, "shape")
        tree = None if shape.is_chain else shape
        inputs = _with_shared(msg, _inputs_from_proto(msg, feature_data), ring)
    except ValueError as exc:
        ids = tuple(DraftInput(m.request_id, (), SamplingParams()) for m in msg.inputs)
        raise MalformedRequestError(str(exc), _request(msg, ids, tree)) from None
    return _request(msg, inputs, tree)


def _inputs_from_proto(
    msg: draft_pb2.RoundRequest, run: memoryview | None
) -> tuple[DraftInput, ...]:
    """The inputs; one whose features came without bytes reads them from `feature_data`
    (`run`), in the order of inputs (`encode_request`)."""
    run = memoryview(msg.feature_data) if run is None else run
    # one copy of the run for every input, whose rows are then views of it (not a copy each)
    own = memoryview(bytearray(run))
    taken = 0
    inputs = []
    for m in msg.inputs:
        data = None
        if run and m.HasField("features") and not m.features.data:
            size = data_size(m.features)  # < 0: the input's decode names what is wrong
            if taken + size > len(run):
                raise ValueError(
                    f"feature_data: {len(run)} bytes, too few for inputs[{m.request_id}]"
                    f".features (shape {list(m.features.shape)} from byte {taken})"
                )
            data = own[taken : taken + max(size, 0)]
            taken += max(size, 0)
        inputs.append(_draft_input_from_proto(m, data))
    if taken != len(run):
        raise ValueError(f"feature_data: {len(run) - taken} bytes left over after the features")
    return tuple(inputs)


def _with_shared(
    msg: draft_pb2.RoundRequest, inputs: tuple[DraftInput, ...], ring: RingView | None
) -> tuple[DraftInput, ...]:
    """`inputs` with the features their `shared_features` spans name, read in one copy."""
    shared = [i for i, m in enumerate(msg.inputs) if m.HasField("shared_features")]
    if not shared:
        return inputs
    fields = [f"inputs[{msg.inputs[i].request_id}].shared_features" for i in shared]
    if ring is None:
        raise ValueError(f"{fields[0]}: this stream has no feature ring")
    for i, field in zip(shared, fields, strict=True):
        if msg.inputs[i].HasField("features"):
            raise ValueError(f"{field}: sent beside features (one or the other)")
    spans = [
        (msg.inputs[i].shared_features.start, msg.inputs[i].shared_features.rows) for i in shared
    ]
    rows = dict(zip(shared, ring.take(spans, fields), strict=True))
    return tuple(
        replace(item, features=rows[i]) if i in rows else item for i, item in enumerate(inputs)
    )


def _request(
    msg: draft_pb2.RoundRequest, inputs: tuple[DraftInput, ...], shape: TreeShape | None
) -> RoundRequest:
    return RoundRequest(
        msg.round_id,
        msg.speculative_num_steps,
        inputs,
        tuple(msg.released_request_ids),
        shape,
    )


def response_to_proto(response: RoundResponse, round_q: bool = True) -> draft_pb2.RoundResponse:
    """`round_q`: a sampled round's q as the round's two tensors where it can (False: each
    tree its own, as a draft before them sent it; the decoder reads both)."""
    msg = draft_pb2.RoundResponse(
        round_id=response.round_id,
        error=response.error,
        refused=response.refused,
    )
    trees = response.trees.values()
    # one K for every tree: their q in one tensor each (per-tree, each tensor costs ~20 µs of
    # host time on either side: 2.6 ms a round at batch 64)
    ks = {_sparse_k(t) for t in trees}
    together = round_q and len(ks) == 1 and 0 not in ks
    for request_id, tree in response.trees.items():
        _tree_into(msg.trees.add(), request_id, tree, with_q=not together)
    if together:
        tensor_into(msg.draft_probs, torch.cat([t.draft_probs for t in trees]))  # type: ignore[misc]
        ids = torch.cat([t.draft_ids for t in trees])  # type: ignore[misc]
        tensor_into(msg.draft_token_ids, ids.to(torch.int32))
    timings_into(msg.timings, response.timings)
    return msg


def _sparse_k(tree: CandidateTree) -> int:
    """K of a sampled tree's sparse q; 0 for a greedy or dense one."""
    probs, ids = tree.draft_probs, tree.draft_ids
    if probs is None or ids is None or probs.dim() != 2 or probs.dtype != torch.float32:
        return 0
    return probs.shape[1]


def response_from_proto(
    msg: draft_pb2.RoundResponse,
    max_nodes: int | None = None,
    request_ids: Collection[str] | None = None,
) -> RoundResponse:
    """Never raises: a tree that cannot be decoded lands in `malformed` with why, so that it
    costs only its request's speculation. A peer's answer is bounded before any tree is
    decoded: a tree of more than `max_nodes` nodes (the round's shape) is malformed unread, a
    tree for a request not in `request_ids` (the round's) is dropped unread, and
    the error is cut to `bounded`'s length."""
    trees, malformed = {}, {}
    q, why_not = _round_q(msg)
    # each tree's rows of the round's q, as views made in one call a tensor (a slice a tree
    # cost ~4 µs each: half a millisecond at batch 64)
    nodes = [len(t.token_ids) for t in msg.trees]
    rows = zip(q[0].split(nodes), q[1].split(nodes), strict=True) if q is not None else None
    for t in msg.trees:
        own = next(rows) if rows is not None else None
        if request_ids is not None and t.request_id not in request_ids:
            continue
        if (why := why_not or _oversized(t, max_nodes)) is not None:
            malformed[t.request_id] = why
            continue
        try:
            trees[t.request_id] = _tree_from_proto(t, own)
        except ValueError as exc:
            malformed[t.request_id] = bounded(str(exc))
    return RoundResponse(
        msg.round_id,
        trees,
        timings_from_proto(msg.timings),
        bounded(msg.error),
        malformed,
        dict(msg.refused),
    )


_TIMINGS = tuple(f.name for f in fields(StageTimings))


def timings_into(msg: common_pb2.StageTimings, timings: StageTimings) -> None:
    for name in _TIMINGS:
        setattr(msg, name, getattr(timings, name))


def timings_from_proto(msg: common_pb2.StageTimings) -> StageTimings:
    return StageTimings(**{name: getattr(msg, name) for name in _TIMINGS})


def stats_to_proto(stats: RoundStats) -> target_pb2.RoundStats:
    msg = target_pb2.RoundStats(
        round_id=stats.round_id,
        speculative_num_steps=stats.speculative_num_steps,
        batch_size=stats.batch_size,
        accept_lengths=stats.accept_lengths,
        speculative=stats.speculative,
        unix_time=stats.unix_time,
        request_ids=stats.request_ids,
        request_steps=stats.request_steps,
        plain_request_ids=stats.plain_request_ids,
        sampled_requests=stats.sampled_requests,
        shape=tier_name(stats.tier),
        verify_rows=stats.verify_rows,
    )
    timings_into(msg.timings, stats.timings)
    return msg


def stats_from_proto(msg: target_pb2.RoundStats) -> RoundStats:
    """Raises ShapeError on a shape that is not one (the controller drops that round)."""
    shape = tier_from_wire(msg.speculative_num_steps, msg.shape, "shape")
    return RoundStats(
        round_id=msg.round_id,
        speculative_num_steps=msg.speculative_num_steps,
        batch_size=msg.batch_size,
        accept_lengths=tuple(msg.accept_lengths),
        speculative=msg.speculative,
        timings=timings_from_proto(msg.timings),
        unix_time=msg.unix_time,
        request_ids=tuple(msg.request_ids),
        request_steps=tuple(msg.request_steps),
        plain_request_ids=tuple(msg.plain_request_ids),
        sampled_requests=msg.sampled_requests,
        shape=None if shape.is_chain else shape,
        verify_rows=msg.verify_rows,
    )


def _draft_input_into(
    msg: draft_pb2.DraftInput, item: DraftInput, fp8: bool, data: DataSink = None
) -> None:
    msg.request_id = item.request_id
    msg.appended_token_ids.extend(item.appended)
    msg.speculative_num_steps = item.steps
    msg.continues = item.continues
    sampling_into(msg.sampling, item.sampling)
    if item.features is not None:
        feature_rows_into(msg.features, item.features, fp8, data)


def _draft_input_from_proto(
    msg: draft_pb2.DraftInput, data: memoryview | None = None
) -> DraftInput:
    """`data`: the features' bytes where they came in `feature_data` (default their own)."""
    features = None
    if msg.HasField("features"):
        field = f"inputs[{msg.request_id}].features"
        features = feature_rows_from_proto(msg.features, field, data)
    try:
        sampling = sampling_from_proto(msg.sampling)
    except ValueError as exc:  # it names only its own field
        raise ValueError(f"inputs[{msg.request_id}].sampling.{exc}") from None
    return DraftInput(
        msg.request_id,
        tuple(msg.appended_token_ids),
        sampling,
        features,
        msg.speculative_num_steps,
        msg.continues,
    )


def _tree_into(
    msg: draft_pb2.CandidateTree, request_id: str, tree: CandidateTree, with_q: bool = True
) -> None:
    msg.request_id = request_id
    msg.token_ids.extend(tree.tokens)
    msg.parents.extend(tree.parents)
    if not with_q:
        return
    if tree.draft_probs is not None:
        tensor_into(msg.draft_probs, tree.draft_probs)
    if tree.draft_ids is not None:
        tensor_into(msg.draft_token_ids, tree.draft_ids.to(torch.int32))


def _oversized(msg: draft_pb2.CandidateTree, max_nodes: int | None) -> str | None:
    """Why a tree is larger than a round allows, counted on the message (nothing decoded)."""
    n = max(len(msg.token_ids), len(msg.parents))
    if max_nodes is None or n <= max_nodes:
        return None
    where = f"trees[{bounded(msg.request_id)}]"
    return f"{where}: {n} nodes, more than the round's shape allows ({max_nodes})"


def _round_q(msg: draft_pb2.RoundResponse) -> tuple[tuple[Tensor, Tensor] | None, str | None]:
    """The round's q (probs, int64 ids) when it carries one, else None; or why it cannot be
    read (then every tree is malformed: none can be matched to its rows)."""
    if not (msg.HasField("draft_probs") or msg.HasField("draft_token_ids")):
        return None, None
    try:
        probs = float_tensor(msg.draft_probs, "draft_probs").float()
        ids = tensor_from_proto(msg.draft_token_ids, "draft_token_ids")
    except ValueError as exc:
        return None, bounded(str(exc))
    nodes = sum(len(t.token_ids) for t in msg.trees)
    if ids.dtype != torch.int32:
        return None, f"draft_token_ids: int32 ids expected, got {ids.dtype}"
    if probs.dim() != 2 or probs.shape != ids.shape or probs.shape[0] != nodes:
        return None, (
            f"draft_probs {list(probs.shape)} and draft_token_ids {list(ids.shape)} must both be "
            f"[{nodes}, K]: a row per node of the round's trees"
        )
    return (probs, ids.long()), None


def _tree_from_proto(
    msg: draft_pb2.CandidateTree, round_q: tuple[Tensor, Tensor] | None = None
) -> CandidateTree:
    """`round_q`: this tree's rows of the round's q (probs, int64 ids), when it has one."""
    probs = ids = None
    field = f"trees[{msg.request_id}]"
    if round_q is not None:
        if msg.HasField("draft_probs") or msg.HasField("draft_token_ids"):
            raise ValueError(f"{field}: a q of its own beside the round's")
        return CandidateTree(tuple(msg.token_ids), tuple(msg.parents), *round_q)
    if msg.HasField("draft_probs"):
        probs = float_tensor(msg.draft_probs, f"{field}.draft_probs").float()
    if msg.HasField("draft_token_ids"):
        ids = tensor_from_proto(msg.draft_token_ids, f"{field}.draft_token_ids")
        if ids.dtype != torch.int32:
            raise ValueError(f"{field}.draft_token_ids: int32 ids expected, got {ids.dtype}")
        ids = ids.long()
    return CandidateTree(tuple(msg.token_ids), tuple(msg.parents), probs, ids)


def apply_tier_to_proto(
    tier: TreeShape,
    reason: str,
    request_steps: Mapping[str, int] | None = None,
    regimes: RegimeSteps | None = None,
) -> target_pb2.ApplyTierRequest:
    """An ApplyTier command: each tier as its steps, with its shape string beside when a tree;
    per-request tiers are chains."""
    msg = target_pb2.ApplyTierRequest(
        speculative_num_steps=tier.steps,
        shape=tier_name(tier),
        reason=reason,
        request_steps=dict(request_steps or {}),
    )
    if regimes is not None:
        msg.greedy_steps, msg.greedy_shape = regimes.greedy.steps, tier_name(regimes.greedy)
        msg.sampled_steps, msg.sampled_shape = regimes.sampled.steps, tier_name(regimes.sampled)
    return msg


def apply_tier_from_proto(
    msg: target_pb2.ApplyTierRequest,
) -> tuple[TreeShape, dict[str, TreeShape], RegimeSteps | None]:
    """The batch tier, per-request tiers and per-regime tiers an ApplyTier names (a regime left
    unset takes the batch tier); raises ShapeError naming the field. Whether each one is a
    candidate is the target's check."""
    tier = tier_from_wire(msg.speculative_num_steps, msg.shape, "speculative_num_steps")
    own = {
        rid: tier_from_wire(steps, "", f"request_steps[{rid}]")
        for rid, steps in msg.request_steps.items()
    }
    regimes = None
    greedy, sampled = msg.HasField("greedy_steps"), msg.HasField("sampled_steps")
    if greedy or sampled or msg.greedy_shape or msg.sampled_shape:
        regimes = RegimeSteps(
            tier_from_wire(msg.greedy_steps, msg.greedy_shape, "greedy_steps")
            if greedy or msg.greedy_shape
            else tier,
            tier_from_wire(msg.sampled_steps, msg.sampled_shape, "sampled_steps")
            if sampled or msg.sampled_shape
            else tier,
        )
    return tier, own, regimes
