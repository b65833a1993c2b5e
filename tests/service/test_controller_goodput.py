"""The goodput kind behind the real controller: switched to live, fed timed rounds by a fake
target, it turns speculation off and shows its estimates; a policy class loads by path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from controller.service.server import start
from specpair.client import build_policy_update
from specpair.config import ControllerConfig, ServerConfig
from specpair.proto.v1 import common_pb2, controller_pb2, controller_pb2_grpc, target_pb2
from tests.service.conftest import eventually
from tests.service.test_controller import FakeTarget, serve_target


def push_timed(
    fake: FakeTarget, accepts: tuple[int, ...], total_ms: float, sampled: int = 0
) -> None:
    """A round where verify costs 10 ms and the draft round trip the rest (3 ms a step)."""
    fake.round_id += 1
    stats = target_pb2.RoundStats(
        round_id=fake.round_id,
        speculative_num_steps=fake.steps,
        batch_size=len(accepts),
        accept_lengths=accepts if fake.steps else (),
        speculative=fake.steps > 0,
        timings=common_pb2.StageTimings(
            total_ms=total_ms, verify_ms=10.0, draft_ms=3.0 * fake.steps, schedule_ms=1.0
        ),
        unix_time=time.time(),
        sampled_requests=sampled,
    )
    for queue in fake.watchers:
        queue.put_nowait(stats)


async def test_goodput_sends_a_tier_per_sampling_regime_a_pin_clears_them() -> None:
    """Greedy rounds whose drafts all pass, then sampled ones whose drafts never do: the
    target is told 'greedy: a positive tier, sampled: 0', so that the next greedy batch drafts
    from its first round."""
    fake = FakeTarget(steps=3, candidates=(0, 1, 3, 7))
    target = await serve_target(fake, "127.0.0.1:0")
    config = ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{target.port}",))
    running = await start(config)
    try:
        await eventually(lambda: bool(fake.watchers) and running.controller.snapshot()[0].connected)
        await running.controller.update_policy(
            kind="goodput", candidate_steps=(0, 1, 3, 7), warmup_batches=0, update_interval=1
        )
        assert fake.regimes == (3, 3)  # nothing known of either regime: the starting tier
        for _ in range(40):
            push_timed(fake, (fake.steps,), total_ms=12.0 + 3.0 * fake.steps)
            await asyncio.sleep(0.005)
        await eventually(lambda: running.controller.snapshot()[0].rounds_seen == 40)
        greedy = fake.steps
        assert greedy > 0
        for _ in range(60):
            push_timed(fake, (0,), total_ms=12.0 + 3.0 * fake.steps, sampled=1)
            await asyncio.sleep(0.005)
        await eventually(lambda: fake.regimes == (greedy, 0))
        await running.controller.pin(1)
        assert fake.regimes is None and fake.steps == 1
        await running.controller.unpin()  # back to the policy: its regime tiers with it
        assert fake.regimes == (greedy, 0) and fake.steps == 0
    finally:
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_goodput_turns_speculation_off_when_drafts_are_never_accepted() -> None:
    fake = FakeTarget(steps=3, candidates=(0, 1, 3, 7))
    target = await serve_target(fake, "127.0.0.1:0")
    config = ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{target.port}",))
    running = await start(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    try:
        await eventually(lambda: bool(fake.watchers) and running.controller.snapshot()[0].connected)
        request = build_policy_update(
            kind="goodput", candidate_steps="0,1,3,7", warmup_batches=0, update_interval=1
        )
        response = await stub.UpdatePolicy(request)
        assert response.policy.kind == "goodput"
        assert json.loads(response.policy.options_json)["min_gain"] == 0.05
        for _ in range(100):
            if fake.steps == 0:
                break
            push_timed(fake, (0,), total_ms=12.0 + 3.0 * fake.steps)
            await asyncio.sleep(0.02)
        assert fake.steps == 0 and fake.applied[-1] == (0, "policy")
        state = (await stub.GetState(controller_pb2.GetStateRequest())).targets[0]
        by_tier = {e.steps: e for e in state.estimates}
        assert sorted(by_tier) == [0, 1, 3, 7]
        assert by_tier[0].tokens_per_s > by_tier[1].tokens_per_s > by_tier[7].tokens_per_s
        assert by_tier[3].observed_rounds >= 1 and by_tier[7].observed_rounds == 0
        assert state.model.startswith("goodput at batch 1")
        # Back to SGLang's rule: tier 0 is not one of its tiers, so the update is refused.
        bad = build_policy_update(kind="sglang")
        try:
            await stub.UpdatePolicy(bad)
            raise AssertionError("tier 0 passed for the sglang kind")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "two distinct tiers of at least 1, or [0] alone" in (exc.details() or "")
    finally:
        await channel.close()
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_a_kind_switched_in_while_pinned_starts_at_the_pinned_tier() -> None:
    """Goodput has moved to tier 0; pinned at 3, a switch to sglang starts that kind at 3 (the
    tier the target runs), so unpinning keeps 3, not tier 0 snapped to sglang's lowest, 1."""
    fake = FakeTarget(steps=3, candidates=(0, 1, 3, 7))
    target = await serve_target(fake, "127.0.0.1:0")
    config = ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{target.port}",))
    running = await start(config)
    controller = running.controller
    try:
        await eventually(lambda: bool(fake.watchers) and controller.snapshot()[0].connected)
        await controller.update_policy(
            kind="goodput", candidate_steps=[0, 1, 3, 7], warmup_batches=0, update_interval=1
        )
        for _ in range(100):
            if fake.steps == 0:
                break
            push_timed(fake, (0,), total_ms=12.0 + 3.0 * fake.steps)
            await asyncio.sleep(0.02)
        assert fake.steps == 0
        await controller.pin(3)
        await controller.update_policy(kind="sglang", candidate_steps=[1, 3, 7])
        await controller.unpin()
        assert fake.applied[-1] == (3, "unpin")
        assert controller.snapshot()[0].active_steps == 3
    finally:
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


