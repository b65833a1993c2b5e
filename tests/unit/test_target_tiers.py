"""The target's tier bookkeeping: commands checked on arrival, landing at the next round."""

from __future__ import annotations

import pytest

from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps
from target_service.batching.batch_tiers import Tiers

T = TreeShape
TREE = TreeShape(4, 4, 16)


@pytest.fixture
def tiers() -> Tiers:
    return Tiers([T(0), T(1), T(3), T(7), TREE], T(3), ServiceMetrics("target"))


def test_a_command_lands_at_the_next_round_only(tiers: Tiers) -> None:
    assert tiers.ask(T(7), "policy", {"a": T(1)}) == T(3)  # still 3 until a round starts
    assert tiers.of(["a", "b"]) == [T(3), T(3)]
    tiers.switch(1, {"a", "b"})
    assert tiers.of(["a", "b"]) == [T(1), T(7)]


def test_a_tree_shape_is_a_tier_like_a_chain(tiers: Tiers) -> None:
    tiers.ask(TREE, "pin", {"a": T(1)})
    tiers.switch(1, {"a", "b"})
    assert tiers.of(["a", "b"]) == [T(1), TREE]
    # the round runs at the largest (steps first): the tree, with "a" capped at depth 1
    assert max(tiers.of(["a", "b"])) == TREE and max([T(3), TREE, T(7)]) == T(7)
    with pytest.raises(ValueError, match=r"speculative_num_steps 4x4x8 is not a candidate"):
        tiers.ask(TreeShape(4, 4, 8), "ops")


def test_a_request_that_finished_before_the_command_landed_is_not_kept(tiers: Tiers) -> None:
    tiers.ask(T(3), "policy", {"gone": T(1), "live": T(7)})
    tiers.forget("gone")  # finished between the controller's command and the next round
    tiers.switch(1, {"live"})
    assert tiers.own == {"live": T(7)}


def test_a_tier_that_is_not_a_candidate_is_refused_by_name(tiers: Tiers) -> None:
    with pytest.raises(ValueError, match=r"request_steps\[x\] 5 is not a candidate"):
        tiers.ask(T(3), "ops", {"x": T(5)})


def test_a_batch_runs_at_its_sampling_regimes_tier_where_set(tiers: Tiers) -> None:
    tiers.ask(T(3), "policy", {"a": T(1)}, RegimeSteps(greedy=TREE, sampled=T(0)))
    tiers.switch(1, {"a", "b"})
    assert tiers.of(["a", "b"], sampled=False) == [T(1), TREE]
    assert tiers.of(["a", "b"], sampled=True) == [T(1), T(0)]  # the request's own tier wins
    tiers.ask(T(7), "pin")  # a command without regimes clears them: every batch at 7
    tiers.switch(2, {"a", "b"})
    assert tiers.of(["b"], sampled=True) == [T(7)] and tiers.regimes is None


def test_a_regime_tier_that_is_not_a_candidate_is_refused_by_name(tiers: Tiers) -> None:
    with pytest.raises(ValueError, match="sampled_steps 5 is not a candidate"):
        tiers.ask(T(3), "policy", None, RegimeSteps(greedy=T(3), sampled=T(5)))
    tiers.switch(1, set())
    assert tiers.regimes is None  # the refused command left nothing behind
