"""DraftLink hands a round to the stream without waiting for the write to complete."""

from __future__ import annotations

import asyncio
from typing import Any

from specpair.proto.v1 import draft_pb2, target_pb2
from target_service.draft_link import DraftLink

WRITE_S = 0.2  # a write whose completion comes late


class SlowCall:
    """A Speculate stream whose writes complete WRITE_S after they start (or fail)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.started: list[int] = []
        self.completed: list[int] = []
        self.cancelled = False

    async def write(self, request: draft_pb2.SpeculateRequest) -> None:
        self.started.append(request.round_id)
        await asyncio.sleep(WRITE_S)
        if self.fail:
            raise ConnectionError("stream reset")
        self.completed.append(request.round_id)

    async def read(self) -> draft_pb2.SpeculateResponse:
        assert self.completed, "read before the write completed"
        return draft_pb2.SpeculateResponse(round_id=self.completed[-1])

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def connected(call: Any) -> DraftLink:
    link = DraftLink("127.0.0.1:1", timeout_s=5.0)
    link._call = call
    link.state = target_pb2.DRAFT_CONNECTION_STATE_CONNECTED
    link.epoch = 1
    return link


async def test_send_hands_over_the_write_and_receive_waits_for_it() -> None:
    call = SlowCall()
    link = connected(call)
    epoch = await link.send(draft_pb2.SpeculateRequest(round_id=7))
    assert epoch == 1
    assert call.started == [7] and call.completed == []  # started, not waited for
    response = await link.receive(7, epoch)
    assert response is not None and response.round_id == 7
    assert call.completed == [7]
    # the next round's write goes out the same way
    assert await link.send(draft_pb2.SpeculateRequest(round_id=8)) == 1
    assert call.started == [7, 8]
    assert (await link.receive(8, 1)).round_id == 8  # type: ignore[union-attr]


async def test_a_failed_write_fails_its_round_and_drops_the_stream() -> None:
    call = SlowCall(fail=True)
    link = connected(call)
    assert await link.send(draft_pb2.SpeculateRequest(round_id=3)) == 1
    assert await link.receive(3, 1) is None
    assert call.cancelled and not link.connected
    assert await link.send(draft_pb2.SpeculateRequest(round_id=4)) is None
