"""The peer streams and the ops API against anyone who can reach them: anonymous Round streams,
idle WatchRounds watchers, huge request ids, deep nesting, absurd policy values."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import replace

import grpc
import pytest
from structlog.testing import capture_logs

from controller.service.server import start as start_controller
from specpair.client import AsyncSpecpairClient
from specpair.config import MODELS_DIR, ControllerConfig, ServerConfig
from specpair.proto.v1 import controller_pb2, controller_pb2_grpc, target_pb2
from specpair.rpc.metrics import ServiceMetrics
from specpair.runtime.round_messages import RoundStats, StageTimings
from target_service.batching.round_feed import BEHIND, EVICTED, QUEUE_ROUNDS, RoundFeed
from target_service.request_path.servicer import TargetServicer
from tests.service.conftest import draft_config, eventually, target_config
from tests.service.test_draft_pool import TargetStream
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
        # Without a token a stream is its peer's host: a second stream from it shares the share.
        again = await other.round(*(draft_input(f"q{i}", [5, 6]) for i in range(2)))
        assert not again.trees and "target ipv4:127.0.0.1 holds" in again.refused["q0"]
        assert stack.draft.servicer.rounds.active_requests == 2
    finally:
        await greedy.close()
        await other.close()


async def test_without_a_token_no_peer_host_takes_every_draft_slot(ckpts, make_stack) -> None:
    """One anonymous stream took all 64 slots, and four inventing target names took 64/64."""
    stack = await make_stack(
        draft_config(ckpts["draft"], max_requests=8),  # max_target_requests left at its default
        target_config(ckpts["target"], draft_address=None),
    )
    invented = [TargetStream(stack.draft.port, f"pod-{i}:50051") for i in range(4)]
    try:
        answers = [
            await s.round(*(draft_input(f"r{i}", [5, 6, 7]) for i in range(8))) for s in invented
        ]
        assert sum(len(a.trees) for a in answers) == 4  # half of max_requests: the host's share
        assert len(answers[0].trees) == 4 and not any(a.error for a in answers)
        assert all("max_target_requests 4" in why for why in answers[1].refused.values())
        usage = {u.target: (u.streams, u.requests) for u in stack.draft.servicer.usage()}
        # four names (and the stack's own target, idle), one host
        assert list(usage) == ["ipv4:127.0.0.1"] and usage["ipv4:127.0.0.1"][1] == 4
    finally:
        for stream in invented:
            await stream.close()


async def test_with_the_token_a_target_is_the_name_it_declares(ckpts, make_stack) -> None:
    stack = await make_stack(
        _with_token(draft_config(ckpts["draft"], max_requests=8)),
        _with_token(target_config(ckpts["target"], draft_address=None)),
    )
    named = [TargetStream(stack.draft.port, f"pod-{i}:50051", token=TOKEN) for i in range(2)]
    try:
        answers = [await s.round(*(draft_input(f"r{i}", [5, 6]) for i in range(4))) for s in named]
        assert [len(a.trees) for a in answers] == [4, 4]  # the token proves who they are
        usage = {u.target: u.requests for u in stack.draft.servicer.usage()}
        assert usage["pod-0:50051"] == usage["pod-1:50051"] == 4
    finally:
        for stream in named:
            await stream.close()


async def test_watchers_are_capped_and_a_newcomer_evicts_the_oldest(ckpts, make_stack) -> None:
    stack = await make_stack(
        None, target_config(ckpts["target"], draft_address=None, max_watchers=2)
    )
    feed = stack.target.servicer.scheduler.feed
    calls = []
    for n in (1, 2):  # these two hold the places, the first the oldest
        calls.append(stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()))
        await eventually(lambda n=n: len(feed._watchers) == n)  # type: ignore[misc]
    calls.append(stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the oldest makes room
            await asyncio.wait_for(calls[0].read(), 10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers" in err.value.details()
        assert len(feed._watchers) == 2
        generate = asyncio.create_task(stack.generate(prompt_token_ids=PROMPT, max_tokens=5))
        later = [await asyncio.wait_for(call.read(), 10) for call in calls[1:]]
        assert all(r.round.round_id >= 1 for r in later)
        await generate
    finally:
        for call in calls:
            call.cancel()
    await eventually(lambda: not feed._watchers)


def test_a_watcher_a_whole_queue_behind_is_dropped() -> None:
    async def run() -> None:
        feed = RoundFeed(ServiceMetrics("target"), max_watchers=2)
        slow, live = feed.watch(), feed.watch()
        for round_id in range(QUEUE_ROUNDS + 1):
            feed.publish(RoundStats(round_id, 3, 1, (2,), True, StageTimings(), unix_time=0.0))
            if live.full():
                live.get_nowait()  # this one keeps up
        assert slow.get_nowait() == BEHIND and slow.empty()  # dropped, and told so
        assert isinstance(live.get_nowait(), RoundStats)
        assert len(feed._watchers) == 1  # its place is free

    asyncio.run(run())


def test_a_full_feed_evicts_the_oldest_watcher_of_the_most_crowded_host() -> None:
    async def run() -> None:
        feed = RoundFeed(ServiceMetrics("target"), max_watchers=4)
        controller = feed.watch("ipv4:10.0.0.2")
        flood = [feed.watch("ipv4:10.0.0.9") for _ in range(3)]
        for _ in range(5):  # the flooding host reconnects: it evicts its own watchers
            flood.append(feed.watch("ipv4:10.0.0.9"))
        assert controller in feed._watchers and len(feed._watchers) == 4
        assert all(q.get_nowait() == EVICTED for q in flood[:5])

    asyncio.run(run())


async def test_a_restarted_controller_gets_in_past_anonymous_watchers(ckpts, make_stack) -> None:
    """Eight anonymous WatchRounds streams held every place: a controller that restarted stayed
    disconnected, its policy frozen."""
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    feed = stack.target.servicer.scheduler.feed
    squatters = [stack.stub.WatchRounds(target_pb2.WatchRoundsRequest()) for _ in range(8)]
    await eventually(lambda: len(feed._watchers) == 8)
    target = f"127.0.0.1:{stack.target.port}"
    controller = await start_controller(
        ControllerConfig(ServerConfig("127.0.0.1:0"), (target,), reconnect_s=0.2)
    )
    try:

        def inside() -> bool:  # connected, and the squatters still hold the other places
            connected = all(t.connected for t in controller.controller.snapshot())
            return connected and len(feed._watchers) == 8

        await eventually(inside, timeout=20)
        await stack.generate(prompt_token_ids=PROMPT, max_tokens=8)
        await eventually(lambda: controller.controller.snapshot()[0].rounds_seen > 0, timeout=20)
    finally:
        await controller.stop(grace=0.1)
        for call in squatters:
            call.cancel()


async def test_a_refused_watch_is_retried_with_backoff_and_logged_rarely(
    ckpts, make_stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target that accepts the controller and refuses its WatchRounds at once was retried
    every 0.05 s, a warning each time (482 in 35 s)."""
    attempts = 0

    async def refuse(self, request, context):  # type: ignore[no-untyped-def]
        nonlocal attempts
        attempts += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no place")
        yield  # pragma: no cover - an async generator, as the method is

    monkeypatch.setattr(TargetServicer, "WatchRounds", refuse)
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    target = f"127.0.0.1:{stack.target.port}"
    with capture_logs() as logs:
        controller = await start_controller(
            ControllerConfig(ServerConfig("127.0.0.1:0"), (target,), reconnect_s=1.0)
        )
        try:
            await asyncio.sleep(4.0)
        finally:
            await controller.stop(grace=0.1)
    # 0.05, 0.1, 0.2, 0.4, 0.8, then every 1 s: about 8 in 4 s (80 without the backoff).
    assert 2 <= attempts <= 14, attempts
    lost = [
        e for e in logs if e["event"] == "target connection lost" and e["log_level"] == "warning"
    ]
    assert len(lost) == 1, lost


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


