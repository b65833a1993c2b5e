"""The target's draft replicas: a `DraftLink` each, every request drafted on one of them.

    --draft a:50052,b:50052          two replicas
    --draft drafts:50052             a name resolving to several addresses (a Kubernetes
                                     headless Service): a replica per address, looked up again
                                     every `resolve_s` as pods come and go

A request is homed on the least-loaded connected replica at its first round with drafts and
stays there (its KV lives there) while that replica's stream lives. A round's RoundRequest is
split by home into one RoundRequest per replica, sent concurrently, and the answers are merged
into one RoundResponse, so the scheduler and the `DraftSession` see one draft. Worked example:
inputs r1, r2, r3 homed a, b, a and r4 released from b →
a: RoundRequest(inputs r1, r3), b: RoundRequest(inputs r2, released r4); trees {r1, r3} from a
and {r2} from b answer the round.

A lost or late replica costs its requests their drafts in the round it fails (they decode
plainly); at their next round they move to a live replica and re-prefill there. A late one is
benched until a probe answers in time (`draft_link.py`, `draft_deadline.py`); its deadline
follows the fastest connected replica's pace, since a round waits for its slowest leg. The
move is the DraftSession's epoch logic: a request's stream key (`epochs`) names its home's
current stream, so a new home, or a home that reconnected, is a new stream and the request's
whole history is sent again. A request the replica refuses (no room: `RoundResponse.refused`)
moves the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from specpair.config import split_address
from specpair.logging import get_logger
from specpair.proto.v1 import target_pb2
from specpair.runtime.round_messages import DraftInput, RoundRequest, RoundResponse
from specpair.runtime.target.worker import TargetSequence
from target_service.drafts.draft_deadline import RoundPace
from target_service.drafts.draft_link import DraftLink
from target_service.drafts.draft_merge import merge
from target_service.drafts.draft_resolve import is_name, resolve

log = get_logger(__name__)
State = target_pb2.DraftConnectionState
# (address, authority) → an unstarted link; authority: the name an address was resolved from
MakeLink = Callable[[str, str | None], DraftLink]


@dataclass(eq=False, slots=True)
class Leg:
    """The part of a round sent to one replica."""

    link: DraftLink
    epoch: int  # the link's stream it went out on
    owed: int  # responses still to read: 1 until `receive` reads it


class DraftPool:
    def __init__(self, entries: Sequence[str], make_link: MakeLink, *, resolve_s: float = 30.0):
        self.entries = tuple(entries)  # as configured: addresses, or names to resolve
        self.resolve_s = resolve_s
        self._make = make_link
        self.links: list[DraftLink] = []
        self._by_entry: dict[str, list[DraftLink]] = {}
        self._homes: dict[str, tuple[DraftLink, int]] = {}  # request id → (home, stream key)
        self._keys: dict[DraftLink, tuple[int, int]] = {}  # link → (its epoch, stream key)
        self._next_key = itertools.count()
        # The rounds out, by `send`'s number: a round, and at most a hand-off behind it
        # (`TargetRound.handoff`), answered in the order sent on each replica's stream.
        self._legs: dict[int, list[Leg]] = {}
        self._sent = 0
        self._refresh: asyncio.Task[None] | None = None

    # ---- replicas -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resolves each entry and opens a link per replica; names are looked up again every
        `resolve_s` seconds."""
        for entry in self.entries:
            addresses = await resolve(entry)
            self._set(entry, addresses or [entry])
        if any(is_name(e) for e in self.entries):
            self._refresh = asyncio.create_task(self._keep_resolving(), name="draft-resolve")

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
        for link in self.links:
            await link.close()

    async def _keep_resolving(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_s)
            for entry in filter(is_name, self.entries):
                addresses = await resolve(entry)
                if not addresses:  # a failed lookup keeps the replicas there are
                    continue
                try:
                    for gone in self._set(entry, addresses):
                        await gone.close()
                except Exception:  # a bug here must not end the lookups
                    log.exception("draft replicas not updated", entry=entry)

    def _set(self, entry: str, addresses: Sequence[str]) -> list[DraftLink]:
        """Makes `entry`'s replicas those at `addresses` (started); returns the links dropped."""
        current = {link.address: link for link in self._by_entry.get(entry, [])}
        host = split_address(entry)[0] if is_name(entry) else None
        links = []
        for address in addresses:
            link = current.pop(address, None)
            if link is None:
                link = self._make(address, host if address != entry else None)
                link.peers = functools.partial(self._paces, link)
                link.start()
                log.info("draft replica added", entry=entry, address=address)
            links.append(link)
        self._by_entry[entry] = links
        gone = list(current.values())
        for link in gone:
            log.info("draft replica removed", entry=entry, address=link.address)
            self._keys.pop(link, None)
        # Its requests move at their next round (its stream closes: nothing to release there).
        self._homes = {rid: home for rid, home in self._homes.items() if home[0] not in gone}
        self.links = [link for e in self.entries for link in self._by_entry.get(e, [])]
        return gone

    def _paces(self, link: DraftLink) -> list[RoundPace]:
        """What `link`'s deadline follows: its own pace and every connected replica's, so a
        replica far slower than a live one is benched (a round waits for its slowest leg)."""
        return [link.pace, *(x.pace for x in self.links if x.connected and x is not link)]

    @property
    def connected(self) -> bool:
        return any(link.connected for link in self.links)

    @property
    def state(self) -> target_pb2.DraftConnectionState.ValueType:
        """CONNECTED while any replica is; INCOMPATIBLE when all refused this target."""
        states = {link.state for link in self.links}
        for state in (
            State.DRAFT_CONNECTION_STATE_CONNECTED,
            State.DRAFT_CONNECTION_STATE_DISCONNECTED,
        ):
            if state in states:
                return state
        if states == {State.DRAFT_CONNECTION_STATE_INCOMPATIBLE}:
            return State.DRAFT_CONNECTION_STATE_INCOMPATIBLE
        return State.DRAFT_CONNECTION_STATE_CONNECTING

    @property
    def incompatible(self) -> str:
        """Why a replica refused this target (with its address when there are several)."""
        if len(self.links) == 1:
            return self.links[0].incompatible
        reasons = [f"{x.address}: {x.incompatible}" for x in self.links if x.incompatible]
        return reasons[0] if reasons else ""

    @property
    def features(self) -> bool:
        """Whether rounds carry the target's hidden states (an EAGLE draft is connected)."""
        return any(link.connected and link.draft_kind == "eagle" for link in self.links)

    def replicas(self) -> list[target_pb2.DraftReplica]:
        load = self._load()
        return [
            target_pb2.DraftReplica(
                address=link.address,
                state=link.state,
                incompatible_reason=link.incompatible,
                requests=load[link],
            )
            for link in self.links
        ]

    # ---- homes --------------------------------------------------------------------------

    def _key(self, link: DraftLink) -> int:
        """A number for the link's current stream, new whenever it reconnects."""
        epoch, key = self._keys.get(link, (-1, -1))
        if epoch != link.epoch:
            key = next(self._next_key)
            self._keys[link] = (link.epoch, key)
        return key

    def _fresh(self, link: DraftLink, key: int) -> bool:
        """Whether the stream a request was homed on is still the link's, and up."""
        return link.connected and self._key(link) == key

    def _load(self) -> Counter[DraftLink]:
        return Counter(link for link, key in self._homes.values() if self._fresh(link, key))

    def _home(
        self, request_id: str, load: Counter[DraftLink], avoid: DraftLink | None = None
    ) -> None:
        """Homes the request on the least-loaded connected replica (other than `avoid`)."""
        live = [link for link in self.links if link.connected and link is not avoid]
        if not live:
            return
        link = min(live, key=lambda x: load[x])
        load[link] += 1
        self._homes[request_id] = (link, self._key(link))

    def epochs(self, seqs: Sequence[TargetSequence]) -> dict[str, int]:
        """Each request's stream key (`DraftSession.request`'s epoch), homing a request with no
        live home on the least-loaded connected replica."""
        if len(self._homes) > 2 * len(seqs) + 64:
            # Homes whose stream is gone (requests released while no replica was up): pruned.
            self._homes = {r: h for r, h in self._homes.items() if self._fresh(*h)}
        keys: dict[str, int] = {}
        load: Counter[DraftLink] | None = None
        for seq in seqs:
            rid = seq.request_id
            home = self._homes.get(rid)
            if home is None or not self._fresh(*home):
                load = self._load() if load is None else load
                self._home(rid, load)
                home = self._homes.get(rid)
            keys[rid] = home[1] if home is not None else -1
        return keys

    # ---- rounds -------------------------------------------------------------------------

    def _split(self, request: RoundRequest) -> list[tuple[DraftLink, RoundRequest]]:
        """One RoundRequest per replica holding any of `request`'s inputs or releases."""
        inputs: dict[DraftLink, list[DraftInput]] = {}
        released: dict[DraftLink, list[str]] = {}
        for item in request.inputs:
            home = self._homes.get(item.request_id)
            if home is not None and self._fresh(*home):
                inputs.setdefault(home[0], []).append(item)
        for rid in request.released_request_ids:
            home = self._homes.pop(rid, None)
            if home is not None and self._fresh(*home):  # else its stream is gone, and its state
                released.setdefault(home[0], []).append(rid)
        legs = []
        for link in self.links:
            mine, freed = inputs.get(link, []), released.get(link, [])
            if mine or freed:
                sub = replace(request, inputs=tuple(mine), released_request_ids=tuple(freed))
                legs.append((link, sub))
        return legs

    async def send(self, request: RoundRequest) -> int | None:
        """Sends each replica its part of the round; a number for `receive`, or None when no
        part went out."""
        legs = self._split(request)
        if len(legs) == 1:  # one replica: no task per round
            epochs = [await legs[0][0].send(legs[0][1])]
        else:
            epochs = await asyncio.gather(*(link.send(sub) for link, sub in legs))
        out = [
            Leg(link, epoch, 1)
            for (link, _), epoch in zip(legs, epochs, strict=True)
            if epoch is not None
        ]
        self._sent += 1
        # A round's answers are read before the round after it goes out: a few suffice.
        self._legs = {n: g for n, g in self._legs.items() if n > self._sent - 4}
        if not out:
            return None
        self._legs[self._sent] = out
        return self._sent

    async def receive(self, round_id: int, sent: int) -> RoundResponse | None:
        """The round's next answer from every replica that owes one, merged; None when none
        came (a replica that failed costs only its own requests' drafts)."""
        return (await self.receive_each([(round_id, sent)]))[0]

    async def receive_each(self, rounds: Sequence[tuple[int, int]]) -> list[RoundResponse | None]:
        """The answers to rounds (round id, `send`'s number) sent one after another, each
        merged as `receive` merges one: every replica's read in the order sent, the replicas
        concurrently, so none waits on another's earlier answer (a slow replica's hand-off
        does not hold a fast one's round, whose read time feeds the fast one's pace)."""
        plans = []
        for _, sent in rounds:
            legs = [leg for leg in self._legs.get(sent, ()) if leg.owed > 0]
            for leg in legs:
                leg.owed -= 1
            plans.append(legs)
        links = list(dict.fromkeys(leg.link for legs in plans for leg in legs))

        async def read(link: DraftLink) -> dict[int, RoundResponse | None]:
            return {
                i: await leg.link.receive(round_id, leg.epoch)
                for i, ((round_id, _), legs) in enumerate(zip(rounds, plans, strict=True))
                for leg in legs
                if leg.link is link
            }

        if len(links) == 1:  # one replica: no task per round
            answers = [await read(links[0])]
        else:
            answers = await asyncio.gather(*(read(link) for link in links))
        read_by = dict(zip(links, answers, strict=True))
        merged: list[RoundResponse | None] = []
        for i, ((round_id, _), legs) in enumerate(zip(rounds, plans, strict=True)):
            responses = [read_by[leg.link][i] for leg in legs]
            for leg, response in zip(legs, responses, strict=True):
                if response is not None and response.refused:
                    self._move(response.refused, leg.link)
            if len(legs) == 1:  # one replica's answer, as it is
                merged.append(responses[0])
                continue
            pairs = [(leg.link.address, r) for leg, r in zip(legs, responses, strict=True)]
            merged.append(merge(round_id, pairs))
        return merged

    def _move(self, request_ids: Iterable[str], refusing: DraftLink) -> None:
        """Requests a replica had no room for: homed on another one next round, if any is up."""
        load = self._load()
        for rid in request_ids:
            self._home(rid, load, avoid=refusing)

    async def round(self, request: RoundRequest) -> RoundResponse | None:
        """Sends one round and waits for its answers (releases, when idle)."""
        sent = await self.send(request)
        return None if sent is None else await self.receive(request.round_id, sent)
