"""The scheduler starts round n+1 (its draft request goes out) before it streams round n's results.

Driven with the real target worker on a tiny model and a link that records what the scheduler
has streamed at each send; no gRPC.
"""

import asyncio
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_target
from specpair.runtime.round_messages import RoundRequest, RoundResponse, RoundStats
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE
from target_service.batching import scheduler as scheduler_module
from target_service.batching.scheduler import Scheduler
from target_service.batching.served import RoundEvent, ServedRequest
from tests.service.conftest import one_tier_scheduler

NEW_TOKENS = 6
SEND_S = 0.005


class CountingQueue(asyncio.Queue[RoundEvent]):
    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put_nowait(self, item: RoundEvent) -> None:
        self.puts += 1
        super().put_nowait(item)


class RecordingLink:
    """Answers every round with no trees; notes the results streamed so far at each send."""

    connected = True
    epoch = 1
    features = False  # no EAGLE features

    def epochs(self, seqs: object) -> int:
        return self.epoch

    def __init__(self) -> None:
        self.events = CountingQueue()
        self.sends: list[tuple[int, int]] = []  # (round id, results streamed so far)
        self.requests: list[RoundRequest] = []  # every one with inputs, hand-offs too

    async def send(self, message: RoundRequest) -> int:
        if message.inputs:
            self.requests.append(message)
            if message.speculative_num_steps:
                self.sends.append((message.round_id, self.events.puts))
        await asyncio.sleep(SEND_S)  # a write that takes a while
        return self.epoch

    async def receive(self, round_id: int, epoch: int) -> RoundResponse:
        await asyncio.sleep(0)
        (request,) = [r for r in self.requests if r.round_id == round_id] or [None]
        if request is not None and request.speculative_num_steps == 0:  # a hand-off: taken
            return RoundResponse(round_id, {i.request_id: EMPTY_TREE for i in request.inputs})
        return RoundResponse(round_id)

    async def receive_each(self, rounds: Sequence[tuple[int, int]]) -> list[RoundResponse]:
        return [await self.receive(round_id, epoch) for round_id, epoch in rounds]

    async def round(self, message: RoundRequest) -> RoundResponse:
        await self.send(message)
        return await self.receive(message.round_id, self.epoch)


class GatedLink(RecordingLink):
    """A `RecordingLink` whose answer to one round waits until the test opens its gate."""

    def __init__(self) -> None:
        super().__init__()
        self.held: int | None = None  # the round whose answer waits
        self.waiting = asyncio.Event()  # set once a receive waits at the gate
        self.gate = asyncio.Event()

    async def receive(self, round_id: int, epoch: int) -> RoundResponse:
        if round_id == self.held:
            self.waiting.set()
            await self.gate.wait()
        return await super().receive(round_id, epoch)


R = TypeVar("R", bound=RecordingLink)


def drafted_scheduler(tmp_path: Path, link: R, **kwargs: Any) -> tuple[Scheduler, R]:
    """A tier-3 scheduler of batches up to 2 over a tiny target and `link` (`kwargs`: the
    scheduler's own)."""
    worker = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=2, max_len=64)
    scheduler = one_tier_scheduler(worker, tier=3, max_batch=2, draft=link, **kwargs)
    return scheduler, link


async def streamed(request: ServedRequest) -> list[int]:
    """Every token streamed to `request` until it finishes."""
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(request.events.get(), 10)
        tokens += event.token_ids
        if event.finish_reason is not None:
            return tokens


def decoded_alone(tmp_path: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """What `drafted_scheduler`'s target decodes for `prompt` alone, without drafts."""
    alone = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=1, max_len=64)
    reference = TargetSequence("alone", prompt, SamplingParams(), max_new_tokens=new_tokens)
    alone.prefill([reference])
    while reference.finish_reason is None:
        alone.verify([reference], [EMPTY_TREE], None)
    return reference.output


