"""Bad input, failing rounds and vanished peers never crash, hang or leak a slot."""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
import time
from dataclasses import replace
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from bench.common import free_address
from specpair.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specpair.rpc import wire
from specpair.rpc.wire import response_to_proto
from specpair.runtime.build import build_target
from specpair.runtime.round_messages import RoundResponse
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import chain
from target_service.batching.served import ServedRequest
from tests.service.conftest import (
    draft_config,
    eventually,
    fake_draft,
    one_tier_scheduler,
    reference_greedy,
    target_config,
)

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18]


def draft_input(rid: str, tokens: list[int], **sampling: Any) -> draft_pb2.DraftInput:
    return draft_pb2.DraftInput(
        request_id=rid,
        appended_token_ids=tokens,
        sampling=common_pb2.SamplingParams(**sampling),
    )


class DraftStream:
    """One Round stream straight to a draft service, a round at a time."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.call = draft_pb2_grpc.DraftServiceStub(self.channel).Round()
        self.round_id = 0

    async def round(self, *inputs: draft_pb2.DraftInput, tier: int = 3) -> draft_pb2.RoundResponse:
        self.round_id += 1
        await self.call.write(
            draft_pb2.RoundRequest(
                round_id=self.round_id, speculative_num_steps=tier, inputs=inputs
            )
        )
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response.round_id == self.round_id
        return response  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self.call.done_writing()
        await self.channel.close()


@pytest.mark.parametrize("temperature", [math.nan, 1e-45, math.inf])
async def test_nan_or_tiny_temperature_is_refused_and_spares_others(
    ckpts, make_stack, temperature: float
) -> None:
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    good = asyncio.create_task(stack.generate(prompt_token_ids=PROMPT, max_tokens=40))
    bad = common_pb2.SamplingParams(temperature=temperature)
    for _ in range(20):  # more than the 16 KV slots: one leaked per request would run out
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(
                stack.generate(prompt_token_ids=[1, 2], max_tokens=5, sampling=bad), 10
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("sampling.temperature"), err.value.details()
    tokens, _ = await asyncio.wait_for(good, 30)
    assert tokens == reference_greedy(ckpts["target"], [PROMPT], 40)[0]
    assert stack.target.servicer.scheduler.worker.cache.free_slots == 16


async def test_failing_prefill_answers_its_requests_and_frees_their_slots(
    ckpts, make_stack
) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    worker = stack.target.servicer.scheduler.worker
    prefill = worker.prefill

    def flaky(seqs: list[Any]) -> Any:
        if any(s.prompt == [7, 7, 7] for s in seqs):
            for seq in seqs:  # fail after the slots are taken, as a NaN warp did
                seq.slot = worker.cache.alloc() if seq.slot < 0 else seq.slot
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return prefill(seqs)

    worker.prefill = flaky
    for _ in range(20):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(stack.generate(prompt_token_ids=[7, 7, 7], max_tokens=5), 10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
    assert worker.cache.free_slots == 16
    tokens, _ = await asyncio.wait_for(stack.generate(prompt_token_ids=PROMPT, max_tokens=20), 10)
    assert tokens == reference_greedy(ckpts["target"], [PROMPT], 20)[0]


async def test_largest_seed_speculates_and_leaks_no_draft_slot(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["draft"]), target_config(ckpts["target"]))
    sampling = common_pb2.SamplingParams(temperature=0.9, seed=2**64 - 1)
    runs = [
        await stack.generate(prompt_token_ids=PROMPT, max_tokens=40, sampling=sampling)
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 40
    assert all(responses[-1].speculation.plain_rounds == 0 for _, responses in runs)
    drafter = stack.draft.servicer.rounds.drafter
    await eventually(lambda: drafter.cache.free_slots == stack.draft_cfg.max_requests)
    assert not drafter.requests


async def test_draft_round_errors_name_the_field_and_keep_the_stream(ckpts, make_stack) -> None:
    # One peer may hold every slot here (without a token its default share is half).
    draft = draft_config(ckpts["target"], max_requests=4, max_target_requests=4)
    stack = await make_stack(draft, target_config(ckpts["target"], draft_address=None))
    drafter = stack.draft.servicer.rounds.drafter
    stream = DraftStream(stack.draft.port)
    try:
        ok = await stream.round(draft_input("a", [5, 6, 7]))
        assert not ok.error and len(ok.trees[0].token_ids) == 3
        cases = [
            ([draft_input("b", [1], temperature=math.nan)], "inputs[b].sampling.temperature"),
            ([draft_input("b", [1], temperature=1e-45)], "inputs[b].sampling.temperature"),
            ([draft_input("b", [1], temperature=1.0, top_p=math.nan)], "sampling.top_p"),
            ([draft_input("b", [1]), draft_input("b", [2])], "inputs: a request_id appears"),
            ([draft_input("b", [99999])], "inputs[b].appended_token_ids"),
        ]
        for inputs, field in cases:
            response = await stream.round(*inputs)
            assert field in response.error, (field, response.error)
            assert list(drafter.requests) == [k for k in drafter.requests if k.endswith("/a")]
            assert drafter.cache.free_slots == 3  # only "a" holds one
        seeded = await stream.round(draft_input("c", [1, 2], temperature=0.8, seed=2**64 - 1))
        # a sampled round: its q as the round's tensors, a row per node of its one tree
        assert not seeded.error and seeded.HasField("draft_probs")
        assert seeded.draft_probs.shape[0] == len(seeded.trees[0].token_ids)
        # More new requests than free slots (2 left: "a" and "c" hold two): the first two are
        # drafted, the rest get no tree and hold nothing; "a" drafts on.
        crowd = await stream.round(
            draft_input("a", [8]), *(draft_input(f"n{i}", [1, 2]) for i in range(4))
        )
        assert not crowd.error
        assert [t.request_id for t in crowd.trees] == ["a", "n0", "n1"]
        assert drafter.cache.free_slots == 0 and len(drafter.requests) == 4
        too_long = await stream.round(draft_input("n0", [1] * 1023))
        assert not too_long.error and not too_long.trees  # 2 + 1023 > the 1024 served (+ 7 drafts)
        assert "s1/n0" not in drafter.requests and len(drafter.requests) == 3
    finally:
        await stream.close()
    await eventually(lambda: drafter.cache.free_slots == 4)


async def test_more_requests_than_draft_slots_keeps_the_others_speculating(
    ckpts, make_stack
) -> None:
    stack = await make_stack(
        draft_config(ckpts["target"], max_requests=2), target_config(ckpts["target"])
    )
    prompts = [PROMPT, [5, 6, 7], [3], [100, 200, 50]]
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=30) for p in prompts)
    )
    assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], prompts, 30)
    drafted = [len(r[-1].speculation.accept_lengths) for _, r in outputs]
    assert sum(drafted) >= 10, drafted  # requests without a slot must not cost the others


async def test_request_expired_in_the_queue_is_not_prefilled(ckpts) -> None:
    worker = build_target(ckpts["target"], max_requests=2, max_len=64)
    scheduler = one_tier_scheduler(worker, tier=3, max_batch=2)
    prefilled: list[str] = []
    prefill = worker.prefill

    def counting(seqs: list[Any]) -> Any:
        prefilled.extend(s.request_id for s in seqs)
        return prefill(seqs)

    worker.prefill = counting  # type: ignore[method-assign]
    now = time.monotonic()
    expired, live = (
        ServedRequest(TargetSequence(rid, [5, 6, 7], SamplingParams(), 3), deadline=deadline)
        for rid, deadline in (("expired", now - 0.1), ("live", now + 30))
    )
    task = asyncio.create_task(scheduler.run())
    try:
        scheduler.submit(expired)
        scheduler.submit(live)
        event = await asyncio.wait_for(expired.events.get(), 10)
        assert event.finish_reason == "expired" and event.token_ids == []
        while (await asyncio.wait_for(live.events.get(), 10)).finish_reason is None:
            pass
    finally:
        task.cancel()
    assert prefilled == ["live"]
    assert worker.cache.free_slots == 2


def _bad_rows(kind: str, n: int, vocab: int, token: int) -> torch.Tensor:
    """[n, vocab] draft distributions a dishonest draft might send for `token`."""
    if kind == "zeros":
        return torch.zeros(n, vocab)
    rows = torch.full((n, vocab), 1.0 / (vocab - 1))
    rows[:, token] = 0.0  # a distribution, but the drafted token is impossible under it
    if kind == "negative":
        rows[:, token] = -1.0
        rows[:, token + 1] += 1.0  # still sums to 1
    elif kind == "nan":
        rows[:, token] = math.nan
    elif kind == "inf":
        rows[:, token] = math.inf
    return rows


class DishonestDraft(draft_pb2_grpc.DraftServiceServicer):
    """Well-formed chains of one token whose draft_probs rejection sampling cannot trust."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.trees = 0

    async def Round(self, request_iterator: Any, context: Any) -> Any:
        async for req in request_iterator:
            n = req.speculative_num_steps
            trees = {
                i.request_id: chain([5] * n, _bad_rows(self.kind, n, 320, 5)) for i in req.inputs
            }
            self.trees += len(trees)
            yield response_to_proto(RoundResponse(req.round_id, trees))

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return draft_pb2.DraftServiceGetServerInfoResponse(draft_kind="model")


