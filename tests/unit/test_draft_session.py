"""The target's draft session: what goes to the draft each round, and which trees come back."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from specpair.runtime.round_messages import RoundRequest, RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.features import FeatureLog
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE, CandidateTree, chain

H = 4


def rows(first: int, n: int) -> torch.Tensor:
    """[n, H] feature rows whose values name their positions first .. first + n - 1."""
    return torch.arange(first, first + n, dtype=torch.float32)[:, None].expand(n, H).clone()


def joined(prompt: list[int], first: int, rid: str = "a", **sampling: float) -> TargetSequence:
    seq = TargetSequence(rid, prompt, SamplingParams(**sampling), max_new_tokens=100)
    seq.output.append(first)  # what prefill samples
    return seq


@pytest.mark.parametrize("in_process", [False, True])
def test_each_round_sends_what_the_draft_has_not_seen_with_its_features(in_process: bool) -> None:
    session = DraftSession(vocab_size=50, in_process=in_process)
    seq = joined([5, 6, 7], 8)
    session.add(seq, rows(0, 3))
    first = session.request(1, [seq], 3, features=True)
    (item,) = first.inputs
    assert item.appended == (5, 6, 7, 8) and item.features is not None
    assert item.features[:, 0].tolist() == [0, 1, 2]  # one row fewer than tokens at first
    drafts = session.drafts(first, RoundResponse(1, {"a": chain([9, 4, 1])}))
    assert drafts.speculative and drafts.trees == [chain([9, 4, 1])] and not drafts.fallbacks
    seq.append([9, 4, 2])  # 2 drafts accepted + the bonus
    session.verified(seq, rows(3, 3))  # the committed rows: 8, 9, 4 (positions 3, 4, 5)
    (item,) = session.request(2, [seq], 3, features=True).inputs
    assert item.appended == (9, 4, 2)
    assert item.features is not None and item.features[:, 0].tolist() == [3, 4, 5]


def test_a_new_stream_a_refusal_or_a_missing_tree_resends_everything() -> None:
    session = DraftSession(vocab_size=50)
    a, b = joined([1, 2], 3, "a"), joined([4], 5, "b")
    for seq in (a, b):
        session.add(seq, None)
    request = session.request(1, [a, b], 1, epoch=1)
    drafts = session.drafts(request, RoundResponse(1, {"a": chain([7])}))  # b was not kept
    assert drafts.trees == [chain([7]), EMPTY_TREE]
    a.append([7, 9])
    b.append([6])
    request = session.request(2, [a, b], 1, epoch=1)
    assert [i.appended for i in request.inputs] == [(7, 9), (4, 5, 6)]
    refused = session.drafts(request, RoundResponse(2, error="unknown tier"))
    assert not refused.speculative and refused.fallbacks == ["draft_error"]
    assert [i.appended for i in session.request(3, [a], 1, epoch=1).inputs] == [(1, 2, 3, 7, 9)]
    session.drafts(session.request(3, [a], 1, epoch=1), RoundResponse(3, {"a": chain([1])}))
    assert session.request(4, [a], 1, epoch=1).inputs[0].appended == ()  # all seen
    # a reconnected draft (stream 2) holds nothing
    assert session.request(4, [a], 1, epoch=2).inputs[0].appended == (1, 2, 3, 7, 9)
    failed = session.drafts(request, None)
    assert failed.fallbacks == ["draft_failed"] and failed.trees == [EMPTY_TREE] * 2


def test_a_bad_tree_costs_only_its_request() -> None:
    session = DraftSession(vocab_size=50)
    seqs = [joined([1], 2, r) for r in "abcd"] + [joined([1], 2, "e", temperature=0.7)]
    for seq in seqs:
        session.add(seq, None)
    request = session.request(1, seqs, 2)
    response = RoundResponse(
        1,
        {
            "a": chain([3, 4]),
            "b": chain([3, 4, 5]),  # deeper than the tier
            "c": CandidateTree((60,), (-1,)),  # outside the vocabulary
            "e": chain([3]),  # sampled without draft_probs
        },
        malformed={"d": "trees[d].draft_probs: 3 bytes do not hold shape []"},
    )
    drafts = session.drafts(request, response)
    assert drafts.speculative and drafts.trees == [chain([3, 4])] + [EMPTY_TREE] * 4
    assert drafts.fallbacks == ["malformed_tree"] * 4
    # the draft did process every request's tokens, malformed tree or not
    assert [i.appended for i in session.request(2, seqs, 2).inputs] == [()] * 5
    trusted = DraftSession(vocab_size=50, in_process=True)
    trusted.add(seqs[1], None)
    request = trusted.request(1, seqs[1:2], 2)
    assert trusted.drafts(request, RoundResponse(1, {"b": chain([3, 4, 5])})).trees == [
        chain([3, 4, 5])
    ]


def test_released_requests_go_with_the_next_request_once() -> None:
    session = DraftSession(vocab_size=50)
    a, b = joined([1], 2, "a"), joined([3], 4, "b")
    session.add(a, None)
    session.add(b, None)
    session.release("a")
    assert session.request(1, [b], 3).released_request_ids == ("a",)
    assert session.request(2, [b], 3).released_request_ids == ()
    assert session.releases(2) is None
    session.release("b")
    only = session.releases(3)
    assert only is not None and only.released_request_ids == ("b",) and not only.inputs
    session.add(a, None)
    session.release("a")
    session.no_stream()  # nobody holds it: nothing to free
    assert session.releases(4) is None


def test_an_in_process_session_keeps_only_the_last_rows() -> None:
    session = DraftSession(vocab_size=50, in_process=True)
    seq = joined([5, 6, 7], 8)
    session.add(seq, rows(0, 3))
    session.request(1, [seq], 3, features=True)  # no answer: the draft has seen nothing
    seq.append([9])
    session.verified(seq, rows(3, 1))
    with pytest.raises(ValueError, match="only the last round's rows from 3"):
        session.request(2, [seq], 3, features=True)


def test_a_handed_off_prompt_leaves_the_first_round_one_token() -> None:
    """The worked example of `DraftSession.handoff`: the prompt and the rows that predicted its
    tokens go at tier 0; the first round appends the first output token with the last row."""
    session = DraftSession(vocab_size=50)
    seq, seen, short = joined([5, 6, 7], 8), joined([1, 2], 3, "b"), joined([4], 9, "c")
    for s in (seq, seen, short):
        session.add(s, rows(0, len(s.prompt)))
    request = session.request(1, [seen], 1, epoch=1, features=True)
    session.drafts(request, RoundResponse(1, {"b": chain([4])}))  # b's prompt is held
    handoff = session.handoff(2, [seq, seen, short], epoch=1, features=True)
    assert handoff is not None and handoff.speculative_num_steps == 0
    (item,) = handoff.inputs  # b was seen; c's prompt of one token has no row to send
    assert item.request_id == "a" and item.appended == (5, 6, 7)
    assert item.features is not None and item.features[:, 0].tolist() == [0, 1]
    drafts = session.drafts(handoff, RoundResponse(2, {"a": EMPTY_TREE}))
    assert not drafts.fallbacks
    (item,) = session.request(3, [seq], 3, epoch=1, features=True).inputs
    assert item.appended == (8,)
    assert item.features is not None and item.features[:, 0].tolist() == [2]
    assert session.handoff(4, [seq], epoch=1) is None  # nothing left to hand off


def test_a_handoff_frees_the_requests_that_left_before_its_prompts() -> None:
    session = DraftSession(vocab_size=50)
    seq = joined([5, 6, 7], 8)
    session.add(seq, None)
    session.release("gone")  # left after the round now out was sent
    assert session.handoff(1, [], epoch=1) is None  # no prompt: the release waits
    handoff = session.handoff(1, [seq], epoch=1)
    assert handoff is not None and handoff.released_request_ids == ("gone",)
    assert session.request(2, [seq], 3, epoch=1).released_request_ids == ()


def test_a_refused_handoff_sends_the_whole_prompt_in_the_first_round() -> None:
    session = DraftSession(vocab_size=50)
    seq = joined([5, 6, 7], 8)
    session.add(seq, None)
    handoff = session.handoff(1, [seq], epoch=1)
    assert handoff is not None
    session.drafts(handoff, RoundResponse(1, refused={"a": "RESOURCE_EXHAUSTED: no slot"}))
    (item,) = session.request(2, [seq], 3, epoch=1).inputs
    assert item.appended == (5, 6, 7, 8)
    handoff = session.handoff(3, [seq], epoch=2)  # a new stream: the draft holds nothing
    assert handoff is not None and handoff.inputs[0].appended == (5, 6, 7)


def handed_ahead() -> tuple[DraftSession, TargetSequence, RoundRequest]:
    """A session whose request a (prompt [5, 6, 7], first token 8) went in a hand-off counted
    ahead (`handed_ahead`) on stream 1, its answer unread."""
    session = DraftSession(vocab_size=50)
    seq = joined([5, 6, 7], 8)
    session.add(seq, None)
    handoff = session.handoff(1, [seq], epoch=1)
    assert handoff is not None
    session.handed_ahead(handoff)
    return session, seq, handoff


@pytest.mark.parametrize("kept", [True, False])
def test_a_handoff_counted_ahead_lets_the_next_round_continue_the_request(kept: bool) -> None:
    """The worked example of `handed_ahead`: the next round goes out before the hand-off's
    answer, appending the first token flagged `continues`; a refusal in that answer undoes
    the count, and the request goes whole again (unflagged) once that round is answered."""
    session, seq, handoff = handed_ahead()
    (item,) = session.request(2, [seq], 3, epoch=1).inputs
    assert (item.appended, item.continues) == ((8,), True)
    answer = (
        RoundResponse(1, {"a": EMPTY_TREE})
        if kept
        else RoundResponse(1, refused={"a": "RESOURCE_EXHAUSTED: no slot"})
    )
    fallbacks = session.drafts(handoff, answer, ahead=True).fallbacks
    assert fallbacks == ([] if kept else ["draft_refused"])
    round_two = RoundRequest(2, 3, (item,))
    if kept:
        session.drafts(round_two, RoundResponse(2, {"a": chain([9])}))
        (item,) = session.request(3, [seq], 3, epoch=1).inputs
        assert (item.appended, item.continues) == ((), False)  # all held, nothing new yet
    else:  # the draft refuses round 2's `continues` too: it holds nothing of the request
        session.drafts(round_two, RoundResponse(2, refused={"a": "FAILED_PRECONDITION"}))
        (item,) = session.request(3, [seq], 3, epoch=1).inputs
        assert (item.appended, item.continues) == ((5, 6, 7, 8), False)


def test_a_continues_the_draft_refused_is_sent_whole_and_unflagged() -> None:
    """The hand-off's answer never read (its round's request did not go out) and the round
    behind it refused: the request starts afresh, so it is not flagged `continues` again (a
    draft would refuse it every round)."""
    session, seq, _ = handed_ahead()
    (item,) = session.request(2, [seq], 3, epoch=1).inputs
    assert item.continues
    session.drafts(RoundRequest(2, 3, (item,)), RoundResponse(2, refused={"a": "FAILED"}))
    (item,) = session.request(3, [seq], 3, epoch=1).inputs
    assert (item.appended, item.continues) == ((5, 6, 7, 8), False)


def test_a_new_stream_drops_a_handoff_counted_ahead() -> None:
    session, seq, _ = handed_ahead()
    (item,) = session.request(2, [seq], 3, epoch=2).inputs  # the draft reconnected
    assert (item.appended, item.continues) == ((5, 6, 7, 8), False)


@pytest.mark.parametrize("in_process", [False, True])
def test_a_window_sends_the_last_tokens_with_the_rows_that_predicted_them(
    in_process: bool,
) -> None:
    """The worked examples of `DraftSession.handoff` and `request` with a window of 2: the
    draft starts at the history's last two tokens, each with the row that predicted it, and
    after that each round appends as before."""
    session = DraftSession(vocab_size=50, in_process=in_process, window=2)
    seq = joined([5, 6, 7], 8)
    session.add(seq, rows(0, 3))
    handoff = session.handoff(1, [seq], features=True)
    assert handoff is not None
    (item,) = handoff.inputs
    assert item.appended == (6, 7) and item.features is not None
    assert item.features[:, 0].tolist() == [0, 1]  # the rows of 5, 6
    session.drafts(handoff, RoundResponse(1, {"a": chain(())}))
    (item,) = session.request(2, [seq], 3, features=True).inputs
    assert item.appended == (8,) and item.features is not None
    assert item.features[:, 0].tolist() == [2]


def test_a_window_cuts_a_restart_and_a_first_round_without_hand_off() -> None:
    session = DraftSession(vocab_size=50, window=3)
    seq = joined([5, 6, 7, 8, 9], 10)
    session.add(seq, rows(0, 5))
    first = session.request(1, [seq], 1, epoch=1, features=True)
    (item,) = first.inputs
    assert item.appended == (8, 9, 10) and item.features is not None
    assert item.features[:, 0].tolist() == [2, 3, 4]  # as many rows as tokens
    session.drafts(first, RoundResponse(1, {"a": chain([1])}))
    seq.append([11, 12])
    session.verified(seq, rows(5, 2))
    assert session.request(2, [seq], 1, epoch=1).inputs[0].appended == (11, 12)
    # a reconnected draft holds nothing: the last 3 of 8 tokens again
    (item,) = session.request(2, [seq], 1, epoch=2, features=True).inputs
    assert item.appended == (10, 11, 12) and item.features is not None
    assert item.features[:, 0].tolist() == [4, 5, 6]
    short = DraftSession(vocab_size=50, window=8)  # a window longer than the history
    short.add(seq, rows(0, 7))
    assert short.request(1, [seq], 1).inputs[0].appended == (5, 6, 7, 8, 9, 10, 11, 12)


def test_a_window_keeps_only_the_rows_a_later_request_can_ask_for() -> None:
    """300 rounds of random acceptance, failed rounds (resent) and reconnects (restarted at
    the window): every request carries the rows that predicted its tokens, and the target
    keeps a request's rows only from what the draft has not seen, or its window, on."""
    g = random.Random(0)
    session = DraftSession(vocab_size=50, window=4)
    seq = TargetSequence("a", list(range(1, 11)), SamplingParams(), max_new_tokens=2000)
    seq.output.append(11)
    session.add(seq, rows(0, 10))
    log = session.views["a"].features
    assert isinstance(log, FeatureLog)
    epoch, outcomes = 1, collections.Counter[str]()
    for r in range(300):
        length = len(seq.prompt) + len(seq.output)
        (item,) = session.request(r, [seq], 3, epoch=epoch, features=True).inputs
        first = length - len(item.appended)  # the position of its first token
        assert item.features is not None
        assert item.features[:, 0].tolist() == list(range(max(first - 1, 0), length - 1))
        outcome = g.choices(["answer", "fail", "reconnect"], [0.75, 0.2, 0.05])[0]
        outcomes[outcome] += 1
        if outcome == "reconnect":
            epoch += 1
            continue
        request = RoundRequest(r, 3, (item,))
        session.drafts(request, None if outcome == "fail" else RoundResponse(r, {"a": chain([1])}))
        accepted = g.randint(0, 3)
        seq.append(list(range(accepted + 1)))
        session.verified(seq, rows(length - 1, accepted + 1))
        seen = session.views["a"].seen
        assert log.first <= min(seen - 1, log.length - 4)  # what a resend or a restart reads
        # before it, at most the rest of the chunk that holds it (the prompt's 10 rows, a round's 4)
        assert log.first > min(seen - 1, log.length - 4) - 10
    assert min(outcomes.values()) >= 10
