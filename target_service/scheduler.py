"""Continuous batching and the round loop: admit → draft (remote) → verify → stream results.

One asyncio task drives every round; model compute runs through `Compute` (inline on a GPU, on
one worker thread on the CPU). New requests are prefilled and join at the next round boundary;
finished or cancelled ones leave there, and their draft state is released with the next
SpeculateRequest. A round starts when its draft request goes out: right after the previous
round's verify when nobody waits for admission, so that streaming results, metrics and round
statistics overlap the draft's work instead of delaying it. A tier command takes effect when
the next round starts, never inside one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field

from torch import Tensor

from specpair.logging import get_logger
from specpair.metrics import ServiceMetrics
from specpair.proto.v1 import common_pb2, draft_pb2, target_pb2
from specpair.runtime.draft import DraftInput
from specpair.runtime.state import SpecRuntimeState, gpu_ms
from specpair.runtime.target import TargetSequence, TargetWorker
from specpair.runtime.tree import EMPTY_TREE, CandidateTree, MalformedTreeError, validate_tree
from specpair.serving import Compute
from specpair.wire import draft_input_into, tree_from_proto
from target_service.draft_link import DraftLink

log = get_logger(__name__)
MAX_TREE_NODES = 64


class QueueFullError(RuntimeError):
    """More requests waiting than max_queue."""


@dataclass(frozen=True, slots=True)
class RoundEvent:
    """New tokens of one request from one round (or its prefill)."""

    token_ids: list[int]
    accept_length: int  # -1: the round had no drafts for this request
    tier: int
    finish_reason: str | None


class FeatureLog:
    """The target's hidden states of one request, a row per committed position (EAGLE features).

    Rows append into one buffer that grows by doubling, so a round reads the rows it sends as a
    view: the cost per round is the rows appended, not the context. The whole history stays
    because a reconnected draft re-prefills from it.
    """

    def __init__(self) -> None:
        self._rows: Tensor | None = None
        self.length = 0

    def append(self, rows: Tensor) -> None:
        end = self.length + len(rows)
        if self._rows is None or end > len(self._rows):
            grown = rows.new_empty((max(end, 2 * self.length, 64), rows.shape[-1]))
            if self._rows is not None:
                grown[: self.length] = self._rows[: self.length]
            self._rows = grown
        self._rows[self.length : end] = rows
        self.length = end

    def since(self, start: int) -> Tensor:
        """Rows from position `start` (clamped at 0) to the last committed one."""
        assert self._rows is not None, "no features recorded"
        return self._rows[max(start, 0) : self.length]


@dataclass(eq=False)
class ServedRequest:
    seq: TargetSequence
    events: asyncio.Queue[RoundEvent] = field(default_factory=asyncio.Queue)
    cancelled: str | None = None  # outcome once the client went away or a stop string hit
    draft_seen: int = 0  # tokens (prompt + output) the draft has been sent and processed
    draft_epoch: int = -1
    features: FeatureLog = field(default_factory=FeatureLog)
    accept_lengths: list[int] = field(default_factory=list)
    plain_rounds: int = 0
    deadline: float | None = None  # time.monotonic() past which the client no longer waits

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    @property
    def tokens(self) -> list[int]:
        return self.seq.prompt + self.seq.output


@dataclass(eq=False, slots=True)
class Flight:
    """One round from its start, when its draft request goes out, to its verify."""

    round_id: int
    batch: list[ServedRequest]
    state: SpecRuntimeState
    started: float  # perf_counter at the start
    admit_s: float  # admission (prefill) just before the start
    sent: list[int] | None = None  # per request, its tokens the draft has once it answers
    epoch: int | None = None  # the draft stream the request went out on; None: it did not


class Scheduler:
    def __init__(
        self,
        worker: TargetWorker,
        states: dict[int, SpecRuntimeState],
        *,
        initial_steps: int,
        max_batch: int,
        max_queue: int,
        draft: DraftLink | None,
        metrics: ServiceMetrics,
        threads: int = 1,
        device: str = "cpu",
    ) -> None:
        self.worker = worker
        self.states = states
        self.tier = initial_steps
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.draft = draft
        self.metrics = metrics
        self.compute = Compute("target-compute", threads, device)
        self.queue: collections.deque[ServedRequest] = collections.deque()
        self.running: list[ServedRequest] = []
        self.round_id = 0
        self.recent_accepts: collections.deque[int] = collections.deque(maxlen=256)
        self._pending_tier: tuple[int, str] | None = None
        self._released: list[str] = []
        self._wakeup = asyncio.Event()
        self._watchers: set[asyncio.Queue[target_pb2.RoundStats]] = set()
        self._ids = itertools.count()
        metrics.active_tier.set(initial_steps)

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

    def apply_tier(self, tier: int, reason: str) -> int:
        """Queues a tier switch for the next round; returns the tier active now."""
        if tier not in self.states:
            raise ValueError(
                f"speculative_num_steps {tier} is not a candidate tier {sorted(self.states)}"
            )
        self._pending_tier = (tier, reason)
        return self.tier

    def watch(self) -> asyncio.Queue[target_pb2.RoundStats]:
        queue: asyncio.Queue[target_pb2.RoundStats] = asyncio.Queue(maxsize=1024)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[target_pb2.RoundStats]) -> None:
        self._watchers.discard(queue)

    @property
    def avg_accept_length(self) -> float:
        n = len(self.recent_accepts)
        return sum(self.recent_accepts) / n if n else 0.0

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        flight: Flight | None = None  # a round already started: its draft request is out
        while True:
            if flight is None:
                self._switch_tier()
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
                flight = await self._round(flight)
                # Inline compute with no draft to wait for never suspends: without this yield a
                # batch would run to its end before a submit or a cancel could land.
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

    def _switch_tier(self) -> None:
        if self._pending_tier is None:
            return
        tier, reason = self._pending_tier
        self._pending_tier = None
        if tier != self.tier:
            log.info("tier switch", round_id=self.round_id, frm=self.tier, to=tier, reason=reason)
            self.tier = tier  # a reference swap to the state built at start-up
            self.metrics.active_tier.set(tier)
            self.metrics.tier_switches.inc()

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
        self.worker.release(req.seq)
        self._released.append(req.seq.request_id)
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
            if f is not None:
                req.features.append(f)
            self.running.append(req)
            req.events.put_nowait(
                RoundEvent(list(req.seq.output), -1, self.tier, req.seq.finish_reason)
            )
            if req.seq.finish_reason is not None:
                self._finish(req, req.seq.finish_reason)
        self.metrics.running.set(len(self.running))

    async def _start(self, batch: list[ServedRequest], admit_s: float) -> Flight:
        """Starts a round: its draft request goes out (when a draft is connected)."""
        self.round_id += 1
        flight = Flight(self.round_id, batch, self.states[self.tier], time.perf_counter(), admit_s)
        link = self.draft
        if link is None or not link.connected:
            self._released = []  # no stream, no draft state left to free
            return flight
        message = draft_pb2.SpeculateRequest(
            round_id=self.round_id,
            speculative_num_steps=flight.state.tier,
            released_request_ids=self._released,
        )
        sent = []
        eagle = link.draft_kind == "eagle"
        for req in batch:
            if req.draft_epoch != link.epoch:  # new stream: the draft re-prefills from scratch
                req.draft_seen, req.draft_epoch = 0, link.epoch
            tokens = req.tokens
            features = req.features.since(req.draft_seen - 1) if eagle else None
            item = DraftInput(
                req.seq.request_id, tuple(tokens[req.draft_seen :]), req.seq.sampling, features
            )
            draft_input_into(message.inputs.add(), item)
            sent.append(len(tokens))
        self._released = []
        flight.epoch = await link.send(message)
        flight.sent = sent
        if flight.epoch is not None and flight.state.verify_stage().plans_ahead:
            # While the draft service drafts: plan this round's verify graph (see prepare).
            await self.compute(self.worker.prepare, [r.seq for r in batch], flight.state)
        return flight

    async def _round(self, flight: Flight) -> Flight | None:
        """Verifies a started round; starts the next one (when nothing waits for admission)
        before streaming this one's results, so that work overlaps the draft's. Returns it."""
        batch, state = flight.batch, flight.state
        trees, draft, speculative = await self._trees(flight)
        t1 = time.perf_counter()
        results = await self.compute(self.worker.verify, [r.seq for r in batch], trees, state)
        t2 = time.perf_counter()
        for req, res in zip(batch, results, strict=True):
            if res.features is not None:
                req.features.append(res.features)
        self._switch_tier()
        ready = [r for r in batch if r.seq.finish_reason is None and not r.cancelled]
        following = await self._start(ready, 0.0) if ready and not self.queue else None
        accepts: list[int] = []
        for req, tree, res in zip(batch, trees, results, strict=True):
            drafted = speculative and len(tree) > 0
            if drafted:
                accepts.append(res.acceptance.accept_length)
                req.accept_lengths.append(res.acceptance.accept_length)
                self.metrics.accept_length.observe(res.acceptance.accept_length)
            else:
                req.plain_rounds += 1
            accept = res.acceptance.accept_length if drafted else -1
            req.events.put_nowait(
                RoundEvent(res.new_tokens, accept, flight.state.tier, req.seq.finish_reason)
            )
            if req.seq.finish_reason is not None and req in self.running:
                self._finish(req, req.seq.finish_reason)
        self._drop_cancelled(keep=following)
        self.recent_accepts.extend(accepts)
        # The round ends where the next one starts (rounds tile time), or here when none has yet.
        end = following.started if following is not None else time.perf_counter()
        self._publish(flight, accepts, speculative, draft, rtt_s=t1 - flight.started,
                      verify_s=t2 - t1, total_s=flight.admit_s + end - flight.started)  # fmt: skip
        return following

    def _publish(
        self,
        flight: Flight,
        accepts: list[int],
        speculative: bool,
        draft: common_pb2.StageTimings,
        *,
        rtt_s: float,
        verify_s: float,
        total_s: float,
    ) -> None:
        """The round's stage timings to the metrics and its RoundStats to every watcher."""
        rpc_ms = 1e3 * rtt_s - draft.total_ms - draft.draft_host_ms
        timings = common_pb2.StageTimings(
            draft_ms=draft.draft_ms,
            draft_host_ms=draft.draft_host_ms,
            draft_gpu_ms=draft.draft_gpu_ms,
            verify_ms=1e3 * verify_s,
            verify_gpu_ms=gpu_ms(self.worker),
            rpc_ms=max(rpc_ms, 0.0) if speculative else 0.0,
            schedule_ms=1e3 * max(total_s - rtt_s - verify_s, 0.0),
            total_ms=1e3 * total_s,
        )
        for stage in ("draft", "verify", "rpc", "schedule"):
            self.metrics.stage_latency.labels(stage).observe(getattr(timings, f"{stage}_ms") / 1e3)
        stats = target_pb2.RoundStats(
            round_id=flight.round_id,
            speculative_num_steps=flight.state.tier,
            batch_size=len(flight.batch),
            accept_lengths=accepts,
            speculative=speculative,
            timings=timings,
            unix_time=time.time(),
        )
        for queue in list(self._watchers):
            if queue.full():
                queue.get_nowait()  # a slow watcher loses the oldest round, never blocks us
            queue.put_nowait(stats)

    async def _trees(
        self, flight: Flight
    ) -> tuple[list[CandidateTree], common_pb2.StageTimings, bool]:
        """The round's trees from the draft service (and its timings); empty trees when it is
        unavailable."""
        batch, state = flight.batch, flight.state
        empty, none = [EMPTY_TREE] * len(batch), common_pb2.StageTimings()
        link = self.draft
        if flight.sent is None or link is None:
            self.metrics.fallback_rounds.labels("no_draft").inc()
            return empty, none, False
        response = (
            None if flight.epoch is None else await link.receive(flight.round_id, flight.epoch)
        )
        if response is None:
            self.metrics.fallback_rounds.labels("draft_failed").inc()
            return empty, none, False
        if response.error:
            log.warning("draft rejected the round", round_id=flight.round_id, error=response.error)
            for req in batch:
                req.draft_seen = 0  # the draft dropped their state: re-send everything
            self.metrics.fallback_rounds.labels("draft_error").inc()
            return empty, response.timings, False
        by_id = {t.request_id: t for t in response.trees}
        trees = []
        for req, n_sent in zip(batch, flight.sent, strict=True):
            msg = by_id.get(req.seq.request_id)
            # No tree: the draft could not hold this request and kept nothing of it.
            req.draft_seen = n_sent if msg is not None else 0
            trees.append(self._checked_tree(req, msg, state))
        return trees, response.timings, True

    def _checked_tree(
        self, req: ServedRequest, msg: draft_pb2.CandidateTree | None, state: SpecRuntimeState
    ) -> CandidateTree:
        """A malformed tree from a (buggy) draft costs only speculation for this request."""
        if msg is None:
            return EMPTY_TREE
        try:
            tree = tree_from_proto(msg)
            validate_tree(
                tree,
                max_nodes=MAX_TREE_NODES,
                max_depth=state.tier,
                vocab_size=self.worker.model.args.vocab_size,
            )
            if len(tree) and not req.seq.sampling.greedy and tree.draft_probs is None:
                raise MalformedTreeError("sampling round without draft_probs")
        except (MalformedTreeError, ValueError) as exc:
            log.warning("malformed candidate tree", request_id=req.seq.request_id, error=str(exc))
            self.metrics.fallback_rounds.labels("malformed_tree").inc()
            return EMPTY_TREE
        return tree

    async def _flush_releases(self) -> None:
        if self._released and self.draft is not None and self.draft.connected:
            message = draft_pb2.SpeculateRequest(
                round_id=self.round_id, released_request_ids=self._released
            )
            self._released = []
            await self.draft.round(message)
