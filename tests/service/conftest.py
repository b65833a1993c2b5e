"""In-process services on ephemeral ports, over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import draft_service.server as draft_server
import target_service.server as target_server
from specpair.config import DraftConfig, ServerConfig, TargetConfig
from specpair.proto.v1 import draft_pb2_grpc, target_pb2, target_pb2_grpc
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.build import build_states, build_target
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.shape import TreeShape
from specpair.runtime.target.worker import TargetWorker
from target_service.batching.scheduler import Scheduler
from target_service.drafts.draft_link import DRAFT_SERVICE


class Stack:
    """A draft + target pair; `restart_draft` brings the draft back on the same port."""

    def __init__(self, draft_cfg: DraftConfig | None, target_cfg: TargetConfig) -> None:
        self.draft_cfg, self.target_cfg = draft_cfg, target_cfg
        self.draft: Any = None
        self.target: Any = None

    async def start(self, wait_connected: bool = True) -> Stack:
        if self.draft_cfg is not None:
            self.draft = await draft_server.start(self.draft_cfg)
            address = self.draft_cfg.server.address  # a unix: socket keeps its path
            if not address.startswith("unix:"):
                address = f"127.0.0.1:{self.draft.port}"
            self.draft_cfg = replace(
                self.draft_cfg, server=replace(self.draft_cfg.server, address=address)
            )
            self.target_cfg = replace(self.target_cfg, draft_address=address)
        self.target = await target_server.start(self.target_cfg)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.target.port}")
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        if self.draft is not None and wait_connected:
            # The target serves before its draft link is up (plainly); tests that count
            # speculative rounds start from a connected pair.
            await self.wait_draft_connected()
        return self

    async def stop_draft(self) -> None:
        await self.draft.stop(grace=0)
        self.draft = None

    async def restart_draft(self) -> None:
        assert self.draft_cfg is not None
        self.draft = await draft_server.start(self.draft_cfg)

    async def stop(self) -> None:
        await self.channel.close()
        await self.target.stop()
        if self.draft is not None:
            await self.draft.stop()

    async def wait_draft_connected(self, timeout: float = 5.0) -> None:
        for _ in range(int(timeout / 0.05)):
            info = await self.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
            if info.draft_connection_state == target_pb2.DRAFT_CONNECTION_STATE_CONNECTED:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the target never connected to the draft")

    async def generate(
        self, metadata: tuple[tuple[str, str], ...] = (), **kwargs: Any
    ) -> tuple[list[int], list[target_pb2.GenerateResponse]]:
        """`metadata`: the call's (an API key, where the target has one)."""
        request = target_pb2.GenerateRequest(**kwargs)
        responses = [r async for r in self.stub.Generate(request, metadata=metadata)]
        return [t for r in responses for t in r.token_ids], responses


@contextlib.asynccontextmanager
async def fake_draft(servicer: draft_pb2_grpc.DraftServiceServicer) -> AsyncIterator[str]:
    """A DraftService `servicer` (a test double) on an ephemeral port; yields its address."""
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()  # the target waits for SERVING
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set(DRAFT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Polls `predicate` until it holds; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{predicate} did not hold within {timeout} s")
        await asyncio.sleep(0.01)


def one_tier_scheduler(
    worker: TargetWorker, tier: int, max_batch: int, draft: Any = None, **kwargs: Any
) -> Scheduler:
    """A scheduler of tier `tier` alone over `worker`, its queue twice the batch; no draft
    unless one (a real link or a fake) is given."""
    return Scheduler(
        worker,
        build_states([TreeShape(tier)], worker),
        initial_tier=TreeShape(tier),
        max_batch=max_batch,
        max_queue=2 * max_batch,
        draft=draft,
        metrics=ServiceMetrics("target"),
        **kwargs,
    )


def target_config(target: Path, **kwargs: Any) -> TargetConfig:
    kwargs.setdefault("draft_timeout_s", 15.0)  # a loaded CI box must not look like a dead draft
    # nor a late one: a fixed deadline unless a test asks for the measured one
    kwargs.setdefault("draft_deadline_floor_s", kwargs["draft_timeout_s"])
    kwargs.setdefault("reconnect_min_s", 0.05)
    kwargs.setdefault("reconnect_max_s", 0.2)
    return TargetConfig(ServerConfig("127.0.0.1:0"), target, **kwargs)


def draft_config(draft: Path, **kwargs: Any) -> DraftConfig:
    return DraftConfig(ServerConfig("127.0.0.1:0"), draft, **kwargs)


@pytest.fixture
async def make_stack() -> AsyncIterator[Any]:
    stacks: list[Stack] = []

    async def make(
        draft_cfg: DraftConfig | None, target_cfg: TargetConfig, wait_connected: bool = True
    ) -> Stack:
        stack = await Stack(draft_cfg, target_cfg).start(wait_connected)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        await stack.stop()


def reference_greedy(target: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Target-only greedy decoding with our engine (itself checked against transformers)."""
    worker = build_target(target, max_requests=len(prompts), max_len=1024)
    results = SpeculativeEngine(worker, None).generate(
        prompts, max_new_tokens=max_tokens, state=None, stop_token_ids=frozenset({0})
    )
    return [r.token_ids for r in results]


def self_signed(directory: Path, name: str = "specpair") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1/localhost that is its own CA, and its key (needs openssl)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
