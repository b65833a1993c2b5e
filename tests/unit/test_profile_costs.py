"""The start-up cost profile counts only the rounds that show a tier's own cost."""

from __future__ import annotations

from bench.profile_costs import SKIP_AFTER_PIN, counted_ms, render
from specpair.runtime.round_messages import RoundStats, StageTimings
from specpair.runtime.shape import TreeShape

T0, T1, T3 = map(TreeShape, (0, 1, 3))
TREE = TreeShape.parse("3x2x6")


def stats(tier: TreeShape, batch: int, ms: float, admit_ms: float = 0.0) -> RoundStats:
    timings = StageTimings(total_ms=ms, admit_ms=admit_ms)
    s = tier.steps
    return RoundStats(
        round_id=0,
        speculative_num_steps=s,
        batch_size=batch,
        accept_lengths=(1,) * batch if s else (),
        speculative=s > 0,
        timings=timings,
        unix_time=0.0,
        shape=None if tier.is_chain else tier,
    )


def test_only_whole_batches_at_the_tier_without_admission_count() -> None:
    rounds = [stats(T3, 4, 90.0)] * SKIP_AFTER_PIN  # the pin landing, the draft's catch-up
    rounds += [
        stats(T3, 4, 12.0),
        stats(T3, 4, 40.0, admit_ms=25.0),  # a request joined: its prefill is not tier 3's
        stats(T3, 3, 11.0),  # one request finished: not batch 4
        stats(T1, 4, 9.0),  # the pin had not landed
        stats(TREE, 4, 15.0),  # a tree of 3 steps is no chain of 3
        stats(T3, 4, 13.0),
    ]
    assert counted_ms(rounds, T3, 4) == [12.0, 13.0]
    assert counted_ms(rounds, TREE, 4) == [15.0]
    plain = [stats(T0, 2, 7.0)] * (SKIP_AFTER_PIN + 2) + [stats(T3, 2, 11.0)]
    assert counted_ms(plain, T0, 2) == [7.0, 7.0]  # a round with drafts is no tier-0 round


def test_the_table_names_each_regime_and_leaves_unmeasured_tiers_blank() -> None:
    table = render({"profile_ms": {"1": {"0": 7.25, "3": 11.5}}, "sampled_profile_ms": {}})
    row = table.splitlines()[-1].split()
    assert row[:3] == ["greedy", "1", "7.2"] and row[3] == "-" and row[4] == "11.5"
    trees = render({"profile_ms": {"1": {"7": 12.0, "5x4x20": 12.5}}, "sampled_profile_ms": {}})
    head, row = trees.splitlines()[0].split(), trees.splitlines()[-1].split()
    assert head.index("5x4x20") < head.index("7") and row[-2:] == ["12.5", "12.0"]  # by steps
