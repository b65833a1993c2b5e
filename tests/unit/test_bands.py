"""PolicySpec and BandedPolicy: the file's shape, bands per batch size for both kinds, kind
switches, and policy classes loaded by import path."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import pytest

from controller.policies.bands import BandedPolicy, PolicySpec, load_policy_class
from controller.policies.goodput.config import GoodputConfig
from controller.policies.interface import RoundSample, SpeculationPolicy, TierEstimate
from controller.policies.sglang import AdaptiveSpeculativeParams, PolicyConfig

FILE = {
    "kind": "goodput",
    "candidate_steps": [0, 1, 3, 7],
    "bands": [
        {"min_batch_size": 16, "candidate_steps": [0, 1, 3]},
        {"min_batch_size": 64, "candidate_steps": [0, 1], "min_gain": 0.1},
    ],
}


def test_file_shape_and_round_trip() -> None:
    spec = PolicySpec.from_mapping(FILE)
    assert spec.kind == "goodput" and spec.candidate_steps == (0, 1, 3, 7)
    assert [b.min_batch_size for b in spec.bands] == [1, 16, 64]
    assert [b.config.candidate_steps for b in spec.bands] == [(0, 1, 3, 7), (0, 1, 3), (0, 1)]
    last = spec.bands[2].config
    assert isinstance(last, GoodputConfig) and last.min_gain == 0.1
    assert spec.to_dict()["bands"] == FILE["bands"]
    assert PolicySpec.from_mapping(spec.to_dict()) == spec
    # Without "kind" a file is SGLang's rule, as before kinds existed.
    plain = PolicySpec.from_mapping({"candidate_steps": [1, 3]})
    assert plain.kind == "sglang" and plain.bands[0].config == PolicyConfig(candidate_steps=(1, 3))
    assert "bands" not in plain.to_dict()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kind": "fast"}, "unknown policy kind 'fast'"),
        ({"kind": 3}, "kind must be a string"),
        ({"bands": {"min_batch_size": 2}}, "bands must be a list"),
        ({"bands": [3]}, r"bands\[0\] must be an object"),
        ({"bands": [{"candidate_steps": [1, 3]}]}, r"bands\[0\]\.min_batch_size must be an int"),
        ({"bands": [{"min_batch_size": 1}]}, r"bands\[0\]\.min_batch_size must be an int above 1"),
        (
            {"bands": [{"min_batch_size": 8}, {"min_batch_size": 8}]},
            r"bands\[1\]\.min_batch_size must be an int above 8",
        ),
        ({"bands": [{"min_batch_size": 2**62}]}, r"bands\[0\]\.min_batch_size .* at most 65536"),
        ({"bands": [{"min_batch_size": 8, "candidate_steps": [0, 1]}]}, r"bands\[0\]: cand"),
        ({"bands": [{"min_batch_size": 8, "min_gain": 0.1}]}, r"bands\[0\]: unknown.*min_gain"),
        ({"kind": "pkg_does_not_exist:Policy"}, "cannot be loaded"),
        ({"kind": "tests.unit.test_bands:FILE"}, "is not a class"),
    ],
)
def test_errors_name_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicySpec.from_mapping(values)


def sglang_round(batch: int, accept: int) -> RoundSample:
    return RoundSample(3, batch, (accept,) * batch)


def test_one_band_is_exactly_sglangs_rule() -> None:
    rng = random.Random(3)
    cfg = PolicyConfig(warmup_batches=2, update_interval=2)
    banded = PolicySpec.of(cfg).build(3)
    plain = AdaptiveSpeculativeParams(cfg, 3)
    for _ in range(300):
        accepts = [rng.randint(0, 7) for _ in range(rng.randint(1, 4))]
        changed = banded.observe(RoundSample(plain.current_steps, len(accepts), tuple(accepts)))
        assert changed == plain.update(accepts)
        assert (banded.current_steps, banded.ema, banded.count) == (
            plain.current_steps,
            plain.ema,
            plain.count,
        )


def test_sglang_bands_keep_their_own_ema_and_tier() -> None:
    spec = PolicySpec.from_mapping(
        {
            "ema_alpha": 1.0,
            "warmup_batches": 0,
            "update_interval": 1,
            "expect_tail": False,  # SGLang's count: the EMA is the batch's mean
            "bands": [{"min_batch_size": 16, "candidate_steps": [1, 2, 5], "up_hysteresis": 3}],
        }
    )
    policy = spec.build(3)
    assert policy.observe(sglang_round(1, 7)) is True and policy.current_steps == 7
    # Batch 16: its band started at 3, snapped to its nearest candidate 2.
    assert policy.observe(sglang_round(16, 2)) is True and policy.current_steps == 2
    assert policy.ema == 2.0
    # Its own thresholds: up from 2 needs EMA > 2 − 0.5 + 3.
    assert policy.observe(sglang_round(16, 4)) is False and policy.current_steps == 2
    assert policy.observe(sglang_round(20, 5)) is True and policy.current_steps == 5
    # Back to batch 1: that band's tier and EMA were untouched.
    assert policy.observe(sglang_round(1, 7)) is True and policy.current_steps == 7
    assert "band 1–15" in policy.describe()


def test_reconfigure_keeps_learning_when_the_bands_keep_their_shape() -> None:
    spec = PolicySpec.from_mapping(
        {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1, "expect_tail": False}
    )
    policy = spec.build(3)
    policy.observe(sglang_round(1, 6))
    assert policy.current_steps == 7 and policy.count == 1
    spec = spec.replace_partial(candidate_steps=[1, 3, 5])
    assert policy.reconfigure(spec.to_dict()) is True
    assert policy.current_steps == 5 and policy.count == 1 and policy.ema == 6.0
    banded = spec.replace_partial(bands=[{"min_batch_size": 4}])
    assert policy.reconfigure(banded.to_dict()) is False  # a fresh start at the same tier
    assert policy.current_steps == 5 and policy.count == 0


def test_kind_switch_keeps_shared_keys_and_bands() -> None:
    spec = PolicySpec.from_mapping(
        {"candidate_steps": [1, 3], "down_hysteresis": 0.1, "bands": [{"min_batch_size": 8}]}
    )
    goodput = spec.replace_partial(kind="goodput")
    assert goodput.kind == "goodput" and goodput.candidate_steps == (1, 3)
    assert [b.min_batch_size for b in goodput.bands] == [1, 8]
    with_zero = goodput.replace_partial(candidate_steps=[0, 1, 3])
    with pytest.raises(ValueError, match=r"two distinct tiers of at least 1, or \[0\] alone"):
        with_zero.replace_partial(kind="sglang")
    assert with_zero.replace_partial(kind="sglang", candidate_steps=[1, 3]).kind == "sglang"
    with pytest.raises(ValueError, match="chosen at start-up"):
        spec.replace_partial(kind="tests.unit.test_bands:FixedPolicy")


class FixedPolicy:
    """A custom policy: always `options["steps"]`."""

    def __init__(self, options: Mapping[str, Any], initial_steps: int) -> None:
        self.reconfigure(options)
        self.seen = 0

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        return (self._steps,)

    @property
    def current_steps(self) -> int:
        return self._steps

    @property
    def ema(self) -> float:
        return 0.0

    @property
    def count(self) -> int:
        return self.seen

    def observe(self, sample: RoundSample) -> bool:
        self.seen += 1
        return False

    def resume(self, ema: float, count: int) -> None:
        self.seen = count

    def reconfigure(self, options: Mapping[str, Any]) -> bool:
        steps = options.get("steps")
        if not isinstance(steps, int):
            raise ValueError(f"steps must be an int, got {steps!r}")
        old, self._steps = getattr(self, "_steps", steps), steps
        return old != steps

    def estimates(self) -> tuple[TierEstimate, ...]:
        return ()

    def describe(self) -> str:
        return f"fixed at {self._steps}"


def test_policy_class_by_import_path() -> None:
    spec = PolicySpec.from_mapping({"kind": "tests.unit.test_bands:FixedPolicy", "steps": 2})
    assert spec.candidate_steps == (2,) and spec.to_dict() == {
        "kind": "tests.unit.test_bands:FixedPolicy",
        "steps": 2,
    }
    policy = spec.build(5)
    assert isinstance(policy, SpeculationPolicy) and policy.current_steps == 2
    assert spec.replace_partial(steps=4).candidate_steps == (4,)
    assert policy.reconfigure(spec.replace_partial(steps=4).policy_options()) is True
    with pytest.raises(ValueError, match="steps must be an int"):
        spec.replace_partial(steps="x")
    assert load_policy_class("controller.policies.bands:BandedPolicy") is BandedPolicy
    with pytest.raises(ValueError, match="does not implement SpeculationPolicy"):
        PolicySpec.from_mapping({"kind": "controller.policies.interface:DecisionGate"})
    with pytest.raises(ValueError, match="failed"):
        PolicySpec.from_mapping({"kind": "collections:OrderedDict"})


def test_an_sglang_band_of_tier_0_alone_turns_speculation_off_and_back_on_below() -> None:
    spec = PolicySpec.from_mapping(
        {"candidate_steps": [1, 3, 7], "bands": [{"min_batch_size": 33, "candidate_steps": [0]}]}
    )
    assert spec.kind == "sglang" and spec.candidate_steps == (0, 1, 3, 7)
    policy = spec.build(3)
    assert policy.observe(RoundSample(3, 33, (2,) * 33)) is True and policy.current_steps == 0
    for batch in (40, 64):  # the target alone: no accept lengths, the band stays at 0
        assert policy.observe(RoundSample(0, batch, ())) is False and policy.current_steps == 0
    assert policy.observe(RoundSample(0, 32, ())) is True and policy.current_steps == 3
    assert "band 1–32" in policy.describe()


@pytest.mark.parametrize("steps", [[0, 1], [0, 3, 7], [1]])
def test_sglang_takes_tier_0_only_alone(steps: list[int]) -> None:
    with pytest.raises(ValueError, match=r"two distinct tiers of at least 1, or \[0\] alone"):
        PolicyConfig(candidate_steps=tuple(steps))
