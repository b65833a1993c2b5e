"""The adaptive policy as a pure object: snapping, EMA, gates, tier moves, config validation."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest

from controller.policies.goodput.acceptance import AcceptanceModel
from controller.policies.interface import RoundSample
from controller.policies.sglang import AdaptiveSpeculativeParams, PolicyConfig, snap_to_candidate
from controller.service.server import load_policy

# α = 1 makes the EMA equal to the last batch mean exactly, so thresholds can be hit exactly;
# SGLang's count (no expected tail), whose arithmetic these tests check.
FAST = PolicyConfig(ema_alpha=1.0, warmup_batches=0, update_interval=1, expect_tail=False)


@pytest.mark.parametrize(
    ("initial", "snapped"), [(0, 1), (1, 1), (2, 3), (3, 3), (4, 3), (5, 7), (6, 7), (100, 7)]
)
def test_initial_steps_snap_to_nearest_candidate_ties_to_larger(initial: int, snapped: int) -> None:
    assert snap_to_candidate(initial, (1, 3, 7)) == snapped
    policy = AdaptiveSpeculativeParams(PolicyConfig(), initial)
    assert policy.current_steps == snapped
    assert policy.ema == snapped - 1  # neutral start
    assert policy.count == 0


def test_ema_arithmetic() -> None:
    policy = AdaptiveSpeculativeParams(PolicyConfig(expect_tail=False), 3)  # ema 2.0
    policy.update([4, 2])  # mean 3: 0.8·2.0 + 0.2·3 = 2.2
    assert policy.ema == pytest.approx(2.2)
    policy.update([0])  # 0.8·2.2 = 1.76
    assert policy.ema == pytest.approx(1.76)
    policy.update([1, 2, 3, 6])  # mean 3: 0.8·1.76 + 0.6 = 2.008
    assert policy.ema == pytest.approx(2.008)
    assert policy.count == 3


def chains(alpha: float, steps: int, batch: int, rng: random.Random) -> list[int]:
    """A round's accept lengths: each draft accepted with probability `alpha` given the one
    before it, a chain stopping at its first rejection or at `steps`."""

    def one() -> int:
        a = 0
        while a < steps and rng.random() < alpha:
            a += 1
        return a

    return [one() for _ in range(batch)]


def tiers_run(config: PolicyConfig, alpha: float, start: int, rounds: int = 400) -> list[int]:
    """The tier of each of `rounds` rounds of 8 requests, each drafted at the tier the policy
    chose last (a served batch's loop)."""
    rng, policy, seen = random.Random(5), AdaptiveSpeculativeParams(config, start), []
    for _ in range(rounds):
        seen.append(policy.current_steps)
        policy.update(chains(alpha, policy.current_steps, 8, rng))
    return seen


def test_the_expected_tail_lifts_a_good_pair_out_of_a_low_tier() -> None:
    # Acceptance 0.82 a draft accepts 2.05 of 3 and 3.43 of 7. SGLang's count at 3 never passes
    # its up-threshold 2.5; the tail counted at 3 reads 3.43, and the policy goes to 7 and stays
    # (its down-threshold there is 2.25).
    sglang = tiers_run(PolicyConfig(expect_tail=False), 0.82, 3)
    assert set(sglang) == {3}
    tail = tiers_run(PolicyConfig(), 0.82, 3)
    assert tail[15:] == [7] * (len(tail) - 15)  # the first decision, after warm-up, and on


def test_the_expected_tail_still_leaves_a_tier_a_weak_pair_cannot_fill() -> None:
    # Acceptance 0.4: 0.65 of 7, at or under the threshold down from 7 (2.25) with either count.
    for config in (PolicyConfig(), PolicyConfig(expect_tail=False)):
        seen = tiers_run(config, 0.4, 7)
        assert seen[15:] == [3] * (len(seen) - 15)


# Round times at batch 1 (H200, T 0.7, up, 2026-11-29): (total, verify, draft) ms a round by
# tier, the draft's share proportional to its steps; and the same round where drafting is dear
# (a draft whose every step costs as much as the target's verify).
CHEAP_DRAFTS = {1: (7.5, 5.1, 0.6), 3: (8.4, 5.2, 1.3), 7: (10.4, 5.6, 3.0)}
DEAR_DRAFTS = {1: (9.0, 5.0, 3.5), 3: (16.0, 5.0, 10.5), 7: (30.0, 5.0, 24.5)}


def timed_run(
    config: PolicyConfig,
    alpha: float,
    start: int,
    times: dict[int, tuple[float, float, float]],
    policy: AdaptiveSpeculativeParams | None = None,
) -> list[int]:
    """`tiers_run` at batch 1, each round reporting its tier's time from `times`."""
    rng, seen = random.Random(7), []
    policy = policy or AdaptiveSpeculativeParams(config, start)
    for _ in range(600):
        steps = policy.current_steps
        total, verify, draft = times[steps]
        seen.append(steps)
        sample = RoundSample(
            steps=steps,
            batch_size=1,
            accept_lengths=tuple(chains(alpha, steps, 1, rng)),
            total_ms=total,
            verify_ms=verify,
            draft_ms=draft,
        )
        policy.observe(sample)
    return seen


def test_the_cost_guard_keeps_a_tier_whose_drafts_pay_where_the_thresholds_leave_it() -> None:
    # Acceptance 0.74 a draft accepts ~2.5 of 7 (T 0.7 on code): at batch 1 the EMA crosses
    # the threshold down from 7 (2.25) again and again; tier 3 would give 2.7 tokens in 8.4 ms
    # against 7's 3.5 in 10.4, so the guard keeps 7 where SGLang's thresholds leave it.
    sglang = timed_run(PolicyConfig(cost_guard=False), 0.74, 7, CHEAP_DRAFTS)
    policy = AdaptiveSpeculativeParams(PolicyConfig(), 7)
    guarded = timed_run(policy.config, 0.74, 7, CHEAP_DRAFTS, policy)
    assert sglang.count(7) < 0.75 * len(sglang)
    assert guarded.count(7) > 0.95 * len(guarded)
    # what the operator's `ctl status` shows: the move refused, the rates it was refused on
    refused = re.search(
        r"last refused 7 → (\d): ([\d.]+) against ([\d.]+) tokens/ms", policy.describe()
    )
    assert refused is not None, policy.describe()
    assert float(refused[2]) < float(refused[3])
    # and `ctl status`'s table: each chain predicted at batch 1, tier 7's time its own
    estimates = {e.steps: e for e in policy.estimates()}
    assert set(estimates) == {1, 3, 7} and estimates[7].observed_rounds > 0
    assert estimates[7].round_ms == pytest.approx(10.4, rel=0.05)
    assert estimates[7].tokens_per_s > estimates[3].tokens_per_s > estimates[1].tokens_per_s
    assert AdaptiveSpeculativeParams(PolicyConfig(cost_guard=False), 7).estimates() == ()


def test_the_cost_guards_round_times_follow_a_live_ema_alpha() -> None:
    # `ctl policy ema_alpha=1` mid-run: the next round's time replaces tier 7's estimate, as
    # the next batch replaces the EMA (at 0.2 it would move 10 → 12 ms, not to 20).
    policy = AdaptiveSpeculativeParams(PolicyConfig(ema_alpha=0.2), 7)

    def round_of(total_ms: float) -> RoundSample:
        return RoundSample(7, 1, (4,), total_ms=total_ms, verify_ms=5.0, draft_ms=2.0)

    for _ in range(20):
        policy.observe(round_of(10.0))
    policy.reconfigure(replace(policy.config, ema_alpha=1.0))
    policy.observe(round_of(20.0))
    estimates = {e.steps: e for e in policy.estimates()}
    assert estimates[7].round_ms == pytest.approx(20.0)


def test_the_cost_guard_lets_a_weak_pair_leave_the_top_tier() -> None:
    # Acceptance 0.4: 1.7 tokens at 7 in 10.4 ms, 1.6 at 3 in ~8.7: the move down gains.
    seen = timed_run(PolicyConfig(), 0.4, 7, CHEAP_DRAFTS)
    assert set(seen[-300:]) <= {1, 3}
    assert seen.count(7) < 30


def test_the_cost_guard_refuses_a_move_up_that_dear_drafts_make_lose() -> None:
    # Acceptance 0.82 reads 3.4 of 7 from tier 3 (over the threshold up, 2.5), but 7's round
    # would take 30 ms against 3's 16 for 4.4 tokens against 3.0: the guard stays at 3.
    sglang = timed_run(PolicyConfig(cost_guard=False), 0.82, 3, DEAR_DRAFTS)
    assert sglang.count(7) > 0.5 * len(sglang)
    assert set(timed_run(PolicyConfig(), 0.82, 3, DEAR_DRAFTS)) == {3}


def test_the_draft_acceptance_is_estimated_through_censored_rounds() -> None:
    # At tier 1 a round shows one draft at most; the estimate still finds 0.82. (A warm-up
    # longer than the run keeps the tier at 1.)
    rng, config = random.Random(3), PolicyConfig(ema_alpha=0.01, warmup_batches=1_000_000)
    policy = AdaptiveSpeculativeParams(config, 1)
    for _ in range(3000):
        lengths = tuple(chains(0.82, 1, 8, rng))
        policy.observe(RoundSample(steps=1, batch_size=8, accept_lengths=lengths))
    assert policy.current_steps == 1
    assert policy.draft_acceptance == pytest.approx(0.82, abs=0.03)
    tail = sum(0.82**k for k in range(1, 7))  # positions 2-7 past a full chain of 1
    assert policy.ema == pytest.approx(0.82 + 0.82 * tail, abs=0.2)


def test_at_the_largest_tier_the_count_is_sglangs() -> None:
    rng = random.Random(9)
    plain = AdaptiveSpeculativeParams(PolicyConfig(expect_tail=False), 7)
    tail = AdaptiveSpeculativeParams(PolicyConfig(), 7)
    for _ in range(14):  # warm-up and an interval: no decision yet
        batch = chains(0.6, 7, 8, rng)
        plain.update(batch)
        tail.update(batch)
    assert tail.ema == plain.ema and tail.draft_acceptance is not None


def test_only_a_full_chain_below_the_top_counts_a_tail() -> None:
    config = PolicyConfig(ema_alpha=1.0, warmup_batches=1_000_000)
    policy = AdaptiveSpeculativeParams(config, 3)
    policy.update([1, 1], [1, 1])  # alpha from these: 2 passed of 2 tried, with the prior
    policy.update([0, 2, 7], [0, 3, 7])  # none drafted, stopped at 2 of 3, all 7 of the top
    assert policy.ema == pytest.approx((0 + 2 + 7) / 3)


def test_the_tail_past_a_full_chain_worked_example() -> None:
    model = AcceptanceModel(0.01, prior=0.0)
    model.observe(3, [3, 3, 2, 3, 0])  # tried 5 + 4 + 4 = 13 positions, passed 4 + 4 + 3 = 11
    a = 11 / 13
    assert model.alpha == pytest.approx(a)
    assert model.pooled_tail(4) == pytest.approx(a + a**2 + a**3 + a**4)  # 3 of 7: 4 more
    assert model.pooled_tail(0) == 0.0
    model = AcceptanceModel(0.01, prior=0.0)
    model.observe(1, [1] * 41 + [0] * 9)
    assert model.pooled_tail(4) == pytest.approx(2.50, abs=0.01)  # α 0.82, the docstring's


def test_empty_batch_is_ignored_and_not_counted() -> None:
    policy = AdaptiveSpeculativeParams(FAST, 3)
    assert policy.update([]) is False
    assert (policy.ema, policy.count, policy.current_steps) == (2.0, 0, 3)


def test_negative_accept_lengths_are_rejected() -> None:
    policy = AdaptiveSpeculativeParams(FAST, 3)
    with pytest.raises(ValueError, match="accept_lengths"):
        policy.update([1, -1])
    assert policy.count == 0


def test_defaults_first_decision_after_warmup_and_one_interval() -> None:
    # warmup 10, interval 5: batches 1..14 never decide, batch 15 does.
    policy = AdaptiveSpeculativeParams(PolicyConfig(), 3)
    for _ in range(14):
        assert policy.update([6]) is False
    assert policy.current_steps == 3
    assert policy.ema > 2.5  # above the up threshold for a while already
    assert policy.update([6]) is True  # ema = 6 − 4·0.8¹⁵ ≈ 5.86
    assert policy.current_steps == 7
    assert policy.count == 15


def test_warmup_gate() -> None:
    policy = AdaptiveSpeculativeParams(PolicyConfig(warmup_batches=3, update_interval=1), 3)
    # count ≤ warmup: no decision even though ema (3.0, 3.8, 4.44) is past 2.5.
    assert [policy.update([7]) for _ in range(3)] == [False, False, False]
    assert policy.current_steps == 3
    assert policy.update([7]) is True  # count 4: ema 4.952 → up to 7
    assert policy.current_steps == 7


def test_interval_gate() -> None:
    # warmup 2, interval 3: decisions only at counts 5, 8, 11, …
    policy = AdaptiveSpeculativeParams(PolicyConfig(warmup_batches=2, update_interval=3), 3)
    results = [policy.update([7]) for _ in range(5)]
    assert results == [False, False, False, False, True]
    assert policy.current_steps == 7
    # Now the EMA collapses, but the next decision waits until count 8.
    results = [policy.update([0]) for _ in range(3)]
    assert results[:2] == [False, False]
    assert policy.count == 8
    # ema after 5 × [7] then 3 × [0]: (7 − 5·0.8⁵)·0.8³ ≈ 2.745 > 2.25: 7 stays at count 8.
    assert results[2] is False and policy.current_steps == 7


def test_multi_tier_jump_down_7_to_1_in_one_decision() -> None:
    policy = AdaptiveSpeculativeParams(FAST, 7)
    # ema 0: ≤ 3 − 0.5 − 0.25 = 2.25 → 3, then ≤ 1 − 0.75 = 0.25 → 1.
    assert policy.update([0, 0]) is True
    assert policy.current_steps == 1


def test_multi_tier_jump_up_1_to_7_in_one_decision() -> None:
    policy = AdaptiveSpeculativeParams(FAST, 1)
    # ema 7: > 1 − 0.5 → 3, then > 3 − 0.5 → 7.
    assert policy.update([7]) is True
    assert policy.current_steps == 7


@pytest.mark.parametrize(
    ("start", "batch", "expected"),
    [
        # At 3, down threshold 1 − 0.5 − 0.25 = 0.25 (≤ moves): exactly 0.25 moves down.
        (3, [0, 0, 0, 1], 1),
        (3, [0, 1], 3),  # 0.5 stays
        # At 3, up threshold 3 − 0.5 + 0 = 2.5 (> moves): exactly 2.5 stays.
        (3, [2, 3], 3),
        (3, [2, 3, 3, 3], 7),  # 2.75 moves up
        # At 7, down threshold 3 − 0.75 = 2.25: exactly 2.25 moves to 3 (and not further).
        (7, [2, 2, 2, 3], 3),
        (7, [2, 3], 7),  # 2.5 stays
        # At 1, up threshold 0.5: exactly 0.5 stays, 0.75 moves to 3 (2.5 not passed).
        (1, [0, 1], 1),
        (1, [0, 1, 1, 1], 3),
    ],
)
def test_hysteresis_boundaries(start: int, batch: list[int], expected: int) -> None:
    policy = AdaptiveSpeculativeParams(FAST, start)
    assert policy.update(batch) is (expected != start)
    assert policy.current_steps == expected


def test_custom_hysteresis_shifts_thresholds() -> None:
    cfg = FAST.replace_partial(up_hysteresis=0.5)
    policy = AdaptiveSpeculativeParams(cfg, 3)
    assert policy.update([3]) is False  # 3.0 is not > 3 − 0.5 + 0.5
    assert policy.update([3, 4]) is True  # 3.5 is
    assert policy.current_steps == 7
    cfg = cfg.replace_partial(down_hysteresis=0.5, up_hysteresis=0.6)
    policy = AdaptiveSpeculativeParams(cfg, 3)
    assert policy.update([1]) is True  # 1.0 ≤ 1 − 0.5 + 0.5; and not > 1 − 0.5 + 0.6
    assert policy.current_steps == 1


def test_up_pass_runs_after_a_down_move() -> None:
    # down_hysteresis > up_hysteresis overlaps the bands: at 3 with ema 1.0 the down pass goes
    # to 1 (1.0 ≤ 1.0), then the up pass goes back to 3 (1.0 > 0.5). Newer SGLang skips the up
    # pass after a down move; we follow SGLang's original rule, which does not.
    cfg = PolicyConfig(ema_alpha=1.0, warmup_batches=0, update_interval=1, down_hysteresis=0.5)
    policy = AdaptiveSpeculativeParams(cfg, 3)
    assert policy.update([1]) is False
    assert policy.current_steps == 3


def test_reconfigure_keeps_ema_and_count_and_snaps_tier() -> None:
    policy = AdaptiveSpeculativeParams(PolicyConfig(), 7)
    policy.update([5])  # ema 0.8·6 + 1 = 5.8
    assert policy.reconfigure(PolicyConfig(candidate_steps=(1, 3, 5))) is True
    assert policy.current_steps == 5
    assert policy.ema == pytest.approx(5.8) and policy.count == 1
    assert policy.reconfigure(PolicyConfig(candidate_steps=(2, 5), ema_alpha=0.5)) is False
    policy.update([0])
    assert policy.ema == pytest.approx(2.9)


def test_config_defaults_and_normalization() -> None:
    cfg = PolicyConfig()
    assert cfg.to_dict() == {
        "candidate_steps": (1, 3, 7),
        "ema_alpha": 0.2,
        "update_interval": 5,
        "warmup_batches": 10,
        "down_hysteresis": -0.25,
        "up_hysteresis": 0.0,
        "expect_tail": True,
        "cost_guard": True,
    }
    assert PolicyConfig(candidate_steps=(7, 1, 3, 3)).candidate_steps == (1, 3, 7)
    assert PolicyConfig(ema_alpha=1).ema_alpha == 1.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"candidate_steps": [3]}, "candidate_steps needs at least two"),
        ({"candidate_steps": [3, 3]}, "candidate_steps needs at least two"),
        ({"candidate_steps": [0, 1]}, r"at least 1, or \[0\] alone"),
        ({"candidate_steps": [1, 2.5]}, r"candidate_steps must be ints in \[0, 64\]"),
        ({"candidate_steps": [1, 2**62]}, r"candidate_steps must be ints in \[0, 64\]"),
        ({"candidate_steps": 3}, "candidate_steps must be a list"),
        ({"ema_alpha": 0}, r"ema_alpha must be in \(0, 1\]"),
        ({"ema_alpha": 1.5}, r"ema_alpha must be in \(0, 1\]"),
        ({"ema_alpha": float("nan")}, "ema_alpha must be a finite number"),
        ({"ema_alpha": "0.2"}, "ema_alpha must be a finite number"),
        ({"update_interval": 0}, r"update_interval must be an int in \[1, 1000000\]"),
        ({"update_interval": True}, r"update_interval must be an int in \[1, 1000000\]"),
        ({"update_interval": 2**31 - 1}, r"update_interval must be an int in \[1, 1000000\]"),
        ({"warmup_batches": -1}, r"warmup_batches must be an int in \[0, 1000000\]"),
        ({"warmup_batches": 1.5}, r"warmup_batches must be an int in \[0, 1000000\]"),
        ({"warmup_batches": 2**31 - 1}, r"warmup_batches must be an int in \[0, 1000000\]"),
        ({"down_hysteresis": -1e300}, r"down_hysteresis must be in \[-64, 64\]"),
        ({"up_hysteresis": 1e300}, r"up_hysteresis must be in \[-64, 64\]"),
        ({"down_hysteresis": float("inf")}, "down_hysteresis must be a finite number"),
        ({"up_hysteresis": None}, "up_hysteresis must be a finite number"),
        ({"alpha": 0.3}, r"unknown policy key.*alpha"),
        ({"expect_tail": 1}, "expect_tail must be true or false"),
        ({"expect_tail": "false"}, "expect_tail must be true or false"),
        ({"cost_guard": 0}, "cost_guard must be true or false"),
    ],
)
def test_config_validation_names_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyConfig.from_mapping(values)


