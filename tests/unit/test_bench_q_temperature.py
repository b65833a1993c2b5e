"""`bench.cpu q-temperature`: each drafted round's overlaps at every factor, aligned with the
engine's rounds, and a chain's expected accepts from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cpu.q_temperature import expected_accepts, main


def test_expected_accepts_is_the_sum_of_the_chains_reach() -> None:
    assert expected_accepts([0.7, 0.7]) == pytest.approx(0.7 + 0.49)
    assert expected_accepts([1.0, 0.0, 1.0]) == 1.0  # nothing past a sure rejection
    assert expected_accepts([]) == 0.0


def test_every_drafted_round_gets_an_overlap_at_every_factor(tmp_path: Path, capsys) -> None:
    out = tmp_path / "q.json"
    options = {"--code-prompts": "1", "--new-tokens": "12", "--tier": "3", "--out": str(out)}
    main([*(x for item in options.items() for x in item), "--factors", "0.5", "1"])
    result = json.loads(out.read_text())
    assert result["rounds"] == result["measured_rounds"] > 0
    for row in result["factors"]:
        alphas = [a for a in row["alpha_by_position"] if a is not None]
        assert len(alphas) == 3 and all(0.0 <= a <= 1.0 for a in alphas)
    half, one = (row["expected_accepts"] for row in result["factors"])
    assert half != one  # another temperature is another q
    assert capsys.readouterr().out.splitlines()[-1].startswith("1 ")