async def a_running(
    scheduler: Scheduler, link: RecordingLink, tokens: int
) -> tuple[ServedRequest, ServedRequest, asyncio.Queue[RoundStats | str], asyncio.Task[None]]:
    """Request a ([5, 6, 7], `tokens` new) running on `scheduler`, a round of it streamed, and
    b ([8, 9], 4 new) made but not submitted; the rounds' watch and the scheduler's task."""
    first = ServedRequest(
        TargetSequence("a", [5, 6, 7], SamplingParams(), max_new_tokens=tokens), events=link.events
    )
    second = ServedRequest(TargetSequence("b", [8, 9], SamplingParams(), max_new_tokens=4))
    watch = scheduler.feed.watch()
    task = asyncio.create_task(scheduler.run())
    scheduler.submit(first)
    await asyncio.wait_for(first.events.get(), 10)  # prefilled
    await asyncio.wait_for(first.events.get(), 10)  # a round has streamed: rounds are going
    return first, second, watch, task


async def test_next_round_goes_out_before_the_results_stream(tmp_path: Path) -> None:
    scheduler, link = drafted_scheduler(tmp_path, RecordingLink())
    seq = TargetSequence("r", [5, 6, 7], SamplingParams(), max_new_tokens=NEW_TOKENS)
    served = ServedRequest(seq, events=link.events)
    watch = scheduler.feed.watch()
    task = asyncio.create_task(scheduler.run())
    start = time.perf_counter()
    scheduler.submit(served)
    tokens = []
    while True:
        event = await asyncio.wait_for(served.events.get(), 10)
        tokens += event.token_ids
        if event.finish_reason is not None:
            break
    wall_ms = 1e3 * (time.perf_counter() - start)
    task.cancel()
    assert len(tokens) == NEW_TOKENS
    # Round 1 starts after the prefill's event; round n > 1 starts before round n - 1's event.
    assert link.sends[0] == (1, 1)
    assert link.sends[1:] == [(n, 1 + n - 2) for n in range(2, len(link.sends) + 1)]
    # Overlapping rounds still tile time: their totals add up to no more than the wall time.
    stats = [watch.get_nowait() for _ in range(watch.qsize())]
    assert [s.round_id for s in stats] == [n for n, _ in link.sends]
    assert sum(s.timings.total_ms for s in stats) <= wall_ms


def inline_scheduler(tmp_path: Path) -> Scheduler:
    """A target with no draft whose compute runs inline on the event loop, as on a GPU."""
    worker = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=2, max_len=96)
    scheduler = one_tier_scheduler(worker, tier=1, max_batch=2)
    scheduler.compute.shutdown()
    scheduler.compute.executor = None
    return scheduler


async def test_requests_join_a_running_batch_without_a_draft(tmp_path: Path) -> None:
    """Inline compute (the CUDA setting) and no draft: a round never waits on anything, yet a
    request submitted while another decodes joins its batch (the loop yields each round)."""
    scheduler = inline_scheduler(tmp_path)
    first = ServedRequest(TargetSequence("a", [5, 6, 7], SamplingParams(), max_new_tokens=60))
    second = ServedRequest(TargetSequence("b", [8, 9], SamplingParams(), max_new_tokens=4))
    task = asyncio.create_task(scheduler.run())
    scheduler.submit(first)
    await asyncio.wait_for(first.events.get(), 10)  # prefilled: a is decoding now
    scheduler.submit(second)
    while (await asyncio.wait_for(second.events.get(), 10)).finish_reason is None:
        pass
    task.cancel()
    assert first.seq.finish_reason is None, "b waited for a's whole batch"


async def test_a_request_that_takes_many_loop_passes_joins_at_the_next_round(
    tmp_path: Path,
) -> None:
    """A gRPC call reaches the servicer after several loop passes (each completion comes back
    through gRPC's poller socket). Between inline rounds the loop is turned until it is idle,
    so such a request joins at the next round, not one pass per round later."""
    scheduler = inline_scheduler(tmp_path)
    first = ServedRequest(TargetSequence("a", [5, 6, 7], SamplingParams(), max_new_tokens=80))
    second = ServedRequest(TargetSequence("b", [8, 9], SamplingParams(), max_new_tokens=2))
    task = asyncio.create_task(scheduler.run())
    scheduler.submit(first)
    await asyncio.wait_for(first.events.get(), 10)

    async def submit_after_passes(passes: int) -> int:
        for _ in range(passes):
            await asyncio.sleep(0)
        scheduler.submit(second)
        return scheduler.round_id

    submitted_in = await submit_after_passes(20)
    await asyncio.wait_for(second.events.get(), 10)  # prefilled: it has joined
    joined_in = scheduler.round_id
    task.cancel()
    # One yield a round would take about 20 rounds to get it there.
    assert joined_in - submitted_in <= 2, (submitted_in, joined_in)


