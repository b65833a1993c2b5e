"""The target's tier bookkeeping: commands checked on arrival, landing at the next round."""

from __future__ import annotations

import pytest

from specpair.metrics import ServiceMetrics
from specpair.tiers import RegimeSteps
from target_service.tiers import Tiers


@pytest.fixture
def tiers() -> Tiers:
    return Tiers([0, 1, 3, 7], 3, ServiceMetrics("target"))


def test_a_command_lands_at_the_next_round_only(tiers: Tiers) -> None:
    assert tiers.ask(7, "policy", {"a": 1}) == 3  # still 3 until a round starts
    assert tiers.of(["a", "b"]) == [3, 3]
    tiers.switch(1, {"a", "b"})
    assert tiers.of(["a", "b"]) == [1, 7]


def test_a_request_that_finished_before_the_command_landed_is_not_kept(tiers: Tiers) -> None:
    tiers.ask(3, "policy", {"gone": 1, "live": 7})
    tiers.forget("gone")  # finished between the controller's command and the next round
    tiers.switch(1, {"live"})
    assert tiers.own == {"live": 7}


def test_a_tier_that_is_not_a_candidate_is_refused_by_name(tiers: Tiers) -> None:
    with pytest.raises(ValueError, match=r"request_steps\[x\] 5 is not a candidate"):
        tiers.ask(3, "ops", {"x": 5})


def test_a_batch_runs_at_its_sampling_regimes_tier_where_set(tiers: Tiers) -> None:
    tiers.ask(3, "policy", {"a": 1}, RegimeSteps(greedy=3, sampled=0))
    tiers.switch(1, {"a", "b"})
    assert tiers.of(["a", "b"], sampled=False) == [1, 3]
    assert tiers.of(["a", "b"], sampled=True) == [1, 0]  # the request's own tier still wins
    tiers.ask(7, "pin")  # a command without regimes clears them: every batch at 7
    tiers.switch(2, {"a", "b"})
    assert tiers.of(["b"], sampled=True) == [7] and tiers.regimes is None


def test_a_regime_tier_that_is_not_a_candidate_is_refused_by_name(tiers: Tiers) -> None:
    with pytest.raises(ValueError, match="sampled_steps 5 is not a candidate"):
        tiers.ask(3, "policy", None, RegimeSteps(greedy=3, sampled=5))
    tiers.switch(1, set())
    assert tiers.regimes is None  # the refused command left nothing behind
