"""Ready means loaded: the target and the draft answer grpc.health.v1 from the moment their port
is bound, NOT_SERVING while the model loads and the tiers are built, SERVING after. This is what
the kubelet's gRPC probes (deploy/k8s/) and compose's healthchecks wait on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import draft_service.server as draft_server
import target_service.server as target_server
from specpair.config import DraftConfig, ServerConfig, TargetConfig

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
    starting = asyncio.create_task(service.start(config))
    try:
        await asyncio.to_thread(loading.wait, 30)
        assert loading.is_set(), "the service never started loading its model"
        for name in names:
            assert await _status(address, name) == NOT_SERVING, name
        gate.set()
        running = await asyncio.wait_for(starting, 120)
    finally:
        gate.set()
        if not starting.done():
            await asyncio.wait_for(starting, 120)
    try:
        for name in names:
            assert await _status(address, name) == SERVING, name
    finally:
        await running.stop()
