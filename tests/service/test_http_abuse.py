"""The HTTP door against what any client on the network may send: oversized lists, bodies and
values, deep nesting, slow senders, clients that leave, a foreign Host, no API key.

Each test drives a real target (uvicorn + the scheduler) with a real client: http.client or a
raw socket where a client library would refuse to send the request, `openai` otherwise.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from specpair.config import MODELS_DIR
from specpair.proto.v1 import target_pb2
from target_service.http_door.http_guards import body_limit
from tests.service.conftest import Stack, draft_config, eventually, target_config

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEY = "sk-specpair-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)  # the key guards gRPC Generate too
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]
READ_TIMEOUT_S = 1.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack() -> AsyncIterator[Stack]:
    started = await Stack(
        draft_config(MODELS_DIR / "draft"),
        target_config(
            MODELS_DIR / "target",
            http_address="127.0.0.1:0",
            api_key=KEY,
            http_read_timeout_s=READ_TIMEOUT_S,
        ),
    ).start()
    yield started
    await started.stop()


def send(
    port: int,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request through http.client; (status, JSON body)."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, data, sent)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


async def call(stack: Stack, *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    return await asyncio.to_thread(send, stack.target.http_port, *args, **kwargs)


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": "target", "messages": USER, "max_tokens": 4, "temperature": 0} | changes


async def test_stop_lists_are_bounded_in_count_and_length(stack: Stack) -> None:
    many = [f"s{i}" for i in range(100_000)]  # ~1 MB: 25 000 times OpenAI's 4
    for stop, param, start in [
        (many, "stop", "stop: 100000 stop strings, at most 4"),
        (["a", "b", "c", "d", "e"], "stop", "stop: 5 stop strings, at most 4"),
        (["x" * 300], "stop[0]", "stop[0]: 300 characters, at most 256"),
    ]:
        t0 = time.perf_counter()
        status, reply = await call(stack, CHAT, chat(stop=stop))
        assert (status, reply["error"]["param"]) == (400, param), reply
        assert reply["error"]["message"].startswith(start)
        assert time.perf_counter() - t0 < 2.0
    ok, reply = await call(stack, CHAT, chat(stop=["\n\n", "def", "class", "#"]))
    assert ok == 200, reply
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the gRPC door applies the same bound
        await stack.generate(GRPC_AUTH, prompt="x", max_tokens=4, stop=["a"] * 5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("stop: 5 stop strings")


async def test_messages_are_sized_before_the_template_renders_them(stack: Stack) -> None:
    big = [{"role": "user", "content": "x" * 40_000}]  # more text than 1024 tokens hold
    status, reply = await call(stack, CHAT, chat(messages=big))
    assert (status, reply["error"]["param"]) == (400, "messages"), reply
    assert "40004 characters cannot fit the context of 1024 tokens" in reply["error"]["message"]
    many = [{"role": "user", "content": ""}] * 2000
    status, reply = await call(stack, CHAT, chat(messages=many))
    assert (status, reply["error"]["param"]) == (400, "messages"), reply
    assert "2000 messages cannot fit" in reply["error"]["message"]
    messages = [target_pb2.ChatMessage(role="user", content="y" * 40_000)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(GRPC_AUTH, messages=messages, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("messages: 40004 characters cannot fit")


async def test_token_id_prompts_are_counted_before_each_id_is_checked(stack: Stack) -> None:
    ids = [1] * 300_000  # 900 kB of JSON
    t0 = time.perf_counter()
    status, reply = await call(stack, COMPLETIONS, {"model": "t", "prompt": ids, "max_tokens": 4})
    assert (status, reply["error"]["param"]) == (400, "prompt"), reply
    assert reply["error"]["message"].startswith("prompt: 300000 items cannot fit")
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.generate(GRPC_AUTH, prompt_token_ids=[1] * 5000, max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_token_ids: 5000 tokens cannot fit")
    stop_ids = {"model": "t", "prompt": "x", "stop_token_ids": [1] * 1000}
    status, reply = await call(stack, COMPLETIONS, stop_ids)
    assert (status, reply["error"]["param"]) == (400, "stop_token_ids"), reply


@pytest.mark.parametrize("name", ["max_tokens", "temperature", "seed", "top_k", "top_p", "stream"])
async def test_a_huge_bad_value_is_named_not_echoed(stack: Stack, name: str) -> None:
    status, reply = await call(stack, CHAT, chat(**{name: "9" * 900_000}))
    assert (status, reply["error"]["param"]) == (400, name), reply
    assert reply["error"]["message"].startswith(name)
    assert len(reply["error"]["message"]) <= 512


async def test_deeply_nested_json_is_400_not_500(stack: Stack) -> None:
    for raw, param in [
        (b"[" * 100_000 + b"]" * 100_000, "body"),
        (json.dumps(chat(temperature=[[[[]]]])).replace("[[[[]]]]", "[" * 900 + "]" * 900), None),
        (
            json.dumps(chat(messages=[{"role": "user", "content": [[[[]]]]}])).replace(
                "[[[[]]]]", "[" * 900 + "]" * 900
            ),
            None,
        ),
    ]:
        body = raw if isinstance(raw, bytes) else raw.encode()
        status, reply = await call(stack, CHAT, body)
        assert status == 400, reply
        assert reply["error"]["type"] == "invalid_request_error"
        if param is not None:
            assert reply["error"]["param"] == param
        assert len(reply["error"]["message"]) <= 512


async def test_api_key_json_content_type_and_host(stack: Stack) -> None:
    port = stack.target.http_port
    base = f"http://127.0.0.1:{port}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0) as anonymous:
        with pytest.raises(openai.AuthenticationError) as info:
            await anonymous.models.list()
    assert info.value.status_code == 401
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "invalid_api_key"
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="target",
            messages=USER,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    # /health stays open: orchestrators probe it without the key.
    assert (await call(stack, "/health", method="GET", headers={"Authorization": ""}))[0] == 200

    status, reply = await call(stack, CHAT, chat(), headers={"Content-Type": "text/plain"})
    assert (status, reply["error"]["param"]) == (415, "Content-Type"), reply
    status, reply = await call(stack, CHAT, chat(), headers={"Host": "attacker.example"})
    assert (status, reply["error"]["param"]) == (421, "Host"), reply
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert (await call(stack, CHAT, chat(), headers={"Host": host}))[0] == 200, host


async def test_a_key_less_door_beyond_loopback_says_so(ckpts) -> None:
    config = target_config(ckpts["target"], draft_address=None, http_address="0.0.0.0:0")
    with capture_logs() as logs:
        wide = await Stack(None, config).start()
    try:
        # Beyond loopback any Host is served (the name clients use is not known here).
        status, _ = await asyncio.to_thread(
            send,
            wide.target.http_port,
            COMPLETIONS,
            {"prompt": [1, 2], "max_tokens": 2},
            headers={"Host": "specpair.internal"},
        )
        assert status == 200
    finally:
        await wide.stop()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert any("without an API key" in e["event"] for e in warnings), warnings


async def test_a_body_past_the_limit_is_413_not_a_reset(stack: Stack) -> None:
    limit = body_limit(1024)
    for size in (limit + 1, 10 * 1024 * 1024):
        status, reply = await call(stack, COMPLETIONS, {"prompt": "x" * size})
        assert (status, reply["error"]["param"]) == (413, "body"), size
        assert str(limit) in reply["error"]["message"]
    # A client waiting for 100 Continue hears the 413 before it sends a byte of the body.
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {100 * 1024 * 1024}\r\n"
        "Expect: 100-continue\r\n\r\n"
    )
    with await asyncio.to_thread(_raw, stack.target.http_port, head.encode()) as sock:
        answer = await asyncio.to_thread(_read_all, sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:100]


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_slow_senders_are_timed_out(stack: Stack) -> None:
    port = stack.target.http_port
    t0 = time.perf_counter()
    # Headers that never end: the connection is closed.
    headers_only = await asyncio.to_thread(_raw, port, b"POST /v1/completions HTTP/1.1\r\nHo")
    # A body that never ends: 408, and the connection closed.
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n"
    )
    body_part = await asyncio.to_thread(_raw, port, head.encode() + b'{"prompt": ')
    with headers_only, body_part:
        assert await asyncio.to_thread(_read_all, headers_only) == b""
        answer = await asyncio.to_thread(_read_all, body_part)
    elapsed = time.perf_counter() - t0
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"not received within 1 s" in answer
    assert READ_TIMEOUT_S <= elapsed < READ_TIMEOUT_S + 5


async def test_clients_that_leave_while_queued_are_freed_unprefilled(ckpts) -> None:
    config = target_config(
        ckpts["target"], draft_address=None, http_address="127.0.0.1:0", max_batch=1
    )
    tiny = await Stack(None, config).start()
    try:
        scheduler = tiny.target.servicer.scheduler
        worker = scheduler.worker
        prefills: list[int] = []
        prefill, verify = worker.prefill, worker.verify

        def counted_prefill(seqs: list[Any]) -> Any:
            prefills.append(len(seqs))
            return prefill(seqs)

        def slow_verify(*args: Any) -> Any:  # the one running request outlasts the test
            time.sleep(0.05)
            return verify(*args)

        worker.prefill, worker.verify = counted_prefill, slow_verify
        running = asyncio.create_task(tiny.generate(prompt_token_ids=[5, 6, 7], max_tokens=900))
        await eventually(lambda: bool(scheduler.running))
        registry = tiny.target.servicer.frontend.metrics.registry

        def cancelled() -> float:
            sample = {"outcome": "cancelled"}
            return registry.get_sample_value("specpair_target_requests_total", sample) or 0

        before, admitted = cancelled(), len(prefills)
        sockets = []
        for i in range(12):
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 50, "stream": i % 2 == 0})
            head = (
                f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sockets.append(
                await asyncio.to_thread(_raw, tiny.target.http_port, (head + body).encode())
            )
        await eventually(lambda: len(scheduler.queue) == 12)
        for sock in sockets:
            sock.close()
        await eventually(lambda: not scheduler.queue and cancelled() == before + 12)
        assert scheduler.running and not running.done()  # freed while the batch was busy
        assert len(prefills) == admitted  # none of them was prefilled
        running.cancel()
    finally:
        await tiny.stop()


async def test_unknown_paths_and_methods_and_tools_get_openai_errors(stack: Stack) -> None:
    status, reply = await call(stack, "/v1/embeddings", {"input": "x"})
    assert status == 404 and reply["error"]["type"] == "not_found_error", reply
    assert reply["error"]["message"].startswith("POST /v1/embeddings: Not Found")
    status, reply = await call(stack, CHAT, method="GET")
    assert status == 405 and reply["error"]["message"].startswith("GET /v1/chat/completions")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    status, reply = await call(stack, CHAT, chat(tools=tools))
    assert (status, reply["error"]["param"]) == (400, "tools"), reply
    assert "no tool calling" in reply["error"]["message"]
    assert "speculative" not in reply["error"]["message"]
    status, reply = await call(stack, CHAT, chat(presence_penalty=1))
    assert "not applied exactly under speculative decoding" in reply["error"]["message"]


async def test_the_demo_chat_turn_sends_the_api_key(stack: Stack) -> None:
    import urllib.error

    from specpair.cli.demo import chat_over_http

    address = f"127.0.0.1:{stack.target.http_port}"
    reply = await asyncio.to_thread(chat_over_http, address, "Hi", max_tokens=3, api_key=KEY)
    assert reply["usage"]["completion_tokens"] == 3
    with pytest.raises(urllib.error.HTTPError) as info:
        await asyncio.to_thread(chat_over_http, address, "Hi", max_tokens=3)
    assert info.value.code == 401
