"""Per-request tiers: each request's own acceptance, one cost model, the batch's tokens/s."""

from __future__ import annotations

import pytest

from controller.policies.bands import PolicySpec
from controller.policies.goodput.cost import CostModel
from controller.policies.interface import PerRequestPolicy, RoundSample
from controller.policies.request_tiers import RequestTiers

OPTIONS = {"candidate_steps": [0, 1, 3, 7], "warmup_batches": 0, "update_interval": 1}


def timed(
    steps: int, accepts: dict[str, int], own: dict[str, int], plain: tuple[str, ...] = ()
) -> RoundSample:
    """A round like the docstring's: verify 25 ms, a fixed draft round trip of 8 ms, 2 ms per
    draft step (batch-wide), schedule 1 ms; a request below `steps` saves its share."""
    b = len(accepts) + len(plain)
    drafted = [own.get(r, steps) for r in accepts]
    draft_ms = 2.0 * sum(drafted) / b
    fixed = 8.0 * len(drafted) / b if drafted else 0.0
    return RoundSample(
        steps=steps,
        batch_size=b,
        accept_lengths=tuple(min(a, s) for a, s in zip(accepts.values(), drafted, strict=True)),
        total_ms=26.0 + fixed + draft_ms,
        verify_ms=25.0,
        draft_ms=draft_ms,
        schedule_ms=1.0,
        request_ids=tuple(accepts),
        request_steps=tuple(drafted),
        plain_request_ids=plain,
    )


def test_mixed_round_cost_worked_example() -> None:
    cost = CostModel(0.5)
    cost.observe(
        RoundSample(
            7, 4, (7, 7, 7, 7), total_ms=40.0, verify_ms=17.0, draft_ms=14.0, schedule_ms=1.0
        )
    )  # round trip 40 − 17 − 1 = 22 = fixed 8 + 7 steps of 2
    assert cost.mixed_round_ms([7, 7, 7, 7]) == 40.0
    assert cost.mixed_round_ms([7, 7, 1, 0]) == pytest.approx(40 - 8 / 4 - 2 * (28 - 15) / 4)
    assert cost.mixed_round_ms([0, 0, 0, 0]) == cost.round_ms(0, 4)


def test_an_easy_and_a_hard_request_get_their_own_tiers() -> None:
    policy = RequestTiers(OPTIONS, 3)
    assert isinstance(policy, PerRequestPolicy)
    for _ in range(40):
        steps, own = policy.current_steps, dict(policy.request_steps)
        live = ("code", "prose")
        drafted = {r: {"code": 7, "prose": 0}[r] for r in live if own.get(r, steps) > 0}
        plain = tuple(r for r in live if r not in drafted)
        policy.observe(timed(steps, drafted, own, plain) if drafted else timed(0, {}, {}, plain))
    assert policy.tier_of("code") >= 3
    assert policy.tier_of("prose") in (0, 1)
    assert policy.current_steps == policy.tier_of("code")
    assert policy.request_steps == {"prose": policy.tier_of("prose")}
    assert "per-request tiers" in policy.describe()
    # The prose request leaves: its estimate and its tier go with it.
    policy.observe(timed(policy.current_steps, {"code": 7}, {}))
    assert "prose" not in policy.request_steps and "prose" not in policy._models


def test_a_request_parked_at_tier_zero_is_probed() -> None:
    options = {**OPTIONS, "probe_interval": 5}
    policy = RequestTiers(options, 3)
    seen_positive = []
    for _ in range(60):
        steps, own = policy.current_steps, dict(policy.request_steps)
        prose_tier = own.get("prose", steps)
        drafted = {"code": 7} | ({"prose": 0} if prose_tier > 0 else {})
        plain = () if prose_tier > 0 else ("prose",)
        seen_positive.append(prose_tier > 0)
        policy.observe(timed(steps, drafted, own, plain))
    assert seen_positive[-30:].count(False) > 15  # mostly parked ...
    assert seen_positive[-30:].count(True) >= 2  # ... but tried now and then


def test_equal_requests_share_one_tier_and_no_map() -> None:
    policy = RequestTiers(OPTIONS, 3)
    for _ in range(30):
        steps = policy.current_steps
        policy.observe(timed(steps, {"a": 7, "b": 7}, dict(policy.request_steps)))
    assert policy.request_steps == {} and policy.current_steps == 7


def test_loads_as_a_policy_class_with_the_goodput_keys() -> None:
    spec = PolicySpec.from_mapping(
        {"kind": "controller.policies.request_tiers:RequestTiers", **OPTIONS}
    )
    assert spec.candidate_steps == (0, 1, 3, 7)
    assert isinstance(spec.build(3), RequestTiers)
    with pytest.raises(ValueError, match="unknown policy key"):
        PolicySpec.from_mapping(
            {"kind": "controller.policies.request_tiers:RequestTiers", "nope": 1}
        )


def test_a_mixed_round_teaches_the_uniform_costs() -> None:
    """The inverse of the worked example: the mixed round's time, seen as tier 7's."""
    cost = CostModel(1.0)
    mixed = RoundSample(
        7,
        4,
        (7, 7, 1),
        total_ms=40 - 2.0 - 6.5,
        verify_ms=17.0,
        draft_ms=7.5,
        schedule_ms=1.0,
        request_ids=("a", "b", "c"),
        request_steps=(7, 7, 1),
        plain_request_ids=("d",),
    )
    cost.observe(mixed)  # its requests' first round: a join round, not learnt
    assert cost.round_ms(7, 4) is None
    cost.observe(mixed)
    assert cost.round_ms(7, 4) == pytest.approx(40.0)
    assert cost.mixed_round_ms([7, 7, 1, 0]) == pytest.approx(mixed.total_ms)


def test_new_candidates_drop_the_tiers_they_lack() -> None:
    policy = RequestTiers(OPTIONS, 7)
    policy._own = {"a": 0, "b": 1}
    assert policy.reconfigure({"candidate_steps": [1, 3]})
    assert policy.current_steps == 3 and policy.request_steps == {"b": 1}
