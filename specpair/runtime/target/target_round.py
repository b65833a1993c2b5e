"""The target's round, for the target service, the in-process engine and the benchmarks alike.

    start  draft-request: the RoundRequest goes out through the `DraftTransport` (gRPC to a
           draft service, or a drafter in this process); the verify is planned meanwhile
    run    the trees come back → verify → accept → commit → the next round starts → each
           request's tokens stream → the round's RoundStats publish

Who runs and at which tier is the caller's (the scheduler's batching, or the engine's loop), as
is streaming: `run` asks its `Batcher` for the next round after the verify, and starts it
before this one streams, so that streaming and publishing overlap the draft's work. What goes
to the draft and what comes back is the `DraftSession`'s.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from specpair.runtime.round_messages import RoundRequest, RoundResponse, RoundStats, StageTimings
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target.session import Drafts, DraftSession
from specpair.runtime.target.transport import DraftTransport
from specpair.runtime.target.worker import TargetSequence, TargetWorker, VerifyResult
from specpair.runtime.tree import EMPTY_TREE

if TYPE_CHECKING:  # the service's counters; the engine keeps none
    from specpair.rpc.metrics import ServiceMetrics

B = TypeVar("B")  # what the caller batches: the served request, or the sequence itself
T = TypeVar("T")


class Runs(Protocol):
    """Where model compute runs (`specpair.rpc.serving.Compute`: inline, or on a worker thread)."""

    def __call__(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]: ...


@dataclass(eq=False, slots=True)
class Flight(Generic[B]):
    """One round from its start, when its RoundRequest goes out, to its stats."""

    round_id: int
    batch: list[B]
    seqs: list[TargetSequence]  # aligned with batch
    state: SpecRuntimeState | None  # None: plain decoding, no tier's stages
    steps: list[int]  # each request's tier, aligned with batch
    started: float  # perf_counter at the start
    admit_s: float = 0.0  # admission (prefill) just before the start
    beside_s: float = 0.0  # admission while its draft worked (within the round, not before)
    request: RoundRequest | None = None  # None: no draft stream was open, or tier 0
    epoch: int | None = None  # what `send` returned for `receive`; None: it did not go out
    sent: float = 0.0  # perf_counter once the request is out (the start, without one)
    verified: float = 0.0  # perf_counter after the verify
    wait_s: float = 0.0  # the target waited for the draft's messages
    # prompts of requests admitted beside it, sent after it (`TargetRound.handoff`): the
    # request, and what `send` returned for `receive`
    handoff: tuple[RoundRequest, int] | None = None
    handoff_s: float = 0.0  # waiting for the hand-off's answer, after the verify
    handoff_send_s: float = 0.0  # building and sending the hand-off (within beside_s)
    # requests admitted while its draft worked whose prompts ride in its verify
    # (`TargetWorker.verify`): the batcher's items and their sequences, slots allocated
    riders: list[B] = field(default_factory=list)
    rider_seqs: list[TargetSequence] = field(default_factory=list)
    # a hand-off sent ahead of its request on the stream, answered first (`hand_over` with
    # `handoff_ahead`): the request, and what `send` returned for `receive`
    ahead: tuple[RoundRequest, int] | None = None


class Batcher(Protocol[B]):
    """What the round asks of the one who batches (the scheduler; the engine)."""

    async def next_round(self, done: Flight[B]) -> Flight[B] | None:
        """Starts the round after `done` now, or returns None (none is ready yet)."""
        ...

    def stream(self, item: B, result: VerifyResult, drafted: bool, steps: int) -> None:
        """One request's outcome of the round (`drafted`: it was verified with drafts)."""
        ...

    async def awaiting_draft(self, flight: Flight[B], answer: Awaitable[T]) -> T:
        """Awaits `answer`, the draft's to `flight`; the batcher may admit requests meanwhile
        (beside the draft's work) to join the next round."""
        ...


