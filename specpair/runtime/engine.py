"""In-process speculative generation: the target's round (`target/target_round.py`) with the draft's
round (`draft/draft_round.py`) answering it in this process instead of over gRPC.

The services run the same two rounds split across processes; this loop is the reference they
are measured against (bench/round_overhead.py), and the tests' and benchmarks' engine (the
demo runs through the services). The round is
async (a service awaits its draft and its compute thread); here nothing it awaits ever
suspends, so `run_inline` drives it to its end without an event loop.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from specpair.runtime.draft.draft_round import DraftRound
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.round_messages import RoundRequest, RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.target_round import Batcher, Flight, TargetRound
from specpair.runtime.target.worker import TargetSequence, TargetWorker, VerifyResult

GREEDY = SamplingParams()
T = TypeVar("T")


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never waits on anything (no event loop needed)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("an in-process round waited on something")


async def inline(fn: Callable[..., T], *args: Any) -> T:
    """Compute in line (`target/target_round.py: Runs`)."""
    return fn(*args)


class InProcessDraft:
    """The `DraftTransport` to a drafter in this process: `send` answers at once, as the draft
    service would; `receive` hands the answers back in order."""

    connected = True

    def __init__(self, drafter: Drafter) -> None:
        self.round = DraftRound(drafter)
        self.features = drafter.needs_features
        self.states: dict[int, SpecRuntimeState] = {}  # tier → the state both sides run
        self._answers: collections.deque[RoundResponse] = collections.deque()

    def epochs(self, seqs: Sequence[TargetSequence]) -> int:
        return 0  # one drafter that never loses a request's state

    async def send(self, request: RoundRequest) -> int:
        state = self.states[request.speculative_num_steps]
        # The plans a service makes while its peer computes (`prepare`), made in line.
        self.round.drafter.prepare([item.request_id for item in request.inputs], state)
        self._answers.append(self.round.answer(request, state))
        return 0

    async def receive(self, round_id: int, sent: int) -> RoundResponse | None:
        return self._answers.popleft()

    async def receive_each(self, rounds: Sequence[tuple[int, int]]) -> list[RoundResponse | None]:
        return [self._answers.popleft() for _ in rounds]


class InProcessRounds:
    """Rounds of a target and a drafter in this process (`drafter` None: plain decoding), one
    `step` at a time: the engine's, and the GPU benchmarks' (`bench/gpu_common.RoundLoop`)."""

    def __init__(self, target: TargetWorker, drafter: Drafter | None, window: int = 0) -> None:
        self.target = target
        eagle = drafter is not None and drafter.needs_features
        self.session = DraftSession(
            target.model.args.vocab_size, in_process=True, features=eagle, window=window
        )
        self.draft = InProcessDraft(drafter) if drafter is not None else None
        self.round: TargetRound[TargetSequence] = TargetRound(
            target, self.session, self.draft, inline
        )
        self.round_id = 0

    def prefill(self, seqs: Sequence[TargetSequence]) -> None:
        for seq, features in zip(seqs, self.target.prefill(seqs), strict=True):
            self.session.add(seq, features)

    def start(
        self, seqs: list[TargetSequence], state: SpecRuntimeState | None, steps: list[int]
    ) -> Flight[TargetSequence]:
        """Starts a round of `seqs` at `state` (None: plain decoding), each at its `steps`: its
        request built and drafted."""
        self.round_id += 1
        if self.draft is not None and state is not None:
            self.draft.states[state.tier] = state
        return run_inline(self.round.start(self.round_id, seqs, seqs, state, steps))

    def finish(self, flight: Flight[TargetSequence], batcher: Batcher[TargetSequence]) -> None:
        """Verifies, accepts and commits a started round; `batcher` gets each outcome."""
        run_inline(self.round.run(flight, batcher))

    def step(
        self,
        seqs: list[TargetSequence],
        state: SpecRuntimeState | None,
        steps: list[int],
        batcher: Batcher[TargetSequence],
    ) -> Flight[TargetSequence]:
        flight = self.start(seqs, state, steps)
        self.finish(flight, batcher)
        return flight

    def release(self, seq: TargetSequence) -> None:
        self.target.release(seq)
        if self.draft is not None:
            self.draft.round.release(seq.request_id)


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


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    accept_lengths: list[int] = field(default_factory=list)


class _Outcomes:
    """The engine's `Batcher`: rounds do not overlap; each request's accept lengths are kept
    (with a drafter), and a finished one is released from the draft."""

    def __init__(self, session: DraftSession, seqs: Sequence[TargetSequence], drafting: bool):
        self.session, self.drafting = session, drafting
        self.accept_lengths: dict[str, list[int]] = {s.request_id: [] for s in seqs}

    async def next_round(self, done: Flight[TargetSequence]) -> None:
        return None

    async def awaiting_draft(self, flight: Flight[TargetSequence], answer: Awaitable[T]) -> T:
        return await answer  # nobody to admit: the batch is fixed

    def stream(self, seq: TargetSequence, result: VerifyResult, drafted: bool, steps: int) -> None:
        if self.drafting:
            self.accept_lengths[seq.request_id].append(result.acceptance.accept_length)
        if seq.finish_reason is not None:
            self.session.release(seq.request_id)


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
        request_steps: Sequence[int] | None = None,
        draft_window: int = 0,
    ) -> list[GenerationResult]:
        """`request_steps`: per prompt its own tier, at most `state`'s (the round's);
        `draft_window`: the tokens of each prompt the drafter starts from (0: all)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        seqs = [
            TargetSequence(f"r{i}", list(p), sp, max_new_tokens, stop_token_ids)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        if request_steps is not None and len(request_steps) != len(seqs):
            raise ValueError(f"request_steps: {len(request_steps)} tiers for {len(seqs)} prompts")
        own = dict(zip((s.request_id for s in seqs), request_steps or (), strict=False))
        rounds = InProcessRounds(self.target, self.drafter, draft_window)
        rounds.prefill(seqs)
        outcomes = _Outcomes(rounds.session, seqs, self.drafter is not None)
        running = [s for s in seqs if s.finish_reason is None]
        while running:
            tier = state.tier if state is not None else 0
            steps = [own.get(s.request_id, tier) for s in running]
            t0 = time.perf_counter()
            flight = rounds.step(running, state, steps, outcomes)
            t3 = time.perf_counter()
            draft_s, verify_s = flight.sent - t0, flight.verified - flight.sent
            self.times.draft += draft_s
            self.times.verify += verify_s
            self.times.accept += t3 - flight.verified
            self.times.rounds += 1
            self.times.per_round.append((draft_s, verify_s, t3 - flight.verified))
            self.times.gpu_ms.append((gpu_ms(self.drafter), gpu_ms(self.target)))
            running = [s for s in running if s.finish_reason is None]
        for seq in seqs:
            rounds.release(seq)
        return [
            GenerationResult(s.request_id, s.output, s.finish_reason or "length", accepts)
            for s, accepts in zip(seqs, outcomes.accept_lengths.values(), strict=True)
        ]
