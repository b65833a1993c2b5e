"""Server interceptors every service installs: malformed requests, and bearer tokens (the ops
token on the ops methods; the target's API key on its client methods)."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc


class _Malformed:
    """What a request deserializer yields for bytes that are not the method's message."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the method's request message answer INVALID_ARGUMENT.

    Without it gRPC reports a failing deserializer as UNKNOWN, which clients (and retry
    policies) cannot tell from a server bug.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _checked(handler, details.method)


def _checked(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:
            return _Malformed(exc)

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {method} request message"
        )

    async def requests(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async for message in iterator:
            if isinstance(message, _Malformed):
                await refuse(context)
            yield message

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await refuse(context)
        return await handler.unary_unary(request, context)

    # The wrapped handler is closed with its wrapper, so its `finally` (freeing a request's
    # slots) runs when the call ends, not whenever the garbage collector gets to it.
    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await refuse(context)
        async with contextlib.aclosing(handler.unary_stream(request, context)) as responses:
            async for response in responses:
                yield response

    async def stream_unary(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        return await handler.stream_unary(requests(iterator, context), context)

    async def stream_stream(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        call = handler.stream_stream(requests(iterator, context), context)
        async with contextlib.aclosing(call) as responses:
            async for response in responses:
                yield response

    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, ser)
    return grpc.unary_unary_rpc_method_handler(unary, deserialize, ser)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to `protected` methods without `authorization: Bearer <token>`; `what`
    names the token in the refusal ("ops bearer token", "API key")."""

    def __init__(
        self, token: str, protected: Iterable[str], what: str = "ops bearer token"
    ) -> None:
        self.expected = f"Bearer {token}".encode()
        self.protected = frozenset(protected)
        self.what = what

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method not in self.protected:
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self.expected):  # in a time that does not tell how close
            return handler
        return _deny(handler, f"missing or wrong {self.what} (authorization: Bearer …)")


def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, des, ser)
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)