async def test_a_request_joins_beside_a_round_out_to_the_draft(tmp_path: Path) -> None:
    """A request queued while a round is out to the draft is prefilled then (beside the draft's
    work) and joins the round after it: no round waits between rounds for a prefill, every
    round after the first still goes out before its predecessor streams, and the joiner's
    tokens are those it decodes alone."""
    scheduler, link = drafted_scheduler(tmp_path, RecordingLink())
    first, second, watch, task = await a_running(scheduler, link, tokens=12)
    scheduler.submit(second)
    joined = await streamed(second)
    await streamed(first)
    task.cancel()
    stats = [watch.get_nowait() for _ in range(watch.qsize())]
    admitting = [s for s in stats if s.timings.admit_ms > 0]
    assert admitting[0].round_id == 1
    assert len(admitting) == 2, "b's prefill ran beside one round"
    beside = admitting[1]
    assert beside.batch_size == 1, "b joins the round after the one it was prefilled beside"
    later = [s for s in stats if s.round_id > beside.round_id]
    assert later and later[0].batch_size == 2
    # b's prompt went to the draft right after the round it was prefilled beside, and its
    # first round appends only its first token
    handoffs = [r for r in link.requests if r.speculative_num_steps == 0]
    assert [(r.round_id, [(i.request_id, i.appended) for i in r.inputs]) for r in handoffs] == [
        (beside.round_id + 1, [("b", (8, 9))])
    ]
    first_round = next(r for r in link.requests if r.round_id == later[0].round_id)
    assert {i.request_id: len(i.appended) for i in first_round.inputs}["b"] == 1
    # round n > 1 went out before round n - 1's results streamed to a, the join included
    ids = [n for n, _ in link.sends]
    puts = dict(link.sends)
    assert all(puts[n] <= puts[m] + 1 for m, n in itertools.pairwise(ids[1:]))
    assert joined == decoded_alone(tmp_path, [8, 9], 4)


async def streamed_before_a_join(tmp_path: Path, settle_s: float) -> tuple[int, int]:
    """Compute inline on the loop (as on a GPU), a client's writer that takes several loop
    passes an event, and b submitted while a's rounds run: at b's prefill beside a round, the
    events a's writer had delivered and those streamed to it."""
    scheduler, link = drafted_scheduler(tmp_path, RecordingLink(), join_settle_s=settle_s)
    scheduler.compute.executor = None
    worker = scheduler.worker
    delivered = 0
    at_join: list[tuple[int, int]] = []
    prefill = worker.prefill

    def recording(seqs: list[TargetSequence]) -> list[object]:
        if seqs[0].request_id == "b":
            at_join.append((delivered, link.events.puts))
        return prefill(seqs)  # type: ignore[return-value]

    worker.prefill = recording  # type: ignore[method-assign]
    first, second, _, task = await a_running(scheduler, link, tokens=24)

    async def writer() -> None:  # a gRPC write: the event, the message, its completion
        nonlocal delivered
        while True:
            await first.events.get()
            for _ in range(4):
                await asyncio.sleep(0)
            delivered += 1

    writing = asyncio.create_task(writer())
    await asyncio.sleep(SEND_S / 2)  # inside a round's send: b is queued as the next one awaits
    scheduler.submit(second)
    while (await asyncio.wait_for(second.events.get(), 10)).finish_reason is None:
        pass
    task.cancel()
    writing.cancel()
    (seen,) = at_join
    return seen


