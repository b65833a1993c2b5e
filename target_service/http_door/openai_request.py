"""OpenAI's completions and chat completions bodies as ClientRequests.

Pure functions of JSON values, no I/O: the HTTP door (`http_api.py`) parses a
body into a `ClientRequest` here and runs it through the same `Frontend.generate` as gRPC
(`openai_response.py` writes the answers). Every error names the field as the client sent it
(`temperature`, not `sampling.temperature`).
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass, replace
from typing import Any

from target_service.request_path.request import ChatTurn, ClientRequest, SamplingAsked
from target_service.request_path.validation import (
    DEFAULT_MAX_TOKENS,
    MAX_BYTES_PER_TOKEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
    check_messages_size,
    check_stop,
)

# OpenAI's documented default; send 0 for greedy decoding. (max_tokens: the request path's
# DEFAULT_MAX_TOKENS, OpenAI's completions default, for chat too: a "rest of the context"
# default would need the prompt's length before validation.)
DEFAULT_TEMPERATURE = 1.0
INT32_MAX = 2**31 - 1
UINT64_LIMIT = 2**64

# Parameters of OpenAI's API (and vLLM/SGLang extensions) that this server does not apply,
# with the values that mean "off" and why. Any other value is refused naming the parameter,
# rather than silently ignored.
NOT_EXACT = "not applied exactly under speculative decoding"
NO_TOOLS = "this server has no tool calling or structured output"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "use_beam_search": (False,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
}
TOOL_PARAMETERS = frozenset(
    {"tools", "functions", "tool_choice", "function_call", "response_format"}
)


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One parsed HTTP request: what it asks, and how to answer it."""

    generate: ClientRequest
    chat: bool
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    max_tokens_field: str = "max_tokens"  # the name the client used, for error messages


# A bad value is quoted in its error, shortened: a 3 MB string or a list nested 900 deep
# becomes a few dozen characters (and never recurses through the whole value).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 40, 40, 4, 4


def shown(value: Any) -> str:
    """`value` as an error message quotes it: repr, cut short."""
    return _SHORT.repr(value)


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # bool is an int subclass: `n: true` must not pass as n == 1.
    return value is None or any(
        value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults
    )


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name}: expected a finite number, got {shown(value)}")
    return float(value)


def _integer(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        raise InvalidRequestError(
            f"{name}: expected an integer in [{lo}, {hi}), got {shown(value)}"
        )
    return value


def _strings(value: Any, name: str) -> list[str]:
    """null, a string, or a list of strings (OpenAI's `stop`)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name}: expected a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:  # counted before any per-item work
        check_stop(value)
    if not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"{name}: expected a string or a list of strings")
    check_stop(value)
    return value


def _token_ids(value: Any, name: str, limit: int, what: str) -> list[int]:
    """Token ids, at most `limit` of them (counted before any per-id work)."""
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name}: expected a list of token ids")
    if len(value) > limit:
        raise InvalidRequestError(f"{name}: {len(value)} token ids, {what}")
    return [_integer(t, f"{name}[{i}]", 0, INT32_MAX + 1) for i, t in enumerate(value)]


def _prompt(prompt: Any, max_len: int) -> ClientRequest:
    """A string, token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and len(prompt) > max_len:
        raise InvalidRequestError(
            f"prompt: {len(prompt)} items cannot fit the context of {max_len} tokens"
        )
    if isinstance(prompt, str):
        return ClientRequest(prompt=prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ClientRequest(prompt_token_ids=_token_ids(prompt, "prompt", max_len, "too many"))
    if isinstance(prompt, list):
        raise InvalidRequestError("prompt: batches of prompts are not supported; send one each")
    raise InvalidRequestError("prompt: expected a string or a list of token ids")


def _content(value: Any, name: str, max_len: int) -> str:
    """A message's content: a string or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name}: expected a string or a list of text parts")
    if len(value) > max_len:
        raise InvalidRequestError(
            f"{name}: {len(value)} parts cannot fit the context of {max_len} tokens"
        )
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequestError(f"{name}[{j}].type: only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{name}[{j}].text: expected a string")
        texts.append(part["text"])
    return "".join(texts)


def _messages(messages: Any, max_len: int) -> ClientRequest:
    """The messages, refused as soon as their count or text cannot fit the context: a few MB of
    them would otherwise be copied, templated and tokenized first."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages: expected a non-empty list of messages")
    check_messages_size((), len(messages), max_len)
    chars, turns = 0, []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}]: expected an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role: expected a non-empty string")
        if message.get("tool_calls"):
            raise InvalidRequestError(f"messages[{i}].tool_calls: not supported ({NO_TOOLS})")
        content = _content(message.get("content"), f"messages[{i}].content", max_len)
        chars += len(role) + len(content)
        if chars > MAX_BYTES_PER_TOKEN * max_len:
            check_messages_size((chars,), len(messages), max_len)
        turns.append(ChatTurn(role, content))
    return ClientRequest(messages=tuple(turns))


