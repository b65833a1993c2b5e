"""Many targets, one controller, a shared draft pool, over real gRPC: two targets spread their
requests over two draft replicas, one replica is killed mid-run, and nothing is lost; a draft
counts its slots per target."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc

import draft_service.server as draft_server
import target_service.server as target_server
from controller.policies.sglang import PolicyConfig
from controller.service.server import RunningController
from controller.service.server import start as start_controller
from specpair.cli.client_commands import status_table
from specpair.client.results import ControllerState
from specpair.config import MODELS_DIR, ControllerConfig, DraftConfig, ServerConfig, TargetConfig
from specpair.proto.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specpair.rpc.channels import auth_metadata, target_metadata
from tests.service.conftest import draft_config, eventually, reference_greedy, target_config
from tests.service.test_hardening import draft_input

TARGET, DRAFT = MODELS_DIR / "target", MODELS_DIR / "draft"
CONNECTED = target_pb2.DRAFT_CONNECTION_STATE_CONNECTED
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14], [3, 4], [100, 200, 50, 60]]
MAX_TOKENS = 80


TOKEN = "s3cret"  # a declared target name counts only on a stream that presents the token
Config = TypeVar("Config", DraftConfig, TargetConfig)


def _with_token(config: Config) -> Config:
    return replace(config, server=replace(config.server, ops_token=TOKEN))


@dataclass
class Pool:
    drafts: list[Any]  # RunningDraft
    targets: list[Any]  # RunningTarget
    controller: RunningController
    stubs: list[target_pb2_grpc.TargetServiceStub]

    async def info(self, i: int) -> target_pb2.TargetServiceGetServerInfoResponse:
        return await self.stubs[i].GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())

    async def generate(self, i: int, prompt: list[int]) -> list[tuple[float, Any]]:
        request = target_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS)
        return [(time.monotonic(), r) async for r in self.stubs[i].Generate(request)]


@contextlib.asynccontextmanager
async def pool_of_two() -> AsyncIterator[Pool]:
    """2 draft replicas, 2 targets each drafting on both, 1 controller steering both; all share
    the ops token, so each draft tells the two targets (one host here) apart."""
    drafts = [await draft_server.start(_with_token(draft_config(DRAFT))) for _ in range(2)]
    replicas = ",".join(f"127.0.0.1:{d.port}" for d in drafts)
    targets = []
    for _ in range(2):
        config = target_config(TARGET, draft_address=replicas)
        targets.append(await target_server.start(_with_token(config)))
    addresses = ",".join(f"127.0.0.1:{t.port}" for t in targets)  # `--target a,b`
    fast = PolicyConfig(ema_alpha=0.5, warmup_batches=1, update_interval=1)
    server = ServerConfig("127.0.0.1:0", ops_token=TOKEN)
    config = ControllerConfig(server, targets=(addresses,), reconnect_s=0.1)
    controller = await start_controller(config, policy=fast)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{t.port}") for t in targets]
    pool = Pool(
        drafts, targets, controller, [target_pb2_grpc.TargetServiceStub(c) for c in channels]
    )
    try:
        yield pool
    finally:
        for channel in channels:
            await channel.close()
        await controller.stop(grace=0.1)
        for target in targets:
            await target.stop()
        for draft in drafts:
            if draft is not None:
                await draft.stop(grace=0)


async def test_two_targets_two_drafts_one_controller_lose_a_replica_and_nothing_else() -> None:
    expected = reference_greedy(TARGET, PROMPTS, MAX_TOKENS)
    async with pool_of_two() as pool:

        async def all_connected() -> bool:
            infos = [await pool.info(i) for i in range(2)]
            return all(r.state == CONNECTED for info in infos for r in info.draft_replicas)

        for _ in range(200):
            if await all_connected():
                break
            await asyncio.sleep(0.05)
        assert await all_connected()
        await eventually(lambda: all(t.connected for t in pool.controller.controller.snapshot()))

        runs = {
            (i, j): asyncio.create_task(pool.generate(i, prompt))
            for i in range(2)
            for j, prompt in enumerate(PROMPTS)
        }
        # Both targets draft on both replicas (each has homed requests on each), then replica 1
        # is killed hard, its streams cut in the middle of whatever round they carry.
        killed = pool.drafts[1]

        def both_on_both() -> bool:
            usage = [{u.target: u.requests for u in d.servicer.usage()} for d in pool.drafts]
            return all(len(u) == 2 and all(n > 0 for n in u.values()) for u in usage)

        await eventually(both_on_both, timeout=30)
        assert not any(run.done() for run in runs.values()), "killed too late: raise MAX_TOKENS"
        await killed.stop(grace=0)
        pool.drafts[1] = None
        killed_at = time.monotonic()

        results = {key: await asyncio.wait_for(run, 120) for key, run in runs.items()}
        # Nothing lost: every request finished, each exactly what its target alone decodes.
        for (_, j), responses in results.items():
            tokens = [t for _, r in responses for t in r.token_ids]
            assert tokens == expected[j]
            assert responses[-1][1].finish_reason != target_pb2.FINISH_REASON_UNSPECIFIED
        # The killed replica's requests moved to the live one and speculated there again: every
        # request has drafted rounds after the kill (only replica 0 was left to draft them).
        for key, responses in results.items():
            after = [r.accept_length for t, r in responses if t > killed_at + 0.05]
            assert any(a >= 0 for a in after), f"request {key} never speculated after the kill"
        for i in range(2):
            info = await pool.info(i)
            states = [r.state for r in info.draft_replicas]
            assert states[0] == CONNECTED and states[1] != CONNECTED
            assert info.draft_connection_state == CONNECTED  # one live replica is enough

        # One controller, each target its own policy and row.
        snapshot = pool.controller.controller.snapshot()
        assert [t.target_address for t in snapshot] == [f"127.0.0.1:{t.port}" for t in pool.targets]
        assert all(t.connected and t.rounds_seen > 0 for t in snapshot)
        policies = [t.policy for t in pool.controller.controller._targets]
        assert policies[0] is not policies[1]
        table = status_table(ControllerState({"kind": "sglang"}, tuple(snapshot)))
        assert all(f"127.0.0.1:{t.port}" in table for t in pool.targets)


class TargetStream:
    """A Round stream that presents a target identity (and the ops token, where given)."""

    def __init__(self, port: int, target: str, token: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.call = stub.Round(metadata=target_metadata(target) + auth_metadata(token))
        self.round_id = 0

    async def round(self, *inputs: draft_pb2.DraftInput) -> draft_pb2.RoundResponse:
        self.round_id += 1
        message = draft_pb2.RoundRequest(
            round_id=self.round_id, speculative_num_steps=3, inputs=inputs
        )
        await self.call.write(message)
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response.round_id == self.round_id
        return response  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self.call.done_writing()
        await self.channel.close()


async def test_a_draft_counts_slots_per_target_over_all_its_streams() -> None:
    config = draft_config(DRAFT, max_requests=6, max_target_requests=3)
    draft = await draft_server.start(_with_token(config))
    a1 = TargetStream(draft.port, "pod-a:50051", TOKEN)
    a2 = TargetStream(draft.port, "pod-a:50051", TOKEN)
    b = TargetStream(draft.port, "pod-b:50051", TOKEN)
    try:
        first = await a1.round(*(draft_input(f"r{i}", [5, 6, 7]) for i in range(2)))
        assert len(first.trees) == 2 and not first.refused
        # Target a's second stream shares its share: one slot left of 3.
        second = await a2.round(*(draft_input(f"r{i}", [5, 6]) for i in range(2)))
        assert [t.request_id for t in second.trees] == ["r0"]
        assert not second.error  # one request refused, not the round
        assert second.refused["r1"] == (
            "RESOURCE_EXHAUSTED: target pod-a:50051 holds max_target_requests 3 draft slots"
        )
        # Target b sends the same request ids: its own state, its own share.
        other = await b.round(*(draft_input(f"r{i}", [9, 8, 7]) for i in range(3)))
        assert len(other.trees) == 3 and not other.refused
        usage = {u.target: (u.streams, u.requests) for u in draft.servicer.usage()}
        assert usage == {"pod-a:50051": (2, 3), "pod-b:50051": (1, 3)}
        # a's first stream ends: its 2 slots are free, and b is still at its share.
        await a1.close()
        await eventually(lambda: draft.servicer.rounds.active_requests == 4)
        more = await b.round(draft_input("r9", [1, 2]))
        assert more.refused["r9"] == (
            "RESOURCE_EXHAUSTED: target pod-b:50051 holds max_target_requests 3 draft slots"
        )
        # Closing a target's streams frees its slots, and another target may take them.
        await a2.close()
        await eventually(lambda: draft.servicer.rounds.active_requests == 3)
        usage = {u.target: (u.streams, u.requests) for u in draft.servicer.usage()}
        assert usage == {"pod-b:50051": (1, 3)}
    finally:
        await b.close()
        await draft.stop(grace=0)


async def test_a_stream_without_an_identity_is_its_own_target_and_names_are_cleaned() -> None:
    config = draft_config(DRAFT, max_requests=4, max_target_requests=1)
    draft = await draft_server.start(_with_token(config))
    names = ("", "", "evil#1/r0", "evil#1/r0")
    streams = [TargetStream(draft.port, name, TOKEN) for name in names]
    try:
        answers = [await s.round(draft_input("r0", [5, 6, 7])) for s in streams]
        # A stream naming nobody is a target of its own; the two naming "evil#1/r0" are one
        # target, "evil_1_r0", with one slot.
        assert [len(a.trees) for a in answers] == [1, 1, 1, 0]
        assert "max_target_requests 1" in answers[3].refused["r0"]
        targets = [u.target for u in draft.servicer.usage()]
        assert len(targets) == 3 and "evil_1_r0" in targets
        assert all("#" not in t and "/" not in t for t in targets)
    finally:
        for stream in streams:
            await stream.close()
        await draft.stop(grace=0)
