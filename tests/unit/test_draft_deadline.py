"""The draft's deadline follows its measured pace within a floor and a ceiling; a late replica's
bench grows with its strikes; a repeated event is logged once in a while; a tree larger than
the round is refused from its counts alone."""

from __future__ import annotations

import pytest

from specpair.logging import Repeats, bounded
from specpair.proto.v1 import draft_pb2
from specpair.rpc import wire
from target_service.drafts.draft_deadline import (
    MAX_BENCH_S,
    MIN_ROUNDS,
    RoundPace,
    bench_s,
    deadline,
)


def _pace(seconds: float, inputs: int, rounds: int = MIN_ROUNDS) -> RoundPace:
    pace = RoundPace()
    for _ in range(rounds):
        pace.add(seconds, inputs)
    return pace


def test_the_deadline_is_the_ceiling_until_the_pace_is_measured() -> None:
    assert deadline([_pace(0.02, 4, MIN_ROUNDS - 1)], 4, floor_s=0.5, ceiling_s=5.0) == 5.0
    assert deadline([_pace(0.02, 4)], 4, floor_s=0.5, ceiling_s=5.0) == 0.5  # 4 · 20 ms: floor


def test_the_deadline_follows_the_pace_and_the_batch_within_floor_and_ceiling() -> None:
    pace = _pace(0.4, 4)  # 0.1 s an input
    assert deadline([pace], 4, floor_s=0.5, ceiling_s=5.0) == pytest.approx(1.6)
    assert deadline([pace], 8, floor_s=0.5, ceiling_s=5.0) == pytest.approx(3.2)  # grown batch
    assert deadline([pace], 1, floor_s=0.5, ceiling_s=5.0) == pytest.approx(1.6)  # its rounds'
    assert deadline([pace], 64, floor_s=0.5, ceiling_s=5.0) == 5.0


def test_a_slow_replica_is_judged_by_the_fastest_live_one() -> None:
    slow, fast = _pace(4.5, 2), _pace(0.05, 2)
    assert deadline([slow], 2, floor_s=1.0, ceiling_s=5.0) == 5.0  # alone: only the ceiling
    assert deadline([slow, fast], 2, floor_s=1.0, ceiling_s=5.0) == 1.0


def test_a_high_percentile_not_the_worst_round_sets_it() -> None:
    pace = _pace(0.1, 1, rounds=100)
    pace.add(3.0, 1)  # one outlier in 101
    assert deadline([pace], 1, floor_s=0.1, ceiling_s=5.0) == pytest.approx(0.4)


def test_the_bench_doubles_from_the_reconnect_minimum_to_its_cap() -> None:
    assert [bench_s(n, 0.2) for n in (1, 2, 3)] == pytest.approx([0.2, 0.4, 0.8])
    assert bench_s(100, 0.2) == MAX_BENCH_S


def test_repeats_log_the_first_then_one_an_interval_with_the_count_left_out() -> None:
    now = [0.0]
    repeats = Repeats(10.0, clock=lambda: now[0])
    seen = []
    for t in range(25):
        now[0] = float(t)
        seen.append(repeats.due("draft error"))
    assert [(t, n) for t, n in enumerate(seen) if n is not None] == [(0, 0), (10, 9), (20, 9)]
    assert repeats.due("another") == 0  # each event its own


def test_an_oversized_tree_is_malformed_unread_and_errors_are_cut() -> None:
    msg = draft_pb2.RoundResponse(round_id=3, error="x" * 1_000_000)
    msg.trees.add(request_id="r0", token_ids=[5] * 100_000, parents=range(-1, 99_999))
    msg.trees.add(request_id="r1", token_ids=[5, 6], parents=[-1, 0])
    msg.trees.add(request_id="stranger", token_ids=[5], parents=[-1])
    response = wire.response_from_proto(msg, max_nodes=3, request_ids={"r0", "r1"})
    assert response.malformed == {
        "r0": "trees[r0]: 100000 nodes, more than the round's shape allows (3)"
    }
    assert list(response.trees) == ["r1"]  # a tree for a request not in the round: dropped
    assert response.error == bounded("x" * 1_000_000) and len(response.error) == 512
