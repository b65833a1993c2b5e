"""What any client of the HTTP door may do, bounded before the request path sees it: the Host
(bound to loopback, only loopback names: a web page that rebinds its DNS name to 127.0.0.1 is
refused), the API key (`Authorization: Bearer KEY` on /v1/, when one is set), the time to send
the headers (the connection is closed) and the body (408), the body's size (413), the nesting
of its JSON (400). Refusals are OpenAI's error object (`error_response`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Mapping
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specpair.logging import bounded
from target_service.request_path.validation import request_bytes_limit

# Bodies above this are parsed on a worker thread: json.loads grows with the body (milliseconds
# by 1 MB) and would hold every other request on the loop meanwhile.
PARSE_INLINE_BYTES = 64 * 1024
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def body_limit(max_len: int) -> int:
    """The largest body read: 8 × what a gRPC request may be (JSON escapes a character in up
    to 6 bytes), at least 1 MiB. 1024 tokens of context: 1 MiB."""
    return max(1024 * 1024, 8 * request_bytes_limit(max_len))


def error_response(
    status: int,
    message: str,
    *,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error object: the `openai` client raises it as e.g. BadRequestError. The
    message is cut as gRPC's details are (`specpair.logging.bounded`)."""
    error = {"message": bounded(message), "type": kind, "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


class BodyError(Exception):
    """A body refused before it is parsed: `status` is 408 (too slow) or 413 (too large)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # Python's json would accept NaN


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, all of it within `timeout_s` (408 otherwise: a slow sender holds a
    connection and its buffers). Past `limit` it is read on and dropped, within the same
    time, before the 413: a server that answers and closes while the client still sends
    resets the connection, and the client sees that instead of the 413. A client that waits
    for `100 Continue` before sending (curl, for large bodies) gets the 413 at once instead."""
    declared = request.headers.get("content-length", "")
    if (
        declared.isdigit()
        and int(declared) > limit
        and "100-continue" in request.headers.get("expect", "").lower()
    ):
        raise BodyError(413, f"body: larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                else:
                    chunks.clear()
    except TimeoutError:
        raise BodyError(408, f"body: not received within {timeout_s:g} s") from None
    if size > limit:
        raise BodyError(413, f"body: larger than {limit} bytes")
    return b"".join(chunks)


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:  # nesting deeper than the interpreter's recursion limit
        raise ValueError("nested too deeply") from None


async def parse_json(raw: bytes) -> Any:
    """The body's JSON (ValueError if it is none), parsed off the loop past
    `PARSE_INLINE_BYTES`."""
    if len(raw) > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(_loads, raw)
    return _loads(raw)


def host_name(header: str) -> str:
    """The name in a Host header: "[::1]:8000" → "::1", "Localhost:8000" → "localhost"."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0].lower() if ":" in header else header.lower()


class Gate:
    """Checks what every request must pass before routing: the Host header (bound to loopback,
    a loopback name or none) and, on /v1/, the API key."""

    def __init__(self, app: ASGIApp, *, loopback: bool, api_key: str | None) -> None:
        self.app = app
        self.loopback = loopback
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        refusal = None
        if self.loopback and host and host_name(host) not in LOOPBACK_NAMES:
            refusal = error_response(
                421,
                f"Host: {host!r} is not a name of this server (it listens on loopback)",
                kind="invalid_request_error",
                param="Host",
            )
        elif self.expected is not None and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = error_response(
                    401,
                    "missing or wrong API key (send Authorization: Bearer KEY)",
                    kind="invalid_request_error",
                    code="invalid_api_key",
                )
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)


class TimedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request line and headers take
    longer than `read_timeout_s` (uvicorn times out only idle kept-alive connections, so a
    client sending a byte a second held its connection for ever)."""

    read_timeout_s = 10.0
    _headers_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._headers_timer = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _timed_out(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
