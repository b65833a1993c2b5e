"""The controller over real gRPC: a fake TargetService streams scripted rounds to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import free_address
from controller.policies.sglang import PolicyConfig
from controller.service.server import RunningController, serve, start
from specpair.cli.client_commands import status_table
from specpair.client.results import ControllerState
from specpair.config import ControllerConfig, ServerConfig, TLSConfig
from specpair.proto.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specpair.rpc.channels import auth_metadata
from specpair.rpc.serving import BindError, GrpcServer
from specpair.target_state import TargetState
from tests.service.conftest import eventually, self_signed

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
# Decide on every batch from the first one on, with an EMA that moves fast.
FAST = PolicyConfig(ema_alpha=0.5, warmup_batches=1, update_interval=1)


class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """Reports a tier, records ApplyTier, and streams the rounds a test pushes."""

    def __init__(self, steps: int = 3, candidates: tuple[int, ...] = (1, 3, 7)) -> None:
        self.steps = steps
        self.candidates = candidates
        self.applied: list[tuple[int, str]] = []
        self.request_steps: dict[str, int] = {}  # of the last ApplyTier
        self.regimes: tuple[int, int] | None = None  # (greedy, sampled) of the last ApplyTier
        self.round_id = 0
        self.watchers: list[asyncio.Queue[target_pb2.RoundStats]] = []

    def push(
        self,
        *accept_lengths: int,
        speculative: bool = True,
        timings: common_pb2.StageTimings | None = None,
    ) -> None:
        self.round_id += 1
        stats = target_pb2.RoundStats(
            round_id=self.round_id,
            speculative_num_steps=self.steps,
            batch_size=len(accept_lengths),
            accept_lengths=accept_lengths,
            speculative=speculative,
            unix_time=time.time(),
            timings=timings,
        )
        for queue in self.watchers:
            queue.put_nowait(stats)

    async def Generate(
        self, request: target_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.GenerateResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake target only has rounds")
        yield target_pb2.GenerateResponse()  # pragma: no cover - makes this a generator

    async def GetServerInfo(
        self,
        request: target_pb2.TargetServiceGetServerInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> target_pb2.TargetServiceGetServerInfoResponse:
        return target_pb2.TargetServiceGetServerInfoResponse(
            speculative_num_steps=self.steps, candidate_steps=self.candidates, rounds=self.round_id
        )

    async def ApplyTier(
        self, request: target_pb2.ApplyTierRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ApplyTierResponse:
        if request.speculative_num_steps not in self.candidates:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "speculative_num_steps")
        previous, self.steps = self.steps, request.speculative_num_steps
        self.applied.append((request.speculative_num_steps, request.reason))
        self.request_steps = dict(request.request_steps)
        self.regimes = None
        if request.HasField("greedy_steps"):
            self.regimes = (request.greedy_steps, request.sampled_steps)
        return target_pb2.ApplyTierResponse(
            previous_steps=previous,
            speculative_num_steps=self.steps,
            current_round=self.round_id,
        )

    async def WatchRounds(
        self, request: target_pb2.WatchRoundsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.WatchRoundsResponse]:
        queue: asyncio.Queue[target_pb2.RoundStats] = asyncio.Queue()
        self.watchers.append(queue)
        try:
            while True:
                yield target_pb2.WatchRoundsResponse(round=await queue.get())
        finally:
            self.watchers.remove(queue)


async def serve_target(
    fake: FakeTarget, address: str, token: str | None = None, tls: TLSConfig | None = None
) -> GrpcServer:
    """The fake behind the real server plumbing, so the ops-token check is the real one.

    The port came from `free_address`: until it is bound again, the kernel may lend it to an
    outgoing connection (the controller redials the address every 0.1 s), so a bind that
    finds it taken retries for up to 5 s."""
    protected = [f"/{TARGET_SERVICE}/ApplyTier", f"/{TARGET_SERVICE}/WatchRounds"]
    for attempt in range(50):
        try:
            server = GrpcServer(
                ServerConfig(address, ops_token=token, tls=tls or TLSConfig()),
                [TARGET_SERVICE],
                protected_methods=protected,
            )
            break
        except BindError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.1)
    target_pb2_grpc.add_TargetServiceServicer_to_server(fake, server.server)
    await server.start()
    await server.ready()
    return server


@dataclass
class ControllerStack:
    fake: FakeTarget
    controller: RunningController
    channel: grpc.aio.Channel
    stub: controller_pb2_grpc.ControllerServiceStub
    metadata: tuple[tuple[str, str], ...]

    def snapshot(self) -> TargetState:
        return self.controller.controller.snapshot()[0]

    async def get_state(self) -> controller_pb2.GetStateResponse:
        return await self.stub.GetState(controller_pb2.GetStateRequest(), metadata=self.metadata)

    async def feed_until(self, accept: tuple[int, ...], steps: int) -> None:
        """Pushes rounds until the fake target runs at `steps`."""
        for _ in range(150):
            if self.fake.steps == steps:
                return
            self.fake.push(*accept)
            await asyncio.sleep(0.02)
        raise AssertionError(f"target stayed at {self.fake.steps}, wanted {steps}")


@contextlib.asynccontextmanager
async def controller_stack(
    *, token: str | None = None, policy: PolicyConfig = FAST
) -> AsyncIterator[ControllerStack]:
    fake = FakeTarget(steps=3)
    target = await serve_target(fake, "127.0.0.1:0", token)
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0", ops_token=token),
        targets=(f"127.0.0.1:{target.port}",),
        reconnect_s=0.1,
    )
    running = await start(config, policy=policy)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    stack = ControllerStack(fake, running, channel, stub, auth_metadata(token))
    try:
        await eventually(lambda: stack.snapshot().connected and bool(fake.watchers))
        # Every connect applies the tier it wants, here the target's own: no switch.
        assert fake.applied == [(3, "policy")]
        fake.applied.clear()
        yield stack
    finally:
        await channel.close()
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


@pytest.fixture
async def stack() -> AsyncIterator[ControllerStack]:
    async with controller_stack() as s:
        yield s


async def test_policy_moves_tier_up_then_down(stack: ControllerStack) -> None:
    state = (await stack.get_state()).targets[0]
    assert state.connected and state.active_steps == 3 and not state.pinned
    await stack.feed_until((7, 7), 7)
    await stack.feed_until((0, 0), 1)
    # α = 0.5 halves the EMA per batch of zeros, so on the way down it spends a decision or
    # more in 3's band (0.25, 2.25] before it falls to 1.
    assert stack.fake.applied == [(7, "policy"), (3, "policy"), (1, "policy")]
    state = (await stack.get_state()).targets[0]
    assert state.active_steps == 1 and state.batches_counted >= 6
    assert state.ema <= 0.25
    switches = [(s.from_steps, s.to_steps, s.reason) for s in state.recent_switches]
    assert switches == [(3, 7, "policy"), (7, 3, "policy"), (3, 1, "policy")]
    registry = stack.controller.controller.metrics.registry
    assert registry.get_sample_value("specpair_controller_tier_switches_total") == 3
    assert registry.get_sample_value("specpair_controller_speculative_num_steps") == 1
    assert state.recent_switches[-1].round_id == stack.fake.round_id


async def test_the_cost_guard_reads_the_rounds_timings_off_the_wire(stack: ControllerStack) -> None:
    # Every draft accepted at tier 3 reads ~7 of 7: the thresholds call for 7 at once. With
    # draft steps of 4.2 ms in a 16 ms round, tier 7's is predicted at 16 + 4 · 4.2 = 32.8 ms,
    # over twice 3's, for at most twice the tokens (8 against 4): refused. Cheap steps: made.
    dear = common_pb2.StageTimings(total_ms=16.0, verify_ms=3.0, draft_ms=12.6)
    for _ in range(20):
        stack.fake.push(3, 3, timings=dear)
        await asyncio.sleep(0.01)
    await eventually(lambda: stack.snapshot().rounds_seen == 20)
    assert stack.fake.applied == []
    state = (await stack.get_state()).targets[0]
    assert "last refused 3 → 7" in state.model, state.model
    estimates = {e.steps: e for e in state.estimates}
    assert set(estimates) == {1, 3, 7} and estimates[3].observed_rounds > 0
    assert estimates[3].tokens_per_s > estimates[7].tokens_per_s
    cheap = common_pb2.StageTimings(total_ms=9.0, verify_ms=5.0, draft_ms=1.5)
    for _ in range(150):
        if stack.fake.steps == 7:
            break
        stack.fake.push(3, 3, timings=cheap)
        await asyncio.sleep(0.02)
    assert stack.fake.applied == [(7, "policy")]


async def test_non_speculative_rounds_are_seen_but_not_counted(stack: ControllerStack) -> None:
    for _ in range(5):
        stack.fake.push(speculative=False)
    await eventually(lambda: stack.snapshot().rounds_seen == 5)
    state = (await stack.get_state()).targets[0]
    assert state.batches_counted == 0 and state.active_steps == 3
    assert stack.fake.applied == []


async def test_pin_applies_now_and_overrides_policy_until_unpin(stack: ControllerStack) -> None:
    response = await stack.stub.PinTier(
        controller_pb2.PinTierRequest(speculative_num_steps=1), metadata=stack.metadata
    )
    assert stack.fake.applied == [(1, "pin")]
    assert response.targets[0].pinned and response.targets[0].pinned_steps == 1
    assert response.targets[0].active_steps == 1
    # The policy learns (its EMA rises) but does not move a pinned tier.
    for _ in range(10):
        stack.fake.push(7, 7)
    await eventually(lambda: stack.snapshot().batches_counted == 10)
    assert stack.fake.steps == 1 and stack.fake.applied == [(1, "pin")]
    response = await stack.stub.Unpin(controller_pb2.UnpinRequest(), metadata=stack.metadata)
    assert stack.fake.applied[-1] == (7, "unpin")
    state = response.targets[0]
    assert not state.pinned and state.active_steps == 7
    assert [s.reason for s in state.recent_switches] == ["pin", "unpin"]


async def test_pin_rejects_a_tier_that_is_not_a_candidate(stack: ControllerStack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.PinTier(controller_pb2.PinTierRequest(speculative_num_steps=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative_num_steps" in (err.value.details() or "")
    assert stack.fake.applied == []
    assert not (await stack.get_state()).targets[0].pinned


async def test_update_policy_validates_and_applies_partial_updates(stack: ControllerStack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.UpdatePolicy(controller_pb2.UpdatePolicyRequest(ema_alpha=1.5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ema_alpha must be in (0, 1]" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.UpdatePolicy(controller_pb2.UpdatePolicyRequest(candidate_steps=[3]))
    assert "candidate_steps" in (err.value.details() or "")
    # A tier the target has not built is refused too.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.UpdatePolicy(controller_pb2.UpdatePolicyRequest(candidate_steps=[1, 5]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "candidate_steps [5]" in (err.value.details() or "")

    response = await stack.stub.UpdatePolicy(
        controller_pb2.UpdatePolicyRequest(update_interval=7, down_hysteresis=0.0)
    )
    assert response.policy.update_interval == 7 and response.policy.down_hysteresis == 0.0
    assert response.policy.ema_alpha == FAST.ema_alpha  # untouched
    assert list(response.policy.candidate_steps) == [1, 3, 7]
    assert (await stack.get_state()).policy == response.policy
    assert stack.fake.applied == []
    # A flag set false travels as set (proto3's false is its unset value): SGLang's count.
    assert response.policy.expect_tail is True
    response = await stack.stub.UpdatePolicy(controller_pb2.UpdatePolicyRequest(expect_tail=False))
    assert response.policy.expect_tail is False and response.policy.update_interval == 7
    assert stack.controller.controller.policy.to_dict()["expect_tail"] is False
    assert response.policy.cost_guard is True
    response = await stack.stub.UpdatePolicy(controller_pb2.UpdatePolicyRequest(cost_guard=False))
    assert response.policy.cost_guard is False and response.policy.expect_tail is False
    assert stack.controller.controller.policy.to_dict()["cost_guard"] is False

    # Dropping the active tier snaps the target to the nearest remaining one (3 → 1).
    response = await stack.stub.UpdatePolicy(
        controller_pb2.UpdatePolicyRequest(candidate_steps=[1, 7])
    )
    assert list(response.policy.candidate_steps) == [1, 7]
    assert stack.fake.applied == [(1, "policy")]


async def test_ops_token_is_required_and_presented_to_the_target() -> None:
    async with controller_stack(token="s3cret") as stack:
        # controller_stack waited for WatchRounds, which the fake target only serves with the token.
        assert stack.snapshot().connected
        for call, request in [
            (stack.stub.GetState, controller_pb2.GetStateRequest()),
            (stack.stub.UpdatePolicy, controller_pb2.UpdatePolicyRequest(ema_alpha=0.3)),
            (stack.stub.PinTier, controller_pb2.PinTierRequest(speculative_num_steps=1)),
            (stack.stub.Unpin, controller_pb2.UnpinRequest()),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=auth_metadata("wrong"))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stack.fake.applied == [] and stack.controller.controller.pinned_steps is None
        # With the token: ops work and the controller's ApplyTier passes the target's check.
        await stack.stub.PinTier(
            controller_pb2.PinTierRequest(speculative_num_steps=7), metadata=stack.metadata
        )
        assert stack.fake.applied == [(7, "pin")]


async def test_controller_without_the_targets_token_stays_disconnected() -> None:
    fake = FakeTarget()
    target = await serve_target(fake, "127.0.0.1:0", token="target-token")
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0", ops_token="other"),
        targets=(f"127.0.0.1:{target.port}",),
        reconnect_s=0.05,
    )
    running = await start(config, policy=FAST)
    try:
        await asyncio.sleep(0.3)
        assert not fake.watchers
        assert not running.controller.snapshot()[0].connected
    finally:
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_target_down_at_start_then_up_then_restarted() -> None:
    address = free_address()
    config = ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(address,), reconnect_s=0.1)
    running = await start(config, policy=FAST)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        await asyncio.sleep(0.2)
        state = (await stub.GetState(controller_pb2.GetStateRequest())).targets[0]
        assert state.target_address == address
        assert not state.connected and state.active_steps == 0
        # A pin while the target is down is applied when it comes up.
        await stub.PinTier(controller_pb2.PinTierRequest(speculative_num_steps=7))

        fake = FakeTarget(steps=3)
        target = await serve_target(fake, address)
        await eventually(lambda: running.controller.snapshot()[0].connected)
        assert fake.applied == [(7, "pin")]
        await stub.Unpin(controller_pb2.UnpinRequest())
        assert fake.applied[-1] == (3, "unpin")

        # The target restarts at a different tier: the controller restores the policy's.
        await target.stop(grace=0)
        await eventually(lambda: not running.controller.snapshot()[0].connected)
        state = (await stub.GetState(controller_pb2.GetStateRequest())).targets[0]
        assert not state.connected
        fake = FakeTarget(steps=1)
        target = await serve_target(fake, address)
        await eventually(lambda: running.controller.snapshot()[0].connected)
        assert fake.applied == [(3, "reconnect")]
        state = (await stub.GetState(controller_pb2.GetStateRequest())).targets[0]
        assert state.recent_switches[-1].reason == "reconnect"
        await target.stop(grace=0)
    finally:
        await channel.close()
        await running.stop(grace=0.1)


async def test_ctl_status_is_a_table_and_json_on_request(stack: ControllerStack) -> None:
    async def ctl(*args: str) -> str:  # its own process: the controller logs to this one's stdout
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specpair.cli",
            "ctl",
            "--address",
            f"127.0.0.1:{stack.controller.port}",
            "status",
            *args,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        return out.decode()

    await stack.feed_until((7, 7), 7)
    table = (await ctl()).splitlines()
    assert table[0].startswith("policy: sglang  candidate_steps=[1, 3, 7]")
    header = ["target", "connected", "tier", "pinned", "EMA", "rounds"]
    assert table[1].split() == header
    row = table[2].split()
    assert row[0] == stack.snapshot().target_address and row[1:4] == ["yes", "7", "-"]
    assert any(line.strip().startswith("round ") and "3 → 7 (policy" in line for line in table)
    state = json.loads(await ctl("--json"))
    assert state["targets"][0]["active_steps"] == 7 and state["policy"]["kind"] == "sglang"


async def test_health_reports_serving(stack: ControllerStack) -> None:
    health = health_pb2_grpc.HealthStub(stack.channel)
    for service in ("", "specpair.v1.ControllerService"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_malformed_rounds_do_not_break_the_watch(stack: ControllerStack) -> None:
    stack.fake.push(-1, 2)  # negative accept length: ignored, not counted
    await stack.feed_until((7, 7), 7)
    state = (await stack.get_state()).targets[0]
    assert state.connected and state.rounds_seen >= 2


async def test_serve_runs_until_cancelled_then_stops() -> None:
    address = free_address()
    config = ControllerConfig(ServerConfig(address), targets=(free_address(),))
    ready = asyncio.Event()
    task = asyncio.create_task(serve(config, ready_event=ready))
    await asyncio.wait_for(ready.wait(), timeout=3)
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        state = await controller_pb2_grpc.ControllerServiceStub(channel).GetState(
            controller_pb2.GetStateRequest(), timeout=2
        )
        assert not state.targets[0].connected
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        # Gone (UNAVAILABLE), or still tearing down and cancelling new calls (CANCELLED).
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def test_tls_on_the_ops_api_and_to_the_target(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = TLSConfig(cert=cert, key=key, ca=cert)  # self-signed: its own CA
    fake = FakeTarget()
    target = await serve_target(fake, "127.0.0.1:0", tls=tls)
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0", tls=tls), targets=(f"127.0.0.1:{target.port}",)
    )
    running = await start(config, policy=FAST)
    # Given a CA, the controller takes only clients with a certificate it signed (mTLS).
    creds = grpc.ssl_channel_credentials(
        root_certificates=cert.read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    ca_only = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        await eventually(lambda: running.controller.snapshot()[0].connected)
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", creds) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            state = await stub.GetState(controller_pb2.GetStateRequest(), timeout=2)
            assert state.targets[0].connected
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetState(controller_pb2.GetStateRequest(), timeout=1)
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", ca_only) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no client certificate
                await stub.GetState(controller_pb2.GetStateRequest(), timeout=1)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_pin_policy_and_ema_survive_a_controller_restart(tmp_path: Path) -> None:
    fake = FakeTarget(steps=3)
    target = await serve_target(fake, "127.0.0.1:0")
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0"),
        targets=(f"127.0.0.1:{target.port}",),
        reconnect_s=0.1,
        state_file=tmp_path / "controller-state.json",
    )
    try:
        first = await start(config, policy=FAST)
        await eventually(lambda: first.controller.snapshot()[0].connected)
        await first.controller.update_policy(update_interval=2)
        await first.controller.pin(7)
        for _ in range(4):  # the EMA learns while pinned
            fake.push(1, 1)
        await eventually(lambda: first.controller.snapshot()[0].batches_counted == 4)
        before = first.controller.snapshot()[0]
        await first.stop(grace=0.1)
        fake.applied.clear()

        second = await start(config, policy=FAST)  # as `serve` would: the file's policy
        try:
            await eventually(lambda: second.controller.snapshot()[0].connected)
            after = second.controller.snapshot()[0]
            assert after.pinned_steps == 7 and after.active_steps == 7
            assert (after.ema, after.batches_counted) == (before.ema, before.batches_counted)
            assert second.controller.policy.to_dict()["update_interval"] == 2
            assert fake.applied == [(7, "pin")] and fake.steps == 7  # the pin holds
        finally:
            await second.stop(grace=0.1)
    finally:
        await target.stop(grace=0.1)


async def test_two_targets_each_steered_by_its_own_policy() -> None:
    """One controller, `--target a,b`: a's rounds move a's tier only, b's b's; status has a
    row per target."""
    fakes = [FakeTarget(steps=3), FakeTarget(steps=3)]
    servers = [await serve_target(fake, "127.0.0.1:0") for fake in fakes]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0"), targets=(",".join(addresses),), reconnect_s=0.1
    )
    running = await start(config, policy=FAST)
    controller = running.controller
    try:
        await eventually(
            lambda: (
                all(t.connected for t in controller.snapshot()) and all(f.watchers for f in fakes)
            )
        )
        a, b = fakes
        for fake in fakes:
            fake.applied.clear()
        for _ in range(150):
            if (a.steps, b.steps) == (7, 1):
                break
            a.push(7, 7)  # a accepts everything
            b.push(0, 0)  # b nothing
            await asyncio.sleep(0.02)
        assert a.applied == [(7, "policy")] and b.applied == [(1, "policy")]
        rows = controller.snapshot()
        assert [(t.target_address, t.active_steps) for t in rows] == list(
            zip(addresses, [7, 1], strict=True)
        )
        assert rows[0].ema > 3 > rows[1].ema
        assert [s.to_steps for s in rows[0].recent_switches] == [7]
        assert [s.to_steps for s in rows[1].recent_switches] == [1]
        table = status_table(ControllerState(controller.policy.to_dict(), tuple(rows)))
        lines = table.splitlines()
        assert [line.split()[:3] for line in lines if line.startswith("127.0.0.1:")] == [
            [addresses[0], "yes", "7"],
            [addresses[1], "yes", "1"],
        ]
        # A lost target is reported as such; the other goes on being steered.
        await servers[1].stop(0)
        await eventually(lambda: not controller.snapshot()[1].connected)
        assert controller.snapshot()[0].connected
    finally:
        await running.stop(grace=0.1)
        for server in servers:
            await server.stop(0)