def test_replace_partial() -> None:
    cfg = PolicyConfig().replace_partial(ema_alpha=0.5, candidate_steps=(2, 4))
    assert cfg.ema_alpha == 0.5 and cfg.candidate_steps == (2, 4) and cfg.update_interval == 5
    with pytest.raises(ValueError, match="update_interval"):
        cfg.replace_partial(update_interval=-3)
    with pytest.raises(ValueError, match=r"unknown policy key.*speed"):
        cfg.replace_partial(speed=2)


def test_policy_file_omitted_keys_take_defaults(tmp_path: Path) -> None:
    """The controller's `--policy` file, read as `specpair serve controller` reads it."""
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"candidate_steps": [1, 2, 4], "warmup_batches": 0}))
    spec = load_policy(path)
    assert spec.kind == "sglang"
    assert spec.bands[0].config == PolicyConfig(candidate_steps=(1, 2, 4), warmup_batches=0)


def test_policy_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"ema_alpha": 0.2, "interval": 3}))
    with pytest.raises(ValueError, match=r"policy\.json.*unknown policy key.*interval"):
        load_policy(path)
    path.write_text(json.dumps({"ema_alpha": 2}))
    with pytest.raises(ValueError, match=r"policy\.json.*ema_alpha must be in"):
        load_policy(path)
    path.write_text("[1, 3, 7]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        load_policy(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read policy config"):
        load_policy(path)
    path.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="cannot read policy config"):
        load_policy(path)
    with pytest.raises(ValueError, match="cannot read policy config"):
        load_policy(tmp_path / "missing.json")


def test_the_wire_carries_every_policy_key() -> None:
    # The dataclass is where SGLang's keys are declared; the SDK and the servicer read them off
    # these messages, so a key added to one side only fails here. The kind travels beside them,
    # the tree shapes after them (with, in an update, the flag that they are set), and other
    # kinds' keys (goodput, bands) in options_json.
    from controller.policies.sglang import FIELD_NAMES, WIRE_FIELD_NAMES
    from specpair.proto.v1 import controller_pb2

    assert (*FIELD_NAMES, "tree_shapes") == WIRE_FIELD_NAMES
    config = [f.name for f in controller_pb2.PolicyConfig.DESCRIPTOR.fields]
    assert config == [*FIELD_NAMES, "kind", "options_json", "tree_shapes"]
    update = [f.name for f in controller_pb2.UpdatePolicyRequest.DESCRIPTOR.fields]
    assert update == [*config, "set_tree_shapes"]
