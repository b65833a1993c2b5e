"""The target's OpenAI-compatible HTTP door: Starlette routes served by uvicorn on the
service's own event loop, each request run through the same `Frontend.generate` as gRPC.

    GET  /health                  200 once the model is loaded, 503 before and once it fails
    GET  /v1/models               the one model served
    POST /v1/completions          prompt (text or token ids) → text; stream: server-sent events
    POST /v1/chat/completions     messages → the assistant's reply (the chat template)

What any client may do is bounded before the request path sees it (`http_guards.py`); bodies
become requests in `openai_request.py`, responses OpenAI's objects in `openai_response.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specpair.config import split_address
from specpair.logging import get_logger
from specpair.proto.v1 import target_pb2
from target_service.batching.scheduler import QueueFullError
from target_service.http_door.http_guards import (
    BodyError,
    Gate,
    TimedProtocol,
    body_limit,
    error_response,
    parse_json,
    read_body,
)
from target_service.http_door.openai_request import ApiRequest, error_param, parse_request
from target_service.http_door.openai_response import ResponseWriter
from target_service.request_path.frontend import Frontend, NotReadyError, RoundFailedError
from target_service.request_path.validation import InvalidRequestError

log = get_logger(__name__)
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_unless_gone(
    request: Request, responses: AsyncGenerator[target_pb2.GenerateResponse, None]
) -> target_pb2.GenerateResponse | None:
    """The first response, or None when the client disconnects before it (queued, or in its
    prefill): cancelling the wait closes `responses`, which cancels the request, as gRPC's
    cancellation does."""
    first = asyncio.ensure_future(anext(responses))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
    return first.result() if not first.cancelled() else None


def _sse(event: dict[str, Any] | str) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


async def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 and the like as OpenAI's error object, not Starlette's plain text."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(exc.status_code, message, kind=kind, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("HTTP request failed", path=request.url.path, error=repr(exc)[:200])
    return error_response(500, "internal error; see the server's log", kind="internal_error")


class OpenAIApp:
    """The routes; `model` is the id /v1/models lists and responses echo. `loopback`: the
    server listens on loopback only, so a request must name it so (`Gate`)."""

    def __init__(
        self,
        frontend: Frontend,
        model: str,
        *,
        api_key: str | None = None,
        loopback: bool = True,
        read_timeout_s: float = 10.0,
    ) -> None:
        self.frontend = frontend
        self.model = model
        self.created = int(time.time())
        self.read_timeout_s = read_timeout_s
        self.max_body = body_limit(frontend.config.max_len)
        starlette = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        )
        self.app = Gate(starlette, loopback=loopback, api_key=api_key)

    async def health(self, request: Request) -> Response:
        if self.frontend.failure is not None:
            return JSONResponse({"status": "down", "error": self.frontend.failure}, status_code=503)
        if self.frontend.scheduler is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "specpair",
            "max_model_len": self.frontend.config.max_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return error_response(
                415,
                f"Content-Type: expected application/json, got {media_type!r}",
                kind="invalid_request_error",
                param="Content-Type",
            )
        try:
            raw = await read_body(request, self.max_body, self.read_timeout_s)
        except ClientDisconnect:  # gone before its body arrived: nothing was submitted
            return Response(status_code=CLIENT_CLOSED)
        except BodyError as exc:  # the connection is closed after: its state is unknown
            return error_response(
                exc.status,
                str(exc),
                kind="invalid_request_error",
                param="body",
                headers={"Connection": "close"},
            )
        api: ApiRequest | None = None
        try:
            body = await parse_json(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return error_response(
                400, f"body: not valid JSON ({exc})", kind="invalid_request_error", param="body"
            )
        try:
            api = parse_request(body, chat=chat, max_len=self.frontend.config.max_len)
            responses = self.frontend.generate(api.generate)
            # Validation and admission run up to the first response: their errors must become
            # a status code before any 200 (and its stream) goes out.
            first = await _first_unless_gone(request, responses)
            if first is None:  # the client left while its request queued: it never runs
                return Response(status_code=CLIENT_CLOSED)
        except InvalidRequestError as exc:
            param, message = error_param(str(exc), api)
            return error_response(400, message, kind="invalid_request_error", param=param)
        except NotReadyError as exc:
            return error_response(503, str(exc), kind="unavailable")
        except QueueFullError as exc:
            return error_response(429, str(exc), kind="rate_limit_exceeded")
        except RoundFailedError as exc:
            return error_response(500, str(exc), kind="internal_error")
        writer = ResponseWriter(api, self.model)
        if api.stream:
            return StreamingResponse(
                self._events(writer, first, responses),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        collect = asyncio.ensure_future(self._collect(first, responses))
        gone = asyncio.ensure_future(_until_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():  # the client went away: closing the stream cancels the request
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=CLIENT_CLOSED)
        try:
            return JSONResponse(writer.completion(collect.result()))
        except RoundFailedError as exc:
            return error_response(500, str(exc), kind="internal_error")

    @staticmethod
    async def _collect(
        first: target_pb2.GenerateResponse,
        responses: AsyncGenerator[target_pb2.GenerateResponse, None],
    ) -> list[target_pb2.GenerateResponse]:
        async with contextlib.aclosing(responses):
            return [first] + [r async for r in responses]

    @staticmethod
    async def _events(
        writer: ResponseWriter,
        first: target_pb2.GenerateResponse,
        responses: AsyncGenerator[target_pb2.GenerateResponse, None],
    ) -> AsyncIterator[str]:
        """Server-sent events; a client that disconnects cancels this (Starlette), and
        closing `responses` cancels the request at the next round boundary."""
        async with contextlib.aclosing(responses):
            for chunk in writer.chunks(first, first=True):
                yield _sse(chunk)
            try:
                async for response in responses:
                    for chunk in writer.chunks(response, first=False):
                        yield _sse(chunk)
            except RoundFailedError as exc:  # the 200 is out: the error travels as an event
                yield _sse({"error": {"message": str(exc), "type": "internal_error"}})
        yield _sse("[DONE]")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The service's process owns its signals (SIGTERM stops gRPC and HTTP together).
        yield


class HttpServer:
    """uvicorn on an already bound socket, as a task on the running event loop."""

    def __init__(self, app: OpenAIApp, address: str) -> None:
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise OSError(exc.errno, f"HTTP API address {address}: {exc.strerror}") from None
        self.port = int(self.socket.getsockname()[1])  # the real one for port 0
        protocol = type("Protocol", (TimedProtocol,), {"read_timeout_s": app.read_timeout_s})
        config = uvicorn.Config(
            app.app,
            http=protocol,
            lifespan="off",
            log_config=None,  # keep the process's logging (structlog) as it is
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = _Server(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve([self.socket]), name="http")
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.socket.close()
