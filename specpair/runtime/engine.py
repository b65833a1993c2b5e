"""In-process speculative generation: draft s steps → verify → accept → roll the draft back.

The services run the same stages split across processes; this loop is the reference they are
measured against (bench/round_overhead.py) and the engine of the offline demo. It speaks the
round protocol in process: a `DraftSession` builds each RoundRequest, the drafter answers it
here (`draft_in_process`) instead of over gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.draft.pipeline import Pipeline
from specpair.runtime.round import RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.worker import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE, CandidateTree

GREEDY = SamplingParams()


@dataclass
class StageTimes:
    """Seconds spent per stage, summed over rounds."""

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0  # bookkeeping: accept lengths, finished requests, EAGLE features
    rounds: int = 0
    per_round: list[tuple[float, float, float]] = field(
        default_factory=list
    )  # (draft, verify, accept)
    gpu_ms: list[tuple[float, float]] = field(default_factory=list)  # (draft, verify) graphs


def draft_in_process(
    drafter: Drafter,
    session: DraftSession,
    round_id: int,
    seqs: Sequence[TargetSequence],
    state: SpecRuntimeState,
    steps: Sequence[int] | None = None,
    pipeline: Pipeline | None = None,
) -> list[CandidateTree]:
    """One round's draft side without a service: the RoundRequest the draft service would get
    (releases first), extended and drafted here; the trees align with `seqs` (`steps`: each
    one's tier, at most the state's; 0: not drafted). With a `pipeline` the round is
    pipelined as over the wire, its pre-drafts made here before the verify (in one process
    nothing overlaps: this is the protocol's reference, not a speed-up)."""
    request = session.request(
        round_id, seqs, state.tier, features=drafter.needs_features, steps=steps,
        predraft=pipeline is not None,
    )  # fmt: skip
    for request_id in request.released_request_ids:
        (pipeline or drafter).release(request_id)
    adopted = pipeline.begin(request.inputs, state) if pipeline is not None else []
    fresh = [item for item in request.inputs if not item.predrafted]
    if not fresh:
        trees = []
    elif pipeline is not None and state.tier > 0:
        trees = pipeline.draft(fresh, state)
    else:
        trees = drafter.draft(fresh, state)
    ids = [item.request_id for item in fresh]
    response = RoundResponse(round_id, dict(zip(ids, trees, strict=True)), adopted=tuple(adopted))
    drafts = session.drafts(request, response).aligned([s.request_id for s in seqs])
    if request.predraft and pipeline is not None:
        ahead = RoundResponse(round_id, predrafts=pipeline.predraft(request.inputs, state))
        session.predrafted(request, ahead)
    return drafts


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    accept_lengths: list[int] = field(default_factory=list)


class SpeculativeEngine:
    """Runs a batch of requests to completion at a fixed tier (no drafter: plain decoding)."""

    def __init__(
        self, target: TargetWorker, drafter: Drafter | None, *, pipeline_width: int = 0
    ) -> None:
        """`pipeline_width` > 0: rounds run pipelined (see `draft_in_process`)."""
        self.target = target
        self.drafter = drafter
        self.pipeline = (
            Pipeline(drafter, pipeline_width) if drafter is not None and pipeline_width else None
        )
        self.times = StageTimes()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        state: SpecRuntimeState | None,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        stop_token_ids: frozenset[int] = frozenset(),
        request_steps: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """`request_steps`: per prompt its own tier, at most `state`'s (the round's)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        seqs = [
            TargetSequence(f"r{i}", list(p), sp, max_new_tokens, stop_token_ids)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        accept_lengths: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        if request_steps is not None and len(request_steps) != len(seqs):
            raise ValueError(f"request_steps: {len(request_steps)} tiers for {len(seqs)} prompts")
        own = dict(zip((s.request_id for s in seqs), request_steps or (), strict=False))
        session = DraftSession(self.target.model.args.vocab_size, in_process=True)
        eagle = self.drafter is not None and self.drafter.needs_features
        for seq, features in zip(seqs, self.target.prefill(seqs), strict=True):
            session.add(seq, features if eagle else None)
        running = [s for s in seqs if s.finish_reason is None]
        round_id = 0
        while running:
            t0 = time.perf_counter()
            if self.drafter is not None and state is not None:
                round_id += 1
                # The plans a service makes while its peer computes (`prepare`), made in line.
                self.drafter.prepare([s.request_id for s in running], state)
                steps = [own.get(s.request_id, state.tier) for s in running]
                trees = draft_in_process(
                    self.drafter, session, round_id, running, state, steps, self.pipeline
                )
            else:
                trees = [EMPTY_TREE] * len(running)
            t1 = time.perf_counter()
            if self.drafter is not None and state is not None:
                self.target.prepare(running, state)
            results = self.target.verify(running, trees, state)
            t2 = time.perf_counter()
            still = []
            for seq, res in zip(running, results, strict=True):
                if self.drafter is not None:
                    accept_lengths[seq.request_id].append(res.acceptance.accept_length)
                session.verified(seq, res.features if eagle else None)
                if seq.finish_reason is None:
                    still.append(seq)
                else:
                    session.release(seq.request_id)
            running = still
            t3 = time.perf_counter()
            self.times.draft += t1 - t0
            self.times.verify += t2 - t1
            self.times.accept += t3 - t2
            self.times.rounds += 1
            self.times.per_round.append((t1 - t0, t2 - t1, t3 - t2))
            self.times.gpu_ms.append((gpu_ms(self.drafter), gpu_ms(self.target)))
        for seq in seqs:
            self.target.release(seq)
            if self.drafter is not None:
                (self.pipeline or self.drafter).release(seq.request_id)
        return [
            GenerationResult(
                s.request_id, s.output, s.finish_reason or "length", accept_lengths[s.request_id]
            )
            for s in seqs
        ]
