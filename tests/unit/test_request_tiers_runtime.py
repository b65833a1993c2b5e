"""Per-request tiers and tier 0 in the runtime: what the session sends, what the drafter
drafts, what the wire carries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.rounds import DraftRounds, RoundError
from specpair.config import DraftConfig, ServerConfig
from specpair.proto.v1 import draft_pb2
from specpair.rpc.wire import (
    encode_request,
    read_round,
    request_from_proto,
    request_to_proto,
    stats_to_proto,
)
from specpair.runtime.build import build_drafter, build_states
from specpair.runtime.round_messages import (
    DraftInput,
    RoundRequest,
    RoundResponse,
    RoundStats,
    StageTimings,
)
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.features import LastRows
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE, chain

GREEDY = SamplingParams()


def seq(rid: str, prompt: list[int], first: int) -> TargetSequence:
    s = TargetSequence(rid, prompt, GREEDY, max_new_tokens=100)
    s.output.append(first)
    return s


def test_a_request_at_tier_zero_is_not_sent_and_catches_up_later() -> None:
    session = DraftSession(vocab_size=50)
    a, b = seq("a", [5, 6], 7), seq("b", [1], 2)
    session.add(a, torch.zeros(2, 4))
    session.add(b, torch.zeros(1, 4))
    first = session.request(1, [a, b], 3, steps=[3, 0])
    assert [i.request_id for i in first.inputs] == ["a"] and first.inputs[0].steps == 0
    drafts = session.drafts(first, RoundResponse(1, {"a": chain([1, 2, 3])}))
    assert drafts.aligned(["a", "b"]) == [chain([1, 2, 3]), EMPTY_TREE]
    b.append([4, 9])  # two plain rounds: b's draft falls behind
    a.append([8])
    second = session.request(2, [a, b], 3, features=True, steps=[1, 3])
    item_a, item_b = second.inputs
    assert (item_a.appended, item_a.steps) == ((8,), 1)  # its own tier on the wire
    assert (item_b.appended, item_b.steps) == ((1, 2, 4, 9), 0)  # all of b, the round's tier
    assert item_b.features is not None and len(item_b.features) == 1  # the prompt's row so far


def test_a_tree_deeper_than_its_request_tier_is_malformed() -> None:
    session = DraftSession(vocab_size=50)
    a = seq("a", [5], 7)
    session.add(a, None)
    request = session.request(1, [a], 3, steps=[1])
    drafts = session.drafts(request, RoundResponse(1, {"a": chain([1, 2])}))
    assert drafts.trees == [EMPTY_TREE] and drafts.fallbacks == ["malformed_tree"]


def test_last_rows_keep_what_no_round_read() -> None:
    rows = LastRows()
    rows.append(torch.tensor([[0.0], [1.0]]))
    assert rows.since(-1)[:, 0].tolist() == [0, 1]
    rows.append(torch.tensor([[2.0]]))  # read by no round (tier 0) ...
    rows.append(torch.tensor([[3.0], [4.0]]))  # ... nor this one
    assert rows.since(2)[:, 0].tolist() == [2, 3, 4]
    rows.append(torch.tensor([[5.0], [6.0]]))
    assert rows.since(6)[:, 0].tolist() == [6]  # a window's start, past the first kept row
    rows.append(torch.tensor([[7.0]]))
    with pytest.raises(ValueError, match="only the last round"):
        rows.since(6)  # before the first kept row


def test_drafter_drafts_each_request_to_its_own_depth(ckpts: dict[str, Path]) -> None:
    drafter = build_drafter(ckpts["draft"], target_path=None, max_requests=4, max_len=64)
    states = build_states([0, 3], drafter=drafter)
    sampled = SamplingParams(temperature=1.0, seed=3)
    inputs = [
        DraftInput("a", (5, 6, 7), GREEDY, steps=1),
        DraftInput("b", (8, 9), sampled),  # 0: the round's tier
        DraftInput("c", (1,), GREEDY, steps=2),
    ]
    trees = drafter.draft(inputs, states[3])
    assert [len(t) for t in trees] == [1, 3, 2]
    assert trees[1].draft_probs is not None and trees[1].draft_probs.shape[0] == 3
    assert drafter.last_times[0] > 0  # the extend, timed for RoundStats
    # Greedy chains are the prefix of the full tier's: the same draft, cut.
    full = build_drafter(ckpts["draft"], target_path=None, max_requests=4, max_len=64)
    alone = full.draft([DraftInput("a", (5, 6, 7), GREEDY)], build_states([3], drafter=full)[3])
    assert alone[0].tokens[:1] == trees[0].tokens
    # Tier 0: extend only, the cache follows and nothing is drafted.
    before = drafter.cache.lengths[drafter.requests["a"].slot]
    assert drafter.draft([DraftInput("a", (4, 2), GREEDY)], states[0]) == [chain(())]
    assert drafter.cache.lengths[drafter.requests["a"].slot] == before + 2
    with pytest.raises(ValueError, match="more than the round"):
        drafter.draft([DraftInput("a", (3,), GREEDY, steps=2)], states[0])


def test_draft_service_names_a_request_tier_above_the_rounds(ckpts: dict[str, Path]) -> None:
    rounds = DraftRounds(DraftConfig(ServerConfig("127.0.0.1:0"), ckpts["draft"]))
    request = RoundRequest(1, 1, (DraftInput("a", (5,), GREEDY, steps=3),))
    with pytest.raises(RoundError, match=r"inputs\[a\].speculative_num_steps 3"):
        rounds.draft("s", request)
    answer = rounds.run("s", read_round(encode_request(request)))
    assert "speculative_num_steps" in answer.message.error and rounds.active_requests == 0


def test_request_tiers_travel_on_the_wire() -> None:
    sent = RoundRequest(1, 7, (DraftInput("a", (5,), GREEDY, steps=2),))
    wire = draft_pb2.RoundRequest.FromString(request_to_proto(sent).SerializeToString())
    assert request_from_proto(wire).inputs[0].steps == 2
    stats = RoundStats(
        9, 7, 3, (2, 7), True, StageTimings(extend_ms=1.5), 1.0, ("a", "b"), (2, 7), ("c",)
    )
    msg = stats_to_proto(stats)
    assert list(msg.request_ids) == ["a", "b"] and list(msg.request_steps) == [2, 7]
    assert list(msg.plain_request_ids) == ["c"] and msg.timings.extend_ms == 1.5