async def test_a_join_beside_a_round_lets_the_streams_write_first(tmp_path: Path) -> None:
    """With `join_settle_s` the loop turns before a joiner's inline prefill, so the round that
    just streamed reaches its client first; without it the writes wait for the prefill."""
    delivered, streamed = await streamed_before_a_join(tmp_path / "settled", settle_s=0.05)
    assert delivered == streamed - 2  # all but the two `a_running` took
    delivered, streamed = await streamed_before_a_join(tmp_path / "at_once", settle_s=0.0)
    assert delivered < streamed - 2


def prefill_sizes(scheduler: Scheduler) -> list[int]:
    """Records how many prompts each of `scheduler`'s prefills takes."""
    sizes: list[int] = []
    prefill = scheduler.worker.prefill

    def recording(seqs: list[TargetSequence]) -> list[object]:
        sizes.append(len(seqs))
        return prefill(seqs)  # type: ignore[return-value]

    scheduler.worker.prefill = recording  # type: ignore[method-assign]
    return sizes


async def joins_under_load(tmp_path: Path, join_group: int) -> list[int]:
    """Seven requests through a batch of 4 (they leave after 2, 4, 6, … tokens): the size of
    each prefill."""
    worker = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=4, max_len=96)
    scheduler = one_tier_scheduler(worker, tier=1, max_batch=4, join_group=join_group)
    sizes = prefill_sizes(scheduler)
    served = [
        ServedRequest(TargetSequence(f"r{i}", [5, 6, 7 + i], SamplingParams(), 2 * i + 2))
        for i in range(7)
    ]
    for request in served:
        scheduler.submit(request)
    task = asyncio.create_task(scheduler.run())
    for request in served:
        while (await asyncio.wait_for(request.events.get(), 10)).finish_reason is None:
            pass
    task.cancel()
    assert all(len(r.seq.output) == r.seq.max_new_tokens for r in served)
    return sizes


async def test_under_load_requests_join_a_group_at_a_time(tmp_path: Path) -> None:
    """With more requests waiting than the batch has room for, joins wait for `join_group`
    free places (one prefill for two prompts); the last one, alone in the queue, joins as soon
    as a place frees. With a group of 1 each joins as its place frees."""
    assert await joins_under_load(tmp_path, join_group=2) == [4, 2, 1]
    assert await joins_under_load(tmp_path, join_group=1) == [4, 1, 1, 1]


@pytest.mark.parametrize(("budget", "beside"), [(1024, True), (1, False)])
async def test_a_request_arriving_while_the_draft_works_joins_the_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int, beside: bool
) -> None:
    """A request submitted while a round's draft answer is awaited (where a client whose last
    request just streamed sends its next) is prefilled beside that round, before its answer,
    and decodes in the very next round, where it would otherwise be admitted beside the next
    round and join the one after. A prompt over `WAIT_PREFILL_TOKENS` (the answer's deadline
    runs meanwhile) waits for that next round's start instead."""
    monkeypatch.setattr(scheduler_module, "WAIT_PREFILL_TOKENS", budget)
    scheduler, link = drafted_scheduler(tmp_path, GatedLink())
    _, second, watch, task = await a_running(scheduler, link, tokens=20)
    link.held = scheduler.round_id + 1  # the round after the one out now
    await asyncio.wait_for(link.waiting.wait(), 10)
    scheduler.submit(second)
    await asyncio.sleep(0.2)  # the loop turns while the answer is held
    assert (second.events.qsize() > 0) is beside, "prefilled before the answer"
    link.gate.set()
    while (await asyncio.wait_for(second.events.get(), 10)).finish_reason is None:
        pass
    task.cancel()
    stats = {s.round_id: s for s in (watch.get_nowait() for _ in range(watch.qsize()))}
    held = stats[link.held]
    assert held.batch_size == 1 and (held.timings.admit_ms > 0) is beside
    joined = min(n for n, s in stats.items() if n > link.held and s.batch_size == 2)
    # the next round out (the hand-off took a round id), or the one after
    assert joined == link.held + (2 if beside else 3)