class TargetRound(Generic[B]):
    def __init__(
        self,
        worker: TargetWorker,
        session: DraftSession,
        draft: DraftTransport | None,
        compute: Runs,
        *,
        metrics: ServiceMetrics | None = None,
        publish: Callable[[RoundStats], None] | None = None,
        feed_at_tier_0: bool = False,
        handoff_ahead: bool = True,
    ) -> None:
        self.worker, self.session, self.draft, self.compute = worker, session, draft, compute
        self.metrics = metrics
        self.publish = publish
        self.feed_at_tier_0 = feed_at_tier_0  # `feed`'s switch
        self.handoff_ahead = handoff_ahead  # `hand_over`'s switch
        self._ahead: tuple[RoundRequest, int] | None = None  # out, for the next request to carry

    async def start(
        self,
        round_id: int,
        batch: list[B],
        seqs: list[TargetSequence],
        state: SpecRuntimeState | None,
        steps: list[int],
        admit_s: float = 0.0,
    ) -> Flight[B]:
        """Starts a round: its RoundRequest goes out (when a draft is connected and the tier
        is positive) and, while the draft works, the verify is planned."""
        flight = Flight(round_id, batch, seqs, state, steps, time.perf_counter(), admit_s)
        flight.sent, draft = flight.started, self.draft
        if draft is None or not draft.connected:
            self._ahead = None  # its stream is gone, and the answer with it
            self.session.no_stream()
            return flight
        if state is None or state.tier == 0:
            await self.read_ahead()  # no request of this round follows it
            if state is not None and self.feed_at_tier_0:
                await self.feed(flight, draft)
            return flight  # target-only: no drafts (releases wait for a round)
        flight.request = self.session.request(
            round_id,
            seqs,
            state.tier,
            epoch=draft.epochs(seqs),
            features=draft.features,
            steps=steps,
            shape=None if state.is_chain else state.shape,
        )
        flight.ahead, self._ahead = self._ahead, None
        flight.epoch = await draft.send(flight.request)
        flight.sent = time.perf_counter()
        await self.replan(flight)
        return flight

    async def replan(self, flight: Flight[B]) -> None:
        """Plans the verify of `flight`, out to its draft, ahead (again after an admission
        beside it: a slot's allocation voids the plan)."""
        state = flight.state
        if flight.epoch is None or state is None or not state.verify_stage().plans_ahead:
            return
        depths = None if min(flight.steps) == state.tier else flight.steps
        await self.compute(self.worker.prepare, flight.seqs, state, depths, flight.rider_seqs)

    async def run(self, flight: Flight[B], batcher: Batcher[B]) -> Flight[B] | None:
        """Finishes a started round: trees → verify → accept → commit → (the next round starts)
        → stream → publish. Returns the next round, when `batcher` started one."""
        seqs = flight.seqs
        drafts = await self._drafts(flight, batcher)  # the answer to the request sent at `start`
        trees = drafts.aligned([seq.request_id for seq in seqs])
        t1 = time.perf_counter()
        # verify + accept + commit: every tree in one forward, each accepted path's KV kept
        results = await self.compute(
            self.worker.verify, seqs, trees, flight.state, flight.rider_seqs
        )
        flight.verified = time.perf_counter()
        if self.metrics is not None:
            self.metrics.accepts.labels(self.worker.last_accept).inc()
        for seq, res in zip(seqs, results, strict=True):
            self.session.verified(seq, res.features)  # EAGLE: the committed rows' features
        await self._handoff_answer(flight)  # it follows the round's own on the stream
        following = await batcher.next_round(flight)  # out before this one streams
        drafted = []  # the requests verified with drafts (the rest decoded plainly)
        for i, (item, tree, res) in enumerate(zip(flight.batch, trees, results, strict=True)):
            with_drafts = drafts.speculative and len(tree) > 0
            if with_drafts:
                drafted.append(i)
                if self.metrics is not None:
                    self.metrics.accept_length.observe(res.acceptance.accept_length)
            batcher.stream(item, res, with_drafts, flight.steps[i])
        end = following.started if following is not None else time.perf_counter()
        if self.publish is not None:
            self.publish(round_stats(flight, drafts, results, drafted, t1, end, self.worker))
        return following

    async def _drafts(self, flight: Flight[B], batcher: Batcher[B]) -> Drafts:
        """The round's checked trees (and the draft's timings); empty trees when the draft is
        unavailable, with the reason counted."""
        request, draft = flight.request, self.draft
        if request is None or draft is None:
            # A round at tier 0 went without drafts by choice: no fallback to count.
            tier = flight.state.tier if flight.state is not None else 0
            why = [] if tier == 0 and draft is not None else ["no_draft"]
            ids = tuple(seq.request_id for seq in flight.seqs)
            drafts = Drafts([EMPTY_TREE] * len(ids), StageTimings(), False, why, ids)
        else:
            t0, beside_s = time.perf_counter(), flight.beside_s
            response = await batcher.awaiting_draft(flight, self._receive(flight, draft))
            # what the batcher admitted meanwhile is admission, not waiting
            flight.wait_s += time.perf_counter() - t0 - (flight.beside_s - beside_s)
            drafts = self.session.drafts(request, response)
        self._count(drafts.fallbacks)
        return drafts

    async def _receive(self, flight: Flight[B], draft: DraftTransport) -> RoundResponse | None:
        """The draft's answer to `flight`, read after that to a hand-off sent ahead of it;
        None where its request did not go out."""
        ahead, flight.ahead = flight.ahead, None
        if flight.epoch is None:
            return None
        if ahead is None:
            return await draft.receive(flight.round_id, flight.epoch)
        request, sent = ahead
        rounds = [(request.round_id, sent), (flight.round_id, flight.epoch)]
        handed, response = await draft.receive_each(rounds)
        self._take(request, handed, ahead=True)
        return response

    async def read_ahead(self) -> None:
        """The answer to a hand-off sent ahead (`hand_over`) that no request followed."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await self._answer(*ahead, ahead=True)

    async def handoff(self, flight: Flight[B], round_id: int, seqs: list[TargetSequence]) -> None:
        """Sends the draft the prompts of `seqs`, admitted while `flight`'s draft works
        (`DraftSession.handoff`), behind `flight`'s request on the same streams: the draft
        extends them while this target verifies `flight`, where their first round would
        otherwise carry them (a join's whole prompt and its features on the round's path).
        `run` reads the answer after `flight`'s own."""
        draft = self.draft
        if draft is None or not draft.connected or flight.epoch is None or flight.handoff:
            return
        t0 = time.perf_counter()
        request = self.session.handoff(
            round_id, seqs, epoch=draft.epochs(seqs), features=draft.features
        )
        if request is None:
            return
        sent = await draft.send(request)
        if sent is not None:
            flight.handoff = (request, sent)
        flight.handoff_send_s += time.perf_counter() - t0

    async def feed(self, flight: Flight[B], draft: DraftTransport) -> None:
        """A round at tier 0: sends the draft every token of `flight` it has not seen (a tier-0
        request: it only extends), behind nothing, answered after the verify as a hand-off
        is. Without it a request decoded at tier 0 for n tokens sends all n (with an EAGLE
        head, n feature rows) in its next round at a positive tier, on that round's path."""
        request = self.session.feed(
            flight.round_id, flight.seqs, epoch=draft.epochs(flight.seqs), features=draft.features
        )
        if (sent := await draft.send(request)) is not None:
            flight.handoff = (request, sent)

    async def hand_over(self, flight: Flight[B], round_id: int, seqs: list[TargetSequence]) -> None:
        """Hands the draft the prompts of `seqs` now, after `flight`'s verify: the riders of
        `flight`, prefilled in its verify, ahead of their first round. With `handoff_ahead`
        (the default) leaves its answer for the next round's request to carry (`start`): that
        round goes out at once behind it, these requests counted as seen and flagged
        `continues`, and its answer is read after the hand-off's (`_receive`); without, awaits
        it (measured: 5-10 % slower at 8 and 32 clients on an H200, RESULTS)."""
        await self.handoff(flight, round_id, seqs)
        if self.handoff_ahead and flight.handoff is not None:
            self._ahead, flight.handoff = flight.handoff, None
            self.session.handed_ahead(self._ahead[0])
            return
        await self._handoff_answer(flight)

    async def _handoff_answer(self, flight: Flight[B]) -> None:
        """The answer to `flight`'s hand-off, if one is out: each prompt the draft took counts
        as seen; a refused or lost one is sent whole in its first round, as without a hand-off.
        Answered, `flight` may send another (its riders', `hand_over`)."""
        if flight.handoff is None:
            return
        (request, sent), flight.handoff = flight.handoff, None
        t0 = time.perf_counter()
        await self._answer(request, sent)
        flight.handoff_s += time.perf_counter() - t0

    async def _answer(self, request: RoundRequest, sent: int, *, ahead: bool = False) -> None:
        """Reads the answer to a hand-off (or a tier-0 feed) into the session (`ahead`: it
        counted the prompts when they went out, `handed_ahead`)."""
        assert self.draft is not None
        self._take(request, await self.draft.receive(request.round_id, sent), ahead=ahead)

    def _take(self, request: RoundRequest, response: RoundResponse | None, *, ahead: bool) -> None:
        self._count(self.session.drafts(request, response, ahead=ahead).fallbacks)

    def _count(self, fallbacks: list[str]) -> None:
        if self.metrics is not None:
            for reason in fallbacks:
                self.metrics.fallback_rounds.labels(reason).inc()

    async def send_releases(self, round_id: int) -> None:
        """Frees on the draft the requests that left when no round follows to carry them."""
        draft = self.draft
        if draft is not None and draft.connected:
            await self.read_ahead()  # its answer comes first on the stream
            request = self.session.releases(round_id)
            if request is not None and (epoch := await draft.send(request)) is not None:
                await draft.receive(request.round_id, epoch)


