"""bench/goodput_sim.py on a tiny made-up phased run: 2 phases (sampled, then greedy) of 2
requests of 8 tokens each, static tiers 0 and 3."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.goodput_sim import Pinned, Recorded, load, main, simulate
from controller.policies.bands import PolicySpec
from controller.policies.interface import RoundSample, TierEstimate
from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps

HERE = "tests.unit.test_goodput_sim"
BETWEEN_S = 0.004  # per phase, outside rounds


def rnd(tier: int, accept: int, ms: float, sampled: bool, admit: float = 0.0) -> dict[str, Any]:
    return {
        "tier": tier,
        "steps": tier,
        "batch_size": 1,
        "accept_lengths": [accept] if tier else [],
        "total_ms": ms + admit,
        "verify_ms": ms / 2,
        "draft_ms": ms / 4 if tier else 0.0,
        "schedule_ms": 0.1,
        "admit_ms": admit,
        "sampled": int(sampled),
    }


def request(tier: int, sampled: bool, k: int) -> list[dict[str, Any]]:
    """8 tokens. Tier 0: 2 (prefill + 1), then 1 a round. Tier 3: 1 + 1 + 1, 1 + 3, then 1 + 2
    (one past the end, as a real last round overshoots); `k` varies the times."""
    if tier == 0:
        ms = 10.0 + k if sampled else 5.0 + k
        return [rnd(0, 0, ms, sampled, admit=20.0), *[rnd(0, 0, ms, sampled) for _ in range(6)]]
    ms = 40.0 + k if sampled else 8.0 + k
    accepts = (3, 2) if k % 2 else (2, 3)  # positions 3, 7 or 3, 6
    return [rnd(3, 1, ms, sampled, admit=30.0), *[rnd(3, a, ms + 1, sampled) for a in accepts]]


def static_run(tier: int, first_round: list[int]) -> dict[str, Any]:
    phases = [[request(tier, True, k) for k in (0, 1)], [request(tier, False, k) for k in (2, 3)]]
    rounds = [r for phase in phases for q in phase for r in q]
    seconds = [sum(r["total_ms"] for q in ph for r in q) / 1e3 + BETWEEN_S for ph in phases]
    return {
        "name": f"static-{tier}",
        "phase_seconds": seconds,
        "phase_tokens": [16, 16],
        "phase_first_round": first_round,
        "rounds": rounds,
        "switches": 0,
    }


def report() -> dict[str, Any]:
    # static-0's second phase really starts at round 14: the recorded index lags the stream.
    runs = {"static-0": static_run(0, [0, 12]), "static-3": static_run(3, [0, 6])}
    goodput = {
        "kind": "goodput",
        "candidate_steps": [0, 3],
        "warmup_batches": 2,
        "update_interval": 2,
    }
    return {
        "phased": {"phases": ["prose", "code"], "requests_per_phase": 2, "runs": runs},
        "policies": {"goodput": goodput},
    }


class FixedTier:
    """Stays at `options["steps"]`."""

    def __init__(self, options: Mapping[str, Any], initial_steps: int) -> None:
        self._steps = int(options.get("steps", initial_steps))
        self.options, self.seen = dict(options), 0
        self.samples: list[RoundSample] = []

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        return (0, 3)

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
        self.samples.append(sample)
        return False

    def resume(self, ema: float, count: int) -> None:
        pass

    def reconfigure(self, options: Mapping[str, Any]) -> bool:
        return False

    def estimates(self) -> tuple[TierEstimate, ...]:
        return ()

    def describe(self) -> str:
        return "fixed"


class SwitchAt(FixedTier):
    """Moves to `options["to"]` when it has seen `options["after"]` rounds."""

    def observe(self, sample: RoundSample) -> bool:
        super().observe(sample)
        if self.seen == self.options["after"]:
            self._steps = self.options["to"]
            return True
        return False


class RegimeMapped(FixedTier):
    @property
    def regime_steps(self) -> RegimeSteps:
        return RegimeSteps(greedy=TreeShape(3), sampled=TreeShape(0))


def built(cls: str, **options: Any) -> Any:
    """Through the controller's --policy-class loader, as the bench builds one."""
    return PolicySpec.from_mapping({"kind": f"{HERE}:{cls}", **options}).build(3)


@pytest.fixture
def rec() -> Recorded:
    return load(report())


