"""The asyncio SDK: the one implementation, which the blocking clients (`sync.py`) drive."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack

import grpc
from google.protobuf.message import Message

from specpair.client.requests import (
    Fold,
    GenerateParams,
    Messages,
    Prompt,
    build_chat_request,
    build_generate_request,
    build_pin,
    build_policy_update,
    to_delta,
)
from specpair.client.results import (
    ControllerState,
    GenerateDelta,
    GenerateResult,
    SpecpairError,
    message_to_dict,
    policy_from_pb,
    targets_from_pb,
)
from specpair.config import TLSConfig, env_address
from specpair.proto.v1 import controller_pb2, controller_pb2_grpc, target_pb2, target_pb2_grpc
from specpair.rpc.channels import auth_metadata, open_channel
from specpair.target_state import TargetState

# A TLSConfig, or the path of the CA that signed the server's certificate.
TLSArg = TLSConfig | str | os.PathLike[str] | None


API_KEY_ENV = "SPECPAIR_API_KEY"  # where a target client finds its API key when given none


class ConnectionOptions(TypedDict, total=False):
    token: str | None  # the ops bearer token (the controller's ops API, a target's ApplyTier)
    api_key: str | None  # a target's API key (its Generate); default: $SPECPAIR_API_KEY
    tls: TLSArg
    timeout: float | None  # seconds per call (a whole stream for Generate); None: no limit


def tls_config(tls: TLSArg) -> TLSConfig | None:
    if tls is None or isinstance(tls, TLSConfig):
        return tls
    return TLSConfig(ca=Path(tls))


class Connection:
    """A lazily opened channel, the call metadata and the per-call timeout."""

    service = ""  # whose SPECPAIR_<SERVICE>_ADDRESS (or default) an omitted address means

    def __init__(self, address: str | None = None, **options: Unpack[ConnectionOptions]) -> None:
        self.address = address or env_address(self.service)
        self.timeout = options.get("timeout")
        name, token = self._bearer(options)
        if token and not (token.isascii() and token.isprintable()):
            # gRPC would fail every call with a bare ExecuteBatchError instead.
            raise SpecpairError(
                "INVALID_ARGUMENT", f"{name}: a bearer token is printable ASCII (call metadata)"
            )
        self._metadata = auth_metadata(token)
        self._tls = tls_config(options.get("tls"))
        # Opened on first use: a grpc.aio channel belongs to the event loop it was created on.
        self._channel: grpc.aio.Channel | None = None

    def _bearer(self, options: ConnectionOptions) -> tuple[str, str | None]:
        """What goes in `authorization: Bearer …` (the ops token, where a service has one), and
        where it came from."""
        return "token", options.get("token")

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.address, self._tls)
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

    async def _unary(self, method: Any, request: Message) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None


class AsyncSpecpairClient(Connection):
    """asyncio client of a target service; use as `async with`. A target started with an API
    key wants it on Generate: `api_key=`, else $SPECPAIR_API_KEY."""

    service = "target"

    def _bearer(self, options: ConnectionOptions) -> tuple[str, str | None]:
        # The API key where there is one: a target's client calls ask for it, not the ops token.
        if key := options.get("api_key"):
            return "api_key", key
        if key := os.environ.get(API_KEY_ENV):
            return API_KEY_ENV, key
        return super()._bearer(options)

    def _stub(self) -> target_pb2_grpc.TargetServiceStub:
        return target_pb2_grpc.TargetServiceStub(self._open())

    async def generate(self, prompt: Prompt, **params: Unpack[GenerateParams]) -> GenerateResult:
        """Generate to completion. Raises SpecpairError on a failed RPC."""
        return await self._fold(build_generate_request(prompt, **params))

    async def stream(
        self, prompt: Prompt, **params: Unpack[GenerateParams]
    ) -> AsyncIterator[GenerateDelta]:
        """Deltas as rounds finish. Leaving the loop early cancels the request on the server."""
        request = build_generate_request(prompt, **params)
        async for response in self._responses(request):
            yield to_delta(response)

    async def chat(self, messages: Messages, **params: Unpack[GenerateParams]) -> GenerateResult:
        """The assistant's reply to `messages`, rendered by the server's chat template."""
        return await self._fold(build_chat_request(messages, **params))

    async def stream_chat(
        self, messages: Messages, **params: Unpack[GenerateParams]
    ) -> AsyncIterator[GenerateDelta]:
        """The reply's deltas as rounds finish. Leaving the loop early cancels the request."""
        request = build_chat_request(messages, **params)
        async for response in self._responses(request):
            yield to_delta(response)

    async def server_info(self) -> dict[str, Any]:
        """TargetService.GetServerInfo as a dict (SGLang's /server_info names)."""
        request = target_pb2.TargetServiceGetServerInfoRequest()
        return message_to_dict(await self._unary(self._stub().GetServerInfo, request))

    async def _fold(self, request: target_pb2.GenerateRequest) -> GenerateResult:
        fold = Fold()
        async for response in self._responses(request):
            fold.add(response)
        return fold.result()

    async def _responses(
        self, request: target_pb2.GenerateRequest
    ) -> AsyncIterator[target_pb2.GenerateResponse]:
        call = self._stub().Generate(request, metadata=self._metadata, timeout=self.timeout)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as e:
            raise SpecpairError.from_rpc(e) from None
        finally:
            # A consumer that stops early must free the request's KV on both services.
            call.cancel()


class AsyncControllerClient(Connection):
    """asyncio client of the controller's ops API (bearer token when the server has one)."""

    service = "controller"

    def _stub(self) -> controller_pb2_grpc.ControllerServiceStub:
        return controller_pb2_grpc.ControllerServiceStub(self._open())

    async def state(self) -> ControllerState:
        """The live policy and, per target, the active tier, EMA, pin and recent switches."""
        reply = await self._unary(self._stub().GetState, controller_pb2.GetStateRequest())
        return ControllerState(policy_from_pb(reply.policy), targets_from_pb(reply.targets))

    async def update_policy(self, **changes: Any) -> dict[str, Any]:
        """Changes some policy keys; returns the whole policy as the controller validated it."""
        reply = await self._unary(self._stub().UpdatePolicy, build_policy_update(**changes))
        return policy_from_pb(reply.policy)

    async def pin(self, tier: int | str) -> tuple[TargetState, ...]:
        """Pins every target to `tier`, a chain's steps (7, "7") or a tree shape ("4x4x16"):
        the policy keeps learning but is not applied. ValueError on a tier that is none."""
        request = build_pin(tier)
        return targets_from_pb((await self._unary(self._stub().PinTier, request)).targets)

    async def unpin(self) -> tuple[TargetState, ...]:
        """Hands the tier back to the policy."""
        reply = await self._unary(self._stub().Unpin, controller_pb2.UnpinRequest())
        return targets_from_pb(reply.targets)
