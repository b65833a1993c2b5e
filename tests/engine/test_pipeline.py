"""Pipelined rounds in process: pre-drafted trees change when a tree is there, never the output.

Greedy output equals transformers' with every draft kind at tiers 1 / 3 / 7 (hits, misses and
requests leaving mid-batch); the draft that is the target itself hits nearly every round; the
sampling distribution with pre-drafts is tests/engine/test_sampling_lossless.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.draft.pipeline import Outcome, likely_outcomes
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.lookahead import Lookahead
from tests.engine.test_greedy_lossless import NEW_TOKENS, PROMPTS


def test_likely_outcomes_worked_example() -> None:
    ahead = Lookahead(
        ids=torch.tensor([[7, 4], [9, 2], [5, 1]]),
        p=torch.tensor([[0.6, 0.3], [0.9, 0.1], [0.8, 0.1]]),
        hidden=torch.zeros(3, 1),
    )
    got = likely_outcomes([7, 9], ahead, 2)
    assert [(o.accepted, o.bonus) for o in got] == [(2, 5), (0, 4)]
    assert got[0].p == pytest.approx(0.432) and got[1].p == pytest.approx(0.3)
    every = likely_outcomes([7, 9], ahead, 10)
    assert Outcome(1, 2, pytest.approx(0.06)) in every  # type: ignore[arg-type]
    assert all(o.bonus != [7, 9][o.accepted] for o in every if o.accepted < 2)


def generate(ckpts: dict[str, Path], draft: str, tier: int, width: int, prompts: list[list[int]]):
    worker = build_target(ckpts["target"], max_requests=4, max_len=160, keep_features=True)
    drafter = build_drafter(ckpts[draft], target_path=ckpts["target"], max_requests=40, max_len=160)
    engine = SpeculativeEngine(worker, drafter, pipeline_width=width)
    results = engine.generate(
        prompts, max_new_tokens=NEW_TOKENS, state=build_states([tier], worker, drafter)[tier]
    )
    assert drafter.cache.free_slots == 40, "a fork or a request kept its slot"
    return results, engine


@pytest.mark.parametrize("tier", [1, 3, 7])
@pytest.mark.parametrize("draft", ["target", "draft", "eagle"])
def test_pipelined_greedy_matches_transformers(ckpts, references, draft: str, tier: int) -> None:
    results, engine = generate(ckpts, draft, tier, 8, PROMPTS)
    assert [r.token_ids for r in results] == references["target"]
    plain, _ = generate(ckpts, draft, tier, 0, PROMPTS)
    assert [r.accept_lengths for r in results] != [] and all(
        0 <= a <= tier for r in results for a in r.accept_lengths
    )
    assert engine.pipeline is not None and engine.pipeline.misses == 0  # adoptions all found
    rounds = sum(len(r.accept_lengths) for r in results)
    if draft == "target":
        # All s drafts accepted and the bonus the draft's own first choice: a hit each round
        # after each request's first (fewer as the batch thins out at the end).
        assert engine.pipeline.hits >= rounds - 2 * len(PROMPTS)
        assert [r.accept_lengths for r in results] == [r.accept_lengths for r in plain]
    else:
        assert engine.pipeline.hits < rounds


@pytest.fixture(scope="module")
def references(ckpts: dict[str, Path]) -> dict[str, list[list[int]]]:
    from tests.engine.test_greedy_lossless import hf_greedy

    return {"target": [hf_greedy(ckpts["target"], p) for p in PROMPTS]}
