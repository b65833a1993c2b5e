"""The OpenAI-compatible HTTP API, driven by the `openai` package (a client nobody here wrote).

One module-scoped stack serves the shipped pair (models/: draft LM + target with its chat
template) with gRPC and HTTP on ephemeral ports. Greedy output over HTTP must equal
`transformers`' greedy decode of the (templated) prompt and the SDK's output over gRPC.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from specpair.cli.demo import chat_over_http
from specpair.client import AsyncSpecpairClient, SpecpairError
from specpair.config import MODELS_DIR
from specpair.proto.v1 import target_pb2
from specpair.rpc.metrics import ServiceMetrics
from target_service.http_door.http_api import HttpServer, OpenAIApp
from target_service.http_door.http_guards import body_limit
from target_service.request_path.frontend import Frontend
from tests.conftest import hf_greedy
from tests.service.conftest import Stack, draft_config, target_config

pytestmark = pytest.mark.asyncio(loop_scope="module")
TARGET = MODELS_DIR / "target"
ROOT = MODELS_DIR.parent
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function that adds two numbers."},
]
PROMPT = "def read_json(path):\n    with open(path) as f:\n        return json."
MAX_TOKENS = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack() -> AsyncIterator[Stack]:
    started = await Stack(
        draft_config(MODELS_DIR / "draft"),
        target_config(TARGET, http_address="127.0.0.1:0", max_batch=4),
    ).start()
    yield started
    await started.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    base = f"http://127.0.0.1:{stack.target.http_port}/v1"
    async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf() -> tuple[Any, LlamaForCausalLM]:
    tok = AutoTokenizer.from_pretrained(TARGET)
    return tok, LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def greedy(hf: tuple[Any, LlamaForCausalLM], ids: list[int], n: int) -> tuple[list[int], str]:
    """transformers' greedy continuation (stopping at <|endoftext|> = 0) and its text."""
    tok, model = hf
    new = hf_greedy(model, ids, n)
    return new, tok.decode(new, skip_special_tokens=True)


def templated(hf: tuple[Any, LlamaForCausalLM], messages: list[dict[str, str]]) -> list[int]:
    encoding = hf[0].apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoding["input_ids"])