@pytest.mark.parametrize("kind", ["zeros", "negative", "nan", "inf", "impossible"])
async def test_dishonest_draft_probs_never_change_sampled_output(
    ckpts, make_stack, kind: str
) -> None:
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=123)
    alone = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    expected, _ = await alone.generate(prompt_token_ids=PROMPT, max_tokens=30, sampling=sampling)
    draft = DishonestDraft(kind)
    async with fake_draft(draft) as address:
        stack = await make_stack(None, target_config(ckpts["target"], draft_address=address))
        await stack.wait_draft_connected()
        tokens, responses = await stack.generate(
            prompt_token_ids=PROMPT, max_tokens=30, sampling=sampling
        )
    assert draft.trees > 0
    assert tokens == expected
    assert list(responses[-1].speculation.accept_lengths) == []  # every tree was refused


PEER = """
import asyncio, sys
import grpc
from specpair.proto.v1 import common_pb2, draft_pb2, draft_pb2_grpc

async def main():
    channel = grpc.aio.insecure_channel(sys.argv[1])
    call = draft_pb2_grpc.DraftServiceStub(channel).Round()
    inputs = [draft_pb2.DraftInput(request_id=f"r{i}", appended_token_ids=[1, 2, 3],
              sampling=common_pb2.SamplingParams()) for i in range(8)]
    await call.write(draft_pb2.RoundRequest(round_id=1, speculative_num_steps=3, inputs=inputs))
    await call.read()
    if sys.argv[2] == "mid-round":
        await call.write(draft_pb2.RoundRequest(round_id=2, speculative_num_steps=7,
                         inputs=[draft_pb2.DraftInput(request_id=f"r{i}", appended_token_ids=[4])
                                 for i in range(8)]))
    print("holding", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.parametrize("when", ["between-rounds", "mid-round"])
async def test_killed_round_peer_releases_its_draft_slots(ckpts, make_stack, when) -> None:
    import os
    import signal
    import sys

    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    drafter = stack.draft.servicer.rounds.drafter
    streams = stack.draft.servicer.streams  # the target's own
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(3):  # a kill that stranded its 8 slots would show by the third
        peer = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PEER,
            f"127.0.0.1:{stack.draft.port}",
            when,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        assert peer.stdout is not None
        assert await asyncio.wait_for(peer.stdout.readline(), 30) == b"holding\n"
        assert len(drafter.requests) == 8
        peer.send_signal(signal.SIGKILL)
        await peer.wait()
        await eventually(lambda: drafter.cache.free_slots == 64, timeout=10)
        await eventually(lambda: stack.draft.servicer.streams == streams)


GARBAGE = b"\xff\xff\xff\xff\x0f"  # an invalid tag: no protobuf message parses it


async def _send_garbage(channel: grpc.aio.Channel, method: str, streaming: bool) -> grpc.RpcError:
    """Raw bytes to `method`; the error it answers with."""
    try:
        if streaming:
            call = channel.stream_stream(method)()
            await call.write(GARBAGE)
            await call.done_writing()
            async for _ in call:
                pass
        else:
            await channel.unary_stream(method)(GARBAGE, timeout=10).read()
    except grpc.aio.AioRpcError as err:
        return err
    raise AssertionError(f"{method} accepted garbage")


async def test_garbage_bytes_on_every_rpc_are_invalid_argument(ckpts, make_stack) -> None:
    from controller.service.server import start as start_controller
    from specpair.config import ControllerConfig, ServerConfig
    from specpair.proto.v1 import controller_pb2

    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    controller = await start_controller(
        ControllerConfig(ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{stack.target.port}",))
    )
    try:
        for module, port in (
            (target_pb2, stack.target.port),
            (draft_pb2, stack.draft.port),
            (controller_pb2, controller.port),
        ):
            (service,) = module.DESCRIPTOR.services_by_name.values()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    err = await _send_garbage(channel, path, method.client_streaming)
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err)
                    assert err.details().startswith("request: not a valid"), err.details()
    finally:
        await controller.stop(grace=0.1)
    tokens, _ = await stack.generate(prompt_token_ids=PROMPT, max_tokens=20)
    assert tokens == reference_greedy(ckpts["target"], [PROMPT], 20)[0]
    assert stack.draft.servicer.streams == 1  # the target's stream survived


async def test_update_policy_error_does_not_echo_a_huge_list(ckpts, make_stack) -> None:
    from controller.service.server import start as start_controller
    from specpair.config import ControllerConfig, ServerConfig
    from specpair.proto.v1 import controller_pb2, controller_pb2_grpc

    nowhere = ("unix:/nonexistent/specpair-target.sock",)  # never someone else's service
    controller = await start_controller(ControllerConfig(ServerConfig("127.0.0.1:0"), nowhere))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{controller.port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            request = controller_pb2.UpdatePolicyRequest(candidate_steps=[1] * 100_000)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdatePolicy(request, timeout=10)
    finally:
        await controller.stop(grace=0.1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("candidate_steps")
    assert len(err.value.details()) <= 512


async def test_taken_grpc_port_fails_before_the_model_loads(ckpts, make_stack, monkeypatch) -> None:
    import target_service.server as target_server
    from specpair.rpc.serving import BindError

    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    taken = f"127.0.0.1:{stack.target.port}"

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model loaded before the bind failed")

    monkeypatch.setattr(target_server, "build_target", no_load)
    cfg = target_config(ckpts["target"], draft_address=None)
    with pytest.raises(BindError, match=f"cannot listen on {taken}"):
        await target_server.start(replace(cfg, server=replace(cfg.server, address=taken)))
    # The first service still owns every connection.
    for _ in range(4):
        info = await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
        assert info.target_model_path == str(ckpts["target"])


async def test_taken_unix_socket_and_metrics_port_fail_naming_the_address(
    ckpts, tmp_path, monkeypatch
) -> None:
    import socket

    import draft_service.server as draft_server
    from specpair.rpc.serving import BindError

    monkeypatch.setattr(draft_server, "DraftRounds", None)  # calling it would fail the test
    sockets = tempfile.mkdtemp(prefix="specpair-")  # short: socket paths stop at ~107 bytes
    try:
        path = f"{sockets}/d.sock"
        with socket.socket(socket.AF_UNIX) as holder, socket.socket() as metrics:
            holder.bind(path)
            holder.listen()
            cfg = draft_config(ckpts["target"])
            with pytest.raises(BindError, match=f"cannot listen on unix:{path}"):
                await draft_server.start(
                    replace(cfg, server=replace(cfg.server, address=f"unix:{path}"))
                )
            metrics.bind(("127.0.0.1", 0))
            metrics.listen()
            taken = f"127.0.0.1:{metrics.getsockname()[1]}"
            with pytest.raises(BindError, match=f"cannot serve metrics on {taken}"):
                await draft_server.start(
                    replace(cfg, server=replace(cfg.server, metrics_address=taken))
                )
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


async def test_prompt_larger_than_the_context_is_refused_unparsed(ckpts, make_stack) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None, max_len=64))
    good = asyncio.create_task(stack.generate(prompt_token_ids=[1, 2, 3], max_tokens=50))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt="x" * (1 << 20), max_tokens=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the receive limit
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(prompt="y " * 5000, max_tokens=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt: 10000 characters cannot fit"), (
        err.value.details()
    )
    tokens, _ = await good
    assert len(tokens) == 50


async def test_tokenizing_a_prompt_does_not_stall_other_calls(ckpts, make_stack) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    servicer = stack.target.servicer
    real = servicer.frontend.tokenizer

    class SlowTokenizer:
        """The real tokenizer, as slow as a multi-megabyte prompt made it."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode(self, text: str, **kwargs: Any) -> Any:
            time.sleep(1.0)
            return real.encode(text, **kwargs)

    servicer.frontend.tokenizer = SlowTokenizer()
    t0 = time.perf_counter()
    slow = asyncio.create_task(stack.generate(prompt="def main(argv):", max_tokens=3))
    await asyncio.sleep(0.2)  # the slow encode is under way: on the loop, it would block it
    await stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest())
    assert time.perf_counter() - t0 < 0.8
    tokens, _ = await slow
    assert len(tokens) == 3


