"""Continuous batching and the round loop: admit → start (draft, remote) → verify → stream.

One asyncio task drives every round; model compute runs through `Compute` (inline on a GPU, on
one worker thread on the CPU). New requests are prefilled and join at the next round boundary;
finished or cancelled ones leave there, and their draft state is released with the next
RoundRequest. What goes to the draft and what comes back is the `DraftSession`'s business; the
wire is the `DraftPool`'s (a `DraftLink` per draft replica); which answer a round reads when
(pipelined: some after its verify), the `Flight`'s. A round starts when its RoundRequest goes
out: right after the previous round's verify when nobody waits for admission, so that
streaming results, metrics and round statistics overlap the draft's work instead of delaying
it. A tier command takes effect when the next round starts, never inside one.

Tiers (`target_service/tiers.py`): the batch's, and optionally each request's. A round runs at
the state of the largest tier among its requests; each request's chain is drafted to its own
tier (a shorter tree in the same verify). A request at tier 0 is not sent to the draft (the
`DraftSession` sends what it missed when its tier turns positive), and a round whose requests
are all at tier 0 decodes without calling the draft at all.
"""

from __future__ import annotations

import asyncio
import collections
import time

from specpair.config import DEFAULT_MAX_WATCHERS, PipelineMode
from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.worker import TargetWorker
from specpair.serving import Compute, settle, settle_budget
from specpair.tiers import RegimeSteps
from target_service.draft_pool import DraftPool
from target_service.flight import Flight, pipelines
from target_service.round_feed import RoundFeed
from target_service.served import RoundEvent, ServedRequest
from target_service.tiers import Tiers

log = get_logger(__name__)


class QueueFullError(RuntimeError):
    """More requests waiting than max_queue."""


