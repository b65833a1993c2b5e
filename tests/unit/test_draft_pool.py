"""The target's draft pool without gRPC: homes, the split of a round, the merge of its answers,
moves off a lost or refusing replica, and which addresses are replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from specpair.proto.v1 import target_pb2
from specpair.runtime.round_messages import RoundRequest, RoundResponse, StageTimings
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.session import DraftSession
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE, CandidateTree
from target_service.drafts.draft_merge import slowest
from target_service.drafts.draft_pool import DraftPool
from target_service.drafts.draft_resolve import is_name, resolve

State = target_pb2.DraftConnectionState


class FakeLink:
    """A DraftLink's surface: records what it is sent, answers a tree per input."""

    def __init__(self, address: str, authority: str | None) -> None:
        self.address, self.authority = address, authority
        self.epoch, self.connected = 1, True
        self.incompatible, self.draft_kind = "", "model"
        self.sent: list[RoundRequest] = []
        self.refuse: set[str] = set()
        self.fail = False

    @property
    def state(self) -> int:
        connected = State.DRAFT_CONNECTION_STATE_CONNECTED
        return connected if self.connected else State.DRAFT_CONNECTION_STATE_DISCONNECTED

    def start(self) -> None:
        pass

    async def close(self) -> None:
        self.connected = False

    def lose(self) -> None:
        self.connected = False

    def reconnect(self) -> None:
        self.connected, self.epoch = True, self.epoch + 1

    async def send(self, request: RoundRequest) -> int | None:
        self.sent.append(request)
        return self.epoch if self.connected else None

    async def receive(self, round_id: int, epoch: int) -> RoundResponse | None:
        if self.fail or not self.connected or epoch != self.epoch:
            return None
        request = next(r for r in reversed(self.sent) if r.round_id == round_id)
        ids = [i.request_id for i in request.inputs if i.request_id not in self.refuse]
        tree = CandidateTree((7,), (-1,)) if request.speculative_num_steps else EMPTY_TREE
        trees = {rid: tree for rid in ids}  # tier 0 (a hand-off): extended, nothing drafted
        refused = {rid: "RESOURCE_EXHAUSTED: max_target_requests" for rid in self.refuse}
        timings = StageTimings(draft_ms=float(len(ids)), total_ms=float(len(ids)))
        return RoundResponse(round_id, trees, timings, refused=refused)


def seq(rid: str) -> TargetSequence:
    return TargetSequence(rid, [1, 2, 3], SamplingParams(), max_new_tokens=8)


async def pool_of(*addresses: str) -> tuple[DraftPool, dict[str, FakeLink]]:
    links: dict[str, FakeLink] = {}

    def make(address: str, authority: str | None) -> Any:
        links[address] = FakeLink(address, authority)
        return links[address]

    pool = DraftPool(addresses, make)
    await pool.start()
    return pool, links


def request(pool: DraftPool, session: DraftSession, seqs: list[TargetSequence], round_id: int):  # type: ignore[no-untyped-def]
    return session.request(round_id, seqs, 3, epoch=pool.epochs(seqs))


def test_requests_are_homed_least_loaded_and_stay() -> None:
    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        a, b = links["10.0.0.1:1"], links["10.0.0.2:1"]
        seqs = [seq(f"r{i}") for i in range(4)]
        keys = pool.epochs(seqs)
        assert [keys[s.request_id] for s in seqs] == [0, 1, 0, 1]  # a, b, a, b
        assert pool.epochs(seqs) == keys  # sticky
        assert [r.requests for r in pool.replicas()] == [2, 2]
        # a newcomer goes where fewest are
        a.lose()
        assert pool.epochs([seq("r9")])["r9"] == keys["r1"]
        assert pool.state == State.DRAFT_CONNECTION_STATE_CONNECTED  # one of two is up
        b.lose()
        assert not pool.connected and pool.state == State.DRAFT_CONNECTION_STATE_DISCONNECTED

    asyncio.run(run())


