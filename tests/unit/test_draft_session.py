"""The target's draft session: what goes to the draft each round, and which trees come back."""

from __future__ import annotations

import pytest
import torch

from specpair.config import PipelineMode
from specpair.runtime.round import Predraft, RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.pipeline import PipelineChoice, Predrafts
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


class Pipelining:
    """A draft that pre-drafts (`DraftTransport`'s say in it)."""

    draft_pipeline, draft_device = True, "cpu"


def test_predrafts_are_checked_and_only_the_actual_outcome_is_used() -> None:
    session = DraftSession(vocab_size=50)
    book = Predrafts(PipelineMode.ON, "cpu")
    seq = joined([5, 6, 7], 8)
    session.add(seq, None)
    ahead = book.begin(Pipelining(), 1, 1)  # type: ignore[arg-type]
    assert ahead is not None
    first = session.request(1, [seq], 3, predrafted=ahead.take)
    assert first.predraft
    session.drafts(first, RoundResponse(1, {"a": chain([9, 4, 1])}))
    good = Predraft(2, 2, chain([30, 31, 32]))
    bad = [
        Predraft(2, 3, chain([30, 31, 99])),  # a token outside the vocabulary
        Predraft(5, 3, chain([1, 2, 3])),  # more accepted than the chain had
        Predraft(1, 3, chain([1, 2, 3, 4])),  # deeper than the tier
    ]
    assert book.keep(first, RoundResponse(1, predrafts={"a": (good, *bad)}), session) == 3
    seq.append([9, 4, 2])  # the outcome (2, 2): pre-drafted
    ahead = book.begin(Pipelining(), 1, 1)  # type: ignore[arg-type]
    assert ahead is not None
    second = session.request(2, [seq], 3, predrafted=ahead.take)
    assert second.inputs[0].predrafted and ahead.pending(second) is not None
    assert ahead.pending(second).trees == [good.tree]  # type: ignore[union-attr]
    # The draft could not go on from that fork: it re-prefills the request next round.
    session.drafts(second, RoundResponse(2, adopted=()), ahead.hits)
    book.keep(second, RoundResponse(2), session)
    seq.append([30, 31, 32, 6])
    ahead = book.begin(Pipelining(), 1, 1)  # type: ignore[arg-type]
    assert ahead is not None
    (third,) = session.request(3, [seq], 3, predrafted=ahead.take).inputs
    assert not third.predrafted and third.appended == (5, 6, 7, 8, 9, 4, 2, 30, 31, 32, 6)
    assert ahead.misses == 0  # nothing was pre-drafted for this round: not a miss


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


def run_blocks(
    choice: PipelineChoice, rounds: int, rate: dict[bool, float], tier: int = 7, batch: int = 1
) -> list[bool]:
    """`rounds` rounds of 10 tokens each at `rate[pipelined]` tokens/s; the modes chosen."""
    modes = []
    for _ in range(rounds):
        pipelined = choice.pipelined(tier, batch)
        choice.observe(tier, batch, False, pipelined, 10, 10 / rate[pipelined])
        modes.append(pipelined)
    return modes


def test_auto_probes_both_ways_then_runs_the_faster_and_probes_again() -> None:
    choice = PipelineChoice()
    probe, exploit = PipelineChoice.PROBE, PipelineChoice.EXPLOIT
    modes = run_blocks(choice, 2 * probe + exploit + probe, {False: 100.0, True: 150.0})
    assert modes[:probe] == [False] * probe  # sequential first
    assert modes[probe : 2 * probe] == [True] * probe
    assert modes[2 * probe : 2 * probe + exploit] == [True] * exploit  # pipelined won
    assert modes[2 * probe + exploit :][:probe] == [False] * probe  # the loser, measured again
    # pipelined wins again: its next block is twice as long
    modes = run_blocks(choice, 2 * exploit + probe, {False: 100.0, True: 150.0})
    assert modes[: 2 * exploit] == [True] * (2 * exploit) and not modes[2 * exploit]
    assert choice.rates(7, 1) == pytest.approx((100.0, 150.0))


def test_auto_keeps_sequential_rounds_unless_pipelining_wins_by_the_margin() -> None:
    for pipelined_rate, wins in [(101.0, False), (70.0, False), (104.0, True)]:
        choice = PipelineChoice()
        modes = run_blocks(
            choice, 2 * PipelineChoice.PROBE + 10, {False: 100.0, True: pipelined_rate}
        )
        assert modes[-10:] == [wins] * 10, pipelined_rate


def test_auto_measures_each_tier_and_batch_bucket_apart() -> None:
    choice = PipelineChoice()
    n = 2 * PipelineChoice.PROBE + 5
    assert run_blocks(choice, n, {False: 100.0, True: 200.0}, tier=7, batch=1)[-1]
    assert not run_blocks(choice, n, {False: 100.0, True: 50.0}, tier=7, batch=8)[-1]
    assert not run_blocks(choice, n, {False: 100.0, True: 50.0}, tier=3, batch=1)[-1]
    assert PipelineChoice.key(7, 5, False) == PipelineChoice.key(7, 8, False)
    assert PipelineChoice.key(7, 8, False) != PipelineChoice.key(7, 9, False)
    assert PipelineChoice.key(7, 8, False) != PipelineChoice.key(7, 8, True)
    assert choice.pipelined(7, 1)  # each contest kept its own state


def test_predrafts_under_auto_send_a_round_pipelined_only_when_the_choice_says() -> None:
    book = Predrafts(PipelineMode.AUTO, "cpu")
    elsewhere = Pipelining()
    elsewhere.draft_device = "cuda:1"
    assert book.pipelined(elsewhere)  # type: ignore[arg-type]
    begun = (book.begin(elsewhere, 3, 1) for _ in range(2 * PipelineChoice.PROBE))  # type: ignore[arg-type]
    sent = [ahead is not None for ahead in begun]
    assert sent == [False] * PipelineChoice.PROBE + [True] * PipelineChoice.PROBE
    assert book.begin(Pipelining(), 3, 1) is None  # type: ignore[arg-type]  # same device: never
