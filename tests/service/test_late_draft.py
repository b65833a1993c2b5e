"""A draft that stays healthy (SERVING) but answers late or never: the target never waits on it
round after round. It is benched, its requests move to a live replica or decode plainly, and it
is let back only when a probe answers in time; the deadline follows the measured pace."""

from __future__ import annotations

import asyncio
from typing import Any

import draft_service.server as draft_server
from specpair.proto.v1 import draft_pb2, draft_pb2_grpc, target_pb2
from specpair.rpc.wire import response_to_proto
from specpair.runtime.round_messages import RoundResponse
from specpair.runtime.tree import chain
from tests.service.conftest import draft_config, eventually, fake_draft, target_config
from tests.service.test_hardening import PROMPT

CONNECTED = target_pb2.DRAFT_CONNECTION_STATE_CONNECTED
PROMPTS = [PROMPT, [5, 6, 7], [3, 4, 5, 6], [100, 200, 50]]


class SilentDraft(draft_pb2_grpc.DraftServiceServicer):
    """Takes the Round stream, reads every round, answers none (its health says SERVING)."""

    def __init__(self) -> None:
        self.rounds = 0  # rounds with requests in them that it was sent

    async def Round(self, request_iterator: Any, context: Any) -> Any:
        async for request in request_iterator:
            self.rounds += bool(request.inputs)
        return
        yield  # pragma: no cover - an async generator that never answers

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return draft_pb2.DraftServiceGetServerInfoResponse(draft_kind="model")


class SlowDraft(SilentDraft):
    """Answers every message with well-formed chains, `delay_s` late."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def Round(self, request_iterator: Any, context: Any) -> Any:
        async for request in request_iterator:
            await asyncio.sleep(self.delay_s)
            steps = request.speculative_num_steps
            self.rounds += bool(request.inputs) and steps > 0
            trees = {i.request_id: chain([5] * steps) for i in request.inputs if steps > 0}
            yield response_to_proto(RoundResponse(request.round_id, trees))


def _late_config(target: Any, draft_address: str, **kwargs: Any) -> Any:
    # A ceiling a loaded box never reaches for a live draft, and the measured deadline below it.
    kwargs.setdefault("draft_timeout_s", 3.0)
    return target_config(target, draft_address=draft_address, draft_deadline_floor_s=0.3, **kwargs)


async def test_a_silent_healthy_draft_is_never_waited_on(ckpts, make_stack) -> None:
    """It answered no round: each waited the whole timeout and the target reconnected at once
    (health SERVING): 0 of 2 32-token requests finished in 100 s."""
    silent = SilentDraft()
    async with fake_draft(silent) as address:
        stack = await make_stack(None, _late_config(ckpts["target"], address), wait_connected=False)
        runs = [stack.generate(prompt_token_ids=PROMPT, max_tokens=32) for _ in range(2)]
        results = await asyncio.wait_for(asyncio.gather(*runs), 60)
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert [len(tokens) for tokens, _ in results] == [32, 32]
    assert silent.rounds == 0  # its probe went unanswered: no round was ever sent to it
    assert info.draft_connection_state != CONNECTED


async def test_a_silent_replica_costs_the_healthy_one_nothing(ckpts, make_stack) -> None:
    """In a pool of one healthy and one silent replica every request slowed (p50 0.68 →
    20.95 s): a round waits for its slowest leg."""
    healthy = await draft_server.start(draft_config(ckpts["draft"]))
    silent = SilentDraft()
    try:
        async with fake_draft(silent) as address:
            pool = f"127.0.0.1:{healthy.port},{address}"
            stack = await make_stack(None, _late_config(ckpts["target"], pool))
            await stack.wait_draft_connected()
            results = []
            for _ in range(3):  # waves: each homes new requests on the least-loaded replicas
                runs = [stack.generate(prompt_token_ids=p, max_tokens=24) for p in PROMPTS]
                results += await asyncio.wait_for(asyncio.gather(*runs), 60)
    finally:
        await healthy.stop(grace=0)
    assert all(len(tokens) == 24 for tokens, _ in results)
    assert silent.rounds == 0
    # Every request drafted on the live replica.
    assert all(r[-1].speculation.accept_lengths for _, r in results)


async def test_a_replica_far_slower_than_a_live_one_is_benched(ckpts, make_stack) -> None:
    """A replica answering every round in 4.5 s, under a 5 s timeout, was never dropped."""
    healthy = await draft_server.start(draft_config(ckpts["draft"]))
    slow = SlowDraft(delay_s=2.5)  # 4x a live round's pace stays below it even on a loaded box
    try:
        async with fake_draft(slow) as address:
            pool = f"127.0.0.1:{healthy.port},{address}"
            stack = await make_stack(None, _late_config(ckpts["target"], pool, draft_timeout_s=4.0))
            links = stack.target.servicer.scheduler.draft.links
            # Nothing measured yet: its probe is judged by the ceiling, and passes.
            await eventually(lambda: all(link.connected for link in links), timeout=20)
            runs = [stack.generate(prompt_token_ids=p, max_tokens=48) for p in PROMPTS]
            results = await asyncio.wait_for(asyncio.gather(*runs), 120)
            assert all(len(tokens) == 48 for tokens, _ in results)
            # It answers in time only until the live replica's pace is measured (8 rounds),
            # then misses, and its probes (2.5 s late) keep it out: its requests draft on the
            # live one.
            assert slow.rounds <= 16, slow.rounds
            assert not links[1].connected and links[1].strikes >= 1
    finally:
        await healthy.stop(grace=0)
