"""`bench/goodput_gpu.py`'s sweep arithmetic over `--repeat` turns, on a made-up report."""

from __future__ import annotations

from typing import Any

import pytest

from bench.goodput_gpu import cell_rounds, pooled_tokens_per_s, summarize


def cell(config: str, batch: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "config": config,
        "batch": batch,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def rounds(tier: int, n: int, batch: int) -> list[dict[str, Any]]:
    return [
        {"tier": tier, "batch_size": batch, "accept_lengths": [1] * batch, "total_ms": 10.0}
        for _ in range(n)
    ]


def two_turns() -> dict[str, Any]:
    """Batch 1 then 2, two turns each: goodput's batch-1 cells ran at tier 3 then tier 7."""
    cells = [
        cell("goodput", 1, 1024, 3.4),
        cell("tier 3", 1, 1024, 4.0),
        cell("tier 3", 1, 1024, 3.0),
        cell("goodput", 1, 1024, 3.6),
        cell("goodput", 2, 2048, 4.0),
        cell("tier 3", 2, 2048, 5.0),
    ]
    goodput = rounds(3, 4, 1) + rounds(7, 2, 1) + rounds(7, 5, 2)
    tier3 = rounds(3, 6, 1) + rounds(3, 6, 1) + rounds(3, 3, 2)
    return {
        "cells": cells,
        "rounds": {"goodput": goodput, "tier 3": tier3},
        "first_round": {"goodput": [0, 4, 6], "tier 3": [0, 6, 12]},
    }


def test_turns_are_pooled_as_tokens_over_seconds() -> None:
    sweep = two_turns()
    tps = pooled_tokens_per_s([c for c in sweep["cells"] if c["batch"] == 1])
    assert tps["goodput"] == pytest.approx(2048 / 7.0)  # not the mean of 301.2 and 284.4
    assert tps["tier 3"] == pytest.approx(2048 / 7.0)
    row = summarize({"sweep": sweep})["sweep"]["batches"][0]
    assert row["batch"] == 1 and row["goodput_vs_best"] == pytest.approx(1.0)


def test_a_batch_sizes_rounds_come_from_every_turn() -> None:
    sweep = two_turns()
    assert [r["tier"] for r in cell_rounds(sweep, "goodput", 1)] == [3] * 4 + [7] * 2
    assert len(cell_rounds(sweep, "goodput", 2)) == 5
    assert len(cell_rounds(sweep, "tier 3", 1)) == 12
    row = summarize({"sweep": sweep})["sweep"]["batches"][0]
    assert row["goodput_tiers"] == {3: pytest.approx(4 / 6), 7: pytest.approx(2 / 6)}
