"""The goodput policy's models and decisions, pure: worked examples, the acceptance assumption
tested against simulated chains, tier 0 and its probes, the shared guards."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from controller.goodput import GoodputConfig, GoodputPolicy, parse_profile
from controller.goodput_model import AcceptanceModel, CostModel, _line_at, batch_bucket
from controller.interface import RoundSample


def chain_accepts(rng: random.Random, rates: list[float], steps: int, n: int) -> list[int]:
    """n requests at tier `steps`: position i passes with rates[i] (the last rate repeats)."""
    out = []
    for _ in range(n):
        a = 0
        while a < steps and rng.random() < rates[min(a, len(rates) - 1)]:
            a += 1
        out.append(a)
    return out


def timed(steps: int, accepts: list[int], total: float, verify: float, draft: float) -> RoundSample:
    # schedule 2 ms: the round trip is total − verify − 2.
    return RoundSample(steps, len(accepts), tuple(accepts), total, verify, draft, 2.0)


def test_acceptance_worked_example() -> None:
    model = AcceptanceModel(decay=0.0, prior=0.0)
    model.observe(3, [3, 1, 0])
    assert model.position_rates(3) == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert model.alpha == pytest.approx(4 / 6)
    # Unseen position 4 takes the pooled rate: 1 + 2/3 + 1/3 + 1/3 + 1/3·2/3.
    assert model.tokens_per_round(4) == pytest.approx(1 + 2 / 3 + 1 / 3 + 1 / 3 + 2 / 9)
    assert model.tokens_per_round(0) == 1.0


def test_geometric_acceptance_learnt_at_one_tier_predicts_the_others() -> None:
    # The assumption: with a constant per-position rate, tier 3's accept lengths predict the
    # mean tokens per round at tiers 1 and 7 (simulated) within 3 %.
    rng = random.Random(0)
    model = AcceptanceModel(decay=0.0)
    model.observe(3, chain_accepts(rng, [0.7], 3, 4000))
    assert model.alpha == pytest.approx(0.7, abs=0.02)
    for steps in (1, 7):
        simulated = 1 + sum(chain_accepts(rng, [0.7], steps, 20000)) / 20000
        assert model.tokens_per_round(steps) == pytest.approx(simulated, rel=0.03)
        assert model.tokens_per_round(steps) == pytest.approx(
            sum(0.7**k for k in range(steps + 1)), rel=0.03
        )


def test_falling_acceptance_is_exact_where_seen_and_pooled_beyond() -> None:
    # Rates 0.9, 0.5, 0.2 by position: tier 3 teaches each, so tier 1 and 2 are exact; beyond
    # position 3 the pooled rate (≈ 0.61 here) stands in and over-predicts tier 7 — the
    # limit of the assumption, corrected as soon as tier 7 is observed.
    rng = random.Random(1)
    rates = [0.9, 0.5, 0.2]
    model = AcceptanceModel(decay=0.0)
    model.observe(3, chain_accepts(rng, rates, 3, 6000))
    assert model.tokens_per_round(2) == pytest.approx(1 + 0.9 + 0.45, rel=0.02)
    true_7 = 1 + 0.9 + 0.45 + 0.09 + 0.018 + 0.0036 + 0.00072 + 0.000144
    assert model.tokens_per_round(7) > true_7 * 1.03
    model.observe(7, chain_accepts(rng, rates, 7, 6000))
    assert model.tokens_per_round(7) == pytest.approx(true_7, rel=0.05)


def test_acceptance_follows_a_phase_change_and_ignores_rounds_without_drafts() -> None:
    model = AcceptanceModel(decay=0.1)
    for _ in range(50):
        model.observe(3, [3])
    high = model.tokens_per_round(3)
    assert high > 3.5
    model.observe(0, [])
    model.observe(3, [])
    assert model.tokens_per_round(3) == high
    for _ in range(30):
        model.observe(3, [0])
    assert model.tokens_per_round(3) < 1.2


def test_cost_model_worked_example() -> None:
    # T(3) = 30 with verify 18, schedule 2: round trip 10 = fixed 4 + 3 steps · 2 ms.
    cost = CostModel(alpha=0.5)
    assert cost.round_ms(3, 1) is None
    cost.observe(timed(3, [2], total=30, verify=18, draft=6))
    assert cost.round_ms(3, 1) == pytest.approx(30)
    assert cost.round_ms(0, 1) == pytest.approx(20)
    assert cost.round_ms(7, 1) == pytest.approx(38)
    assert cost.round_ms(1, 1) == pytest.approx(26)
    # A second batch bucket borrows the nearest measured one until it is measured itself.
    assert cost.round_ms(3, 16) == pytest.approx(30)
    cost.observe(timed(3, [1] * 16, total=60, verify=40, draft=12))
    assert cost.round_ms(3, 20) == pytest.approx(60) and cost.round_ms(3, 1) == pytest.approx(30)
    assert cost.measured_rounds(3, 16) == 1 and cost.measured_rounds(0, 16) == 0


def test_cost_model_measured_tiers_win_and_verify_becomes_a_line() -> None:
    cost = CostModel(alpha=1.0)
    cost.observe(timed(1, [1], total=20, verify=10, draft=2))  # fixed 6, step 2
    cost.observe(timed(3, [1], total=28, verify=14, draft=6))  # fixed 6, step 2
    cost.observe(RoundSample(0, 1, (), 13.0, 11.0, 0.0, 2.0))  # a round without drafts
    assert cost.round_ms(0, 1) == pytest.approx(13)
    # From tier 3: verify line through (0, 11), (1, 10), (3, 14) at 7 → 19.36.
    line = _line_at({0: 11.0, 1: 10.0, 3: 14.0}, 7)
    assert cost.round_ms(7, 1) == pytest.approx(28 + (line - 14) + 4 * 2)
    assert _line_at({1: 10.0, 3: 14.0}, 7) == pytest.approx(22)


def test_cost_model_profile_seeds_and_spikes_are_clipped() -> None:
    cost = CostModel(alpha=0.5, profile_ms=parse_profile({"1": {"0": 20, "3": 30}}))
    assert cost.round_ms(0, 1) == 20 and cost.round_ms(3, 1) == 30
    assert cost.measured_rounds(3, 1) == 0
    for _ in range(4):
        cost.observe(timed(3, [1], total=30, verify=18, draft=6))
    cost.observe(timed(3, [1], total=300, verify=18, draft=6))  # a prefill rode along
    assert cost.round_ms(3, 1) == pytest.approx(45)  # 0.5·30 + 0.5·min(300, 60)


def test_batch_buckets() -> None:
    assert [batch_bucket(b) for b in (0, 1, 2, 3, 4, 7, 8, 64, 100)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        8,
        64,
        64,
    ]


def test_docstring_example_picks_tier_1() -> None:
    # α = 0.6 at every position; T = 20, 22, 30, 38 ms at tiers 0, 1, 3, 7 (profiled).
    profile = {"1": {"0": 20, "1": 22, "3": 30, "7": 38}}
    cfg = GoodputConfig(candidate_steps=(0, 1, 3, 7), profile_ms=profile)  # type: ignore[arg-type]
    policy = GoodputPolicy(cfg, 3)
    policy.acceptance = AcceptanceModel(decay=0.0, prior=1e9, prior_alpha=0.6)
    rates = {e.steps: e.tokens_per_s for e in policy.estimates()}
    assert rates == pytest.approx({0: 50.0, 1: 72.73, 3: 72.53, 7: 64.7}, abs=0.05)


def run(policy: GoodputPolicy, rounds: int, make: object) -> list[int]:
    """Feeds `rounds` rounds built by make(tier) and returns the tier after each."""
    tiers = []
    for _ in range(rounds):
        policy.observe(make(policy.current_steps))  # type: ignore[operator]
        tiers.append(policy.current_steps)
    return tiers


def cpu_round(accept: int) -> object:
    """A round on a machine where verify costs 10 ms and a draft step 3 ms (+ 2 fixed)."""

    def make(steps: int) -> RoundSample:
        if steps == 0:
            return RoundSample(0, 1, (), 12.0, 10.0, 0.0, 2.0)
        return timed(steps, [min(accept, steps)], 14.0 + 3 * steps, 10.0, 3.0 * steps)

    return make


def test_all_accepted_moves_up_after_warmup_and_interval() -> None:
    cfg = GoodputConfig(candidate_steps=(0, 1, 3, 7), warmup_batches=10, update_interval=5)
    policy = GoodputPolicy(cfg, 3)
    tiers = run(policy, 15, cpu_round(accept=7))
    # Rounds 1–14 cannot decide (the gate the sglang kind shares); round 15 does: at α → 1,
    # 8 tokens / 35 ms beats 4 / 23.
    assert tiers[:14] == [3] * 14 and tiers[14] == 7


def test_nothing_accepted_turns_speculation_off_then_probes() -> None:
    cfg = GoodputConfig(
        candidate_steps=(0, 1, 3, 7), warmup_batches=0, update_interval=1, probe_interval=20,
        probe_rounds=4,
    )  # fmt: skip
    policy = GoodputPolicy(cfg, 3)
    tiers = run(policy, 3, cpu_round(accept=0))
    assert tiers[-1] == 0  # 1 token / 12 ms (T(0) predicted) beats 1.0x / 17+ ms
    tiers = run(policy, 40, cpu_round(accept=0))
    # A probe of tier 1 after 20 rounds at 0, four rounds with drafts, back to 0.
    first = tiers.index(1)
    assert 15 <= first <= 21 and tiers[first : first + 4] == [1] * 4
    assert tiers[first + 4] == 0
    # When drafts became good meanwhile, the probe finds it and speculation resumes.
    tiers = run(policy, 60, cpu_round(accept=7))
    assert tiers[-1] == 7


def test_min_gain_hysteresis() -> None:
    # Tier 1 vs 3 at α = 0.6 predicts +0.3 %: below a 3 % margin nothing moves; with 0 % it does.
    profile = {"1": {"0": 20, "1": 22, "3": 30, "7": 38}}
    for gain, expected in ((0.03, 3), (0.0, 1)):
        cfg = GoodputConfig(
            candidate_steps=(1, 3, 7), warmup_batches=0, update_interval=1, min_gain=gain,
            profile_ms=profile,  # type: ignore[arg-type]
        )  # fmt: skip
        policy = GoodputPolicy(cfg, 3)
        policy.acceptance = AcceptanceModel(decay=0.0, prior=1e9, prior_alpha=0.6)
        policy.observe(RoundSample(3, 1, (1,), 0.0))  # no timings: the profile stands
        assert policy.current_steps == expected


def test_without_a_cost_the_tier_stays() -> None:
    policy = GoodputPolicy(GoodputConfig(warmup_batches=0, update_interval=1), 3)
    assert policy.observe(RoundSample(3, 1, (3,))) is False
    assert policy.current_steps == 3 and policy.estimates() == ()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"candidate_steps": [-1, 1]}, "candidate_steps must be ints >= 0"),
        ({"candidate_steps": []}, "needs at least one tier"),
        ({"min_gain": -0.1}, "min_gain must be >= 0"),
        ({"probe_interval": 0}, "probe_interval must be an int >= 1"),
        ({"probe_rounds": 1.5}, "probe_rounds must be an int >= 1"),
        ({"profile_ms": {"1": 20}}, "profile_ms must map batch size"),
        ({"profile_ms": {"0": {"1": 20}}}, "needs batch >= 1"),
        ({"profile_ms": {"1": {"x": 20}}}, "is not"),
        ({"ema_alpha": 0}, r"ema_alpha must be in \(0, 1\]"),
        ({"down_hysteresis": 0.1}, "unknown policy key.*down_hysteresis"),
    ],
)
def test_config_validation_names_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GoodputConfig.from_mapping(values)


def test_config_round_trips_through_json_shape() -> None:
    cfg = GoodputConfig.from_mapping(
        {"candidate_steps": [7, 0, 1], "profile_ms": {"16": {"0": 30.5}, "1": {"3": 9}}}
    )
    assert cfg.candidate_steps == (0, 1, 7)
    assert cfg.profile_ms == ((1, 3, 9.0), (16, 0, 30.5))
    assert cfg.to_dict()["profile_ms"] == {"1": {"3": 9.0}, "16": {"0": 30.5}}
    assert GoodputConfig.from_mapping(cfg.to_dict()) == cfg
    assert cfg.replace_partial(min_gain=0.1).profile_ms == cfg.profile_ms


def test_the_schedule_follows_the_tokens_a_tier_gives() -> None:
    """The docstring's CPU measurement at batch 16: tier 3 rounds of 174 ms, 38.5 of them
    admission and streaming for 45 tokens; tier 0 gives 16 tokens a round, so it schedules less."""
    cost = CostModel(1.0)
    accepts = (2,) * 13 + (1,) * 3  # 29 accepted drafts + 16 bonus tokens
    sample = RoundSample(3, 16, accepts, total_ms=174.0, verify_ms=31.0, draft_ms=102.0,
                         schedule_ms=38.5)  # fmt: skip
    cost.observe(sample)
    e = {0: 1.0, 3: 45 / 16}.__getitem__
    assert cost.round_ms(0, 16) == pytest.approx(174 - 2.5 - 102)  # without acceptance
    assert cost.round_ms(0, 16, e) == pytest.approx(69.5 - 38.5 / 45 * 16 * (45 / 16 - 1))
    assert cost.round_ms(3, 16, e) == 174.0  # measured stays measured


def test_a_round_that_admitted_a_request_does_not_set_a_tiers_cost() -> None:
    """The first round of a request carries its prefill (admit_ms) and the draft's extend of
    its prompt: it must not set T(3), from which T(0) is predicted (an H100 run predicted
    T(0) = 0.2 ms that way and parked at tier 0)."""
    cost = CostModel(alpha=0.5)
    first = replace(timed(3, [0], total=58, verify=6.5, draft=14), admit_ms=34)
    cost.observe(first)
    assert cost.round_ms(3, 1) is None  # nothing learnt from it
    for _ in range(3):
        cost.observe(timed(3, [2], total=11.3, verify=6.4, draft=4))
    assert cost.round_ms(3, 1) == pytest.approx(11.3)
    cost.observe(replace(timed(3, [2], total=40, verify=6.4, draft=4), admit_ms=28.7))
    assert cost.round_ms(3, 1) == pytest.approx(11.3)  # from then on: the total less admission
    assert 5.0 < (cost.round_ms(0, 1) or 0.0) < 11.3
