"""The peer streams and the ops API against anyone who can reach them: anonymous Round streams,
idle WatchRounds watchers, huge request ids, deep nesting, absurd policy values."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from controller.server import start as start_controller
from specpair.config import ControllerConfig, ServerConfig
from specpair.metrics import ServiceMetrics
from specpair.proto.v1 import controller_pb2, controller_pb2_grpc, target_pb2
from specpair.runtime.round import RoundStats, StageTimings
from target_service.round_feed import QUEUE_ROUNDS, RoundFeed
from tests.service.conftest import draft_config, eventually, target_config
from tests.service.test_hardening import PROMPT, DraftStream, draft_input

TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _with_token(config, token: str = TOKEN):  # type: ignore[no-untyped-def]
    return replace(config, server=replace(config.server, ops_token=token))


async def test_the_draft_round_stream_needs_the_ops_token(ckpts, make_stack) -> None:
    stack = await make_stack(
        _with_token(draft_config(ckpts["draft"])), _with_token(target_config(ckpts["target"]))
    )
    anonymous = DraftStream(stack.draft.port)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anonymous.round(draft_input("a", [5, 6, 7]))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await anonymous.channel.close()
    # The target presents the token: its rounds speculate.
    tokens, responses = await stack.generate(prompt_token_ids=PROMPT, max_tokens=20)
    assert len(tokens) == 20 and responses[-1].speculation.plain_rounds == 0
    assert responses[-1].speculation.accept_lengths
    assert stack.draft.servicer.streams == 1


async def test_an_anonymous_round_stream_holds_at_most_max_target_requests(
    ckpts, make_stack
) -> None:
    stack = await make_stack(
        draft_config(ckpts["draft"], max_requests=6, max_target_requests=2),
        target_config(ckpts["target"], draft_address=None),
    )
    greedy, other = DraftStream(stack.draft.port), DraftStream(stack.draft.port)
    try:
        taken = await greedy.round(*(draft_input(f"r{i}", [5, 6, 7]) for i in range(5)))
        assert len(taken.trees) == 2 and not taken.error  # the rest get no tree, no error
        assert all("max_target_requests 2" in why for why in taken.refused.values())
        assert sorted(taken.refused) == ["r2", "r3", "r4"]
        served = await other.round(*(draft_input(f"q{i}", [5, 6]) for i in range(2)))
        assert len(served.trees) == 2
        assert stack.draft.servicer.rounds.active_requests == 4
    finally:
        await greedy.close()
        await other.close()


async def test_watchers_are_capped(ckpts, make_stack) -> None:
    stack = await make_stack(
        None, target_config(ckpts["target"], draft_address=None, max_watchers=2)
    )
    feed = stack.target.servicer.scheduler.feed
    calls = [stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()) for _ in range(2)]
    await eventually(lambda: len(feed._watchers) == 2)  # these two hold the places
    calls.append(stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()))
    try:
        generate = asyncio.create_task(stack.generate(prompt_token_ids=PROMPT, max_tokens=5))
        first = [await asyncio.wait_for(call.read(), 10) for call in calls[:2]]
        assert all(r.round.round_id >= 1 for r in first)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(calls[2].read(), 10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers" in err.value.details()
        await generate
    finally:
        for call in calls:
            call.cancel()
    await eventually(lambda: not feed._watchers)
    # A slot freed is a slot to take.
    again = stack.stub.WatchRounds(target_pb2.WatchRoundsRequest())
    await stack.generate(prompt_token_ids=PROMPT, max_tokens=2)
    assert (await asyncio.wait_for(again.read(), 10)).round.round_id >= 1
    again.cancel()


def test_a_watcher_a_whole_queue_behind_is_dropped() -> None:
    async def run() -> None:
        feed = RoundFeed(ServiceMetrics("target"), max_watchers=2)
        slow, live = feed.watch(), feed.watch()
        assert slow is not None and live is not None and feed.watch() is None
        for round_id in range(QUEUE_ROUNDS + 1):
            feed.publish(RoundStats(round_id, 3, 1, (2,), True, StageTimings(), unix_time=0.0))
            if live.full():
                live.get_nowait()  # this one keeps up
        assert slow.get_nowait() is None and slow.empty()  # dropped, and told so
        assert isinstance(live.get_nowait(), RoundStats)
        assert feed.watch() is not None  # its place is free

    asyncio.run(run())


async def test_request_id_is_bounded(ckpts, make_stack) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt_token_ids=PROMPT, max_tokens=2, request_id="r" * 90_000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request_id: 90000 characters, at most 256")
    _, responses = await stack.generate(prompt_token_ids=PROMPT, max_tokens=2, request_id="r" * 256)
    assert responses[-1].request_id == "r" * 256


@pytest.mark.parametrize(
    ("request_fields", "start"),
    [
        ({"options_json": "[" * 100_000 + "]" * 100_000}, "options_json: nested too deeply"),
        ({"options_json": '{"bands": ' + "[" * 900 + "]" * 900 + "}"}, "bands[0] must be an"),
        ({"update_interval": 2**31 - 1}, "update_interval must be an int in [1, 1000000]"),
        ({"warmup_batches": 2**31 - 1}, "warmup_batches must be an int in [0, 1000000]"),
        ({"down_hysteresis": -1e300}, "down_hysteresis must be in [-64, 64]"),
        ({"options_json": '{"bands": [{"min_batch_size": 4611686018427387904}]}'}, "bands[0]"),
    ],
)
async def test_policy_updates_out_of_range_or_nested_are_invalid_argument(
    request_fields: dict[str, object], start: str
) -> None:
    nowhere = ("unix:/nonexistent/specpair-target.sock",)
    controller = await start_controller(ControllerConfig(ServerConfig("127.0.0.1:0"), nowhere))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{controller.port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            request = controller_pb2.UpdatePolicyRequest(**request_fields)  # type: ignore[arg-type]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdatePolicy(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(start), err.value.details()
            assert len(err.value.details()) <= 512
            state = await stub.GetState(controller_pb2.GetStateRequest(), timeout=10)
    finally:
        await controller.stop(grace=0.1)
    assert state.policy.update_interval == 5 and state.policy.warmup_batches == 10  # unchanged
