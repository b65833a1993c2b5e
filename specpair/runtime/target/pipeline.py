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
    """Whether rounds go out pipelined: the draft pre-drafts, and `mode` is on, or auto with
    the draft on another device (sharing one, its pre-drafts would slow the verify they are
    meant to hide behind)."""
    if not draft.draft_pipeline or mode is PipelineMode.OFF:
        return False
    if mode is PipelineMode.ON:
        return True
    return same_device(draft.draft_device, device) is False


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
        self._book: Book = {}

    def pipelined(self, draft: DraftTransport | None) -> bool:
        return draft is not None and pipelines(draft, self.mode, self.device)

    def begin(self, draft: DraftTransport) -> Ahead | None:
        """A round's `Ahead` when it goes out pipelined, else None; the pre-drafts kept so far
        are its alone either way."""
        book, self._book = self._book, {}
        return Ahead(book) if self.pipelined(draft) else None

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
