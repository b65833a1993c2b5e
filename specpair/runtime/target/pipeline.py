"""The target's side of pipelined rounds (the draft's is `runtime/draft/pipeline.py`): the
pre-drafts the draft sends while the target verifies, and which of them the next round uses.

A pipelined round (`RoundRequest.predraft`) is answered twice: the round's trees (and which
pre-drafted inputs the draft went on from), then its pre-drafts of the next round, read after
the verify they were drafted behind. When every input was pre-drafted the verify need not wait
at all: the first response is deferred and read after it too.

    unpipelined:  send → receive (trees) → verify
    pipelined:    send → receive (trees) → verify → receive (pre-drafts)
    all hits:     send → verify (pre-drafted trees) → receive (adoptions) → receive (pre-drafts)

Off, nothing here runs: the round holds no `Predrafts` (`--pipeline off`), or a round that does
not go out pipelined gets no `Ahead`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpair.config import PipelineMode, same_device
from specpair.logging import get_logger
from specpair.runtime.round import RoundRequest, RoundResponse, StageTimings
from specpair.runtime.target.session import Drafts, DraftSession
from specpair.runtime.target.transport import DraftTransport
from specpair.runtime.tree import CandidateTree

log = get_logger(__name__)
# request id → (accepted, bonus) → (its pre-drafted tree, the tier it was drafted at)
Book = dict[str, dict[tuple[int, int], tuple[CandidateTree, int]]]


def pipelines(draft: DraftTransport, mode: PipelineMode, device: str) -> bool:
    """Whether rounds may go out pipelined: the draft pre-drafts, and `mode` is on, or auto with
    the draft on another device (sharing one, its pre-drafts would slow the verify they are
    meant to hide behind; under auto `PipelineChoice` then decides round by round)."""
    if not draft.draft_pipeline or mode is PipelineMode.OFF:
        return False
    if mode is PipelineMode.ON:
        return True
    return same_device(draft.draft_device, device) is False


@dataclass(slots=True)
class _Arm:
    """Decayed sums of one way of running rounds (pipelined or not) at one tier and batch."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds

    @property
    def rate(self) -> float:  # tokens/s
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _Contest:
    """Pipelined against sequential rounds at one (tier, batch bucket): each is run for a block
    of `PROBE` rounds, then the faster one for `EXPLOIT` rounds, then the slower one is probed
    again, for ever. A pipelined round's pre-drafts pay off in the round after it, so the two
    are compared over blocks of rounds, not round by round."""

    arms: tuple[_Arm, _Arm] = field(default_factory=lambda: (_Arm(), _Arm()))  # seq, pipelined
    pipelined: bool = False  # the mode of the block being run
    left: int = 0  # rounds left in it
    probes: int = 0  # blocks run so far while not both ways were measured
    exploiting: bool = False  # the block being run is the winner's
    winner: bool | None = None  # pipelined won the last comparison; None: not compared yet
    streak: int = 0  # comparisons in a row the winner has won


class PipelineChoice:
    """`--pipeline auto` with the draft on its own device: pipelined rounds only where they
    decode faster here, measured. Whether they do depends on how long the draft's pre-drafts
    take against the verify they hide behind, on the hit rate (greedy against sampled, the
    batch) and on the tier, so each (tier, batch bucket, sampled or not) keeps its own contest
    of tokens/s (decayed sums over rounds, `ROUND_DECAY`). Pipelining has to win by `MARGIN` to
    be run between probes: a tie goes to the simpler sequential round. A winner that keeps
    winning is probed against less often (its block doubles, up to 16 × `EXPLOIT`), so a way
    that loses by half costs 16 rounds once and then under 0.2 % of the rounds.

    Worked example: tier 7, batch 1, greedy: 16 sequential rounds at 7.1 ms with 5.2 tokens
    each (732 tok/s), 16 pipelined at 6.4 ms with 4.9 (766 tok/s, 4.6 % faster): the next 512
    rounds go out pipelined, then 16 sequential ones; if pipelined wins again, 1024, and so on."""

    PROBE = 16
    EXPLOIT = 512
    MARGIN = 0.02
    ROUND_DECAY = 0.995  # ~200 rounds of memory: follows a change of workload within a probe

    def __init__(self) -> None:
        self._contests: dict[tuple[int, int, bool], _Contest] = {}

    @staticmethod
    def key(tier: int, batch: int, sampled: bool) -> tuple[int, int, bool]:
        return tier, 1 << max(batch - 1, 0).bit_length(), sampled  # batch 1, 2, 4, 8, …

    def pipelined(self, tier: int, batch: int, sampled: bool = False) -> bool:
        """Whether the round about to start at `tier` with `batch` requests (`sampled`: any of
        them) goes out pipelined."""
        contest = self._contests.setdefault(self.key(tier, batch, sampled), _Contest())
        if contest.left <= 0:
            contest.pipelined, contest.left = self._next_block(contest, tier, batch)
        contest.left -= 1
        return contest.pipelined

    def observe(
        self, tier: int, batch: int, sampled: bool, pipelined: bool, tokens: int, seconds: float
    ) -> None:
        """A finished round: `tokens` emitted over its `seconds` (its start to the next's)."""
        contest = self._contests.get(self.key(tier, batch, sampled))
        if contest is not None and seconds > 0:
            contest.arms[pipelined].add(tokens, seconds, self.ROUND_DECAY)

    def rates(self, tier: int, batch: int, sampled: bool = False) -> tuple[float, float]:
        """(sequential, pipelined) tokens/s measured there; 0 where not yet."""
        contest = self._contests.get(self.key(tier, batch, sampled))
        return (contest.arms[0].rate, contest.arms[1].rate) if contest else (0.0, 0.0)

    def _next_block(self, contest: _Contest, tier: int, batch: int) -> tuple[bool, int]:
        if contest.probes < 2:  # sequential first, then pipelined
            contest.probes += 1
            return contest.probes == 2, self.PROBE
        sequential, pipelined = (arm.rate for arm in contest.arms)
        faster = pipelined > sequential * (1 + self.MARGIN)
        if contest.exploiting:  # the winner ran its block: measure the other way again
            contest.exploiting = False
            return not faster, self.PROBE
        contest.streak = contest.streak + 1 if faster == contest.winner else 0
        if faster != contest.winner:
            log.info(
                "pipeline auto",
                tier=tier,
                batch=batch,
                pipelined=faster,
                sequential_tok_s=round(sequential),
                pipelined_tok_s=round(pipelined),
            )
        contest.exploiting, contest.winner = True, faster
        return faster, self.EXPLOIT << min(contest.streak, 4)