async def test_long_prompt_joining_a_request_further_along_keeps_speculating(
    ckpts, make_stack
) -> None:
    # As `specpair serve` sizes them: the draft holds the target's context plus a round's drafts.
    stack = await make_stack(
        draft_config(ckpts["target"], max_len=64 + 7), target_config(ckpts["target"], max_len=64)
    )
    first, second = [5, 6, 7], list(range(20, 60))
    expected = reference_greedy(ckpts["target"], [first, second], 58)
    tokens: list[int] = []
    joined = None
    responses = []
    async for r in stack.stub.Generate(
        target_pb2.GenerateRequest(prompt_token_ids=first, max_tokens=58)
    ):
        tokens += r.token_ids
        responses.append(r)
        if joined is None and len(tokens) >= 30:  # at position ~33: 33 + 41 padded rows > 71
            joined = asyncio.create_task(stack.generate(prompt_token_ids=second, max_tokens=5))
    assert joined is not None
    joined_tokens, joined_responses = await joined
    assert tokens == expected[0]
    assert joined_tokens == expected[1][:5]
    for final in (responses[-1], joined_responses[-1]):
        assert final.speculation.plain_rounds == 0, final.speculation


async def test_target_waits_for_a_loading_draft_before_its_first_round(ckpts, monkeypatch) -> None:
    import draft_service.server as draft_server
    import target_service.server as target_server

    real_rounds = draft_server.DraftRounds

    def slow_load(config: Any) -> Any:
        time.sleep(1.0)  # a draft still loading its weights
        return real_rounds(config)

    monkeypatch.setattr(draft_server, "DraftRounds", slow_load)
    sockets = tempfile.mkdtemp(prefix="specpair-")
    address = f"unix:{sockets}/draft.sock"
    cfg = draft_config(ckpts["target"])
    loading = asyncio.create_task(
        draft_server.start(replace(cfg, server=replace(cfg.server, address=address)))
    )
    target = await target_server.start(target_config(ckpts["target"], draft_address=address))
    try:
        link = target.servicer.scheduler.draft
        while not loading.done():
            assert not link.connected, "connected to a draft that cannot draft yet"
            await asyncio.sleep(0.02)
        draft = await loading
        await eventually(lambda: link.connected)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{target.port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            responses = [
                r
                async for r in stub.Generate(
                    target_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=20)
                )
            ]
        assert responses[-1].speculation.plain_rounds == 0
        assert link.links[0].epoch == 1  # no stream was lost on the way
        await draft.stop(grace=0)
    finally:
        await target.stop()
        shutil.rmtree(sockets, ignore_errors=True)


