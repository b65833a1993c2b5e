"""`bench.up_pool`: runs of `bench.up_client` pooled into a verdict per cell."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.common import write_json
from bench.up_pool import goal_arg, main, pool, shares


def cell(config: str, workload: str, batch: int, tps: float) -> dict[str, object]:
    return {
        "config": config,
        "door": "sdk",
        "workload": workload,
        "batch": batch,
        "tokens_per_s": tps,
    }


def run(*cells: dict[str, object]) -> dict[str, object]:
    return {"cells": list(cells)}


def test_the_worked_example_pools_means_and_counts_runs_that_met_the_goal() -> None:
    runs = [
        run(cell("sglang", "code greedy", 8, 2800), cell("tier 0", "code greedy", 8, 1160)),
        run(cell("sglang", "code greedy", 8, 2830), cell("tier 0", "code greedy", 8, 1130)),
    ]
    (got,) = pool(runs, "sglang")
    assert got.runs == pytest.approx((2800 / 1160, 2830 / 1130))
    assert got.pooled == pytest.approx(2815 / 1145)
    assert got.ours_spread == pytest.approx(30 / 2800)
    assert got.alone_spread == pytest.approx(30 / 1130)
    assert (got.goal, got.met) == (2.5, 1)


def test_a_cell_pairs_only_with_the_tier_0_of_its_own_run_and_goals_follow_the_workload() -> None:
    runs = [
        run(cell("sglang", "code T=0.7", 32, 1400), cell("tier 0", "code T=0.7", 32, 1000)),
        run(cell("sglang", "code T=0.7", 32, 1500)),  # no tier 0 beside it: not counted
        run(cell("tier 7", "code T=0.7", 32, 9000), cell("tier 0", "code T=0.7", 32, 1000)),
        run(cell("sglang", "code T=0.7", 2, 300), cell("tier 0", "code T=0.7", 2, 200)),
    ]
    by_clients = {c.clients: c for c in pool(runs, "sglang")}
    assert by_clients[32].runs == pytest.approx((1.4,))
    assert (by_clients[32].goal, by_clients[32].met) == (1.4, 1)  # the sampled goal at 32
    assert (by_clients[2].goal, by_clients[2].met) == (None, 0)  # no goal at 2 clients
    assert pool(runs, "tier 7")[0].runs == pytest.approx((9.0,))


def test_goals_parse_or_say_what_they_expect() -> None:
    assert goal_arg("8=2.5,1.8") == (8, (2.5, 1.8))
    with pytest.raises(argparse.ArgumentTypeError, match="CLIENTS=GREEDY,SAMPLED"):
        goal_arg("8=2.5")


def test_the_command_writes_json_and_prints_the_table_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    write_json(
        path, run(cell("sglang", "code greedy", 64, 6000), cell("tier 0", "code greedy", 64, 4000))
    )
    main([str(path), "--goals", "64=1.4,1.2", "--out", str(tmp_path / "pool.json")])
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[:4] == ["sdk", "code", "greedy", "64"] and row[4:6] == ["1.50", "1.50"]
    assert row[-4:] == ["1.4", "1", "of", "1"]
    assert (tmp_path / "pool.json").exists() and (tmp_path / "pool.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main([str(path), "--config", "goodput", "--out", str(tmp_path / "none.json")])


def timed(cell_: dict[str, object], accept: float, batch: float, total: float) -> dict[str, object]:
    return cell_ | {"rounds": {"accept": accept, "batch": batch, "total": total}}


def test_the_sampled_share_splits_into_its_factors_and_names_the_greedy_x_a_goal_asks() -> None:
    """The worked example: share 0.614, and 1.8 / 0.614 = 2.93 of greedy x."""
    greedy = timed(cell("sglang", "code greedy", 8, 2.7 * 1160), 4.3, 7.5, 13.0)
    sampled_x = 2.7 * (3.5 / 5.3) * (13.0 / 14.6) * (1160 / 1110)
    sampled = timed(cell("sglang", "code T=0.7", 8, sampled_x * 1110), 2.5, 7.5, 14.6)
    alone = [cell("tier 0", "code greedy", 8, 1160), cell("tier 0", "code T=0.7", 8, 1110)]
    untimed = run(
        cell("sglang", "code greedy", 8, 3000), cell("sglang", "code T=0.7", 8, 1800), *alone
    )
    (got,) = shares([run(greedy, sampled, *alone), untimed], "sglang")
    assert (got.clients, got.runs) == (8, 1)  # a run without round stats is left out
    assert got.tokens == pytest.approx(3.5 / 5.3)
    assert (got.batch, got.round, got.alone) == pytest.approx((1.0, 13.0 / 14.6, 1160 / 1110))
    assert got.share == pytest.approx(got.tokens * got.batch * got.round * got.alone)
    assert got.share == pytest.approx(0.614, abs=5e-4)
    assert got.needs == pytest.approx(1.8 / got.share) and round(got.needs, 2) == 2.93
    assert shares([run(greedy, *alone)], "sglang") == []  # no sampled cell: nothing to split