def parse_request(body: Any, *, chat: bool, max_len: int) -> ApiRequest:
    """A `/v1/chat/completions` (chat) or `/v1/completions` body as a ClientRequest.

    Unknown fields are ignored, as OpenAI's clients expect of a server; known ones are
    type-checked here and range-checked by the shared validation (`validate_generate`). Lists
    are counted against the context (`max_len`) before their items are looked at.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("body: expected a JSON object")
    for name, defaults in UNSUPPORTED.items():
        if not _is_default(body.get(name), defaults):
            why = NO_TOOLS if name in TOOL_PARAMETERS else NOT_EXACT
            raise InvalidRequestError(
                f"{name}: not supported ({why}); omit it or send {json.dumps(defaults[0])}"
            )
    if chat:
        asked = _messages(body.get("messages"), max_len)
    else:
        if "prompt" not in body:
            raise InvalidRequestError("prompt: required")
        asked = _prompt(body["prompt"], max_len)
    max_tokens_field = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_field = "max_completion_tokens"  # OpenAI's newer name wins over max_tokens
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        max_tokens = _integer(max_tokens, max_tokens_field, 1, INT32_MAX + 1)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0)
    min_p = _number(body, "min_p", 0.0)  # vLLM's and SGLang's extension
    top_k = body.get("top_k")
    if top_k is not None:
        top_k = _integer(top_k, "top_k", -INT32_MAX, INT32_MAX + 1)
    seed = body.get("seed")
    if seed is not None:
        seed = _integer(seed, "seed", 0, UINT64_LIMIT)
    stop = _strings(body.get("stop"), "stop")
    stop_ids: list[int] = []
    if body.get("stop_token_ids") is not None:
        stop_ids = _token_ids(
            body["stop_token_ids"],
            "stop_token_ids",
            MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS}",
        )
    top_k = 0 if top_k in (None, -1) else top_k  # -1: vLLM's and SGLang's "off"
    request = replace(
        asked,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        sampling=SamplingAsked(temperature, top_p, top_k, seed, min_p),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
    )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError(f"stream: expected a boolean, got {shown(stream)}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options: expected an object")
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise InvalidRequestError("stream_options.include_usage: expected a boolean")
    return ApiRequest(request, chat, bool(stream), include_usage, max_tokens_field)


_FIELD = re.compile(r"^[A-Za-z_]\w*(?:\[\d+\]|\.\w+)*")  # messages[0].content[1].type


def error_param(message: str, api: ApiRequest | None) -> tuple[str, str]:
    """(param, message) with the field as the client named it.

    The shared validation names proto fields: "sampling.temperature must be >= 0" becomes
    ("temperature", "temperature must be >= 0"), "prompt_token_ids[2]: …" becomes
    ("prompt[2]", "prompt[2]: …"), and max_tokens becomes max_completion_tokens when the
    client sent that.
    """
    match = _FIELD.match(message)
    if match is None:
        return "", message
    head = match.group()
    name = head.removeprefix("sampling.")
    name = re.sub(r"^prompt_token_ids", "prompt", name)
    if name == "max_tokens" and api is not None:
        name = api.max_tokens_field
    return name, name + message[len(head) :]