async def test_mutual_tls_between_the_services_and_for_clients(ckpts, tmp_path) -> None:
    import draft_service.server as draft_server
    import target_service.server as target_server
    from specpair.config import TLSConfig
    from tests.service.conftest import self_signed

    cert, key = self_signed(tmp_path)
    tls = TLSConfig(cert=cert, key=key, ca=cert)  # self-signed: its own CA
    d_cfg = draft_config(ckpts["target"])
    draft = await draft_server.start(replace(d_cfg, server=replace(d_cfg.server, tls=tls)))
    t_cfg = target_config(ckpts["target"], draft_address=f"127.0.0.1:{draft.port}")
    target = await target_server.start(replace(t_cfg, server=replace(t_cfg.server, tls=tls)))
    try:
        link = target.servicer.scheduler.draft
        await eventually(lambda: link.connected)  # the target presented its certificate
        foreign_cert, foreign_key = self_signed(tmp_path, "foreign")
        clients = {
            "ours": grpc.ssl_channel_credentials(
                cert.read_bytes(), key.read_bytes(), cert.read_bytes()
            ),
            "no certificate": grpc.ssl_channel_credentials(cert.read_bytes()),
            "foreign": grpc.ssl_channel_credentials(
                cert.read_bytes(), foreign_key.read_bytes(), foreign_cert.read_bytes()
            ),
        }
        for name, creds in clients.items():
            for port in (target.port, draft.port):
                async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                    health = health_pb2_grpc.HealthStub(channel)
                    request = health_pb2.HealthCheckRequest()
                    if name == "ours":
                        await health.Check(request, timeout=5)
                        continue
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await health.Check(request, timeout=2)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, port)
        async with grpc.aio.secure_channel(f"127.0.0.1:{target.port}", clients["ours"]) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            request = target_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=12)
            responses = [r async for r in stub.Generate(request)]
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == reference_greedy(ckpts["target"], [PROMPT], 12)[0]
        assert responses[-1].speculation.plain_rounds == 0  # drafted over the mTLS link
    finally:
        await target.stop()
        await draft.stop()


