"""The specpair SDK: generate from a target service, and drive the controller's ops API.

    with SpecpairClient() as client:              # 127.0.0.1:50051 or $SPECPAIR_TARGET_ADDRESS
        result = client.generate("Once upon a time", max_tokens=32)
        print(result.text, result.avg_accept_length)
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)  # chat template

    async with AsyncSpecpairClient("host:50051", token=..., tls="ca.pem") as client:
        async for delta in client.stream([1, 2, 3], max_tokens=32, temperature=0.8, seed=0):
            print(delta.text, end="")

Importing this module must not import torch: it is all a client needs on its machine.
The sync and async clients share every request builder and the response fold; they differ only
in how they wait on the channel.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from specpair.config import TLSConfig, env_address
from specpair.proto.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specpair.serving import CHANNEL_OPTIONS, auth_metadata, channel_credentials

__all__ = [
    "AsyncControllerClient",
    "AsyncSpecpairClient",
    "ControllerClient",
    "GenerateDelta",
    "GenerateParams",
    "GenerateResult",
    "SpecpairClient",
    "SpecpairError",
]

Prompt = str | Sequence[int]
# [{"role": "system", "content": "…"}, {"role": "user", "content": "…"}, …]
Messages = Sequence[Mapping[str, str]]
TLSArg = TLSConfig | str | os.PathLike[str] | None

_FINISH_REASONS = {
    target_pb2.FINISH_REASON_LENGTH: "length",
    target_pb2.FINISH_REASON_STOP: "stop",
}


class SpecpairError(RuntimeError):
    """A failed RPC: `code` is the gRPC status name (e.g. "INVALID_ARGUMENT"), `details` the
    server's message, which names the offending field."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    @staticmethod
    def from_rpc(error: grpc.RpcError) -> SpecpairError:
        # Both grpc.Call (sync) and grpc.aio.AioRpcError carry code() and details().
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else None
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        return SpecpairError(name, details or str(error))


@dataclass(frozen=True, slots=True)
class GenerateDelta:
    """One streamed message: the tokens a round produced. The last delta has `finish_reason`
    set (and may carry no tokens)."""

    token_ids: tuple[int, ...]
    text: str
    accept_length: int  # accepted drafts of the round; -1 for a round decoded without drafts
    speculative_num_steps: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished generation, folded from its stream."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "length" | "stop"
    accept_lengths: tuple[int, ...]  # per speculative round, bonus token excluded
    prompt_tokens: int
    completion_tokens: int
    avg_accept_length: float
    rounds: int
    plain_rounds: int
    request_id: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists."""
        out = asdict(self)
        out["token_ids"] = list(self.token_ids)
        out["accept_lengths"] = list(self.accept_lengths)
        return out


# ---- request building and response folding (shared by the sync and async clients) ----------


def build_generate_request(
    prompt: Prompt,
    *,
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    request_id: str | None = None,
) -> target_pb2.GenerateRequest:
    """The wire request. Values are checked by the server, which names the bad field; here we
    only reject what cannot be encoded at all."""
    request = target_pb2.GenerateRequest(
        max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
        stop=list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()),
        request_id=request_id or "",
    )
    if seed is not None:
        request.sampling.seed = seed
    # A str is itself a Sequence, so it must be tested first.
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        try:
            # operator.index takes numpy ints too, and refuses floats and strings.
            request.prompt_token_ids.extend([operator.index(t) for t in prompt])
        except TypeError:
            raise TypeError("prompt must be a str or a sequence of int token ids") from None
    return request


class GenerateParams(TypedDict, total=False):
    """The keyword arguments of `chat` and `stream_chat`, as `generate` takes them."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    request_id: str | None


def build_chat_request(
    messages: Messages, *, max_tokens: int, **params: Unpack[GenerateParams]
) -> target_pb2.GenerateRequest:
    """A GenerateRequest with `messages` (no prompt): the server applies its chat template."""
    request = build_generate_request((), max_tokens=max_tokens, **params)
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"messages[{i}] must map 'role' and 'content' to strings")
        request.messages.add(role=role, content=content)
    return request