async def group_beside_a_round(tmp_path: Path, wait_s: float, grouped: bool) -> list[int]:
    """a and a2 running on a batch of 4 (half of it) with `join_group` 2; b submitted while one
    round's draft answer is held, and with `grouped` c 0.2 s later: each prefill's size.
    Asserts b was not prefilled alone while the answer was held."""
    worker = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=4, max_len=64)
    link = GatedLink()
    scheduler = one_tier_scheduler(
        worker, tier=3, max_batch=4, draft=link, join_group=2, join_wait_s=wait_s
    )
    sizes = prefill_sizes(scheduler)
    _, second, _, task = await a_running(scheduler, link, tokens=30)
    running = ServedRequest(TargetSequence("a2", [5, 7], SamplingParams(), max_new_tokens=30))
    scheduler.submit(running)  # one running of 4: it joins at once
    await asyncio.wait_for(running.events.get(), 10)
    third = ServedRequest(TargetSequence("c", [8, 10], SamplingParams(), max_new_tokens=4))
    link.held = scheduler.round_id + 1
    await asyncio.wait_for(link.waiting.wait(), 10)
    scheduler.submit(second)
    await asyncio.sleep(0.2)  # the loop turns while the answer is held
    assert second.events.qsize() == 0, "b waits for its group"
    if grouped:
        scheduler.submit(third)
        await asyncio.sleep(0.2)
        assert second.events.qsize() > 0, "prefilled at c's arrival, before the answer"
    link.gate.set()
    for request in (second, third) if grouped else (second,):
        while (await asyncio.wait_for(request.events.get(), 10)).finish_reason is None:
            pass
    task.cancel()
    return sizes


async def test_under_load_a_join_beside_a_round_waits_for_its_group(tmp_path: Path) -> None:
    """With half the batch running a request that cannot ride waits for `join_group` to queue,
    and one prefill takes them; alone, it goes beside the next round once it has waited
    `join_wait_s`. Below half the batch a join goes at once (a2)."""
    assert await group_beside_a_round(tmp_path / "group", 30.0, grouped=True) == [1, 1, 2]
    assert await group_beside_a_round(tmp_path / "late", 0.1, grouped=False) == [1, 1, 1]


