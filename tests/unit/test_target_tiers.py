"""The target's tier bookkeeping: commands checked on arrival, landing at the next round."""

from __future__ import annotations

import pytest

from specpair.metrics import ServiceMetrics
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
