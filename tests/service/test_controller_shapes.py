"""Tree-shaped tiers through the real controller: a fake target that built a tree shape beside
its chains; pins, policy updates, ApplyTier, the status and the CLI carry the shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from controller.policies.bands import PolicySpec
from controller.service.server import RunningController, start
from specpair.cli.client_commands import status_table
from specpair.client import AsyncControllerClient, SpecpairError
from specpair.client.results import ControllerState
from specpair.config import ControllerConfig, ServerConfig
from specpair.proto.v1 import common_pb2, target_pb2
from specpair.rpc.serving import GrpcServer
from specpair.runtime.shape import TreeShape
from tests.service.conftest import draft_config, eventually, reference_greedy, target_config
from tests.service.test_controller import FakeTarget, serve_target
from tests.service.test_tiers import watch

TREE = "4x4x16"
GOODPUT = {"kind": "goodput", "candidate_steps": [0, 1, 3], "tree_shapes": [TREE]}


class ShapedTarget(FakeTarget):
    """A FakeTarget that built `trees` beside its chains: ApplyTier takes a tree by its
    shape fields and records (steps, shape, reason) and the regimes' shapes."""

    def __init__(self, trees: tuple[str, ...] = (TREE,), shape: str = "", steps: int = 3) -> None:
        super().__init__(steps=steps, candidates=(0, 1, 3))
        self.trees, self.shape = trees, shape
        self.shaped: list[tuple[int, str, str]] = []
        self.regime_shapes: tuple[str, str] | None = None

    async def GetServerInfo(
        self,
        request: target_pb2.TargetServiceGetServerInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> target_pb2.TargetServiceGetServerInfoResponse:
        info = await super().GetServerInfo(request, context)
        info.tree_shapes.extend(self.trees)
        info.shape = self.shape
        return info

    async def ApplyTier(
        self, request: target_pb2.ApplyTierRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ApplyTierResponse:
        if request.shape and request.shape not in self.trees:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "shape")
        if not request.shape and request.speculative_num_steps not in self.candidates:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "speculative_num_steps")
        previous = (self.steps, self.shape)
        self.steps, self.shape = request.speculative_num_steps, request.shape
        self.shaped.append((request.speculative_num_steps, request.shape, request.reason))
        self.regime_shapes = None
        if request.HasField("greedy_steps"):
            self.regime_shapes = (request.greedy_shape, request.sampled_shape)
        return target_pb2.ApplyTierResponse(
            previous_steps=previous[0],
            previous_shape=previous[1],
            speculative_num_steps=self.steps,
            shape=self.shape,
            current_round=self.round_id,
        )

    def push_timed(self, accepts: tuple[int, ...], total_ms: float) -> None:
        self.round_id += 1
        stats = target_pb2.RoundStats(
            round_id=self.round_id,
            speculative_num_steps=self.steps,
            shape=self.shape,
            batch_size=len(accepts),
            accept_lengths=accepts if self.steps else (),
            speculative=self.steps > 0,
            timings=common_pb2.StageTimings(
                total_ms=total_ms, verify_ms=10.0, draft_ms=2.0 * self.steps, schedule_ms=1.0
            ),
            unix_time=time.time(),
        )
        for queue in self.watchers:
            queue.put_nowait(stats)


@dataclass
class Stack:
    fake: ShapedTarget
    running: RunningController
    client: AsyncControllerClient


@contextlib.asynccontextmanager
async def shaped_stack(fake: ShapedTarget, policy: dict[str, object]) -> AsyncIterator[Stack]:
    target: GrpcServer = await serve_target(fake, "127.0.0.1:0")
    config = ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{target.port}",))
    running = await start(config, policy=PolicySpec.from_mapping(policy))
    client = AsyncControllerClient(f"127.0.0.1:{running.port}")
    try:
        await eventually(lambda: bool(fake.watchers) and running.controller.snapshot()[0].connected)
        yield Stack(fake, running, client)
    finally:
        await client.close()
        await running.stop(grace=0.1)
        await target.stop(grace=0.1)