async def test_metrics_count_tokens_answer_only_their_path_and_each_service_its_own(
    ckpts, make_stack
) -> None:
    import urllib.error
    import urllib.request

    def get(url: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, ""

    d_cfg, t_cfg = draft_config(ckpts["target"]), target_config(ckpts["target"])
    d_metrics, t_metrics = free_address(), free_address()
    stack = await make_stack(
        replace(d_cfg, server=replace(d_cfg.server, metrics_address=d_metrics)),
        replace(t_cfg, server=replace(t_cfg.server, metrics_address=t_metrics)),
    )
    tokens, responses = await stack.generate(prompt_token_ids=PROMPT, max_tokens=20)
    assert len(tokens) == 20 and len(responses) < 20  # several tokens a message
    status, target_body = await asyncio.to_thread(get, f"http://{t_metrics}/metrics")
    assert status == 200
    assert "specpair_target_inter_token_latency_seconds_count 19.0" in target_body
    assert "specpair_target_time_to_first_token_seconds_count 1.0" in target_body
    status, draft_body = await asyncio.to_thread(get, f"http://{d_metrics}/metrics")
    assert status == 200 and 'specpair_draft_stage_seconds_count{stage="draft"}' in draft_body
    for absent in ("time_to_first_token", "inter_token_latency", "speculative_num_steps"):
        assert f"specpair_draft_{absent}" not in draft_body, absent
    for path in ("/", "/favicon.ico", "/metricsx", "/admin"):
        assert (await asyncio.to_thread(get, f"http://{t_metrics}{path}"))[0] == 404, path


async def test_demo_names_a_dead_draft_and_passes_the_ops_token(ckpts, make_stack, capsys) -> None:
    from controller.service.server import start as start_controller
    from specpair.cli.demo import run_demo
    from specpair.config import ControllerConfig, ServerConfig

    dead = "unix:/nonexistent/specpair-draft.sock"
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=dead))
    target = f"127.0.0.1:{stack.target.port}"
    controller = await start_controller(
        ControllerConfig(ServerConfig("127.0.0.1:0", ops_token="s3cret"), targets=(target,))
    )
    try:
        await asyncio.to_thread(
            run_demo, target, f"127.0.0.1:{controller.port}", max_tokens=4, token="s3cret"
        )
    finally:
        await controller.stop(grace=0.1)
    out = capsys.readouterr().out
    assert f"draft {dead} (" in out
    assert "rounds without drafts (the draft is " in out
    assert "controller unavailable" not in out and f"controller: {target} tier" in out


