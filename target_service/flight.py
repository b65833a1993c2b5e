"""A round in flight: from its RoundRequest going out to its verify, and the draft's answers.

An unpipelined round reads one response, its trees, before the verify. A pipelined round
(`RoundRequest.predraft`) is answered twice: the round's trees (and which pre-drafted inputs
the draft went on from), then its pre-drafts of the next round, read after the verify they
were drafted behind. When every input was pre-drafted the verify need not wait at all: the
first response is deferred and read after it too.

    unpipelined:  send → receive (trees) → verify
    pipelined:    send → receive (trees) → verify → receive (pre-drafts)
    all hits:     send → verify (pre-drafted trees) → receive (adoptions) → receive (pre-drafts)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specpair.config import PipelineMode, same_device
from specpair.metrics import ServiceMetrics
from specpair.runtime.round import RoundRequest, StageTimings
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.session import Drafts, DraftSession
from specpair.runtime.tree import EMPTY_TREE
from target_service.draft_pool import DraftPool
from target_service.served import ServedRequest


def pipelines(link: DraftPool | None, mode: PipelineMode, device: str) -> bool:
    """Whether rounds go out pipelined: the draft pre-drafts, and `mode` is on, or auto with
    the draft on another device (sharing one, its pre-drafts would slow the verify they are
    meant to hide behind)."""
    if link is None or not link.draft_pipeline or mode is PipelineMode.OFF:
        return False
    if mode is PipelineMode.ON:
        return True
    return same_device(link.draft_device, device) is False


@dataclass(eq=False, slots=True)
class Flight:
    """One round from its start, when its RoundRequest goes out, to its verify."""

    round_id: int
    batch: list[ServedRequest]
    state: SpecRuntimeState
    started: float  # perf_counter at the start
    admit_s: float  # admission (prefill) just before the start
    steps: list[int] = field(default_factory=list)  # each request's tier, aligned with batch
    request: RoundRequest | None = None  # None: no draft stream was open, or tier 0
    epoch: int | None = None  # the draft stream the request went out on; None: it did not
    hit_ids: frozenset[str] = frozenset()  # pipelined: requests whose tree was pre-drafted
    misses: int = 0  # pipelined requests whose outcome had no pre-draft
    deferred: bool = False  # all pre-drafted: the response is read after the verify
    wait_s: float = 0.0  # the target waited for the draft's messages
    predraft_ms: float = 0.0  # the draft's own time pre-drafting the next round

    async def drafts(
        self, link: DraftPool | None, session: DraftSession, metrics: ServiceMetrics
    ) -> Drafts:
        """The round's checked trees from the draft service (and its timings); empty trees when
        it is unavailable, with the reason counted."""
        ids = tuple(r.seq.request_id for r in self.batch)
        if self.request is None or link is None:
            # A round at tier 0 went without drafts by choice: no fallback to count.
            why = [] if self.state.tier == 0 and link is not None else ["no_draft"]
            drafts = Drafts([EMPTY_TREE] * len(ids), StageTimings(), False, why, ids)
        elif self.epoch is not None and (hits := session.pending_hits(self.request)):
            drafts, self.deferred = hits, True  # every tree pre-drafted: verify at once
        else:
            response = None
            if self.epoch is not None:
                t0 = time.perf_counter()
                response = await link.receive(self.round_id, self.epoch)
                self.wait_s += time.perf_counter() - t0
            drafts = session.drafts(self.request, response)
        for reason in drafts.fallbacks:
            metrics.fallback_rounds.labels(reason).inc()
        return drafts

    async def after_verify(
        self, link: DraftPool | None, session: DraftSession, metrics: ServiceMetrics
    ) -> None:
        """A pipelined round's answers read after its verify: the deferred response (its
        adoptions), then the pre-drafts of the next round."""
        request = self.request
        if link is None or request is None or not request.predraft or self.epoch is None:
            return
        t0 = time.perf_counter()
        if self.deferred:
            session.drafts(request, await link.receive(self.round_id, self.epoch))
        second = await link.receive(self.round_id, self.epoch)
        self.wait_s += time.perf_counter() - t0
        self.predraft_ms = second.timings.total_ms if second is not None else 0.0
        if refused := session.predrafted(request, second):
            metrics.fallback_rounds.labels("malformed_predraft").inc(refused)
