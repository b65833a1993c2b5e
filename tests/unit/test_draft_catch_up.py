"""A request joining rounds under way is extended after the round's response (`catch_up`), not
before the draft drafts the others: its first round gets an empty chain, and from the next one
on everyone drafts exactly what a draft that extended it in its round would."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.runtime.build import build_drafter, build_states
from specpair.runtime.draft.round import CATCH_UP_ROWS, DraftRound
from specpair.runtime.round import DraftInput, RoundRequest, RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.tree import chain

GREEDY = SamplingParams()
PROMPT = tuple(range(3, 3 + CATCH_UP_ROWS + 5))  # a prompt over the rows a round extends
STEADY = [DraftInput("s", (5, 6, 7), GREEDY)]
JOIN = [DraftInput("s", (9,), GREEDY), DraftInput("j", PROMPT, GREEDY)]
AFTER = [DraftInput("s", (11,), GREEDY), DraftInput("j", (12,), GREEDY)]  # drafts rejected


def run(
    ckpts: dict[str, Path], *inputs: list[DraftInput], rows: int | None = CATCH_UP_ROWS,
    between: bool = False,
) -> tuple[DraftRound, list[RoundResponse]]:  # fmt: skip
    """A fresh draft at tier 3 through these rounds (ids 1, 2, …); `between`: the service's
    `catch_up` after each response."""
    drafter = build_drafter(ckpts["draft"], target_path=None, max_requests=4, max_len=96)
    state = build_states([3], drafter=drafter)[3]
    rnd = DraftRound(drafter, catch_up_rows=rows)
    out = []
    for i, items in enumerate(inputs, 1):
        out.append(rnd.answer(RoundRequest(i, 3, tuple(items)), state))
        if between:
            rnd.catch_up()
    return rnd, out


@pytest.mark.parametrize("between", [False, True], ids=["next-answer", "service"])
def test_a_joining_prompt_is_answered_undrafted_then_drafts_as_if_extended_in_its_round(
    ckpts: dict[str, Path], between: bool
) -> None:
    late, (_, joined, after) = run(ckpts, STEADY, JOIN, AFTER, between=between)
    assert joined.trees["j"] == chain(()) and len(joined.trees["s"]) == 3
    assert late.owed == [] and "j" in late.drafter.requests
    _, (_, in_round, reference) = run(ckpts, STEADY, JOIN, AFTER, rows=None)
    assert len(in_round.trees["j"]) == 3  # without catch-up it drafts in its round
    assert joined.trees["s"] == in_round.trees["s"]
    assert after.trees == reference.trees  # the same cache, the same drafts from here on


def test_newcomers_alone_and_short_prompts_are_drafted_in_their_round(
    ckpts: dict[str, Path],
) -> None:
    both = [DraftInput("a", PROMPT, GREEDY), DraftInput("b", PROMPT[2:], GREEDY)]
    rnd, (first,) = run(ckpts, both)
    assert [len(first.trees[k]) for k in "ab"] == [3, 3] and rnd.owed == []
    short = [DraftInput("s", (9,), GREEDY), DraftInput("j", PROMPT[:CATCH_UP_ROWS], GREEDY)]
    _, (_, joined) = run(ckpts, STEADY, short)
    assert len(joined.trees["j"]) == 3


def test_a_failed_catch_up_refuses_the_request_once_so_the_target_re_sends_it(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rnd, (_, joined) = run(ckpts, STEADY, JOIN)
    assert joined.trees["j"] == chain(())

    def broken(inputs: object) -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(rnd.drafter, "catch_up", broken)
    assert list(rnd.catch_up()) == ["j"]
    assert "j" not in rnd.drafter.requests and rnd.owed == []
    monkeypatch.undo()
    state = build_states([3], drafter=rnd.drafter)[3]
    refused = rnd.answer(RoundRequest(3, 3, tuple(AFTER)), state)
    assert "j" not in refused.trees and "catch-up failed" in refused.refused["j"]
    resent = rnd.answer(RoundRequest(4, 3, (DraftInput("j", (*PROMPT, 12), GREEDY),)), state)
    assert len(resent.trees["j"]) == 3  # whole again: drafted (alone, so in its round)


def test_a_released_request_owes_nothing(ckpts: dict[str, Path]) -> None:
    rnd, _ = run(ckpts, STEADY, JOIN)
    rnd.release("j")
    assert rnd.owed == [] and rnd.catch_up() == {} and "j" not in rnd.drafter.requests
