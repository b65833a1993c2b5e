"""`DraftInput.continues`: a round that continues a request the draft does not hold (its
hand-off was refused, the answer unread when the round went out) is refused for that request
alone, never started from the one token it appends."""

from __future__ import annotations

from pathlib import Path

from draft_service.rounds import DraftRounds
from specpair.config import DraftConfig, ServerConfig
from specpair.rpc.wire import encode_request, read_round, response_from_proto
from specpair.runtime.round_messages import DraftInput, RoundRequest
from specpair.runtime.sampling import SamplingParams

GREEDY = SamplingParams()


def test_a_draft_refuses_to_continue_a_request_it_does_not_hold(ckpts: dict[str, Path]) -> None:
    rounds = DraftRounds(DraftConfig(ServerConfig("127.0.0.1:0"), ckpts["draft"]))
    handoff = RoundRequest(1, 0, (DraftInput("a", (5, 6, 7), GREEDY),))
    rounds.run("s#1", read_round(encode_request(handoff)))  # a's prompt is held; b's never came
    round_two = RoundRequest(
        2,
        3,
        (
            DraftInput("a", (8,), GREEDY, continues=True),
            DraftInput("b", (9,), GREEDY, continues=True),
            DraftInput("c", (4, 5), GREEDY),  # not flagged: a request the draft starts
        ),
    )
    answer = rounds.run("s#1", read_round(encode_request(round_two)))
    response = response_from_proto(answer.message)
    assert not response.error
    assert sorted(response.trees) == ["a", "c"] and len(response.trees["a"]) == 3
    assert list(response.refused) == ["b"]
    assert response.refused["b"].startswith("FAILED_PRECONDITION")
    assert sorted(rounds.drafter.requests) == ["s#1/a", "s#1/c"], "b holds no slot"
