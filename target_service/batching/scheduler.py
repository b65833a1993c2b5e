"""Continuous batching: admission, cancels, tiers and the loop; the round itself is
`TargetRound`'s (`specpair/runtime/target/target_round.py`), over a `DraftPool` (a `DraftLink` per
draft replica).

One asyncio task drives every round; model compute runs through `Compute` (inline on a GPU, on
one worker thread on the CPU). New requests are admitted while a round is out to the draft: their
prompts ride in its verify (`TargetWorker.verify`'s riders) where it has the rows, or are prefilled
beside the draft's work, and they join the round after it — between rounds only when none is out
(an empty batch, tier 0); finished or cancelled ones leave at a round boundary, and their draft
state is released with the next RoundRequest. A round starts when its RoundRequest goes out: right
after the previous round's verify (`next_round`, which the round calls before it streams), so that
streaming results, metrics, round statistics and admissions overlap the draft's work instead of
delaying it. A tier command takes effect when the next round starts, never inside one.

Tiers (`batch_tiers.py`): the batch's, and optionally each request's. A round runs at
the state of the largest tier among its requests; each request's chain is drafted to its own
tier (a shorter tree in the same verify). A request at tier 0 is not sent to the draft (the
`DraftSession` sends what it missed when its tier turns positive), and a round whose requests
are all at tier 0 decodes without calling the draft at all.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable
from typing import TypeVar

from torch import Tensor

from specpair.config import DEFAULT_MAX_WATCHERS
from specpair.logging import get_logger
from specpair.rpc.metrics import ServiceMetrics
from specpair.rpc.serving import Compute, settle, settle_budget
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.target_round import Flight, TargetRound
from specpair.runtime.target.worker import TargetWorker, VerifyResult
from specpair.tier_estimate import RegimeSteps
from target_service.batching.batch_tiers import Tiers
from target_service.batching.round_feed import RoundFeed
from target_service.batching.served import RoundEvent, ServedRequest
from target_service.drafts.draft_pool import DraftPool

log = get_logger(__name__)
T = TypeVar("T")

# The prompt tokens a prefill may take while a round's answer is awaited (`awaiting_draft`).
# The answer's deadline is at least `draft_deadline_floor_s` (1 s); 1024 tokens are ~16 TFLOP
# of an 8B's prefill (tens of ms on an H100) and ~140 of a 70B's, shared by its GPUs.
WAIT_PREFILL_TOKENS = 1024


class QueueFullError(RuntimeError):
    """More requests waiting than max_queue."""


class Scheduler:
    def __init__(
        self,
        worker: TargetWorker,
        states: dict[TreeShape, SpecRuntimeState],
        *,
        initial_tier: TreeShape,
        max_batch: int,
        max_queue: int,
        join_group: int = 1,
        max_watchers: int = DEFAULT_MAX_WATCHERS,
        draft: DraftPool | None,
        metrics: ServiceMetrics,
        threads: int = 1,
        device: str = "cpu",
        handoff: bool = True,
        handoff_ahead: bool = True,
        join_settle_s: float = 0.0,
        join_wait_s: float = 0.0,
        feed_at_tier_0: bool = False,
        draft_window: int = 0,
    ) -> None:
        self.worker = worker
        self.handoff = handoff  # joins' prompts go to the draft beside a round (`_admit_beside`)
        self.join_settle_s = join_settle_s  # `awaiting_draft`: the loop turns before a join
        self.states = states
        self.tiers = Tiers(states, initial_tier, metrics)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.join_group = join_group  # `_admit`: joins a running batch takes at once, under load
        self.join_wait_s = join_wait_s  # `_waits_for_group`: the longest a join waits
        self._group_held = False  # the last `_admit` held a group back (`_waits_for_group`)
        self.metrics = metrics
        self.compute = Compute("target-compute", threads, device)
        self.session = DraftSession(worker.model.args.vocab_size, window=draft_window)
        self.queue: collections.deque[ServedRequest] = collections.deque()
        self.running: list[ServedRequest] = []
        self.round_id = 0
        self.recent_accepts: collections.deque[int] = collections.deque(maxlen=256)
        self._wakeup = asyncio.Event()
        self._arrived = asyncio.Event()  # set by a submit: `awaiting_draft` admits beside
        self.feed = RoundFeed(metrics, max_watchers)  # each round's RoundStats, for WatchRounds
        self.round: TargetRound[ServedRequest] = TargetRound(
            worker,
            self.session,
            draft,
            self.compute,
            metrics=metrics,
            publish=self.feed.publish,
            feed_at_tier_0=feed_at_tier_0,
            handoff_ahead=handoff_ahead,
        )
        self._draft = draft

    @property
    def draft(self) -> DraftPool | None:
        return self._draft

    @draft.setter
    def draft(self, link: DraftPool | None) -> None:
        self._draft = self.round.draft = link

    # ---- called from the servicer -------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFullError(f"{len(self.queue)} requests already queued (max_queue)")
        self.queue.append(request)
        self.metrics.queued.set(len(self.queue))
        self._wakeup.set()
        self._arrived.set()

    def cancel(self, request: ServedRequest, outcome: str = "cancelled") -> None:
        """Leaves the batch at the next round boundary; its KV is freed on both services."""
        request.cancelled = outcome
        self._wakeup.set()

    def apply_tier(
        self,
        tier: TreeShape,
        reason: str,
        request_steps: dict[str, TreeShape] | None = None,
        regimes: RegimeSteps | None = None,
    ) -> TreeShape:
        """Queues a tier switch (with per-request and per-regime tiers) for the next round;
        returns the batch tier active now."""
        return self.tiers.ask(tier, reason, request_steps, regimes)

    @property
    def tier(self) -> TreeShape:
        return self.tiers.batch

    @property
    def avg_accept_length(self) -> float:
        n = len(self.recent_accepts)
        return sum(self.recent_accepts) / n if n else 0.0

    def _running_ids(self) -> set[str]:
        return {r.seq.request_id for r in self.running}

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        flight: Flight[ServedRequest] | None = None  # a round already started: its request is out
        while True:
            if flight is None:
                self.tiers.switch(self.round_id, self._running_ids())
                self._drop_cancelled()
                if not self.running and not self.queue:
                    await self.round.send_releases(self.round_id)
                    if self.queue:  # submitted while the releases were in flight
                        continue
                    # No await between this check and clear(): a submit cannot slip in unseen.
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
            try:
                if flight is None:
                    t0 = time.perf_counter()
                    await self._admit()
                    if not self.running:
                        if self.queue and self.worker.cache.free_slots == 0:
                            await self._no_room()
                        continue
                    flight = await self._start(list(self.running), time.perf_counter() - t0)
                drafted = flight.request is not None
                flight = await self.round.run(flight, self)  # the next round is out, or None
                self._drop_cancelled(keep=flight)
                # Inline compute with no draft to wait for never suspends: without this a batch
                # would run to its end before a submit, a cancel or a tier could land.
                if self.compute.executor is None and not drafted:
                    await settle(budget_s=settle_budget(len(self.running)))
                else:
                    await asyncio.sleep(0)
            except Exception:
                # A bug must not hang every client: fail this batch loudly, keep serving.
                log.exception("round failed", round_id=self.round_id)
                riders, flight = (flight.riders if flight is not None else []), None
                self._fail_admitted(riders)
                for req in list(self.running):
                    req.events.put_nowait(RoundEvent([], -1, self.tier.steps, "error"))
                    self._finish(req, "error")

    async def _no_room(self) -> None:
        """Requests wait, none runs, and no KV slot is free: slots leaked. Waiting for the next
        submit or cancel keeps health and GetServerInfo answering; looping would starve the
        event loop (it spun at 100 % CPU and ignored SIGTERM)."""
        log.error("no free KV slot with an empty batch", queued=len(self.queue))
        self._wakeup.clear()
        await self._wakeup.wait()

    def _drop_cancelled(self, keep: Flight[ServedRequest] | None = None) -> None:
        """Cancelled requests leave, except those in `keep`'s batch: they leave after its round."""
        for req in [r for r in self.queue if r.cancelled]:
            self.queue.remove(req)
            self.metrics.requests.labels("cancelled").inc()
        flying = keep.batch if keep is not None else []
        for req in [r for r in self.running if r.cancelled and r not in flying]:
            self._finish(req, req.cancelled or "cancelled")

    def _finish(self, req: ServedRequest, outcome: str) -> None:
        self.running.remove(req)
        self.tiers.forget(req.seq.request_id)
        self.worker.release(req.seq)
        self.session.release(req.seq.request_id)
        self.metrics.requests.labels(outcome).inc()
        self.metrics.running.set(len(self.running))

    async def _admit(
        self, max_tokens: int | None = None, ride: Flight[ServedRequest] | None = None
    ) -> list[ServedRequest]:
        """Prefills queued requests into the batch, as many as fit (in order, their prompts
        `max_tokens` at most together); returns those admitted. With `ride` (a round whose
        draft works) they ride in its verify instead where the worker `rides` them: they join
        the batch after it (`_seat`)."""
        new: list[ServedRequest] = []
        self._group_held = False
        riding = len(ride.riders) if ride is not None else 0
        room = min(self.max_batch - len(self.running) - riding, self.worker.cache.free_slots)
        if self.running and room < min(self.join_group, len(self.queue)):
            # Under load, requests join `join_group` at a time: a prefill reads every weight
            # however few its prompts (an 8B's on an H100: 1 prompt 8.9 ms, 4 in 14.3, in its
            # graphs; bench/CHOICES.md), and it holds the whole batch. Room grows as running
            # requests finish, so this waits at most until it fits.
            return []
        budget = max_tokens
        while self.queue and len(new) < room:
            if budget is not None:
                budget -= len(self.queue[0].seq.prompt)
                if budget < 0:
                    break
            req = self.queue.popleft()
            if req.expired:  # its client gave up while it queued: not worth a prefill
                req.events.put_nowait(RoundEvent([], -1, self.tier.steps, "expired"))
                self.metrics.requests.labels("expired").inc()
                continue
            new.append(req)
        self.metrics.queued.set(len(self.queue))
        if not new:
            return []
        riders = self._ride(ride, new) if ride is not None else []
        admitted, new = new, new[len(riders) :]
        if not new:
            return admitted
        if ride is not None and self._waits_for_group(new, room - len(riders)):
            self.queue.extendleft(reversed(new))  # in their order, ahead of later arrivals
            self._group_held = True
            self.metrics.queued.set(len(self.queue))
            return riders
        seqs = [r.seq for r in new]
        try:
            feats = await self.compute(self.worker.prefill, seqs)
        except Exception:
            # These requests are in neither the queue nor the batch: answer and free them
            # here, or their clients wait forever and their KV slots are lost.
            log.exception("prefill failed", requests=[s.request_id for s in seqs])
            self._fail_admitted(new)
            return []
        self.metrics.joins.labels("prefill").inc(len(new))
        self._join(new, feats)
        return admitted

    def _waits_for_group(self, new: list[ServedRequest], room: int) -> bool:
        """Whether `new`, to be prefilled beside a drafted round, wait for more: with half the
        batch or more running, until `join_group` have queued (at most the room there is), or
        the first of them has waited `join_wait_s`. At 64 clients a drafted batch of ~47
        admitted its joiners ~2.4 a round, each a prefill beside the draft on the same GPU
        (one read of the weights, and a joining round's fixed costs): a join cost the batch
        12–14 ms sampled against the target alone's 3 (H200, bench/RESULTS.md). Max batch 64
        (group 8), 40 running, 3 queued for 20 ms of 100: they wait."""
        if 2 * len(self.running) < self.max_batch:
            return False
        need = min(self.join_group, room)
        return len(new) < need and time.monotonic() - new[0].arrived < self.join_wait_s

    def _fail_admitted(self, admitted: list[ServedRequest]) -> None:
        """Requests taken from the queue whose prompt failed to run (a prefill, or the verify
        they rode in): in neither the queue nor the batch, they are answered and freed here, or
        their clients wait forever and their KV slots are lost."""
        for req in admitted:
            self.worker.release(req.seq)
            req.events.put_nowait(RoundEvent([], -1, self.tier.steps, "error"))
            self.metrics.requests.labels("error").inc()

    def _ride(self, flight: Flight[ServedRequest], new: list[ServedRequest]) -> list[ServedRequest]:
        """The longest run of `new` from its first whose prompts ride in `flight`'s verify
        (`TargetWorker.rides`, beside any riding already), their slots allocated; the rest are
        prefilled apart."""
        riding = [len(seq.prompt) for seq in flight.rider_seqs]
        prompts = [len(r.seq.prompt) for r in new]
        n = len(new)
        while n and not self.worker.rides(
            flight.state, len(flight.seqs), riding + prompts[:n], prompts[n:]
        ):
            n -= 1
        for req in new[:n]:
            req.seq.slot = self.worker.cache.alloc()
            flight.riders.append(req)
            flight.rider_seqs.append(req.seq)
        self.metrics.joins.labels("ride").inc(n)
        return new[:n]

    def _join(self, new: list[ServedRequest], feats: list[Tensor | None]) -> None:
        """Prefilled requests join the batch, each first token to its client."""
        for req, f in zip(new, feats, strict=True):
            self.session.add(req.seq, f)
            self.running.append(req)
            req.events.put_nowait(
                RoundEvent(list(req.seq.output), -1, self.tier.steps, req.seq.finish_reason)
            )
            if req.seq.finish_reason is not None:
                self._finish(req, req.seq.finish_reason)
        self.metrics.running.set(len(self.running))

    async def _seat(self, done: Flight[ServedRequest]) -> None:
        """The riders of `done`, prefilled in its verify, join the batch; their prompts go to
        the draft now, answered before the next round's request is built (which would else
        send them whole)."""
        riders, done.riders, done.rider_seqs = done.riders, [], []
        self._join(riders, self.worker.rode)
        joined = [r.seq for r in riders if r in self.running]
        if joined and self.handoff and done.request is not None:
            self.round_id += 1
            await self.round.hand_over(done, self.round_id, joined)

    async def awaiting_draft(self, flight: Flight[ServedRequest], answer: Awaitable[T]) -> T:
        """The draft's answer to `flight`, awaited (`Batcher`). Requests queued as the wait
        starts, or else the first to arrive before the answer, are admitted beside the draft's
        work (`_admit_beside`), once a round, and join the next round. A request that arrives
        while the draft works (where a client whose last request just finished sends its
        next: the finished one streams once the next round is out) then joins one round
        sooner than were it admitted only as a round starts.

        Those queued are prefilled before the answer is awaited. A prefill during the wait
        runs inside the answer's deadline (`DraftLink.receive`), on a GPU with the event loop
        held, so it takes at most `WAIT_PREFILL_TOKENS` of prompt: a large prompt waits for
        the next round's start rather than have a punctual draft benched as late."""
        if self.queue:
            if self.join_settle_s > 0:
                # The round just streamed (`TargetRound.run`) and the inline prefill holds the
                # loop: without turns first, the streams' writes wait for it.
                await settle(budget_s=self.join_settle_s)
            await self._admit_beside(flight)
            if not self._group_held:
                return await answer
        reply = asyncio.ensure_future(answer)
        try:
            # One admission a round; a group held back tries again at each arrival.
            while True:
                self._arrived.clear()
                arrival = asyncio.ensure_future(self._arrived.wait())
                try:
                    await asyncio.wait((reply, arrival), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    arrival.cancel()
                if reply.done() or not self.queue:
                    break
                await self._admit_beside(flight, WAIT_PREFILL_TOKENS)
                if not self._group_held:
                    break
            return await reply
        finally:
            reply.cancel()  # done: nothing; this task cancelled: the read goes with it

    async def _admit_beside(
        self, flight: Flight[ServedRequest], max_tokens: int | None = None
    ) -> None:
        """Admits queued requests while `flight`'s draft works, riding in its verify or
        prefilled now (`_admit`): they join the round after it.

        Admitting between rounds instead would hold the whole batch through the prefill with
        the draft idle, then through the draft with the target idle: at batch 8 (EAGLE-3,
        sampled, H100) a join cost the batch 23 ms against 10.9 ms without speculation.
        """
        t0, generation = time.perf_counter(), self.worker.cache.generation
        new = await self._admit(max_tokens, ride=flight)
        if self.worker.cache.generation != generation:  # a slot was taken (or freed)
            await self.round.replan(flight)  # the verify's plan named the old slots
            joined = [r.seq for r in new if r in self.running]
            if joined and self.handoff:
                self.round_id += 1
                await self.round.handoff(flight, self.round_id, joined)
            flight.beside_s += time.perf_counter() - t0

    async def _start(self, batch: list[ServedRequest], admit_s: float) -> Flight[ServedRequest]:
        """Starts a round of `batch` at its tiers: its RoundRequest goes out."""
        self.round_id += 1
        sampled = any(not r.seq.sampling.greedy for r in batch)
        tiers = self.tiers.of([r.seq.request_id for r in batch], sampled)
        state = self.states[max(tiers)]
        seqs = [r.seq for r in batch]
        steps = [t.steps for t in tiers]  # a tree round caps each request at its own depth
        return await self.round.start(self.round_id, batch, seqs, state, steps, admit_s)

    # ---- what the round asks of the batching (`Batcher`) ---------------------------------

    async def next_round(self, done: Flight[ServedRequest]) -> Flight[ServedRequest] | None:
        """The round after `done` with every running request (those admitted beside `done`
        too), started now; None where requests wait and `done` went out to no draft (they are
        admitted between rounds, after `done` has streamed)."""
        if done.riders:
            await self._seat(done)
        self.tiers.switch(self.round_id, self._running_ids())
        ready = [r for r in self.running if r.seq.finish_reason is None and not r.cancelled]
        if not ready or (self.queue and done.request is None):
            return None  # admitted between rounds (none is out to admit beside)
        return await self._start(ready, 0.0)

    def stream(self, req: ServedRequest, result: VerifyResult, drafted: bool, steps: int) -> None:
        """A request's new tokens to its client; a finished one leaves the batch."""
        accept = result.acceptance.accept_length if drafted else -1
        if drafted:
            req.accept_lengths.append(accept)
            self.recent_accepts.append(accept)
        else:
            req.plain_rounds += 1
        req.events.put_nowait(RoundEvent(result.new_tokens, accept, steps, req.seq.finish_reason))
        if req.seq.finish_reason is not None and req in self.running:
            self._finish(req, req.seq.finish_reason)
