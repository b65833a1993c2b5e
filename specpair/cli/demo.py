"""The demo client: completes Python code through the running services and shows speculation,
one chat turn through the OpenAI-compatible HTTP API, then the number that matters: tokens/s
with speculation against the same prompts at tier 0 (the target alone)."""

from __future__ import annotations

import json
import shlex
import time
import urllib.error
import urllib.request
from typing import Any

import grpc

from specpair.client import ControllerClient, SpecpairClient, SpecpairError
from specpair.proto.v1 import target_pb2, target_pb2_grpc
from specpair.rpc.channels import auth_metadata, open_blocking_channel

# Prompts end mid-line: the shipped models were trained on whole files, and a prompt that ends
# in a bare newline or indentation splits whitespace in a way they never saw.
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import os\n\n\ndef list_python_files(root):\n    result = []\n    for dirpath, dirnames",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return",
    "def read_json(path):\n    with open(path) as f:\n        return json.",
]


def _draft_state(info: dict[str, Any]) -> str:
    """The target's link to its draft in words: 'CONNECTED', 'DISCONNECTED', …"""
    return str(info.get("draft_connection_state", "")).removeprefix("DRAFT_CONNECTION_STATE_")


CHAT = "Write a function that adds two numbers."


def chat_over_http(
    http_address: str, message: str, *, max_tokens: int = 48, api_key: str | None = None
) -> dict[str, Any]:
    """One chat turn through /v1/chat/completions (greedy); prints the equivalent curl.
    `api_key`: the target's (SPECPAIR_API_KEY), sent as OpenAI's clients send it."""
    base = f"http://{http_address}/v1"
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = urllib.request.Request(f"{base}/models", headers=auth)
    with urllib.request.urlopen(models, timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    )
    headers = "-H 'Content-Type: application/json'"
    if api_key:
        headers += ' -H "Authorization: Bearer $SPECPAIR_API_KEY"'
    print(f"demo: curl {base}/chat/completions {headers} -d {shlex.quote(body)}")
    request = urllib.request.Request(
        f"{base}/chat/completions", body.encode(), {"Content-Type": "application/json", **auth}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response))


def run_demo(
    target: str,
    controller: str | None,
    http: str = "",
    *,
    max_tokens: int = 64,
    token: str | None = None,
    api_key: str | None = None,
) -> None:
    """`http`: the target's OpenAI-compatible address ('' skips the chat turn); `token`: the ops
    token, which the controller's state call and the tier-0 run need when one is set;
    `api_key`: the HTTP API's key, when it has one."""
    client = SpecpairClient(target, api_key=api_key)
    info = client.server_info()
    print(
        f"demo: target {info.get('target_model_path')} at tier {info.get('speculative_num_steps')}"
        f", draft {info.get('draft_address') or 'none'} ({_draft_state(info)})"
    )
    texts: list[str] = []
    for prompt in PROMPTS:
        result = client.generate(prompt, max_tokens=max_tokens)
        texts.append(result.text)
        print("=" * 72)
        print(prompt + result.text)
        print("-" * 72)
        print(
            f"{result.completion_tokens} tokens in {result.rounds} rounds, "
            f"accept lengths {result.accept_lengths} (mean {result.avg_accept_length:.2f}), "
            f"finish: {result.finish_reason}"
        )
        if result.plain_rounds:
            link = _draft_state(client.server_info())
            print(
                f"warning: {result.plain_rounds} of {result.rounds} rounds without drafts "
                f"(the draft is {link}): output is the target's alone, only slower"
            )
    if http:
        print("=" * 72)
        try:
            reply = chat_over_http(http, CHAT, api_key=api_key)
        except (urllib.error.URLError, OSError) as exc:
            print(f"demo: HTTP API unavailable ({exc})")
        else:
            meta = reply["meta_info"]
            print(f"user: {CHAT}\nassistant:{reply['choices'][0]['message']['content']}")
            print("-" * 72)
            print(
                f"(the shipped code model is no assistant: the template only frames the turn) "
                f"usage {reply['usage']}, accept lengths {tuple(meta['accept_lengths'])}"
            )
    if controller is not None:
        show_controller(controller, token)
    print("=" * 72)
    # Both timed passes run warm, after the ones shown: tier 0, then speculation again.
    plain = plain_run(client, target, info, max_tokens=max_tokens, token=token)
    speculative, again = timed_pass(client, max_tokens)
    line = f"demo: {speculative:.0f} tokens/s with speculation"
    if plain is None:
        print(f"{line} (tier 0 is not among the target's tiers: nothing to compare)")
    else:
        rate, plain_texts = plain
        same = plain_texts == texts == again
        print(
            f"{line}, {rate:.0f} without (tier 0, the target alone): "
            f"{speculative / rate:.2f}x, "
            f"{'the same text' if same else 'DIFFERENT text (a bug: report it)'}"
        )


def timed_pass(client: SpecpairClient, max_tokens: int) -> tuple[float, list[str]]:
    """The demo's prompts one after another: (tokens/s, texts)."""
    t0 = time.perf_counter()
    results = [client.generate(prompt, max_tokens=max_tokens) for prompt in PROMPTS]
    rate = sum(r.completion_tokens for r in results) / (time.perf_counter() - t0)
    return rate, [r.text for r in results]


def plain_run(
    client: SpecpairClient,
    target: str,
    info: dict[str, Any],
    *,
    max_tokens: int,
    token: str | None,
) -> tuple[float, list[str]] | None:
    """The demo's prompts again at tier 0 (ApplyTier, as the controller sends it; the policy
    leaves rounds without drafts alone), then back to the tier before: (tokens/s, texts), or
    None without tier 0."""
    if 0 not in info.get("candidate_steps", ()):
        return None
    with open_blocking_channel(target) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)

        def apply(steps: int) -> int:
            request = target_pb2.ApplyTierRequest(speculative_num_steps=steps, reason="demo")
            reply = stub.ApplyTier(request, metadata=auth_metadata(token), timeout=30)
            return int(reply.previous_steps)

        try:
            before = apply(0)
        except grpc.RpcError as exc:
            print(f"demo: cannot switch to tier 0 ({exc.code().name})")  # type: ignore[attr-defined]
            return None
        try:
            return timed_pass(client, max_tokens)
        finally:
            apply(before)


def show_controller(controller: str, token: str | None) -> None:
    try:
        state = ControllerClient(controller, token=token).state()
    except SpecpairError as exc:
        print(f"demo: controller unavailable ({exc})")
        return
    for target_state in state.targets:
        switches = target_state.recent_switches
        print(
            f"controller: {target_state.target_address} tier "
            f"{target_state.active_steps}, EMA {target_state.ema:.2f}, "
            f"{len(switches)} tier switches"
        )
        for s in switches:
            print(
                f"  round {s.round_id}: {s.from_steps} → {s.to_steps} ({s.reason}, EMA {s.ema:.2f})"
            )