class HoldingLink(RecordingLink):
    """A `RecordingLink` that counts the requests the draft would hold after each message: one
    arrives with its first inputs and leaves when a message releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[str] = set()
        self.most = 0

    async def send(self, message: RoundRequest) -> int:
        self.held -= set(message.released_request_ids)  # a draft frees before it extends
        self.held |= {item.request_id for item in message.inputs}
        self.most = max(self.most, len(self.held))
        return await super().send(message)

    async def receive(self, round_id: int, epoch: int) -> RoundResponse:
        await asyncio.sleep(SEND_S)  # the draft's work: a client's next request lands meanwhile
        return await super().receive(round_id, epoch)


@pytest.mark.parametrize("ride", [0, 256])
async def test_a_join_never_finds_the_draft_holding_the_request_it_replaced(
    tmp_path: Path, ride: int
) -> None:
    """A request leaves after a round's verify, once the next round is out; one admitted into
    its place beside that next round is handed to the draft then (a rider: after that round's
    verify), and the hand-off frees the one that left. With a draft of as many slots as the
    target's batch (`up`'s 64 and 64), the joiner would else find them all held and its first
    rounds go undrafted."""
    scheduler, link = drafted_scheduler(tmp_path, HoldingLink())
    scheduler.worker.ride_rows = ride
    task = asyncio.create_task(scheduler.run())

    async def client(c: int) -> None:  # a request at a time, the next once the last ended
        for i in range(3):
            seq = TargetSequence(f"c{c}r{i}", [5, 6, 7 + i], SamplingParams(), 3 + 2 * i + c)
            request = ServedRequest(seq)
            scheduler.submit(request)
            while (await asyncio.wait_for(request.events.get(), 10)).finish_reason is None:
                pass

    await asyncio.gather(client(0), client(1))
    task.cancel()
    handoffs = [r for r in link.requests if r.speculative_num_steps == 0]
    assert len(handoffs) >= 3, "requests joined beside rounds, into the places of others"
    assert link.most <= scheduler.max_batch


def riding_scheduler(tmp_path: Path, link: R) -> tuple[Scheduler, R]:
    scheduler, link = drafted_scheduler(tmp_path, link)
    scheduler.worker.ride_rows = 256
    return scheduler, link


async def test_a_rider_joins_after_the_round_whose_verify_prefilled_it(tmp_path: Path) -> None:
    """With `ride_rows` a request queued while a round is out to the draft is not prefilled
    beside it: its prompt rides in that round's verify, it joins the round after, its prompt
    goes to the draft between the two, and its tokens are those it decodes alone."""
    scheduler, link = riding_scheduler(tmp_path, RecordingLink())
    prefills: list[int] = []
    prefill = scheduler.worker.prefill
    scheduler.worker.prefill = lambda seqs: prefills.append(len(seqs)) or prefill(seqs)  # type: ignore[method-assign]
    first, second, watch, task = await a_running(scheduler, link, tokens=12)
    scheduler.submit(second)
    joined = await streamed(second)
    await streamed(first)
    task.cancel()
    assert prefills == [1], "only a, which started an empty batch, was prefilled"
    stats = [watch.get_nowait() for _ in range(watch.qsize())]
    handoffs = [r for r in link.requests if r.speculative_num_steps == 0]
    assert [[(i.request_id, i.appended) for i in r.inputs] for r in handoffs] == [[("b", (8, 9))]]
    rode = max(s.round_id for s in stats if s.round_id < handoffs[0].round_id)
    assert next(s for s in stats if s.round_id == rode).batch_size == 1
    after = next(s for s in stats if s.round_id > handoffs[0].round_id)
    assert after.batch_size == 2
    first_round = next(r for r in link.requests if r.round_id == after.round_id)
    assert {i.request_id: len(i.appended) for i in first_round.inputs}["b"] == 1
    assert joined == decoded_alone(tmp_path, [8, 9], 4)


class StreamLink(RecordingLink):
    """A draft stream as a `DraftLink` reads one: answers come in the order the messages went
    out, so reading one out of turn fails the test; and, as a draft does, it holds what it
    took and refuses a `continues` for a request it does not hold. `refuse`: requests whose
    hand-off it refuses. `log`: ("send" | "receive", round id), in order."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refuse = refuse
        self.held: set[str] = set()
        self.out: list[int] = []  # sent, not yet answered
        self.log: list[tuple[str, int]] = []

    async def send(self, message: RoundRequest) -> int:
        epoch = await super().send(message)
        if message.inputs:
            self.out.append(message.round_id)
            self.log.append(("send", message.round_id))
        return epoch

    async def receive(self, round_id: int, epoch: int) -> RoundResponse:
        await asyncio.sleep(0)
        assert self.out and self.out[0] == round_id, f"{round_id} read before {self.out[:1]}"
        self.out.pop(0)
        self.log.append(("receive", round_id))
        (request,) = [r for r in self.requests if r.round_id == round_id]
        trees, refused = {}, {}
        for item in request.inputs:
            handoff = request.speculative_num_steps == 0
            if (handoff and item.request_id in self.refuse) or (
                item.continues and item.request_id not in self.held
            ):
                refused[item.request_id] = "FAILED_PRECONDITION: not held"
                self.held.discard(item.request_id)
            else:
                self.held.add(item.request_id)
                trees[item.request_id] = EMPTY_TREE
        return RoundResponse(round_id, trees, refused=refused)