async def test_clients_reusing_a_request_id_keep_speculating(ckpts, make_stack) -> None:
    stack = await make_stack(draft_config(ckpts["target"]), target_config(ckpts["target"]))
    prompts = [PROMPT, [5, 6, 7]]
    outputs = await asyncio.gather(
        *(stack.generate(prompt_token_ids=p, max_tokens=30, request_id="same") for p in prompts)
    )
    assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], prompts, 30)
    for _, responses in outputs:
        assert responses[0].request_id == "same"
        assert responses[-1].speculation.plain_rounds == 0, responses[-1].speculation


async def test_garbage_to_an_ops_method_without_the_token_is_unauthenticated(
    ckpts, make_stack
) -> None:
    cfg = target_config(ckpts["target"], draft_address=None)
    stack = await make_stack(None, replace(cfg, server=replace(cfg.server, ops_token="s3cret")))
    path = "/specpair.v1.TargetService/ApplyTier"
    err = await _send_garbage(stack.channel, path, streaming=False)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as authorized:
        await stack.channel.unary_unary(path)(
            GARBAGE, metadata=(("authorization", "Bearer s3cret"),), timeout=10
        )
    assert authorized.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_no_free_slot_with_an_empty_batch_does_not_starve_the_loop(ckpts, make_stack) -> None:
    stack = await make_stack(None, target_config(ckpts["target"], draft_address=None))
    cache = stack.target.servicer.scheduler.worker.cache
    leaked = [cache.alloc() for _ in range(cache.free_slots)]  # as the NaN requests leaked them
    waiting = asyncio.create_task(stack.generate(prompt_token_ids=PROMPT, max_tokens=5))
    for _ in range(3):  # the loop still answers
        await asyncio.wait_for(
            stack.stub.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest()), 2
        )
    assert not waiting.done()
    for slot in leaked:
        cache.free(slot)
    tokens, _ = await asyncio.wait_for(stack.generate(prompt_token_ids=[1, 2], max_tokens=3), 10)
    assert len(tokens) == 3
    assert len((await asyncio.wait_for(waiting, 10))[0]) == 5