async def _cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`specpair …` as its own process, with exactly `env` beside PATH and PYTHONPATH."""
    base = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
    command = (sys.executable, "-m", "specpair.cli", *args)
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*command, env=base | env, stdout=pipe, stderr=pipe)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_the_api_key_guards_grpc_generate_and_the_sdk_and_cli_send_it(
    make_stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With SPECPAIR_API_KEY set, HTTP /v1/ wanted it and gRPC Generate answered anyone."""
    monkeypatch.delenv("SPECPAIR_API_KEY", raising=False)
    key = "k3y-for-clients"
    config = target_config(MODELS_DIR / "target", draft_address=None, api_key=key)
    stack = await make_stack(None, config)
    request = target_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2)
    for metadata in ((), (("authorization", "Bearer wrong"),), AUTH):  # AUTH: the ops token
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in stack.stub.Generate(request, metadata=metadata)]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in err.value.details()
    await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())  # open
    address = f"127.0.0.1:{stack.target.port}"
    async with AsyncSpecpairClient(address, api_key=key) as sdk:
        assert len((await sdk.generate([5, 6, 7], max_tokens=3)).token_ids) == 3
    monkeypatch.setenv("SPECPAIR_API_KEY", key)  # the SDK reads it when given none
    async with AsyncSpecpairClient(address) as sdk:
        assert len((await sdk.generate([5, 6, 7], max_tokens=3)).token_ids) == 3
    command = ("generate", "def f(", "--max-tokens", "3", "--json", "--address", address)
    code, _, err = await _cli(*command, env={})
    assert code == 1 and "UNAUTHENTICATED" in err and "API key" in err
    code, out, _ = await _cli(*command, env={"SPECPAIR_API_KEY": key})
    assert code == 0 and json.loads(out)["completion_tokens"] == 3
    code, out, _ = await _cli(*command, "--api-key-env", "MY_KEY", env={"MY_KEY": key})
    assert code == 0


async def test_pinning_a_tree_under_a_chain_policy_says_how_to_allow_it() -> None:
    nowhere = ("unix:/nonexistent/specpair-target.sock",)
    controller = await start_controller(ControllerConfig(ServerConfig("127.0.0.1:0"), nowhere))
    address = ("--address", f"127.0.0.1:{controller.port}")
    try:
        code, _, err = await _cli("ctl", *address, "pin", "4x4x16", env={})
        assert code == 1
        assert "the sglang policy chooses among chains only" in err
        assert "specpair ctl policy kind=goodput tree_shapes=4x4x16" in err
        # What it says works: the goodput kind with the shape, then the pin.
        code, _, err = await _cli(
            "ctl", *address, "policy", "kind=goodput", "tree_shapes=4x4x16", env={}
        )
        assert code == 0, err
        code, _, err = await _cli("ctl", *address, "pin", "5x4x16", env={})
        assert code == 1 and "specpair ctl policy tree_shapes=5x4x16" in err
        code, _, err = await _cli("ctl", *address, "pin", "4x4x16", env={})
        assert code == 0, err
    finally:
        await controller.stop(grace=0.1)
    assert str(controller.controller.pinned) == "4x4x16"