def test_simulated_statics_reproduce_their_recorded_runs(rec: Recorded) -> None:
    assert rec.targets == [[8, 8], [8, 8]] and rec.between_s == pytest.approx([BETWEEN_S] * 2)
    for tier in (0, 3):
        recorded = report()["phased"]["runs"][f"static-{tier}"]
        sim = simulate(rec, Pinned(tier), "s", catchup_ms=28.0)
        assert sim.result.phase_seconds == pytest.approx(recorded["phase_seconds"], abs=1e-12)
        assert sim.result.phase_tokens == [16, 16]
        assert sim.tiers == [tier] * len(recorded["rounds"])
    assert simulate(rec, Pinned(0), "s").result.phase_first_round == [0, 14]


def test_a_policy_class_fixed_at_3_is_static_3(rec: Recorded) -> None:
    fixed = built("FixedTier", steps=3)
    sim = simulate(rec, fixed, "fixed")
    static = simulate(rec, Pinned(3), "static-3")
    assert sim.result.phase_seconds == static.result.phase_seconds
    assert sim.tiers == static.tiers == [3] * 12 and fixed.seen == 12


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_lag_delays_the_applied_tier_by_that_many_rounds(rec: Recorded, lag: int) -> None:
    # Decided after the 2nd round (index 1): applied from round 2 + lag.
    sim = simulate(rec, built("SwitchAt", steps=3, to=0, after=2), "switch", lag=lag)
    assert sim.tiers[: 2 + lag] == [3] * (2 + lag) and set(sim.tiers[2 + lag :]) == {0}
    assert sim.result.switches == 1 and sim.result.phase_tokens == [16, 16]


@pytest.mark.parametrize(("after", "lag", "catchups"), [(2, 0, 1), (5, 2, 0)])
def test_catch_up_after_tier_0_but_not_on_an_admission(
    rec: Recorded, after: int, lag: int, catchups: int
) -> None:
    # Tier 0's first request is rounds 0–6: the move lands on round 2, or on round 7, the
    # round that admits the second request.
    def run(catchup_ms: float) -> tuple[float, list[RoundSample]]:
        policy = built("SwitchAt", steps=0, to=3, after=after)
        sim = simulate(rec, policy, "s", lag=lag, catchup_ms=catchup_ms)
        return sum(sim.result.phase_seconds), policy.samples

    (with_catchup, seen), (without, plain) = run(28.0), run(0.0)
    assert with_catchup - without == pytest.approx(0.028 * catchups)
    moved = after + lag  # the first round at tier 3
    assert seen[moved].steps == 3 and seen[moved - 1].steps == 0
    # The policy sees the catch-up in the round's total and draft times.
    assert seen[moved].total_ms - plain[moved].total_ms == pytest.approx(28.0 * catchups)
    assert seen[moved].draft_ms - plain[moved].draft_ms == pytest.approx(28.0 * catchups)


def test_regime_map_sets_the_tier_at_the_first_round_of_a_new_regime(rec: Recorded) -> None:
    mapped = simulate(rec, built("RegimeMapped", steps=0), "m", lag=5, regime_map=True)
    assert mapped.tiers == [0] * 14 + [3] * 6  # the greedy phase at 3 from its first round
    assert simulate(rec, built("RegimeMapped", steps=0), "m", lag=5).tiers == [0] * 28
    plain = simulate(rec, built("FixedTier", steps=0), "f", regime_map=True)
    assert plain.tiers == [0] * 28  # no regime_steps: the option does nothing


def test_the_recorded_policy_runs_closed_loop(rec: Recorded) -> None:
    spec = PolicySpec.from_mapping(report()["policies"]["goodput"])
    sim = simulate(rec, spec.build(3), "goodput", lag=1)
    assert sim.result.phase_tokens == [16, 16] and set(sim.tiers) <= {0, 3}
    assert sim.result.phase_first_round[0] == 0 and len(sim.result.phase_first_round) == 2


def test_main_prints_the_table_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run, out = tmp_path / "run.json", tmp_path / "sim.json"
    run.write_text(json.dumps(report()))
    argv = [
        "goodput_sim",
        "--run",
        str(run),
        "--out",
        str(out),
        "--lag",
        "1",
        "4",
        "--set",
        "min_gain=0.05",
        "--policy-class",
        f"{HERE}:FixedTier",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    main()
    text = capsys.readouterr().out
    assert "recorded + min_gain=0.05, lag 4" in text and "oracle (sim)" in text
    written = json.loads(out.read_text())
    assert f"{HERE}:FixedTier, lag 1" in written["runs"]
    assert written["runs"]["static-0"]["tiers"] == [0] * 28
    assert written["static_max_error"] == pytest.approx(0.0, abs=1e-9)