async def test_token_counters_request_latency_kv_use_and_the_throughput_line(
    ckpts, make_stack
) -> None:
    from structlog.testing import capture_logs

    config = target_config(ckpts["target"], draft_address=None, stats_log_interval_s=0.2)
    with capture_logs() as logs:
        stack = await make_stack(None, config)
        registry = stack.target.servicer.frontend.metrics.registry

        def sample(name: str) -> float:
            return registry.get_sample_value(f"specpair_target_{name}") or 0.0

        assert sample("kv_cache_usage") == 0.0
        running = asyncio.create_task(stack.generate(prompt_token_ids=PROMPT, max_tokens=400))
        await eventually(lambda: sample("generation_tokens_total") > 0)
        in_use = sample("kv_cache_usage")
        await asyncio.sleep(0.5)  # at least two lines' worth
        await running
        await stack.generate(prompt_token_ids=PROMPT[:3], max_tokens=7)
    assert 0.0 < in_use < 1.0 and sample("kv_cache_usage") == 0.0  # freed with the requests
    assert sample("prompt_tokens_total") == len(PROMPT) + 3
    assert sample("generation_tokens_total") == 400 + 7
    assert sample("request_latency_seconds_count") == 2
    assert sample("request_latency_seconds_sum") > 0
    lines = [e for e in logs if e["event"] == "throughput"]
    assert lines and any(e["generation_tokens_per_s"] > 0 for e in lines), lines
    assert {"prompt_tokens_per_s", "running", "queued", "kv_cache_usage"} <= set(lines[0])