def round_stats(
    flight: Flight[Any],
    drafts: Drafts,
    results: list[VerifyResult],
    drafted: list[int],
    verify_start: float,
    end: float,
    worker: TargetWorker,
) -> RoundStats:
    """The round's account: `drafted` indexes the requests verified with drafts; the round ends
    where the next one starts (rounds tile time), or at `end`; `worker`'s last verify gives
    its GPU time and rows."""
    seqs, draft = flight.seqs, drafts.timings
    rtt_s = verify_start - flight.started  # the request going out to its trees
    verify_s = flight.verified - verify_start
    total_s = flight.admit_s + end - flight.started  # the round's share of the wall time
    rpc_ms = 1e3 * (rtt_s - flight.beside_s) - draft.total_ms - draft.draft_host_ms
    timings = StageTimings(
        draft_ms=draft.draft_ms,
        extend_ms=draft.extend_ms,
        draft_host_ms=draft.draft_host_ms,
        draft_gpu_ms=draft.draft_gpu_ms,
        verify_ms=1e3 * verify_s,
        verify_gpu_ms=gpu_ms(worker),
        rpc_ms=max(rpc_ms, 0.0) if drafts.speculative else 0.0,
        schedule_ms=1e3 * max(total_s - rtt_s - verify_s - flight.admit_s - flight.handoff_s, 0),
        total_ms=1e3 * total_s,
        wait_ms=1e3 * flight.wait_s,
        admit_ms=1e3 * (flight.admit_s + flight.beside_s + flight.handoff_s),
        handoff_ms=1e3 * (flight.handoff_send_s + flight.handoff_s),
    )
    plain = set(range(len(seqs))).difference(drafted)
    state = flight.state
    return RoundStats(
        round_id=flight.round_id,
        speculative_num_steps=state.tier if state is not None else 0,
        batch_size=len(seqs),
        accept_lengths=tuple(results[i].acceptance.accept_length for i in drafted),
        speculative=drafts.speculative,
        timings=timings,
        unix_time=time.time(),
        request_ids=tuple(seqs[i].request_id for i in drafted),
        request_steps=tuple(flight.steps[i] for i in drafted),
        plain_request_ids=tuple(seqs[i].request_id for i in sorted(plain)),
        sampled_requests=sum(not seq.sampling.greedy for seq in seqs),
        shape=None if state is None or state.is_chain else state.shape,
        verify_rows=worker.last_rows,
    )