@pytest.mark.parametrize("refused", [False, True])
async def test_a_riders_handoff_sent_ahead_is_answered_before_the_round_behind_it(
    tmp_path: Path, refused: bool
) -> None:
    """With `handoff_ahead` the round after a rider's verify goes out behind its hand-off
    without awaiting it: the rider appends its first token flagged `continues`, and the
    hand-off's answer is read first, in the stream's order. A draft that refused the hand-off
    refuses the rider's `continues` too; its prompt then goes whole in a later round. Either
    way the rider's tokens are those it decodes alone."""
    link = StreamLink(frozenset({"b"}) if refused else frozenset())
    scheduler, link = drafted_scheduler(tmp_path, link, handoff_ahead=True)
    scheduler.worker.ride_rows = 256
    first, second, _, task = await a_running(scheduler, link, tokens=12)
    scheduler.submit(second)
    joined = await streamed(second)
    await streamed(first)
    task.cancel()
    (handoff,) = [r for r in link.requests if r.speculative_num_steps == 0]
    assert [(i.request_id, i.appended) for i in handoff.inputs] == [("b", (8, 9))]
    after = next(r for r in link.requests if r.round_id > handoff.round_id)
    sent, answered = (
        link.log.index(("send", after.round_id)),
        link.log.index(("receive", handoff.round_id)),
    )
    assert sent < answered, "the round went out before the hand-off was answered"
    b = {i.request_id: i for i in after.inputs}["b"]
    assert (len(b.appended), b.continues) == (1, True)
    later = [i for r in link.requests if r.round_id > after.round_id for i in r.inputs]
    again = [i for i in later if i.request_id == "b" and i.appended[:2] == (8, 9)]
    assert bool(again) == refused, "a refused rider's prompt goes whole once more, else never"
    assert not any(i.continues for i in later), "only the round behind the hand-off continues"
    assert joined == decoded_alone(tmp_path, [8, 9], 4)


async def test_a_verify_that_fails_with_riders_answers_them_and_frees_their_slots(
    tmp_path: Path,
) -> None:
    """A verify that raises fails its batch and its riders alike: each rider's client hears
    `error` and its KV slot comes back; the scheduler then serves the next request."""
    scheduler, link = riding_scheduler(tmp_path, RecordingLink())
    worker = scheduler.worker
    verify = worker.verify

    def failing(seqs: Any, trees: Any, state: Any = None, riders: Any = ()) -> Any:
        if riders:
            raise RuntimeError("a bug in the verify")
        return verify(seqs, trees, state, riders)

    worker.verify = failing  # type: ignore[method-assign]
    first, second, _, task = await a_running(scheduler, link, tokens=40)
    scheduler.submit(second)
    outcome = None
    while outcome is None:
        outcome = (await asyncio.wait_for(second.events.get(), 10)).finish_reason
    assert outcome == "error"
    await streamed(first)
    assert worker.cache.free_slots == 2
    third = ServedRequest(TargetSequence("c", [8, 9], SamplingParams(), max_new_tokens=3))
    scheduler.submit(third)
    while (event := await asyncio.wait_for(third.events.get(), 10)).finish_reason is None:
        pass
    assert event.finish_reason == "length"
    task.cancel()


async def test_joiners_ride_as_far_as_the_rows_allow_and_the_rest_prefill(
    tmp_path: Path,
) -> None:
    """Two requests queued while a round is out, room in its verify for the first's chunk only
    (`ride_rows` 4 at tier 3): the first rides, the second is prefilled beside the draft's
    work; each prompt goes to the draft once, and both decode what they decode alone."""
    worker = build_target(make_tiny_llama(tmp_path / "t", seed=5), max_requests=3, max_len=64)
    scheduler = one_tier_scheduler(worker, tier=3, max_batch=3, draft=RecordingLink())
    link = scheduler.draft
    assert isinstance(link, RecordingLink)
    worker.ride_rows = 4
    first, _, _, task = await a_running(scheduler, link, tokens=30)
    prompts = {"b": [8, 9], "c": [8, 9, 10, 11, 12]}
    joiners = [
        ServedRequest(TargetSequence(rid, p, SamplingParams(), max_new_tokens=6))
        for rid, p in prompts.items()
    ]
    for req in joiners:
        scheduler.submit(req)
    outputs = {req.seq.request_id: await streamed(req) for req in joiners}
    await streamed(first)
    task.cancel()
    registry = scheduler.metrics.registry
    joins = {
        how: registry.get_sample_value("specpair_target_joins_total", {"how": how})
        for how in ("prefill", "ride")
    }
    assert joins == {"prefill": 2, "ride": 1}  # a and c prefilled, b rode
    handoffs = [r for r in link.requests if r.speculative_num_steps == 0]
    assert sorted(i.request_id for r in handoffs for i in r.inputs) == ["b", "c"]
    for rid, prompt in prompts.items():
        assert outputs[rid] == decoded_alone(tmp_path, prompt, 6), rid