def to_delta(response: target_pb2.GenerateResponse) -> GenerateDelta:
    return GenerateDelta(
        token_ids=tuple(response.token_ids),
        text=response.text,
        accept_length=response.accept_length,
        speculative_num_steps=response.speculative_num_steps,
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
    )


@dataclass(slots=True)
class _Fold:
    """Accumulates a Generate stream into a GenerateResult."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Per-round accept lengths seen on the stream: the fallback if no stats arrive.
    round_accepts: list[int] = field(default_factory=list)
    plain_rounds: int = 0
    request_id: str = ""
    last: target_pb2.GenerateResponse | None = None

    def add(self, response: target_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        if response.token_ids:
            if response.accept_length >= 0:
                self.round_accepts.append(response.accept_length)
            else:
                self.plain_rounds += 1
        self.request_id = response.request_id or self.request_id
        self.last = response

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or last.finish_reason not in _FINISH_REASONS:
            raise SpecpairError("INTERNAL", "Generate stream ended without a finish_reason")
        # The server's final stats are authoritative (they count rounds that produced no new
        # tokens for this request); the per-round values are only a fallback.
        if last.HasField("speculation"):
            spec = last.speculation
            accepts = tuple(spec.accept_lengths)
            rounds, plain, avg = spec.rounds, spec.plain_rounds, spec.avg_accept_length
        else:
            accepts = tuple(self.round_accepts)
            rounds = len(accepts) + self.plain_rounds
            plain = self.plain_rounds
            avg = sum(accepts) / len(accepts) if accepts else 0.0
        usage = last.usage if last.HasField("usage") else None
        return GenerateResult(
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=_FINISH_REASONS[last.finish_reason],
            accept_lengths=accepts,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else len(self.token_ids),
            avg_accept_length=avg,
            rounds=rounds,
            plain_rounds=plain,
            request_id=self.request_id,
        )


def message_to_dict(message: Message) -> dict[str, Any]:
    """Every field by its proto name, defaults included; 64-bit ints stay ints and enums become
    their names (json_format would quote uint64s as strings)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.is_repeated:
            out[fd.name] = [_field_value(fd, v) for v in value]
        elif fd.has_presence and fd.type != FieldDescriptor.TYPE_MESSAGE:
            out[fd.name] = _field_value(fd, value) if message.HasField(fd.name) else None
        else:
            out[fd.name] = _field_value(fd, value)
    return out


def _field_value(fd: Any, value: Any) -> Any:  # fd: a FieldDescriptor (python or upb)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        enum_value = fd.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    return value


# UpdatePolicyRequest fields and how a value (possibly a CLI string) is coerced to each.
_POLICY_FIELDS: dict[str, type] = {
    "ema_alpha": float,
    "update_interval": int,
    "warmup_batches": int,
    "down_hysteresis": float,
    "up_hysteresis": float,
}
# Keys beyond SGLang's, sent as UpdatePolicyRequest.options_json; None: any JSON value (a
# string is parsed as JSON, `bands='[{"min_batch_size": 16, "candidate_steps": [0, 1]}]'`).
_POLICY_OPTIONS: dict[str, type | None] = {
    "min_gain": float,
    "probe_interval": int,
    "probe_rounds": int,
    "profile_ms": None,
    "bands": None,
}


def build_policy_update(**changes: Any) -> controller_pb2.UpdatePolicyRequest:
    """A partial UpdatePolicyRequest. Values may be strings (`ctl policy ema_alpha=0.3`);
    `candidate_steps` may be "1,3,7" or a sequence. Ranges are checked by the controller."""
    if not changes:
        raise ValueError("a policy update needs at least one KEY=VALUE")
    request = controller_pb2.UpdatePolicyRequest()
    options: dict[str, Any] = {}
    for key, value in changes.items():
        if key == "candidate_steps":
            items = value.split(",") if isinstance(value, str) else value
            request.candidate_steps.extend([_coerce(key, int, item) for item in items])
        elif key == "kind":
            request.kind = _coerce(key, str, value)
        elif key in _POLICY_FIELDS:
            setattr(request, key, _coerce(key, _POLICY_FIELDS[key], value))
        elif key in _POLICY_OPTIONS:
            kind = _POLICY_OPTIONS[key]
            options[key] = _coerce(key, kind, value) if kind else _json_value(key, value)
        else:
            known = ", ".join(["candidate_steps", "kind", *_POLICY_FIELDS, *_POLICY_OPTIONS])
            raise ValueError(f"unknown policy key {key!r} (known: {known})")
    if options:
        request.options_json = json.dumps(options)
    return request


