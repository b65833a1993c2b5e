"""The SDK against fake Target and Controller services over real gRPC on an ephemeral port.

The fake servers run on their own event loop in a background thread, so the blocking client and
the asyncio client (on the test's loop) talk to the same server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import grpc
import pytest

from specpair.client import (
    AsyncControllerClient,
    AsyncSpecpairClient,
    ControllerClient,
    GenerateResult,
    SpecpairClient,
    SpecpairError,
)
from specpair.config import ServerConfig
from specpair.proto.v1 import controller_pb2, controller_pb2_grpc, target_pb2, target_pb2_grpc
from specpair.rpc.serving import GrpcServer

TOKEN = "s3cret"
# The fake's script: (new tokens, accept length) per round; the first round is the prefill's
# token (no drafts, -1), then speculative rounds that accepted 2, 0 and 3 drafts (+1 bonus each).
ROUNDS = [([10], -1), ([11, 12, 13], 2), ([14], 0), ([15, 16, 17, 18], 3)]


def _text(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """Streams ROUNDS; records what clients sent; validates like the real one. ApplyTier and
    WatchRounds are the controller's business: the base class answers UNIMPLEMENTED."""

    def __init__(self) -> None:
        self.requests: list[target_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()

    async def Generate(
        self, request: target_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append({m.key: m.value for m in context.invocation_metadata() or ()})
        if not (request.prompt or request.prompt_token_ids or request.messages):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        if request.max_tokens <= 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_tokens: must be > 0, got {request.max_tokens}",
            )
        rid = request.request_id or "req-1"
        if request.prompt == "slow":  # streams forever until the client goes away
            try:
                for i in range(10_000):
                    yield target_pb2.GenerateResponse(request_id=rid, token_ids=[i], text="x")
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return
        for ids, accept in ROUNDS[:-1]:
            yield target_pb2.GenerateResponse(
                request_id=rid,
                token_ids=ids,
                text=_text(ids),
                accept_length=accept,
                speculative_num_steps=3,
            )
        ids, accept = ROUNDS[-1]
        # The last message carries the last round's tokens together with the totals.
        yield target_pb2.GenerateResponse(
            request_id=rid,
            token_ids=ids,
            text=_text(ids),
            accept_length=accept,
            speculative_num_steps=3,
            finish_reason=target_pb2.FINISH_REASON_STOP,
            usage=target_pb2.Usage(prompt_tokens=4, completion_tokens=9),
            speculation=target_pb2.SpeculationStats(
                accept_lengths=[2, 0, 3], rounds=4, plain_rounds=1, avg_accept_length=5 / 3
            ),
        )

    async def GetServerInfo(
        self,
        request: target_pb2.TargetServiceGetServerInfoRequest,
        context: grpc.aio.ServicerContext,
    ) -> target_pb2.TargetServiceGetServerInfoResponse:
        return target_pb2.TargetServiceGetServerInfoResponse(
            speculative_num_steps=3,
            candidate_steps=[1, 3, 7],
            draft_connection_state=target_pb2.DRAFT_CONNECTION_STATE_CONNECTED,
            rounds=2**40,  # a uint64: must come back as an int, not a JSON string
        )


class FakeController(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self) -> None:
        self.policy = controller_pb2.PolicyConfig(
            candidate_steps=[1, 3, 7],
            ema_alpha=0.2,
            update_interval=5,
            warmup_batches=10,
            down_hysteresis=-0.25,
        )
        self.pinned = 0

    def _targets(self) -> list[controller_pb2.TargetState]:
        return [
            controller_pb2.TargetState(
                target_address="t:50051",
                active_steps=self.pinned or 3,
                pinned=bool(self.pinned),
                pinned_steps=self.pinned,
            )
        ]

    async def GetState(
        self, request: controller_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.GetStateResponse:
        return controller_pb2.GetStateResponse(policy=self.policy, targets=self._targets())

    async def UpdatePolicy(
        self, request: controller_pb2.UpdatePolicyRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.UpdatePolicyResponse:
        if request.HasField("ema_alpha") and not 0 < request.ema_alpha <= 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ema_alpha: must be in (0, 1]")
        for name in ("ema_alpha", "update_interval", "warmup_batches", "up_hysteresis"):
            if request.HasField(name):
                setattr(self.policy, name, getattr(request, name))
        if request.candidate_steps:
            self.policy.ClearField("candidate_steps")
            self.policy.candidate_steps.extend(request.candidate_steps)
        return controller_pb2.UpdatePolicyResponse(policy=self.policy)

    async def PinTier(
        self, request: controller_pb2.PinTierRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.PinTierResponse:
        if request.speculative_num_steps not in self.policy.candidate_steps:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"speculative_num_steps: {request.speculative_num_steps} is not a candidate",
            )
        self.pinned = request.speculative_num_steps
        return controller_pb2.PinTierResponse(targets=self._targets())

    async def Unpin(
        self, request: controller_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.UnpinResponse:
        self.pinned = 0
        return controller_pb2.UnpinResponse(targets=self._targets())


class Servers:
    """A target and a controller on ephemeral ports, served from a background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.target = FakeTarget()  # type: ignore[abstract]
        self.controller = FakeController()
        self.target_address = self.run(self._start_target())
        self.controller_address = self.run(self._start_controller())

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start_target(self) -> str:
        self.target_server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(self.target, self.target_server)
        port = self.target_server.add_insecure_port("127.0.0.1:0")
        await self.target_server.start()
        return f"127.0.0.1:{port}"

    async def _start_controller(self) -> str:
        # The real server plumbing, so the bearer-token check is the one production runs.
        self.controller_server = GrpcServer(
            ServerConfig(address="127.0.0.1:0", ops_token=TOKEN),
            ["specpair.v1.ControllerService"],
            protected_methods=[
                f"/specpair.v1.ControllerService/{m}"
                for m in ("GetState", "UpdatePolicy", "PinTier", "Unpin")
            ],
        )
        controller_pb2_grpc.add_ControllerServiceServicer_to_server(
            self.controller, self.controller_server.server
        )
        await self.controller_server.start()
        await self.controller_server.ready()
        return f"127.0.0.1:{self.controller_server.port}"

    def stop(self) -> None:
        self.run(self.target_server.stop(0))
        self.run(self.controller_server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.stop()


EXPECTED_IDS = (10, 11, 12, 13, 14, 15, 16, 17, 18)


def _check_result(result: GenerateResult) -> None:
    assert result.token_ids == EXPECTED_IDS
    assert result.text == _text(list(EXPECTED_IDS))
    assert result.finish_reason == "stop"
    assert result.accept_lengths == (2, 0, 3)
    assert (result.rounds, result.plain_rounds) == (4, 1)
    assert result.avg_accept_length == pytest.approx(5 / 3)
    assert (result.prompt_tokens, result.completion_tokens) == (4, 9)
    assert result.request_id == "req-1"


async def test_generate_folds_the_stream_and_sends_every_parameter(servers: Servers) -> None:
    async with AsyncSpecpairClient(servers.target_address, token=TOKEN) as client:
        result = await client.generate(
            [1, 2, 3, 4],
            max_tokens=9,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=7,
            stop=["\n\n"],
            stop_token_ids=[0],
        )
    _check_result(result)
    assert result.to_dict()["token_ids"] == list(EXPECTED_IDS)

    sent = servers.target.requests[-1]
    assert list(sent.prompt_token_ids) == [1, 2, 3, 4] and sent.prompt == ""
    assert sent.max_tokens == 9
    assert sent.sampling.temperature == pytest.approx(0.7)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert (sent.sampling.top_k, sent.sampling.seed) == (20, 7)
    assert (list(sent.stop), list(sent.stop_token_ids)) == (["\n\n"], [0])
    assert servers.target.metadata[-1]["authorization"] == f"Bearer {TOKEN}"


async def test_no_seed_and_no_token_are_left_unset(servers: Servers) -> None:
    async with AsyncSpecpairClient(servers.target_address) as client:
        await client.generate("hello", max_tokens=4)
    sent = servers.target.requests[-1]
    assert sent.prompt == "hello" and not sent.sampling.HasField("seed")
    assert sent.sampling.temperature == 0.0
    assert "authorization" not in servers.target.metadata[-1]


async def test_stream_yields_one_delta_per_round(servers: Servers) -> None:
    async with AsyncSpecpairClient(servers.target_address) as client:
        deltas = [d async for d in client.stream("hi", max_tokens=9)]
    assert [d.token_ids for d in deltas] == [tuple(ids) for ids, _ in ROUNDS]
    assert [d.accept_length for d in deltas] == [a for _, a in ROUNDS]
    assert [d.text for d in deltas] == [_text(ids) for ids, _ in ROUNDS]
    assert all(d.speculative_num_steps == 3 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None, None, None, "stop"]


async def test_leaving_a_stream_early_cancels_the_request(servers: Servers) -> None:
    servers.target.cancelled.clear()
    async with AsyncSpecpairClient(servers.target_address) as client:
        stream = client.stream("slow", max_tokens=10_000)
        async for _ in stream:
            break
        await stream.aclose()
        # Still connected: the server learns from the cancellation, not from a closed channel.
        assert await asyncio.to_thread(servers.target.cancelled.wait, 5)


@pytest.mark.parametrize(("prompt", "max_tokens", "field"), [("", 4, "prompt")])
async def test_server_errors_become_specpair_errors(
    servers: Servers, prompt: str, max_tokens: int, field: str
) -> None:
    async with AsyncSpecpairClient(servers.target_address) as client:
        with pytest.raises(SpecpairError) as info:
            await client.generate(prompt, max_tokens=max_tokens)
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.details.startswith(f"{field}:")
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_below_1_is_refused_before_sending(max_tokens: int) -> None:
    # 0 on the wire is proto3's unset, the server's 16 tokens: an explicit 0 must not mean that
    client = SpecpairClient("127.0.0.1:1")
    with pytest.raises(ValueError, match=f"^max_tokens: .*got {max_tokens}$"):
        client.generate("hi", max_tokens=max_tokens)


def test_prompt_of_the_wrong_type_is_refused_before_sending() -> None:
    client = SpecpairClient("127.0.0.1:1")
    with pytest.raises(TypeError, match="prompt"):
        client.generate([1.5, 2.0], max_tokens=4)  # type: ignore[list-item]
    client.close()


def test_sync_client_generate_stream_info_and_errors(servers: Servers) -> None:
    with SpecpairClient(servers.target_address, token=TOKEN, timeout=10) as client:
        _check_result(client.generate("hi", max_tokens=9))
        deltas = list(client.stream([5, 6], max_tokens=9))
        info = client.server_info()
        with pytest.raises(SpecpairError) as stream_error:
            list(client.stream("", max_tokens=4))
    assert [d.token_ids for d in deltas] == [tuple(ids) for ids, _ in ROUNDS]
    assert servers.target.metadata[-1]["authorization"] == f"Bearer {TOKEN}"
    assert info["speculative_num_steps"] == 3 and info["candidate_steps"] == [1, 3, 7]
    assert info["draft_connection_state"] == "DRAFT_CONNECTION_STATE_CONNECTED"
    assert info["rounds"] == 2**40 and info["running_requests"] == 0
    assert stream_error.value.code == "INVALID_ARGUMENT"
    assert "prompt" in stream_error.value.details


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


async def test_chat_sends_messages_and_no_prompt(servers: Servers) -> None:
    async with AsyncSpecpairClient(servers.target_address) as client:
        _check_result(await client.chat(CHAT, max_tokens=9, temperature=0.5, seed=3))
        deltas = [d async for d in client.stream_chat(CHAT, max_tokens=9)]
    with SpecpairClient(servers.target_address, timeout=10) as sync:
        _check_result(sync.chat(CHAT, max_tokens=9, stop=["\n"]))
        assert [d.token_ids for d in sync.stream_chat(CHAT, max_tokens=9)] == [
            d.token_ids for d in deltas
        ]
    assert [d.token_ids for d in deltas] == [tuple(ids) for ids, _ in ROUNDS]
    sent = servers.target.requests[-4]  # the async chat
    assert [(m.role, m.content) for m in sent.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert sent.prompt == "" and not sent.prompt_token_ids and sent.max_tokens == 9
    assert sent.sampling.temperature == pytest.approx(0.5) and sent.sampling.seed == 3
    assert list(servers.target.requests[-2].stop) == ["\n"]


def test_chat_message_without_content_is_refused_before_sending() -> None:
    client = SpecpairClient("127.0.0.1:1")
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        client.chat([{"role": "user", "content": "a"}, {"role": "user"}], max_tokens=4)
    client.close()


def test_unreachable_server_is_a_specpair_error() -> None:
    with SpecpairClient("127.0.0.1:1", timeout=2) as client, pytest.raises(SpecpairError) as info:
        client.server_info()
    assert info.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_sync_controller_client(servers: Servers) -> None:
    with ControllerClient(servers.controller_address, token=TOKEN) as ctl:
        state = ctl.state()
        assert state.policy["candidate_steps"] == [1, 3, 7]
        assert state.targets[0].pinned_steps is None
        assert state.to_dict()["targets"][0]["recent_switches"] == []
        # CLI-style strings are coerced to the field's type.
        policy = ctl.update_policy(ema_alpha="0.5", update_interval=2, candidate_steps="1,3")
        assert policy["ema_alpha"] == 0.5
        assert policy["update_interval"] == 2
        assert policy["candidate_steps"] == [1, 3]
        with pytest.raises(SpecpairError, match="ema_alpha") as bad:
            ctl.update_policy(ema_alpha=3)
        assert bad.value.code == "INVALID_ARGUMENT"
        with pytest.raises(ValueError, match="unknown policy key 'alpha'"):
            ctl.update_policy(alpha=0.1)
        with pytest.raises(ValueError, match="update_interval"):
            ctl.update_policy(update_interval="often")
    # Without the ops token the real interceptor refuses every ops RPC.
    with (
        ControllerClient(servers.controller_address) as anon,
        pytest.raises(SpecpairError) as denied,
    ):
        anon.state()
    assert denied.value.code == "UNAUTHENTICATED"


async def test_async_controller_client_pins_and_unpins(servers: Servers) -> None:
    async with AsyncControllerClient(servers.controller_address, token=TOKEN) as ctl:
        pinned = await ctl.pin(3)
        assert pinned[0].pinned_steps == 3
        assert pinned[0].active_steps == 3
        with pytest.raises(SpecpairError) as bad:
            await ctl.pin(4)
        assert bad.value.code == "INVALID_ARGUMENT"
        assert "speculative_num_steps" in bad.value.details
        unpinned = await ctl.unpin()
        assert unpinned[0].pinned_steps is None
        assert (await ctl.state()).targets[0].pinned_steps is None


def test_default_address_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPAIR_TARGET_ADDRESS", "10.0.0.1:6000")
    monkeypatch.delenv("SPECPAIR_CONTROLLER_ADDRESS", raising=False)
    with SpecpairClient() as client, ControllerClient() as ctl:
        assert client.address == "10.0.0.1:6000"
        assert ctl.address == "127.0.0.1:50053"


def test_importing_the_sdk_does_not_import_torch() -> None:
    code = (
        "import sys, specpair.client, specpair.rpc.healthcheck; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_policy_key_the_controller_takes_the_sdk_can_send() -> None:
    # The SDK lists the keys apart (it must not import the controller); a key missing there
    # made `update_policy` refuse a whole goodput config.
    import dataclasses

    from controller.policies.goodput.config import GoodputConfig
    from controller.policies.sglang import PolicyConfig
    from specpair.client.requests import POLICY_FIELDS, POLICY_OPTIONS

    keys = {f.name for c in (GoodputConfig, PolicyConfig) for f in dataclasses.fields(c)}
    assert keys - {"kind"} <= POLICY_FIELDS.keys() | POLICY_OPTIONS.keys()


def test_a_token_grpc_cannot_send_is_a_specpair_error() -> None:
    from specpair.client import ControllerClient, SpecpairError

    with pytest.raises(SpecpairError) as info:
        ControllerClient("127.0.0.1:1", token="…")  # README's old placeholder
    assert info.value.code == "INVALID_ARGUMENT" and info.value.details.startswith("token:")


def test_pin_and_tree_shape_requests_name_the_shape() -> None:
    from specpair.client import build_pin, build_policy_update

    assert build_pin(7) == controller_pb2.PinTierRequest(speculative_num_steps=7)
    assert build_pin("7") == controller_pb2.PinTierRequest(speculative_num_steps=7)
    assert build_pin("4x4x16") == controller_pb2.PinTierRequest(
        speculative_num_steps=4, shape="4x4x16"
    )
    for bad in ("4x4", "x", True, 2.5):
        with pytest.raises(ValueError):
            build_pin(bad)  # type: ignore[arg-type]
    request = build_policy_update(tree_shapes="4x4x16,6x8x32")
    assert list(request.tree_shapes) == ["4x4x16", "6x8x32"] and request.set_tree_shapes
    dropped = build_policy_update(tree_shapes="")  # `ctl policy tree_shapes=`: drop them all
    assert list(dropped.tree_shapes) == [] and dropped.set_tree_shapes
    assert not build_policy_update(min_gain=0.1).set_tree_shapes


def test_a_policy_flag_reads_true_and_false_not_any_string() -> None:
    from specpair.client import build_policy_update

    # bool("false") is True: `ctl policy expect_tail=false` must not turn it on.
    assert build_policy_update(expect_tail="false").expect_tail is False
    assert build_policy_update(expect_tail="True").expect_tail is True
    assert build_policy_update(expect_tail=False).HasField("expect_tail")
    assert build_policy_update(cost_guard="false").cost_guard is False
    assert build_policy_update(cost_guard=False).HasField("cost_guard")
    for bad in ("no", 0, 1.0):
        with pytest.raises(ValueError, match="expect_tail: expected true or false"):
            build_policy_update(expect_tail=bad)