def post(port: int, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A raw POST (the openai client refuses to send some malformed bodies)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


async def test_models_health_and_chat_equal_transformers_and_the_sdk(
    stack: Stack, client: openai.AsyncOpenAI, hf: tuple[Any, LlamaForCausalLM]
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["target"]
    conn = http.client.HTTPConnection("127.0.0.1", stack.target.http_port, timeout=10)
    await asyncio.to_thread(conn.request, "GET", "/health")
    health = await asyncio.to_thread(conn.getresponse)
    assert (health.status, json.loads(health.read())) == (200, {"status": "ok"})
    conn.close()

    prompt_ids = templated(hf, MESSAGES)
    ref_ids, ref_text = greedy(hf, prompt_ids, MAX_TOKENS)
    reply = await client.chat.completions.create(
        model="target",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"an_unknown_field": {"is": "ignored"}},
    )
    assert reply.object == "chat.completion" and reply.model == "target"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == ref_text and ref_text
    assert reply.choices[0].finish_reason == ("length" if len(ref_ids) == MAX_TOKENS else "stop")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(prompt_ids),
        len(ref_ids),
    )
    assert reply.usage.total_tokens == len(prompt_ids) + len(ref_ids)
    meta = reply.model_extra["meta_info"] if reply.model_extra else {}
    assert meta["rounds"] == len(meta["accept_lengths"]) + meta["plain_rounds"] > 0
    assert meta["plain_rounds"] == 0 and meta["speculative_num_steps"] in (1, 3, 7)
    assert meta["avg_accept_length"] == pytest.approx(
        sum(meta["accept_lengths"]) / len(meta["accept_lengths"])
    )

    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="target",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == reply.choices[0].finish_reason
    assert (finals[0].model_extra or {})["meta_info"]["rounds"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage  # include_usage

    async with AsyncSpecpairClient(f"127.0.0.1:{stack.target.port}") as sdk:
        result = await sdk.chat(MESSAGES, max_tokens=MAX_TOKENS)
        streamed = [d.text async for d in sdk.stream_chat(MESSAGES, max_tokens=MAX_TOKENS)]
    assert list(result.token_ids) == ref_ids and result.text == ref_text
    assert "".join(streamed) == ref_text


async def test_completions_of_text_and_token_ids_streamed_and_stopped(
    client: openai.AsyncOpenAI, hf: tuple[Any, LlamaForCausalLM]
) -> None:
    prompt_ids = hf[0].encode(PROMPT, add_special_tokens=False)
    ref_ids, ref_text = greedy(hf, prompt_ids, MAX_TOKENS)
    text = await client.completions.create(
        model="target", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    ids = await client.completions.create(
        model="target", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert text.object == "text_completion"
    assert text.choices[0].text == ids.choices[0].text == ref_text
    assert text.usage is not None and text.usage.completion_tokens == len(ref_ids)
    stream = await client.completions.create(
        model="target", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == ref_text
    assert [c.choices[0].finish_reason for c in chunks][-1] == text.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    stop = ref_text[6:9]  # cut where the stop string first occurs, finish_reason "stop"
    stopped = await client.completions.create(
        model="target", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == ref_text[: ref_text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


async def test_sampling_parameters_reach_the_sampler_as_the_sdk_sends_them(
    stack: Stack, client: openai.AsyncOpenAI
) -> None:
    params = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    replies = [
        await client.chat.completions.create(
            model="target",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_completion_tokens=12,
            max_tokens=3,  # the newer name wins
            extra_body={"top_k": top_k, "min_p": min_p},
            **params,  # type: ignore[arg-type]
        )
        for top_k, min_p in ((20, 0.0), (20, 0.0), (-1, 0.0), (20, 0.05))
    ]
    texts = [r.choices[0].message.content for r in replies]
    async with AsyncSpecpairClient(f"127.0.0.1:{stack.target.port}") as sdk:
        same = await sdk.chat(MESSAGES, max_tokens=12, top_k=20, **params)  # type: ignore[arg-type]
        whole = await sdk.chat(MESSAGES, max_tokens=12, top_k=0, **params)  # type: ignore[arg-type]
        floor = await sdk.chat(MESSAGES, max_tokens=12, top_k=20, min_p=0.05, **params)  # type: ignore[arg-type]
    assert texts[0] == texts[1] == same.text  # seeded: reproducible, and the same mapping
    assert texts[2] == whole.text  # top_k -1: the whole vocabulary
    assert texts[3] == floor.text  # min_p: vLLM's and SGLang's extension, as the SDK's
    assert replies[0].usage is not None and replies[0].usage.completion_tokens == 12


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize(
    ("path", "changes", "param"),
    [
        (CHAT, {"temperature": -1}, "temperature"),
        (CHAT, {"temperature": "hot"}, "temperature"),
        (CHAT, {"top_p": 0}, "top_p"),
        (CHAT, {"top_k": -3}, "top_k"),
        (CHAT, {"seed": -1}, "seed"),
        (CHAT, {"max_tokens": 0}, "max_tokens"),
        (CHAT, {"max_completion_tokens": 5000}, "max_completion_tokens"),
        (CHAT, {"stop": [""]}, "stop[0]"),
        (CHAT, {"stop": 7}, "stop"),
        (CHAT, {"n": 2}, "n"),
        (CHAT, {"logprobs": True}, "logprobs"),
        (CHAT, {"top_logprobs": 3}, "top_logprobs"),
        (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": 1}, "frequency_penalty"),
        (CHAT, {"min_p": 1.5}, "min_p"),
        (CHAT, {"logit_bias": {"5": 10}}, "logit_bias"),
        (CHAT, {"tools": [{"type": "function"}]}, "tools"),
        (CHAT, {"stream": "yes"}, "stream"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (COMPLETIONS, {"prompt": [99999]}, "prompt[0]"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": None}, "prompt"),
        (COMPLETIONS, {"echo": True}, "echo"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
    ],
)
async def test_bad_requests_get_400_naming_the_field(
    stack: Stack, path: str, changes: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "target", "max_tokens": 4}
    body |= {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    status, reply = await asyncio.to_thread(post, stack.target.http_port, path, body | changes)
    assert status == 400, reply
    assert reply["error"]["param"] == param
    assert reply["error"]["message"].startswith(param)
    assert reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"prompt": "x", "top_p": NaN}'])
async def test_a_body_that_is_no_json_object_is_400(stack: Stack, raw: bytes) -> None:
    status, reply = await asyncio.to_thread(post, stack.target.http_port, COMPLETIONS, raw)
    assert status == 400 and reply["error"]["param"] == "body"


async def test_a_body_past_the_limit_is_413(stack: Stack) -> None:
    huge = {"model": "target", "prompt": "x" * body_limit(1024)}
    status, reply = await asyncio.to_thread(post, stack.target.http_port, COMPLETIONS, huge)
    assert status == 413 and reply["error"]["param"] == "body"


async def test_the_openai_client_raises_bad_request_with_the_param(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="target",
            messages=MESSAGES,  # type: ignore[arg-type]
            presence_penalty=1.0,
        )
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "presence_penalty"


def _cancelled(stack: Stack) -> float:
    registry = stack.target.servicer.frontend.metrics.registry
    return (
        registry.get_sample_value("specpair_target_requests_total", {"outcome": "cancelled"}) or 0
    )


async def _wait_cancelled(stack: Stack, before: float) -> None:
    """Until the target counts one more cancelled request and both services hold none."""
    scheduler, draft = stack.target.servicer.scheduler, stack.draft.servicer.rounds
    for _ in range(400):
        if _cancelled(stack) > before and not scheduler.running and not draft.active_requests:
            break
        await asyncio.sleep(0.05)
    assert _cancelled(stack) == before + 1  # not "length": it did not run its 900 tokens
    assert scheduler.worker.cache.free_slots == scheduler.max_batch
    assert draft.active_requests == 0


async def test_a_client_that_disconnects_frees_its_request(stack: Stack) -> None:
    port = stack.target.http_port
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 900, "temperature": 0}

    def read_one_event_and_hang_up() -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        data = json.dumps(body | {"stream": True}).encode()
        conn.request("POST", COMPLETIONS, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        line = response.readline()
        conn.close()
        return line

    before = _cancelled(stack)
    assert (await asyncio.to_thread(read_one_event_and_hang_up)).startswith(b"data: {")
    await _wait_cancelled(stack, before)

    # Not streamed: the request is cancelled as soon as the connection closes.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        payload = json.dumps(body).encode()
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: localhost\r\n"
        head += f"Content-Length: {len(payload)}\r\n"
        sock.sendall(head.encode() + b"Content-Type: application/json\r\n\r\n" + payload)
        for _ in range(500):  # until the request is running, then hang up
            if stack.target.servicer.scheduler.running:
                break
            await asyncio.sleep(0.02)
    await _wait_cancelled(stack, before + 1)


async def _cli(*args: str, stdin: bytes = b"") -> str:
    """`specpair …` as its own process (the services here log to this one's stdout)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "specpair.cli",
        *args,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode == 0
    return out.decode()


async def test_the_cli_chat_and_the_demo_turn_match_the_api(
    stack: Stack, client: openai.AsyncOpenAI
) -> None:
    first, second = MESSAGES[1]["content"], "Now one that multiplies them."
    address = ["--address", f"127.0.0.1:{stack.target.port}", "--max-tokens", "12"]
    one_turn = await _cli("chat", first, *address)
    loop = await _cli("chat", *address, stdin=f"{first}\n{second}\n".encode())

    async def reply(messages: list[dict[str, str]]) -> str:
        answer = await client.chat.completions.create(
            model="target",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
        )
        return answer.choices[0].message.content or ""

    a1 = await reply([{"role": "user", "content": first}])
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": second},
    ]
    a2 = await reply(history)  # the loop keeps the conversation
    assert one_turn == a1 + "\n"
    assert loop == f"> {a1}\n> {a2}\n> "
    demo = await asyncio.to_thread(chat_over_http, f"127.0.0.1:{stack.target.http_port}", first)
    assert demo["choices"][0]["message"]["content"].startswith(a1)


@pytest.mark.parametrize("role", ["wizard", "function", "tool", "User"])
async def test_a_role_the_server_does_not_serve_is_400_naming_it(
    stack: Stack, client: openai.AsyncOpenAI, role: str
) -> None:
    messages = [*MESSAGES, {"role": role, "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="target",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "messages[2].role", body
    assert repr(role) in body["message"] and "user" in body["message"], body
    with pytest.raises(SpecpairError) as grpc_refused:  # the gRPC door refuses it alike
        async with AsyncSpecpairClient(f"127.0.0.1:{stack.target.port}") as sdk:
            await sdk.chat(messages, max_tokens=4)
    assert grpc_refused.value.code == "INVALID_ARGUMENT"
    assert "messages[2].role" in str(grpc_refused.value)


async def test_a_developer_message_is_served_as_a_system_one(client: openai.AsyncOpenAI) -> None:
    async def reply(role: str) -> str:
        answer = await client.chat.completions.create(
            model="target",
            messages=[{"role": role, "content": "You write Python."}, MESSAGES[1]],  # type: ignore[misc,list-item]
            max_tokens=8,
            temperature=0,
        )
        return answer.choices[0].message.content or ""

    assert await reply("developer") == await reply("system")


async def test_cli_generate_refuses_max_tokens_0_as_http_does(stack: Stack) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "specpair.cli",
        "generate",
        "def add(a, b):",
        "--address",
        f"127.0.0.1:{stack.target.port}",
        "--max-tokens",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and out == b"", (out, err)
    (line,) = err.decode().splitlines()
    assert line.startswith("specpair generate: error: max_tokens: "), line
    status, reply = await asyncio.to_thread(  # the same field the HTTP door names
        post, stack.target.http_port, COMPLETIONS, {"prompt": "x", "max_tokens": 0}
    )
    assert status == 400 and reply["error"]["param"] == "max_tokens"


def threads_taking(signum: int, pid: int) -> list[int]:
    """The threads of `pid` that do not block `signum` (Linux's /proc)."""
    taking = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        if not int(fields["SigBlk"], 16) >> (signum - 1) & 1:
            taking.append(int(status.parent.name))
    return sorted(taking)


async def test_the_cli_chat_says_how_it_ends_and_ends_cleanly(stack: Stack) -> None:
    address = ["--address", f"127.0.0.1:{stack.target.port}", "--max-tokens", "4"]

    async def chat() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specpair.cli",
            "chat",
            *address,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # a runner started as a background job hands its children SIGINT ignored, and
            # the Ctrl-C below would then never reach the chat
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    # /exit after one turn: exit 0, and the first line said how a chat ends
    proc = await chat()
    out, err = await asyncio.wait_for(proc.communicate(b"def add(a, b):\n/exit\nnever sent\n"), 60)
    assert proc.returncode == 0, err
    assert "Ctrl-D or /exit ends the chat" in err.decode().splitlines()[0]
    assert out.decode().count("> ") == 2  # one turn answered, then the prompt /exit ended
    # Ctrl-C at the prompt, after a turn: no traceback, the shell's code for an interrupt
    proc = await chat()
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b"def add(a, b):\n")
    await proc.stdin.drain()
    shown = b""
    while shown.count(b"> ") < 2:  # the reply, then the next prompt
        shown += await asyncio.wait_for(proc.stdout.read(64), 60)
    # The kernel hands a process's signal to any thread that does not block it, and a Ctrl-C
    # taken by a thread other than the main one never wakes the main thread's `input()`.
    assert threads_taking(signal.SIGINT, proc.pid) == [proc.pid]
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 60)
    err = await proc.stderr.read()
    assert proc.returncode == 130 and b"Traceback" not in err, err


async def test_chat_without_a_template_is_invalid_argument_and_a_full_queue_429(ckpts) -> None:
    # The tiny test checkpoint has a tokenizer but no chat template.
    config = target_config(
        ckpts["target"], draft_address=None, http_address="127.0.0.1:0", max_batch=1, max_queue=1
    )
    tiny = await Stack(None, config).start()
    try:
        async with AsyncSpecpairClient(f"127.0.0.1:{tiny.target.port}") as sdk:
            with pytest.raises(SpecpairError) as info:
                await sdk.chat(MESSAGES, max_tokens=4)
        assert info.value.code == "INVALID_ARGUMENT"
        assert info.value.details.startswith("messages:") and "chat template" in info.value.details
        body = {"model": "x", "messages": MESSAGES, "max_tokens": 4}
        status, reply = await asyncio.to_thread(post, tiny.target.http_port, CHAT, body)
        assert status == 400 and reply["error"]["param"] == "messages"
        assert "chat template" in reply["error"]["message"]
        request = target_pb2.GenerateRequest(prompt="x", max_tokens=4, messages=[MESSAGES[1]])
        with pytest.raises(grpc.aio.AioRpcError) as both:
            await tiny.generate(**{f.name: v for f, v in request.ListFields()})
        assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert both.value.details().startswith("messages: give either")

        scheduler = tiny.target.servicer.scheduler
        running = asyncio.create_task(tiny.generate(prompt_token_ids=[5, 6, 7], max_tokens=200))
        while not scheduler.running:  # the first one holds the only slot
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(tiny.generate(prompt_token_ids=[3], max_tokens=5))
        while not scheduler.queue:
            await asyncio.sleep(0.01)
        body = {"model": "x", "prompt": [3], "max_tokens": 4}
        status, reply = await asyncio.to_thread(post, tiny.target.http_port, COMPLETIONS, body)
        assert status == 429 and "max_queue" in reply["error"]["message"]
        (first, _), (second, _) = await asyncio.gather(running, queued)
        assert (len(first), len(second)) == (200, 5)
    finally:
        await tiny.stop()


async def test_before_the_model_is_loaded_health_and_requests_are_503() -> None:
    frontend = Frontend(target_config(TARGET), ServiceMetrics("target"))  # no scheduler yet
    server = HttpServer(OpenAIApp(frontend, "target"), "127.0.0.1:0")
    with pytest.raises(OSError, match=f"HTTP API address 127.0.0.1:{server.port}"):
        HttpServer(OpenAIApp(frontend, "target"), f"127.0.0.1:{server.port}")  # taken
    await server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        await asyncio.to_thread(conn.request, "GET", "/health")
        health = await asyncio.to_thread(conn.getresponse)
        assert (health.status, json.loads(health.read())) == (503, {"status": "loading"})
        conn.close()
        body = {"model": "target", "messages": MESSAGES}
        status, reply = await asyncio.to_thread(post, server.port, CHAT, body)
        assert status == 503 and "loading" in reply["error"]["message"]
    finally:
        await server.stop()


async def test_one_defaults_rule_across_the_doors(
    stack: Stack, client: openai.AsyncOpenAI, hf: tuple[Any, LlamaForCausalLM]
) -> None:
    """Omitted: max_tokens is 16 everywhere; temperature is 1.0 on the OpenAI door, 0 on ours."""
    prompt_ids = hf[0].encode(PROMPT, add_special_tokens=False)
    ref_ids, ref_text = greedy(hf, prompt_ids, 16)
    assert len(ref_ids) == 16  # no eos within: every door must stop at the default
    greedy_http = await client.completions.create(model="target", prompt=PROMPT, temperature=0)
    assert greedy_http.choices[0].text == ref_text
    assert greedy_http.usage is not None and greedy_http.usage.completion_tokens == 16
    tokens, responses = await stack.generate(prompt=PROMPT)  # gRPC: no max_tokens, no sampling
    assert tokens == ref_ids and responses[-1].finish_reason == target_pb2.FINISH_REASON_LENGTH
    async with AsyncSpecpairClient(f"127.0.0.1:{stack.target.port}") as sdk:
        result = await sdk.generate(PROMPT)
    assert list(result.token_ids) == ref_ids and result.text == ref_text
    cli = await _cli("generate", PROMPT, "--address", f"127.0.0.1:{stack.target.port}")
    assert cli == ref_text + "\n"
    seeded = [
        await client.completions.create(model="target", prompt=PROMPT, seed=7) for _ in range(2)
    ]  # the OpenAI door's default temperature is 1.0: seeded samples, not the greedy text
    assert seeded[0].choices[0].text == seeded[1].choices[0].text != ref_text
