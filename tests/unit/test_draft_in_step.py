"""The draft checks each input's `start` against what it holds of the request: a round built
before a hand-off's answer was read can name a prompt the draft never took."""

from __future__ import annotations

from pathlib import Path

from specpair.runtime.build import build_drafter, build_states
from specpair.runtime.draft.draft_round import DraftRound
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.sampling import SamplingParams

GREEDY = SamplingParams()


def test_inputs_in_step_extend_and_others_start_over(ckpts: dict[str, Path]) -> None:
    drafter = build_drafter(ckpts["draft"], target_path=None, max_requests=4, max_len=64)
    states = build_states([0, 3], drafter=drafter)
    rounds = DraftRound(drafter)

    def answer(round_id: int, tier: int, item: DraftInput):  # type: ignore[no-untyped-def]
        return rounds.answer(RoundRequest(round_id, tier, (item,)), states[tier], stream="s1")

    answer(1, 0, DraftInput("a", (5, 6, 7), GREEDY, start=0))  # a hand-off
    assert drafter.held("s1/a") == 3
    first = answer(2, 3, DraftInput("a", (8,), GREEDY, start=3))
    assert len(first.trees["a"]) == 3 and drafter.held("s1/a") == 4
    # The same tokens at once, on a drafter of its own: the same chain.
    alone = DraftRound(build_drafter(ckpts["draft"], target_path=None, max_requests=4, max_len=64))
    whole = alone.answer(
        RoundRequest(1, 3, (DraftInput("a", (5, 6, 7, 8), GREEDY, start=0),)),
        build_states([3], drafter=alone.drafter)[3],
    )
    assert whole.trees["a"].tokens == first.trees["a"].tokens

    out_of_step = answer(3, 3, DraftInput("a", (9,), GREEDY, start=7))
    assert "a" not in out_of_step.trees and "holds 4 tokens" in out_of_step.refused["a"]
    assert "s1/a" not in drafter.requests  # nothing kept: the target re-sends it whole

    answer(4, 3, DraftInput("a", (5, 6, 7, 8, 9), GREEDY, start=0))
    assert drafter.held("s1/a") == 5
    again = answer(5, 3, DraftInput("a", (5, 6), GREEDY, start=0))  # afresh, whatever it held
    assert len(again.trees["a"]) == 3 and drafter.held("s1/a") == 2
    unchecked = answer(6, 3, DraftInput("a", (1,), GREEDY))  # no start: extends as it comes
    assert len(unchecked.trees["a"]) == 3 and drafter.held("s1/a") == 3