async def test_a_target_at_a_tree_is_told_the_shape_and_its_regimes() -> None:
    # The target starts at the tree: the policy starts there, and ApplyTier names it in every
    # shape field (the batch's and both regimes').
    async with shaped_stack(ShapedTarget(shape=TREE, steps=4), GOODPUT) as s:
        assert s.fake.shaped == [(4, TREE, "policy")]
        assert s.fake.regime_shapes == (TREE, TREE)
        (state,) = (await s.client.state()).targets
        assert (state.active_steps, state.active_shape, state.active_tier) == (4, TREE, TREE)


async def test_pin_and_unpin_a_tree_shape() -> None:
    async with shaped_stack(ShapedTarget(), GOODPUT) as s:
        s.fake.shaped.clear()
        (state,) = await s.client.pin(TREE)
        assert s.fake.shaped == [(4, TREE, "pin")] and s.fake.regime_shapes is None
        assert (state.pinned_steps, state.pinned_shape, state.pinned_tier) == (4, TREE, TREE)
        assert state.active_tier == TREE
        switch = state.recent_switches[-1]
        assert (switch.from_tier, switch.to_tier, switch.to_steps) == ("3", TREE, 4)
        # A tree the target did not build, or no shape at all, is refused by name.
        with pytest.raises(
            SpecpairError, match="shape 2x2x4 is not among the policy's tree_shapes"
        ):
            await s.client.pin("2x2x4")
        with pytest.raises(ValueError, match="STEPSxTOPKxNUM_DRAFT_TOKENS"):
            await s.client.pin("4x4")
        (state,) = await s.client.unpin()
        assert s.fake.shaped[-1] == (3, "", "unpin") and s.fake.regime_shapes == ("", "")
        assert state.pinned_tier is None and state.active_tier == "3"
        switches = [(w.from_tier, w.to_tier) for w in state.recent_switches]
        assert switches == [("3", TREE), (TREE, "3")]


async def test_policy_updates_add_and_drop_tree_shapes_through_the_sdk() -> None:
    async with shaped_stack(ShapedTarget(trees=(TREE, "2x2x4")), {"kind": "goodput"}) as s:
        # kind goodput, candidates [1, 3, 7] by default: the target lacks 7, the start is lenient
        policy = await s.client.update_policy(candidate_steps="0,1,3", tree_shapes=TREE)
        assert policy["tree_shapes"] == [TREE] and policy["candidate_steps"] == [0, 1, 3]
        policy = await s.client.update_policy(tree_shapes=[TREE, "2X2X4"])
        assert policy["tree_shapes"] == ["2x2x4", TREE]  # canonical, in tier order
        with pytest.raises(SpecpairError, match=r"tree_shapes \[6x8x32\] are not tiers of target"):
            await s.client.update_policy(tree_shapes="6x8x32")
        with pytest.raises(SpecpairError, match="sglang's rule chooses among chains"):
            await s.client.update_policy(kind="sglang", candidate_steps="1,3", tree_shapes=TREE)
        await s.client.pin(TREE)
        with pytest.raises(SpecpairError, match="must include the pinned tier 4x4x16"):
            await s.client.update_policy(tree_shapes="")
        await s.client.unpin()
        policy = await s.client.update_policy(tree_shapes="")  # drops them all
        assert policy["tree_shapes"] == []
        # Untouched by an update that does not name them.
        policy = await s.client.update_policy(tree_shapes=TREE)
        assert (await s.client.update_policy(min_gain=0.1))["tree_shapes"] == [TREE]


async def test_estimates_and_status_carry_the_shape() -> None:
    policy = {**GOODPUT, "warmup_batches": 0, "update_interval": 1}
    async with shaped_stack(ShapedTarget(), policy) as s:
        await s.client.pin(TREE)
        for _ in range(6):
            s.fake.push_timed((4,), total_ms=20.0)
            await asyncio.sleep(0.005)
        await eventually(lambda: s.running.controller.snapshot()[0].rounds_seen == 6)
        state = await s.client.state()
        (target,) = state.targets
        tree = [e for e in target.estimates if e.shape == TREE]
        assert len(tree) == 1 and tree[0].steps == 4 and tree[0].observed_rounds == 6
        assert tree[0].tokens_per_round > 3.0  # its own acceptance: 4 of 4 every round
        assert f"tree {TREE}: E" in target.model
        lines = status_table(state).splitlines()
        assert lines[0].startswith("policy: goodput  candidate_steps=[0, 1, 3]")
        assert f'tree_shapes=["{TREE}"]' in lines[0]
        assert lines[2].split()[1:4] == ["yes", TREE, TREE]
        assert any(line.strip().startswith(f"tier {TREE}: ") for line in lines)
        assert any(f"3 → {TREE} (pin" in line for line in lines)
        as_json = ControllerState(state.policy, state.targets).to_dict()
        assert as_json["targets"][0]["active_shape"] == TREE


