"""Ready means loaded: the target and the draft answer grpc.health.v1 from the moment their port
is bound, NOT_SERVING while the model loads and the tiers are built, SERVING after. This is what
the kubelet's gRPC probes (deploy/k8s/) and compose's healthchecks wait on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import draft_service.server as draft_server
import target_service.server as target_server
from specpair.config import DraftConfig, ServerConfig, TargetConfig
from specpair.proto.v1 import target_pb2

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def _held(fn: Callable[..., Any], gate: threading.Event, loading: threading.Event) -> Any:
    """`fn`, which waits for `gate` after saying it started (it runs in a worker thread)."""

    def held(*args: Any) -> Any:
        loading.set()
        assert gate.wait(60), "the test never let the model load"
        return fn(*args)

    return held


async def _status(address: str, service: str = "") -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


async def _start_held(
    service: Any,
    config: Any,
    gate: threading.Event,
    reached: threading.Event,
    while_held: Callable[[], Awaitable[None]],
    *,
    wait_s: float,
    what: str,
) -> Any:
    """Starts `service` whose patched step (`_held`) waits on `gate`; once the step is
    `reached`, runs the `while_held` checks, then lets it go and returns the running service."""
    starting = asyncio.create_task(service.start(config))
    try:
        await asyncio.to_thread(reached.wait, wait_s)
        assert reached.is_set(), f"the service never {what}"
        await while_held()
        gate.set()
        return await asyncio.wait_for(starting, 120)
    finally:
        gate.set()
        if not starting.done():
            await asyncio.wait_for(starting, 120)


@pytest.mark.parametrize("role", ["target", "draft"])
async def test_health_is_not_serving_until_the_model_is_loaded(
    role: str, ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A unix socket: the address is known before start() returns (an ephemeral port is not).
    address = f"unix:{tmp_path / role}.sock"
    gate, loading = threading.Event(), threading.Event()
    service: Any
    if role == "target":
        service, names = target_server, ["", "specpair.v1.TargetService"]
        monkeypatch.setattr(
            target_server, "_build_scheduler", _held(target_server._build_scheduler, gate, loading)
        )
        config: Any = TargetConfig(ServerConfig(address), ckpts["target"], draft_address=None)
    else:
        service, names = draft_server, ["", draft_server.SERVICE_NAME]
        monkeypatch.setattr(
            draft_server, "DraftRounds", _held(draft_server.DraftRounds, gate, loading)
        )
        config = DraftConfig(ServerConfig(address), ckpts["draft"])

    async def not_serving() -> None:
        for name in names:
            assert await _status(address, name) == NOT_SERVING, name

    running = await _start_held(
        service, config, gate, loading, not_serving, wait_s=30, what="started loading its model"
    )
    try:
        for name in names:
            assert await _status(address, name) == SERVING, name
    finally:
        await running.stop()


@pytest.mark.parametrize("role", ["target", "draft"])
async def test_health_is_not_serving_until_the_warm_up_is_done_and_it_leaves_nothing_held(
    role: str, ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The warm-up runs every path a round takes (on a GPU: what compiles on first use) before
    # SERVING, and gives back every slot and page it used.
    address = f"unix:{tmp_path / role}.sock"
    gate, warming = threading.Event(), threading.Event()
    service: Any = target_server if role == "target" else draft_server
    ran: list[float] = []

    def record(fn: Callable[..., float]) -> Callable[..., float]:
        def warm_up(*args: Any) -> float:
            ran.append(fn(*args))
            return ran[-1]

        return warm_up

    monkeypatch.setattr(service, "warm_up", _held(record(service.warm_up), gate, warming))
    config: Any = (
        TargetConfig(ServerConfig(address), ckpts["target"], draft_address=None, max_batch=2)
        if role == "target"
        else DraftConfig(ServerConfig(address), ckpts["draft"], max_requests=2)
    )

    async def not_serving() -> None:
        assert await _status(address) == NOT_SERVING  # loaded and built, not yet warm

    running = await _start_held(
        service, config, gate, warming, not_serving, wait_s=60, what="warmed up"
    )
    try:
        assert await _status(address) == SERVING and len(ran) == 1
        if role == "target":
            cache = running.servicer.scheduler.worker.cache
        else:
            assert running.servicer.rounds.active_requests == 0
            cache = running.servicer.rounds.drafter.cache
        assert cache.free_slots == 2
        # every page is free but the padding slot's (graphs' padding rows write there)
        assert len(cache.pages.free) == cache.pages.num_pages - cache.pages.owned[cache.pad_slot]
    finally:
        await running.stop()


async def test_the_first_round_after_serving_drafts(ckpts: dict[str, Path]) -> None:
    """A target's first request, the moment both report SERVING: drafted from its first round
    (no plain round, no fallback)."""
    from tests.service.conftest import Stack, draft_config, target_config

    stack = await Stack(
        draft_config(ckpts["draft"]), target_config(ckpts["target"], initial_steps=3)
    ).start()
    try:
        _, responses = await stack.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=12)
        rounds = [r for r in responses if r.token_ids][1:]  # after the prefill's first token
        assert rounds and all(r.accept_length >= 0 for r in rounds), responses
        assert responses[-1].speculation.plain_rounds == 0, responses[-1]
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
        assert info.draft_connection_state == target_pb2.DRAFT_CONNECTION_STATE_CONNECTED
        assert stack.draft.servicer.rounds.active_requests == 0  # freed with the request
    finally:
        await stack.stop()
