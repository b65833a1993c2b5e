"""In-process speculative generation: draft s steps → verify → accept → roll the draft back.

The services run the same stages split across processes; this loop is the reference they are
measured against (bench/round_overhead.py) and the engine of the offline demo.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpair.runtime.draft import Drafter, DraftInput
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE

GREEDY = SamplingParams()


@dataclass
class StageTimes:
    """Seconds spent per stage, summed over rounds."""

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0  # bookkeeping: finished requests, appended tokens, next inputs
    rounds: int = 0
    per_round: list[tuple[float, float, float]] = field(
        default_factory=list
    )  # (draft, verify, accept)
    gpu_ms: list[tuple[float, float]] = field(default_factory=list)  # (draft, verify) graphs


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    accept_lengths: list[int] = field(default_factory=list)


class SpeculativeEngine:
    """Runs a batch of requests to completion at a fixed tier (no drafter: plain decoding)."""

    def __init__(self, target: TargetWorker, drafter: Drafter | None) -> None:
        self.target = target
        self.drafter = drafter
        self.times = StageTimes()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        state: SpecRuntimeState | None,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> list[GenerationResult]:
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        seqs = [
            TargetSequence(f"r{i}", list(p), sp, max_new_tokens, stop_token_ids)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        accept_lengths: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        features = self.target.prefill(seqs)
        # What each request appended since the draft last saw it: prompt + first token.
        pending = {
            s.request_id: DraftInput(s.request_id, (*s.prompt, *s.output), s.sampling, f)
            for s, f in zip(seqs, features, strict=True)
        }
        running = [s for s in seqs if s.finish_reason is None]
        while running:
            t0 = time.perf_counter()
            # The plans a service makes while its peer computes (`prepare`), made in line here.
            if self.drafter is not None and state is not None:
                self.drafter.prepare([s.request_id for s in running], state)
                trees = self.drafter.round([pending[s.request_id] for s in running], state)
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
                if seq.finish_reason is None:
                    pending[seq.request_id] = DraftInput(
                        seq.request_id, tuple(res.new_tokens), seq.sampling, res.features
                    )
                    still.append(seq)
                elif self.drafter is not None:
                    self.drafter.release(seq.request_id)
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
                self.drafter.release(seq.request_id)
        return [
            GenerationResult(
                s.request_id, s.output, s.finish_reason or "length", accept_lengths[s.request_id]
            )
            for s in seqs
        ]
