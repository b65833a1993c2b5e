"""Property-based fuzzing of every request message of the three services.

Draft, target and controller run on one event loop in a background thread; Hypothesis sends
random and boundary messages from the test thread through synchronous stubs, each call under a
deadline. The invariant: every call answers with OK or a client-error code (never a hang, never
UNKNOWN/INTERNAL), the draft frees whatever a fuzzed stream held, and a greedy request running
beside the fuzzing all along still equals its target-only reference.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import draft_service.server as draft_server
import target_service.server as target_server
from controller.service.server import start as start_controller
from specpair.config import ControllerConfig, ServerConfig
from specpair.proto.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from target_service.request_path.validation import DEFAULT_MAX_TOKENS
from tests.service.conftest import draft_config, reference_greedy, target_config

MAX_LEN = 96  # a short context bounds the longest valid generation a fuzzed request asks for
CALL_TIMEOUT_S = 20.0  # a call still unanswered after this is a hang
# Codes a service may answer bad input with; UNKNOWN, INTERNAL or DEADLINE_EXCEEDED fail.
CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
GOOD_PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18]
GOOD_TOKENS = 24
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every CI run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@dataclass
class Services:
    loop: asyncio.AbstractEventLoop
    target_port: int
    draft_port: int
    controller_port: int
    draft: Any
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def channel(self, port: int) -> grpc.Channel:
        key = str(port)
        if key not in self.channels:
            self.channels[key] = grpc.insecure_channel(f"127.0.0.1:{port}")
        return self.channels[key]


@pytest.fixture(scope="module")
def services(ckpts: dict[str, Any]) -> Iterator[Services]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed-services", daemon=True)
    thread.start()

    async def up() -> tuple[Any, Any, Any]:
        draft = await draft_server.start(draft_config(ckpts["target"], max_len=MAX_LEN + 7))
        target = await target_server.start(
            target_config(ckpts["target"], draft_address=f"127.0.0.1:{draft.port}", max_len=MAX_LEN)
        )
        controller = await start_controller(
            ControllerConfig(
                ServerConfig("127.0.0.1:0"), targets=(f"127.0.0.1:{target.port}",), reconnect_s=0.1
            )
        )
        return draft, target, controller

    draft, target, controller = asyncio.run_coroutine_threadsafe(up(), loop).result(60)
    svc = Services(loop, target.port, draft.port, controller.port, draft)
    try:
        yield svc
    finally:
        for channel in svc.channels.values():
            channel.close()
        svc.run(controller.stop(grace=0.1))
        svc.run(target.stop(grace=0.1))
        svc.run(draft.stop(grace=0.1))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class GoodTraffic:
    """Greedy requests, one after another, beside the fuzzing; each must equal its reference."""

    def __init__(self, svc: Services, expected: list[int]) -> None:
        self.stub = target_pb2_grpc.TargetServiceStub(svc.channel(svc.target_port))
        self.expected = expected
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        request = target_pb2.GenerateRequest(prompt_token_ids=GOOD_PROMPT, max_tokens=GOOD_TOKENS)
        while not self._stop.is_set():
            try:
                tokens = [
                    t
                    for r in self.stub.Generate(request, timeout=CALL_TIMEOUT_S)
                    for t in r.token_ids
                ]
            except grpc.RpcError as err:
                self.failures.append(f"{err.code()}: {err.details()}")
                continue
            if tokens != self.expected:
                self.failures.append(f"output {tokens} != reference {self.expected}")
            self.done += 1

    def __enter__(self) -> GoodTraffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S + 5)
        assert not self.failures, self.failures[:3]
        assert self.done > 0


@pytest.fixture
def good_traffic(services: Services, ckpts: dict[str, Any]) -> Iterator[Callable[[], None]]:
    expected = reference_greedy(ckpts["target"], [GOOD_PROMPT], GOOD_TOKENS)[0]
    with GoodTraffic(services, expected):
        yield lambda: None


# ---- strategies: random values with the boundaries mixed in ------------------------------------

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
TEMPERATURES = st.one_of(st.sampled_from([0.0, -0.0, 1e-45, 1e-3, 0.7, 1.0, 100.0, 3e38]), FLOAT32)
VOCAB = 320  # the tiny models'
TOKENS = st.one_of(st.integers(0, VOCAB), INT32)


def token_lists(max_size: int) -> st.SearchStrategy[list[int]]:
    """Mostly valid ids (so the request gets past validation), sometimes anything."""
    valid = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size)
    return st.one_of(valid, valid, st.lists(TOKENS, max_size=max_size))


def _sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    top_k = st.one_of(st.integers(0, 400), st.integers(0, 400), INT32)
    msg = common_pb2.SamplingParams(temperature=draw(TEMPERATURES), top_k=draw(top_k))
    if draw(st.integers(0, 3)) == 0:
        msg.top_p = draw(st.one_of(st.sampled_from([0.0, 1e-30, 0.5, 1.0, 1.5]), FLOAT32))
    if draw(st.booleans()):
        msg.seed = draw(st.one_of(st.sampled_from([0, 2**63, 2**64 - 1]), UINT64))
    return msg


@st.composite
def generate_requests(draw: st.DrawFn) -> target_pb2.GenerateRequest:
    max_tokens = st.one_of(
        st.integers(1, 8), st.integers(-2, 10), st.sampled_from([MAX_LEN, 2**31 - 1])
    )
    msg = target_pb2.GenerateRequest(
        max_tokens=draw(max_tokens),
        stop_token_ids=draw(st.one_of(st.just([]), token_lists(2))),
        stop=draw(st.lists(st.text(max_size=4), max_size=2)),
        request_id=draw(st.sampled_from(["", "same"]) | st.text(max_size=12)),
    )
    kind = draw(st.sampled_from(["ids", "ids", "ids", "text", "text", "both", "none"]))
    if kind in ("ids", "both"):
        msg.prompt_token_ids.extend(draw(st.one_of(token_lists(20), token_lists(MAX_LEN + 4))))
    if kind in ("text", "both"):
        msg.prompt = draw(st.text(max_size=200))
    if draw(st.booleans()):
        msg.sampling.CopyFrom(_sampling(draw))
    return msg


@st.composite
def round_requests(draw: st.DrawFn) -> list[draft_pb2.RoundRequest]:
    rounds = []
    for _ in range(draw(st.integers(1, 3))):
        msg = draft_pb2.RoundRequest(
            round_id=draw(UINT64),
            speculative_num_steps=draw(st.one_of(st.sampled_from([0, 1, 3, 7, 8]), INT32)),
            released_request_ids=draw(st.lists(st.text(max_size=4), max_size=2)),
        )
        for _ in range(draw(st.integers(0, 4))):
            item = msg.inputs.add()
            item.request_id = draw(st.sampled_from(["a", "b", "c", ""]) | st.text(max_size=6))
            item.appended_token_ids.extend(
                draw(st.one_of(token_lists(8), token_lists(MAX_LEN + 10)))
            )
            if draw(st.booleans()):
                item.sampling.CopyFrom(_sampling(draw))
            if draw(st.booleans()):
                item.features.data = draw(st.binary(max_size=64))
                item.features.dtype = draw(st.integers(0, 5))  # 4, 5: unknown values
                item.features.shape.extend(draw(st.lists(st.integers(-4, 2**40), max_size=3)))
        if draw(st.booleans()):  # the inputs' feature bytes as one run (`read_round`)
            msg.feature_data = draw(st.binary(max_size=64))
        rounds.append(msg)
    return rounds


@st.composite
def policy_updates(draw: st.DrawFn) -> controller_pb2.UpdatePolicyRequest:
    msg = controller_pb2.UpdatePolicyRequest(
        candidate_steps=draw(st.lists(st.one_of(st.sampled_from([0, 1, 3, 7]), INT32), max_size=5))
    )
    doubles = st.floats(allow_nan=True, allow_infinity=True)
    for name, values in (
        ("ema_alpha", doubles),
        ("update_interval", INT32),
        ("warmup_batches", INT32),
        ("down_hysteresis", doubles),
        ("up_hysteresis", doubles),
    ):
        if draw(st.booleans()):
            setattr(msg, name, draw(values))
    return msg


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in CLIENT_ERRORS, (err.code(), err.details())
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


# ---- the properties ------------------------------------------------------------------------------


def _generate(temperature: float, seed: int | None = None) -> target_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=seed)
    return target_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=4, sampling=sampling)


def _rounds(n: int, **sampling: Any) -> list[draft_pb2.RoundRequest]:
    inputs = [
        draft_pb2.DraftInput(
            request_id=f"r{i}",
            appended_token_ids=[1, 2],
            sampling=common_pb2.SamplingParams(**sampling),
        )
        for i in range(n)
    ]
    return [draft_pb2.RoundRequest(round_id=1, speculative_num_steps=3, inputs=inputs)]


@FUZZ
@given(request=generate_requests())
# NaN and denormal temperatures and the largest seed once took a service down: always tried
@example(request=_generate(math.nan))
@example(request=_generate(1e-45))
@example(request=_generate(0.9, seed=2**64 - 1))
def test_generate_answers_every_request(
    services: Services, good_traffic: Any, request: target_pb2.GenerateRequest
) -> None:
    stub = target_pb2_grpc.TargetServiceStub(services.channel(services.target_port))
    responses: list[target_pb2.GenerateResponse] = []
    code = _code(lambda: responses.extend(stub.Generate(request, timeout=CALL_TIMEOUT_S)))
    if code == grpc.StatusCode.OK:
        tokens = [t for r in responses for t in r.token_ids]
        assert 0 < len(tokens) <= (request.max_tokens or DEFAULT_MAX_TOKENS)  # 0: unset
        assert all(0 <= t < 320 for t in tokens)
        assert responses[-1].finish_reason != target_pb2.FINISH_REASON_UNSPECIFIED


@FUZZ
@given(rounds=round_requests())
@example(rounds=_rounds(1, temperature=math.nan))
@example(rounds=_rounds(1, temperature=0.9, seed=2**64 - 1))
@example(rounds=_rounds(70))  # more requests than the draft has slots
def test_round_stream_answers_every_round_and_frees_it(
    services: Services, good_traffic: Any, rounds: list[draft_pb2.RoundRequest]
) -> None:
    stub = draft_pb2_grpc.DraftServiceStub(services.channel(services.draft_port))
    responses: list[draft_pb2.RoundResponse] = []
    code = _code(lambda: responses.extend(stub.Round(iter(rounds), timeout=CALL_TIMEOUT_S)))
    assert code == grpc.StatusCode.OK  # errors travel in RoundResponse.error
    assert [r.round_id for r in responses] == [r.round_id for r in rounds]
    streams = services.draft.servicer.open_streams
    # The stream's requests are freed once it ends; the target's own stream is untouched.
    for _ in range(200):
        if len(streams) == 1:
            break
        time.sleep(0.01)
    (target_stream,) = streams
    drafter = services.draft.servicer.rounds.drafter
    assert all(key.startswith(f"{target_stream}/") for key in list(drafter.requests))


@FUZZ
@given(
    update=policy_updates(),
    pin=st.one_of(st.sampled_from([0, 1, 3, 7]), INT32),
    tier=st.one_of(st.sampled_from([0, 1, 3, 7]), INT32),
)
def test_ops_rpcs_answer_every_request(
    services: Services,
    good_traffic: Any,
    update: controller_pb2.UpdatePolicyRequest,
    pin: int,
    tier: int,
) -> None:
    ctl = controller_pb2_grpc.ControllerServiceStub(services.channel(services.controller_port))
    target = target_pb2_grpc.TargetServiceStub(services.channel(services.target_port))
    t = CALL_TIMEOUT_S
    _code(lambda: ctl.UpdatePolicy(update, timeout=t))
    _code(lambda: ctl.PinTier(controller_pb2.PinTierRequest(speculative_num_steps=pin), timeout=t))
    _code(lambda: ctl.Unpin(controller_pb2.UnpinRequest(), timeout=t))
    req = target_pb2.ApplyTierRequest(speculative_num_steps=tier, reason="fuzz")
    _code(lambda: target.ApplyTier(req, timeout=t))
    state = ctl.GetState(controller_pb2.GetStateRequest(), timeout=t)
    assert len(state.policy.candidate_steps) >= 2
    info = target.GetServerInfo(target_pb2.TargetServiceGetServerInfoRequest(), timeout=t)
    assert info.speculative_num_steps in (1, 3, 7)


@FUZZ
@given(data=st.binary(max_size=64), pick=st.integers(0, 1000))
def test_raw_bytes_on_any_method_are_answered(
    services: Services, good_traffic: Any, data: bytes, pick: int
) -> None:
    methods = []
    for module, port in (
        (target_pb2, services.target_port),
        (draft_pb2, services.draft_port),
        (controller_pb2, services.controller_port),
    ):
        (service,) = module.DESCRIPTOR.services_by_name.values()
        methods += [(port, service, m) for m in service.methods]
    port, service, method = methods[pick % len(methods)]
    channel = services.channel(port)
    path = f"/{service.full_name}/{method.name}"
    if method.name == "WatchRounds":  # endless by design: only its first answer is awaited
        return
    if method.client_streaming:
        call = channel.stream_stream(path)
        _code(lambda: list(call(iter([data]), timeout=CALL_TIMEOUT_S)))
    elif method.server_streaming:
        _code(lambda: list(channel.unary_stream(path)(data, timeout=CALL_TIMEOUT_S)))
    else:
        _code(lambda: channel.unary_unary(path)(data, timeout=CALL_TIMEOUT_S))