@contextlib.asynccontextmanager
async def class_controller(
    fake: FakeTarget, tmp_path: Path, policy_class: str, options: dict[str, Any]
) -> AsyncIterator[Any]:
    """A controller started with `policy_class` and a policy file of `options`, on `fake`."""
    target = await serve_target(fake, "127.0.0.1:0")
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(options))
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0"),
        targets=(f"127.0.0.1:{target.port}",),
        policy_file=policy_file,
        policy_class=policy_class,
    )
    running = await start(config)
    try:
        yield running
    finally:
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_policy_class_and_file_at_start_up(tmp_path: Path) -> None:
    fake = FakeTarget(steps=3)
    async with class_controller(
        fake, tmp_path, "tests.unit.test_bands:FixedPolicy", {"steps": 7}
    ) as running:
        await eventually(lambda: fake.applied == [(7, "policy")])
        assert running.controller.snapshot()[0].model == "fixed at 7"
        assert running.controller.policy.to_dict() == {
            "kind": "tests.unit.test_bands:FixedPolicy",
            "steps": 7,
        }


async def test_request_tiers_reach_the_target_through_apply_tier(tmp_path: Path) -> None:
    """Loaded by path, the per-request policy parks a request whose drafts are never accepted
    and keeps the other drafting; the controller sends the map with the batch tier."""
    fake = FakeTarget(steps=3, candidates=(0, 1, 3, 7))
    async with class_controller(
        fake,
        tmp_path,
        "controller.policies.request_tiers:RequestTiers",
        {"candidate_steps": [0, 1, 3, 7]},
    ) as running:
        await eventually(lambda: bool(fake.watchers) and running.controller.snapshot()[0].connected)
        for _ in range(100):
            if fake.request_steps.get("hard") == 0:
                break
            own = fake.request_steps
            drafted = [r for r in ("easy", "hard") if own.get(r, fake.steps) > 0]
            steps = [own.get(r, fake.steps) for r in drafted]
            # verify 18 ms, schedule 1; per drafted request 2 ms of round trip, 1 ms a step
            draft_ms, fixed_ms = 1.0 * sum(steps), 2.0 * len(drafted)
            fake.round_id += 1
            stats = target_pb2.RoundStats(
                round_id=fake.round_id,
                speculative_num_steps=max(steps or [0]),
                batch_size=2,
                accept_lengths=[
                    s if r == "easy" else 0 for r, s in zip(drafted, steps, strict=True)
                ],
                request_ids=drafted,
                request_steps=steps,
                plain_request_ids=[r for r in ("easy", "hard") if r not in drafted],
                speculative=bool(drafted),
                timings=common_pb2.StageTimings(
                    total_ms=19.0 + fixed_ms + draft_ms,
                    verify_ms=18.0,
                    draft_ms=draft_ms,
                    schedule_ms=1.0,
                ),
                unix_time=time.time(),
            )
            for queue in fake.watchers:
                queue.put_nowait(stats)
            await asyncio.sleep(0.02)
        assert fake.request_steps.get("hard") == 0 and fake.steps > 0
        assert "easy" not in fake.request_steps  # it runs at the batch tier
        assert running.controller.snapshot()[0].model.startswith("per-request tiers")