class Scheduler:
    def __init__(
        self,
        worker: TargetWorker,
        states: dict[int, SpecRuntimeState],
        *,
        initial_steps: int,
        max_batch: int,
        max_queue: int,
        max_watchers: int = DEFAULT_MAX_WATCHERS,
        draft: DraftPool | None,
        metrics: ServiceMetrics,
        threads: int = 1,
        device: str = "cpu",
        pipeline: PipelineMode = PipelineMode.OFF,
    ) -> None:
        self.worker = worker
        self.states = states
        self.tiers = Tiers(states, initial_steps, metrics)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.draft = draft
        self.metrics = metrics
        self.compute = Compute("target-compute", threads, device)
        self.device, self.pipeline = device, pipeline
        self.session = DraftSession(worker.model.args.vocab_size)
        self.queue: collections.deque[ServedRequest] = collections.deque()
        self.running: list[ServedRequest] = []
        self.round_id = 0
        self.recent_accepts: collections.deque[int] = collections.deque(maxlen=256)
        self._wakeup = asyncio.Event()
        self.feed = RoundFeed(metrics, max_watchers)  # each round's RoundStats, for WatchRounds

    # ---- called from the servicer -------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFullError(f"{len(self.queue)} requests already queued (max_queue)")
        self.queue.append(request)
        self.metrics.queued.set(len(self.queue))
        self._wakeup.set()

    def cancel(self, request: ServedRequest, outcome: str = "cancelled") -> None:
        """Leaves the batch at the next round boundary; its KV is freed on both services."""
        request.cancelled = outcome
        self._wakeup.set()

    def apply_tier(
        self,
        tier: int,
        reason: str,
        request_steps: dict[str, int] | None = None,
        regimes: RegimeSteps | None = None,
    ) -> int:
        """Queues a tier switch (with per-request and per-regime tiers) for the next round;
        returns the batch tier active now."""
        return self.tiers.ask(tier, reason, request_steps, regimes)

    @property
    def tier(self) -> int:
        return self.tiers.batch

    @property
    def avg_accept_length(self) -> float:
        n = len(self.recent_accepts)
        return sum(self.recent_accepts) / n if n else 0.0

    def _running_ids(self) -> set[str]:
        return {r.seq.request_id for r in self.running}

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        flight: Flight | None = None  # a round already started: its RoundRequest is out
        while True:
            if flight is None:
                self.tiers.switch(self.round_id, self._running_ids())
                self._drop_cancelled()
                if not self.running and not self.queue:
                    await self._flush_releases()
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
                flight = await self._verify(flight)
                # Inline compute with no draft to wait for never suspends: without this a batch
                # would run to its end before a submit, a cancel or a tier could land.
                if self.compute.executor is None and not drafted:
                    await settle(budget_s=settle_budget(len(self.running)))
                else:
                    await asyncio.sleep(0)
            except Exception:
                # A bug must not hang every client: fail this batch loudly, keep serving.
                log.exception("round failed", round_id=self.round_id)
                flight = None
                for req in list(self.running):
                    req.events.put_nowait(RoundEvent([], -1, self.tier, "error"))
                    self._finish(req, "error")

    async def _no_room(self) -> None:
        """Requests wait, none runs, and no KV slot is free: slots leaked. Waiting for the next
        submit or cancel keeps health and GetServerInfo answering; looping would starve the
        event loop (it spun at 100 % CPU and ignored SIGTERM)."""
        log.error("no free KV slot with an empty batch", queued=len(self.queue))
        self._wakeup.clear()
        await self._wakeup.wait()

    def _drop_cancelled(self, keep: Flight | None = None) -> None:
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

    async def _admit(self) -> None:
        new: list[ServedRequest] = []
        room = min(self.max_batch - len(self.running), self.worker.cache.free_slots)
        while self.queue and len(new) < room:
            req = self.queue.popleft()
            if req.expired:  # its client gave up while it queued: not worth a prefill
                req.events.put_nowait(RoundEvent([], -1, self.tier, "expired"))
                self.metrics.requests.labels("expired").inc()
                continue
            new.append(req)
        self.metrics.queued.set(len(self.queue))
        if not new:
            return
        seqs = [r.seq for r in new]
        try:
            feats = await self.compute(self.worker.prefill, seqs)
        except Exception:
            # These requests are in neither the queue nor the batch: answer and free them
            # here, or their clients wait forever and their KV slots are lost.
            log.exception("prefill failed", requests=[s.request_id for s in seqs])
            for req in new:
                self.worker.release(req.seq)
                req.events.put_nowait(RoundEvent([], -1, self.tier, "error"))
                self.metrics.requests.labels("error").inc()
            return
        for req, f in zip(new, feats, strict=True):
            self.session.add(req.seq, f)
            self.running.append(req)
            req.events.put_nowait(
                RoundEvent(list(req.seq.output), -1, self.tier, req.seq.finish_reason)
            )
            if req.seq.finish_reason is not None:
                self._finish(req, req.seq.finish_reason)
        self.metrics.running.set(len(self.running))

    async def _start(self, batch: list[ServedRequest], admit_s: float) -> Flight:
        """Starts a round: its RoundRequest goes out (when a draft is connected)."""
        self.round_id += 1
        sampled = any(not r.seq.sampling.greedy for r in batch)
        steps = self.tiers.of([r.seq.request_id for r in batch], sampled)
        state = self.states[max(steps)]
        flight = Flight(self.round_id, batch, state, time.perf_counter(), admit_s, steps)
        link = self.draft
        if link is None or not link.connected:
            self.session.no_stream()
            return flight
        if state.tier == 0:
            return flight  # target-only: the draft is not called (releases wait for a round)
        seqs = [r.seq for r in batch]
        flight.request = self.session.request(
            self.round_id, seqs, state.tier, epoch=link.epochs(seqs), features=link.features,
            steps=steps, predraft=self.pipelining,
        )  # fmt: skip
        flight.hit_ids, flight.misses = frozenset(self.session.hits), self.session.misses
        flight.epoch = await link.send(flight.request)
        if flight.epoch is not None and state.verify_stage().plans_ahead:
            # While the draft service drafts: plan this round's verify graph (see prepare).
            depths = None if min(steps) == state.tier else steps
            await self.compute(self.worker.prepare, seqs, state, depths)
        return flight

    async def _verify(self, flight: Flight) -> Flight | None:
        """Verifies a started round; starts the next one (when nothing waits for admission)
        before streaming this one's results, so that work overlaps the draft's. Returns it."""
        batch, state = flight.batch, flight.state
        drafts = await flight.drafts(self.draft, self.session, self.metrics)
        trees, speculative = drafts.aligned([r.seq.request_id for r in batch]), drafts.speculative
        t1 = time.perf_counter()
        results = await self.compute(self.worker.verify, [r.seq for r in batch], trees, state)
        t2 = time.perf_counter()
        for req, res in zip(batch, results, strict=True):
            self.session.verified(req.seq, res.features)
        await flight.after_verify(self.draft, self.session, self.metrics)
        self.tiers.switch(self.round_id, self._running_ids())
        ready = [r for r in batch if r.seq.finish_reason is None and not r.cancelled]
        following = await self._start(ready, 0.0) if ready and not self.queue else None
        accepts: list[int] = []
        drafted_ids: list[str] = []
        drafted_steps: list[int] = []
        plain_ids: list[str] = []
        for req, tree, res, steps in zip(batch, trees, results, flight.steps, strict=True):
            drafted = speculative and len(tree) > 0
            if drafted:
                tree_from = "predrafted" if req.seq.request_id in flight.hit_ids else "fresh"
                self.metrics.tree_accept_length.labels(tree_from).observe(
                    res.acceptance.accept_length
                )
                accepts.append(res.acceptance.accept_length)
                drafted_ids.append(req.seq.request_id)
                drafted_steps.append(steps)
                req.accept_lengths.append(res.acceptance.accept_length)
                self.metrics.accept_length.observe(res.acceptance.accept_length)
            else:
                req.plain_rounds += 1
                plain_ids.append(req.seq.request_id)
            accept = res.acceptance.accept_length if drafted else -1
            req.events.put_nowait(RoundEvent(res.new_tokens, accept, steps, req.seq.finish_reason))
            if req.seq.finish_reason is not None and req in self.running:
                self._finish(req, req.seq.finish_reason)
        self._drop_cancelled(keep=following)
        self.recent_accepts.extend(accepts)
        # The round ends where the next one starts (rounds tile time), or here when none has yet.
        end = following.started if following is not None else time.perf_counter()
        self.feed.publish(
            flight.round_id, state.tier, len(batch), accepts, speculative, drafts.timings,
            rtt_s=t1 - flight.started, verify_s=t2 - t1, verify_gpu_ms=gpu_ms(self.worker),
            total_s=flight.admit_s + end - flight.started, admit_s=flight.admit_s,
            request_ids=drafted_ids, request_steps=drafted_steps, plain_request_ids=plain_ids,
            predrafted=[rid in flight.hit_ids for rid in drafted_ids],
            predraft_misses=flight.misses, wait_s=flight.wait_s, predraft_ms=flight.predraft_ms,
            pipelined=flight.request is not None and flight.request.predraft,
            sampled_requests=sum(not r.seq.sampling.greedy for r in batch),
        )  # fmt: skip
        return following

    @property
    def pipelining(self) -> bool:
        """Whether rounds go out pipelined, by `--pipeline` and the draft (`flight.pipelines`)."""
        return pipelines(self.draft, self.pipeline, self.device)

    async def _flush_releases(self) -> None:
        if self.draft is not None and self.draft.connected:
            request = self.session.releases(self.round_id)
            if request is not None:
                await self.draft.round(request)