async def test_demo_ends_with_tokens_per_s_with_and_without_speculation(
    ckpts, make_stack, capsys
) -> None:
    import re

    from controller.service.server import start as start_controller
    from specpair.cli.demo import run_demo
    from specpair.config import ControllerConfig, ServerConfig

    token = "s3cret"
    target_cfg = target_config(ckpts["target"], candidate_steps=(0, 1, 3, 7))
    target_cfg = replace(target_cfg, server=replace(target_cfg.server, ops_token=token))
    stack = await make_stack(draft_config(ckpts["draft"]), target_cfg)
    target = f"127.0.0.1:{stack.target.port}"
    controller = await start_controller(
        ControllerConfig(ServerConfig("127.0.0.1:0", ops_token=token), targets=(target,))
    )
    try:
        await eventually(lambda: controller.controller.snapshot()[0].connected, timeout=15)
        capsys.readouterr()
        await asyncio.to_thread(
            run_demo, target, f"127.0.0.1:{controller.port}", max_tokens=16, token=token
        )
        _, responses = await stack.generate(prompt_token_ids=PROMPT, max_tokens=2)
        tier_after = responses[-1].speculative_num_steps  # a switch lands at the next round
        commanded = controller.controller.snapshot()[0].active_steps
    finally:
        await controller.stop(grace=0.1)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("demo:")]
    last = printed[-1]  # the demo's own lines (the services log to the same stdout)
    pattern = (
        r"demo: \d+ tokens/s with speculation, \d+ without \(tier 0, the target alone\): "
        r"\d+\.\d\dx, the same text"
    )
    assert re.fullmatch(pattern, last), last
    assert tier_after == commanded > 0  # back at the controller's tier after the tier-0 run


class ErringDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers every round with a megabyte of `error`."""

    def __init__(self) -> None:
        self.rounds = 0

    async def Round(self, request_iterator: Any, context: Any) -> Any:
        async for req in request_iterator:
            self.rounds += bool(req.inputs)
            yield draft_pb2.RoundResponse(round_id=req.round_id, error="x" * 1_000_000)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return draft_pb2.DraftServiceGetServerInfoResponse(draft_kind="model")


async def test_a_huge_draft_error_is_cut_and_not_logged_every_round(ckpts, make_stack) -> None:
    """A draft answering a 1 MB error grew the target's log by 50 MB for one batch."""
    draft = ErringDraft()
    async with fake_draft(draft) as address:
        stack = await make_stack(None, target_config(ckpts["target"], draft_address=address))
        await stack.wait_draft_connected()
        with capture_logs() as logs:
            tokens, _ = await stack.generate(prompt_token_ids=PROMPT, max_tokens=20)
    assert len(tokens) == 20 and draft.rounds >= 10
    assert sum(len(str(event)) for event in logs) < 50_000
    refused = [e for e in logs if e["event"] == "draft refused the round"]
    assert len(refused) == 1 and len(refused[0]["error"]) <= 512  # then left out, counted


class HugeTreeDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers every request with a well-formed chain of 100 000 nodes."""

    def __init__(self) -> None:
        n = 100_000
        self.tree = draft_pb2.CandidateTree(token_ids=[5] * n, parents=range(-1, n - 1))
        self.trees = 0

    async def Round(self, request_iterator: Any, context: Any) -> Any:
        async for req in request_iterator:
            response = draft_pb2.RoundResponse(round_id=req.round_id)
            for item in req.inputs:
                tree = response.trees.add()
                tree.CopyFrom(self.tree)
                tree.request_id = item.request_id
            self.trees += len(req.inputs)
            yield response

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return draft_pb2.DraftServiceGetServerInfoResponse(draft_kind="model")


async def test_trees_larger_than_the_round_are_refused_before_they_are_read(
    ckpts, make_stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 000-node trees cost a batch 13.8 s instead of ~0.9: each was decoded, then refused."""
    decoded = 0
    decode = wire._tree_from_proto

    def counting(msg: Any) -> Any:
        nonlocal decoded
        decoded += 1
        return decode(msg)

    monkeypatch.setattr(wire, "_tree_from_proto", counting)
    draft = HugeTreeDraft()
    prompts = [PROMPT, [5, 6, 7], [3, 4]]
    async with fake_draft(draft) as address:
        stack = await make_stack(None, target_config(ckpts["target"], draft_address=address))
        await stack.wait_draft_connected()
        outputs = await asyncio.gather(
            *(stack.generate(prompt_token_ids=p, max_tokens=12) for p in prompts)
        )
    assert [t for t, _ in outputs] == reference_greedy(ckpts["target"], prompts, 12)
    assert draft.trees >= 12 and decoded == 0  # counted on the message, never decoded
    assert all(not r[-1].speculation.accept_lengths for _, r in outputs)
