"""bench/round_overhead.py's tiers: chains and tree shapes from the command line, a bad shape
refused while parsing, and each tier's rounds told apart from a chain of the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.round_overhead import headroom, host_main, make_parser, service_run
from specpair.runtime.round_messages import RoundStats, StageTimings
from specpair.runtime.shape import TreeShape


def test_tiers_take_chains_and_trees() -> None:
    args = make_parser().parse_args(["--tiers", "7", "5x4x20", "3"])
    assert args.tiers == [TreeShape(7), TreeShape(5, 4, 20), TreeShape(3)]
    assert [str(t) for t in sorted(set(args.tiers))] == ["3", "5x4x20", "7"]
    assert make_parser().parse_args([]).tiers == [TreeShape(3)]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("3x2", "STEPSxTOPKxNUM_DRAFT_TOKENS, got '3x2'"),
        ("3xax6", "got '3xax6'"),
        ("2x9x99", "num_draft_tokens must be in [1, 64]"),
    ],
)
def test_a_bad_shape_is_a_usage_error_that_says_why(
    text: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        make_parser().parse_args(["--tiers", "3", text])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tiers" in err and says in err


def test_headroom_covers_a_trees_verify_and_draft_rows() -> None:
    assert headroom([TreeShape(1), TreeShape(7)]) == 8  # a chain of 7 verifies 8 tokens
    assert headroom([TreeShape(3), TreeShape(5, 4, 20)]) == 21
    assert headroom([TreeShape(6, 8, 32)]) == 40  # the last draft forward's 5 · 8 rows


def round_at(tier: TreeShape, total_ms: float) -> RoundStats:
    return RoundStats(
        round_id=0,
        speculative_num_steps=tier.steps,
        batch_size=1,
        accept_lengths=(1,),
        speculative=True,
        timings=StageTimings(total_ms=total_ms),
        unix_time=0.0,
        shape=None if tier.is_chain else tier,
    )


def test_a_tiers_service_rounds_exclude_a_chain_of_the_same_steps() -> None:
    tree, chain = TreeShape(5, 4, 20), TreeShape(5)
    rounds = [round_at(chain, 1.0), round_at(tree, 2.0), round_at(tree, 3.0)]
    assert service_run([], rounds, tree, 1.0)["stages_ms"]["total"] == [2.0, 3.0]
    assert service_run([], rounds, chain, 1.0)["stages_ms"]["total"] == [1.0]


def test_the_host_mode_times_each_cell_and_prints_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "host.json"
    host_main(["--batches", "2", "--tiers", "3", "--iters", "2", "--out", str(out)])
    (cell,) = json.loads(out.read_text())["cells"]
    assert (cell["batch"], cell["tier"]) == (2, 3)
    timed = ("encode", "decode", "check", "chain_inputs", "greedy_accept", "greedy_accept_per_row")
    assert all(cell[key] > 0 for key in timed)
    assert capsys.readouterr().out.splitlines()[-1].startswith("2 ")  # the table comes last