@dataclass(eq=False, slots=True)
class Ahead:
    """One pipelined round's pre-drafts: those it may use, and what came of them."""

    book: Book  # the pre-drafts of the round verified just before it
    hits: dict[str, CandidateTree] = field(default_factory=dict)  # verified from a pre-draft
    misses: int = 0  # requests whose outcome had no pre-draft
    deferred: bool = False  # all pre-drafted: the first response is read after the verify
    predraft_ms: float = 0.0  # the draft's own time pre-drafting the next round

    def take(self, request_id: str, appended: tuple[int, ...], steps: int) -> bool:
        """Whether the outcome `appended` (k drafts accepted, then the bonus) was pre-drafted
        for the request at its tier; a request pipelined last round without one is a miss."""
        kept = self.book.get(request_id)
        if kept is None:
            return False
        hit = kept.get((len(appended) - 1, appended[-1]))
        if hit is None or hit[1] != steps:
            self.misses += 1
            return False
        self.hits[request_id] = hit[0]
        return True

    def pending(self, request: RoundRequest) -> Drafts | None:
        """The round's trees when every input was pre-drafted (its verify need not wait for
        the response, read after it), else None."""
        if not request.inputs or not all(item.predrafted for item in request.inputs):
            return None
        self.deferred = True
        ids = tuple(item.request_id for item in request.inputs)
        return Drafts([self.hits[i] for i in ids], StageTimings(), True, [], ids)


class Predrafts:
    """The pre-drafts of the round just verified, kept for the next round to look up."""

    def __init__(self, mode: PipelineMode, device: str) -> None:
        self.mode, self.device = mode, device
        self.choice = PipelineChoice() if mode is PipelineMode.AUTO else None
        self._book: Book = {}

    def pipelined(self, draft: DraftTransport | None) -> bool:
        """Whether rounds may go out pipelined (under auto, `choice` picks which do)."""
        return draft is not None and pipelines(draft, self.mode, self.device)

    def begin(
        self, draft: DraftTransport, tier: int, batch: int, sampled: bool = False
    ) -> Ahead | None:
        """A round's `Ahead` when it goes out pipelined, else None; the pre-drafts kept so far
        are its alone either way."""
        book, self._book = self._book, {}
        if not self.pipelined(draft):
            return None
        if self.choice is not None and not self.choice.pipelined(tier, batch, sampled):
            return None
        return Ahead(book)

    def observe(
        self, tier: int, batch: int, sampled: bool, pipelined: bool, tokens: int, seconds: float
    ) -> None:
        """A finished chain round with drafts, for auto's choice."""
        if self.choice is not None:
            self.choice.observe(tier, batch, sampled, pipelined, tokens, seconds)

    async def after_verify(
        self,
        ahead: Ahead,
        request: RoundRequest,
        epoch: int,
        draft: DraftTransport,
        session: DraftSession,
    ) -> int:
        """A pipelined round's answers read after its verify: the deferred response (its
        adoptions), then the pre-drafts of the next round, kept; returns how many of those
        were refused."""
        if ahead.deferred:
            deferred = await draft.receive(request.round_id, epoch)
            session.drafts(request, deferred, ahead.hits)
        second = await draft.receive(request.round_id, epoch)
        ahead.predraft_ms = second.timings.total_ms if second is not None else 0.0
        return self.keep(request, second, session)

    def keep(
        self, request: RoundRequest, response: RoundResponse | None, session: DraftSession
    ) -> int:
        """Keeps the pre-drafts that `response` (a pipelined round's second answer) brings for
        `request`'s outcomes, checked as any tree; returns how many were refused."""
        self._book = {}
        refused = 0
        if response is None:
            return 0
        asked = {item.request_id: item for item in request.inputs}
        for request_id, predrafts in response.predrafts.items():
            item = asked.get(request_id)
            if item is None or request_id not in session.views:
                continue  # not asked for, or it left
            depth = item.steps or request.speculative_num_steps
            kept = self._book.setdefault(request_id, {})
            for p in predrafts[: session.max_tree_nodes]:
                why = session.fault(p.tree, item, depth)
                known = 0 <= p.accepted <= depth and 0 <= p.bonus < session.vocab_size
                if why is None and not known:
                    why = f"outcome ({p.accepted}, {p.bonus}) outside [0, {depth}] x vocabulary"
                if why is not None:
                    log.warning("malformed pre-draft", request_id=request_id, error=why)
                    refused += 1
                    continue
                kept[(p.accepted, p.bonus)] = (p.tree, depth)
        return refused