def _json_value(key: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: expected JSON, got {value!r} ({exc})") from None


def _coerce(key: str, kind: type, value: Any) -> Any:
    # bool is an int subclass: `update_interval=True` is a mistake, not 1; and int(2.5) == 2
    # would apply a value nobody asked for, so an int field takes only integers.
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}") from None


def _tls_config(tls: TLSArg) -> TLSConfig | None:
    if tls is None or isinstance(tls, TLSConfig):
        return tls
    return TLSConfig(ca=Path(tls))


# ---- sync clients ----------------------------------------------------------------------------


class _SyncBase:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout  # seconds per call (a whole stream for Generate); None: no limit
        self._metadata = auth_metadata(token)
        creds = channel_credentials(_tls_config(tls))
        self._channel = (
            grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            if creds is None
            else grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _unary(self, method: Any, request: Message) -> dict[str, Any]:
        try:
            response = method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None
        return message_to_dict(response)


class SpecpairClient(_SyncBase):
    """Blocking client of a target service."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(address or env_address("target"), token=token, tls=tls, timeout=timeout)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> GenerateResult:
        """Generate to completion. Raises SpecpairError on a failed RPC."""
        request = build_generate_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        fold = _Fold()
        for response in self._responses(request):
            fold.add(response)
        return fold.result()

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> Iterator[GenerateDelta]:
        """Deltas as rounds finish. Leaving the loop early cancels the request on the server."""
        request = build_generate_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        for response in self._responses(request):
            yield to_delta(response)

    def chat(
        self, messages: Messages, *, max_tokens: int, **params: Unpack[GenerateParams]
    ) -> GenerateResult:
        """The assistant's reply to `messages`, rendered by the server's chat template."""
        request = build_chat_request(messages, max_tokens=max_tokens, **params)
        fold = _Fold()
        for response in self._responses(request):
            fold.add(response)
        return fold.result()

    def stream_chat(
        self, messages: Messages, *, max_tokens: int, **params: Unpack[GenerateParams]
    ) -> Iterator[GenerateDelta]:
        """The reply's deltas as rounds finish. Leaving the loop early cancels the request."""
        request = build_chat_request(messages, max_tokens=max_tokens, **params)
        for response in self._responses(request):
            yield to_delta(response)

    def server_info(self) -> dict[str, Any]:
        """TargetService.GetServerInfo as a dict (SGLang's /server_info names)."""
        return self._unary(self._stub.GetServerInfo, target_pb2.TargetServiceGetServerInfoRequest())

    def _responses(self, request: target_pb2.GenerateRequest) -> Iterator[Any]:
        call = self._stub.Generate(request, metadata=self._metadata, timeout=self.timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None
        finally:
            # A consumer that stops early must free the request's KV on both services.
            call.cancel()


class ControllerClient(_SyncBase):
    """Blocking client of the controller's ops API (bearer token when the server has one)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(
            address or env_address("controller"), token=token, tls=tls, timeout=timeout
        )
        self._stub = controller_pb2_grpc.ControllerServiceStub(self._channel)

    def state(self) -> dict[str, Any]:
        """Policy config and, per target, the active tier, EMA, pin and recent switches."""
        return self._unary(self._stub.GetState, controller_pb2.GetStateRequest())

    def update_policy(self, **changes: Any) -> dict[str, Any]:
        """Change some policy keys; returns {"policy": {...}} as validated by the controller."""
        return self._unary(self._stub.UpdatePolicy, build_policy_update(**changes))

    def pin(self, steps: int) -> dict[str, Any]:
        return self._unary(
            self._stub.PinTier, controller_pb2.PinTierRequest(speculative_num_steps=steps)
        )

    def unpin(self) -> dict[str, Any]:
        return self._unary(self._stub.Unpin, controller_pb2.UnpinRequest())


# ---- async clients ---------------------------------------------------------------------------


class _AsyncBase:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(token)
        self._creds = channel_credentials(_tls_config(tls))
        # Opened on first use: a grpc.aio channel belongs to the event loop it was created on.
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = (
                grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
                if self._creds is None
                else grpc.aio.secure_channel(self.address, self._creds, options=CHANNEL_OPTIONS)
            )
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> Self:
        self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Message) -> dict[str, Any]:
        try:
            response = await method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None
        return message_to_dict(response)


class AsyncSpecpairClient(_AsyncBase):
    """asyncio client of a target service; use as `async with`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(address or env_address("target"), token=token, tls=tls, timeout=timeout)

    def _stub(self) -> target_pb2_grpc.TargetServiceStub:
        return target_pb2_grpc.TargetServiceStub(self._open())

    async def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> GenerateResult:
        """Generate to completion. Raises SpecpairError on a failed RPC."""
        request = build_generate_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        fold = _Fold()
        async for response in self._responses(request):
            fold.add(response)
        return fold.result()

    async def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[GenerateDelta, None]:
        """Deltas as rounds finish. Leaving the loop early cancels the request on the server."""
        request = build_generate_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            request_id=request_id,
        )
        async for response in self._responses(request):
            yield to_delta(response)

    async def chat(
        self, messages: Messages, *, max_tokens: int, **params: Unpack[GenerateParams]
    ) -> GenerateResult:
        """The assistant's reply to `messages`, rendered by the server's chat template."""
        request = build_chat_request(messages, max_tokens=max_tokens, **params)
        fold = _Fold()
        async for response in self._responses(request):
            fold.add(response)
        return fold.result()

    async def stream_chat(
        self, messages: Messages, *, max_tokens: int, **params: Unpack[GenerateParams]
    ) -> AsyncGenerator[GenerateDelta, None]:
        """The reply's deltas as rounds finish. Leaving the loop early cancels the request."""
        request = build_chat_request(messages, max_tokens=max_tokens, **params)
        async for response in self._responses(request):
            yield to_delta(response)

    async def server_info(self) -> dict[str, Any]:
        """TargetService.GetServerInfo as a dict (SGLang's /server_info names)."""
        return await self._unary(
            self._stub().GetServerInfo, target_pb2.TargetServiceGetServerInfoRequest()
        )

    async def _responses(self, request: target_pb2.GenerateRequest) -> AsyncIterator[Any]:
        call = self._stub().Generate(request, metadata=self._metadata, timeout=self.timeout)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None
        finally:
            # A consumer that stops early must free the request's KV on both services.
            call.cancel()


class AsyncControllerClient(_AsyncBase):
    """asyncio client of the controller's ops API; use as `async with`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls: TLSArg = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(
            address or env_address("controller"), token=token, tls=tls, timeout=timeout
        )

    def _stub(self) -> controller_pb2_grpc.ControllerServiceStub:
        return controller_pb2_grpc.ControllerServiceStub(self._open())

    async def state(self) -> dict[str, Any]:
        """Policy config and, per target, the active tier, EMA, pin and recent switches."""
        return await self._unary(self._stub().GetState, controller_pb2.GetStateRequest())

    async def update_policy(self, **changes: Any) -> dict[str, Any]:
        """Change some policy keys; returns {"policy": {...}} as validated by the controller."""
        return await self._unary(self._stub().UpdatePolicy, build_policy_update(**changes))

    async def pin(self, steps: int) -> dict[str, Any]:
        return await self._unary(
            self._stub().PinTier, controller_pb2.PinTierRequest(speculative_num_steps=steps)
        )

    async def unpin(self) -> dict[str, Any]:
        return await self._unary(self._stub().Unpin, controller_pb2.UnpinRequest())