def test_each_replica_reads_a_handoff_and_the_round_behind_it_without_the_other() -> None:
    """A hand-off and the round behind it, both on two replicas, the first slow to answer the
    hand-off: the fast one's round is read while the slow one's hand-off is still awaited
    (each stream in the order sent), and each answer is merged as `receive` merges it."""

    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        slow, fast = links["10.0.0.1:1"], links["10.0.0.2:1"]
        reads: list[tuple[str, int]] = []
        gate = asyncio.Event()

        def recording(link: FakeLink) -> Any:
            answer = link.receive

            async def receive(round_id: int, epoch: int) -> RoundResponse | None:
                if link is slow and round_id == 1:
                    await gate.wait()
                reads.append((link.address, round_id))
                if link is fast and round_id == 2:
                    gate.set()  # the slow hand-off answers only once the fast round is read
                return await answer(round_id, epoch)

            return receive

        for link in (slow, fast):
            link.receive = recording(link)  # type: ignore[method-assign]
        session = DraftSession(vocab_size=16)
        seqs = [seq("r0"), seq("r1")]  # homed on slow, fast
        for s in seqs:
            session.add(s, None)
        handoff = session.handoff(1, seqs, epoch=pool.epochs(seqs))
        assert handoff is not None
        first = await pool.send(handoff)
        second = await pool.send(request(pool, session, seqs, 2))
        assert first is not None and second is not None
        answers = await asyncio.wait_for(pool.receive_each([(1, first), (2, second)]), 5)
        assert reads == [("10.0.0.2:1", 1), ("10.0.0.2:1", 2), ("10.0.0.1:1", 1), ("10.0.0.1:1", 2)]
        handed, drafted = answers
        assert handed is not None and set(handed.trees) == {"r0", "r1"}
        assert drafted is not None and set(drafted.trees) == {"r0", "r1"}

    asyncio.run(run())


def test_a_round_is_split_by_home_and_the_answers_merged() -> None:
    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        a, b = links["10.0.0.1:1"], links["10.0.0.2:1"]
        session = DraftSession(vocab_size=16)
        seqs = [seq(f"r{i}") for i in range(3)]
        for s in seqs:
            session.add(s, None)
        session.release("gone")  # never homed: its release goes nowhere
        req = request(pool, session, seqs, 1)
        sent = await pool.send(req)
        assert sent is not None
        assert [i.request_id for i in a.sent[0].inputs] == ["r0", "r2"]
        assert [i.request_id for i in b.sent[0].inputs] == ["r1"]
        response = await pool.receive(1, sent)
        assert response is not None and set(response.trees) == {"r0", "r1", "r2"}
        assert response.timings.total_ms == 2.0  # the slower replica's
        drafts = session.drafts(req, response)
        assert drafts.speculative and all(len(t) == 1 for t in drafts.trees)
        # r1 finishes: its release goes to b alone, with b's next round
        session.release("r1")
        req = request(pool, session, [seqs[0], seqs[2]], 2)
        await pool.receive(2, await pool.send(req) or 0)
        assert a.sent[1].released_request_ids == ()
        assert b.sent[1].released_request_ids == ("r1",) and not b.sent[1].inputs

    asyncio.run(run())


def test_a_handoff_behind_a_round_is_answered_after_it_on_each_replica() -> None:
    """Two sends out at once (a round, then the hand-off of a request that joined beside it):
    each `receive` gets its own send's answers, merged over the replicas it went to."""

    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        a, b = links["10.0.0.1:1"], links["10.0.0.2:1"]
        session = DraftSession(vocab_size=16)
        running, joiner = [seq("r0"), seq("r1")], seq("r2")
        for s in (*running, joiner):
            s.output.append(4)
            session.add(s, None)
        req = request(pool, session, running, 1)
        sent = await pool.send(req)
        handoff = session.handoff(2, [joiner], epoch=pool.epochs([joiner]))
        assert handoff is not None
        handed = await pool.send(handoff)
        assert sent is not None and handed is not None and handed != sent
        assert [r.round_id for r in a.sent] == [1, 2] and [r.round_id for r in b.sent] == [1]
        response = await pool.receive(1, sent)
        assert response is not None and set(response.trees) == {"r0", "r1"}
        answer = await pool.receive(2, handed)
        assert answer is not None and set(answer.trees) == {"r2"}
        assert not session.drafts(handoff, answer).fallbacks
        (item,) = session.request(3, [joiner], 3, epoch=pool.epochs([joiner])).inputs
        assert item.appended == (4,)  # the prompt went with the hand-off

    asyncio.run(run())


def test_a_lost_replica_costs_its_requests_one_round_then_they_move_and_re_prefill() -> None:
    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        a, b = links["10.0.0.1:1"], links["10.0.0.2:1"]
        session = DraftSession(vocab_size=16)
        seqs = [seq("r0"), seq("r1")]
        for s in seqs:
            session.add(s, None)
        req = request(pool, session, seqs, 1)
        session.drafts(req, await pool.receive(1, await pool.send(req) or 0))
        assert [len(i.appended) for i in req.inputs] == [3, 3]
        for s in seqs:
            s.output.append(5)
        b.fail = True  # b dies in the middle of round 2
        req = request(pool, session, seqs, 2)
        drafts = session.drafts(req, await pool.receive(2, await pool.send(req) or 0))
        assert [len(t) for t in drafts.trees] == [1, 0]  # r1 decodes plainly, r0 speculates
        b.fail = False
        b.lose()
        for s in seqs:
            s.output.append(6)
        req = request(pool, session, seqs, 3)
        await pool.send(req)
        # r1 moved to a, and a gets its whole history (a new stream for it); r0 only what's new
        assert {i.request_id: i.appended for i in a.sent[-1].inputs} == {
            "r0": (6,),
            "r1": (1, 2, 3, 5, 6),
        }
        assert len(b.sent) == 2  # nothing more for b
        # b comes back: new requests may go there, the moved one stays on a
        b.reconnect()
        assert pool.epochs([seq("r2")])["r2"] != pool.epochs(seqs)["r1"]

    asyncio.run(run())