async def test_ctl_pins_a_tree_and_sets_tree_shapes() -> None:
    async with shaped_stack(ShapedTarget(), {**GOODPUT, "tree_shapes": []}) as s:

        async def ctl(*args: str) -> tuple[int, str]:  # its own process, as a person runs it
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "specpair.cli",
                "ctl",
                "--address",
                f"127.0.0.1:{s.running.port}",
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode or 0, (out + err).decode()

        code, out = await ctl("policy", f"tree_shapes={TREE}")
        policy = json.loads(out)["policy"]
        assert code == 0 and policy["tree_shapes"] == [TREE]
        # the goodput kind's own keys as a policy file writes them, not the wire's JSON string
        assert "options_json" not in policy and policy["min_gain"] == 0.05
        code, out = await ctl("pin", TREE)
        address = s.running.controller.snapshot()[0].target_address
        assert code == 0 and out == f"pinned tier {TREE} on 1 target ({address})\n"
        assert s.fake.shaped[-1] == (4, TREE, "pin")
        code, out = await ctl("pin", "4x4")
        assert code == 2 and "STEPSxTOPKxNUM_DRAFT_TOKENS" in out
        code, out = await ctl("status")
        assert code == 0 and out.splitlines()[2].split()[2:4] == [TREE, TREE]
        assert "options_json" not in out and "min_gain=0.05" in out.splitlines()[0]
        code, out = await ctl("unpin")
        assert (
            code == 0 and out == f"unpinned 1 target ({address}): the policy picks the tier again\n"
        )


async def test_the_controller_pins_a_tree_on_real_services(ckpts, make_stack) -> None:
    """Controller, target and draft on the CPU, the tree built beside the chains: pinned by
    shape, every drafted round runs the tree and the outputs are target-alone greedy's; the
    controller learns the tree's acceptance and cost from those rounds."""
    steps, shapes = (1, 3, 7), (TREE,)
    stack = await make_stack(
        draft_config(
            ckpts["eagle"],
            draft_kind="eagle",
            target_path=ckpts["target"],
            candidate_steps=steps,
            tree_shapes=shapes,
        ),
        target_config(ckpts["target"], candidate_steps=steps, tree_shapes=shapes, max_batch=4),
    )
    config = ControllerConfig(
        ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{stack.target.port}",), reconnect_s=0.1
    )
    policy = PolicySpec.from_mapping({**GOODPUT, "candidate_steps": list(steps)})
    running = await start(config, policy=policy)
    try:
        await eventually(lambda: running.controller.snapshot()[0].connected)
        await running.controller.pin(TreeShape.parse(TREE))
        rounds, task = await watch(stack)  # the tier lands with the next round
        prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [3], [100, 200, 50, 60, 70]]
        outputs = await asyncio.gather(
            *(stack.generate(prompt_token_ids=p, max_tokens=24) for p in prompts)
        )
        task.cancel()
        assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], prompts, 24)
        drafted = [r for r in rounds.values() if r.accept_lengths]
        assert drafted and {(r.speculative_num_steps, r.shape) for r in drafted} == {(4, TREE)}
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
        assert (info.speculative_num_steps, info.shape) == (4, TREE)
        await eventually(lambda: running.controller.snapshot()[0].rounds_seen >= len(drafted))
        (state,) = running.controller.snapshot()
        assert (state.active_shape, state.pinned_shape) == (TREE, TREE)
        (tree,) = [e for e in state.estimates if e.shape == TREE]
        assert tree.observed_rounds > 0 and tree.tokens_per_round > 1.0
    finally:
        await running.stop(grace=0.1)