def test_a_refused_request_moves_to_another_replica() -> None:
    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1", "10.0.0.2:1")
        a, b = links["10.0.0.1:1"], links["10.0.0.2:1"]
        a.refuse = {"r0"}
        session = DraftSession(vocab_size=16)
        s = seq("r0")
        session.add(s, None)
        req = request(pool, session, [s], 1)
        response = await pool.receive(1, await pool.send(req) or 0)
        assert response is not None and "max_target_requests" in response.refused["r0"]
        drafts = session.drafts(req, response)
        assert drafts.fallbacks == ["draft_refused"] and len(drafts.trees[0]) == 0
        req = request(pool, session, [s], 2)
        await pool.send(req)
        assert [i.request_id for i in b.sent[0].inputs] == ["r0"] and len(a.sent) == 1

    asyncio.run(run())


def test_one_replica_answers_as_it_is() -> None:
    async def run() -> None:
        pool, links = await pool_of("10.0.0.1:1")
        (link,) = links.values()
        session = DraftSession(vocab_size=16)
        s = seq("r0")
        session.add(s, None)
        req = request(pool, session, [s], 1)
        sent = await pool.send(req)
        assert link.sent == [req]  # the whole round, as the session built it
        link.fail = True
        assert await pool.receive(1, sent or 0) is None  # the target counts draft_failed

    asyncio.run(run())


def test_slowest_takes_each_stage_from_the_slowest_replica() -> None:
    t = slowest([StageTimings(draft_ms=3.0, total_ms=4.0), StageTimings(extend_ms=2.0, total_ms=5)])
    assert (t.draft_ms, t.extend_ms, t.total_ms) == (3.0, 2.0, 5)


@pytest.mark.parametrize(
    ("entry", "name"),
    [("127.0.0.1:5", False), ("[::1]:5", False), ("unix:/tmp/d.sock", False), ("drafts:5", True)],
)
def test_which_entries_are_names(entry: str, name: bool) -> None:
    assert is_name(entry) is name


def test_localhost_is_one_replica_and_addresses_are_themselves() -> None:
    async def run() -> None:
        assert await resolve("localhost:50052") == ["localhost:50052"]
        assert await resolve("10.1.2.3:50052") == ["10.1.2.3:50052"]
        assert await resolve("unix:/tmp/draft.sock") == ["unix:/tmp/draft.sock"]
        assert await resolve("no-such-host.invalid:1") == []

    asyncio.run(run())


def test_a_name_with_several_addresses_is_a_replica_each(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    ips = ["10.0.0.7", "10.0.0.5", "10.0.0.7"]  # one address per socket type, say

    async def getaddrinfo(self: Any, host: str, port: int, **kw: Any) -> list[Any]:
        assert host == "drafts"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)

    async def run() -> None:
        assert await resolve("drafts:50052") == ["10.0.0.5:50052", "10.0.0.7:50052"]
        links: dict[str, FakeLink] = {}

        def make(address: str, authority: str | None) -> Any:
            links[address] = FakeLink(address, authority)
            return links[address]

        pool = DraftPool(["drafts:50052"], make, resolve_s=0.01)
        await pool.start()
        assert [link.address for link in pool.links] == ["10.0.0.5:50052", "10.0.0.7:50052"]
        assert {link.authority for link in links.values()} == {"drafts"}  # TLS checks the name
        first = pool.epochs([seq("r0"), seq("r1")])
        # A pod goes, another comes: .5 is dropped (closed), .9 added; .7 keeps its stream.
        ips[:] = ["10.0.0.7", "10.0.0.9"]
        for _ in range(100):
            if len(links) == 3:
                break
            await asyncio.sleep(0.01)
        assert [link.address for link in pool.links] == ["10.0.0.7:50052", "10.0.0.9:50052"]
        assert not links["10.0.0.5:50052"].connected
        again = pool.epochs([seq("r0"), seq("r1")])
        assert again["r1"] == first["r1"]  # on .7 still
        assert again["r0"] not in first.values()  # moved to .9, a new stream for it
        assert [r.requests for r in pool.replicas()] == [1, 1]
        await pool.close()

    asyncio.run(run())
