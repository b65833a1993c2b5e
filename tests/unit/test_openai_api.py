"""OpenAI request bodies → ClientRequest, and GenerateResponses → OpenAI's objects (pure)."""

from __future__ import annotations

import re

import pytest

from specpair.proto.v1 import target_pb2
from target_service.http_door.openai_request import ApiRequest, error_param, parse_request
from target_service.http_door.openai_response import ResponseWriter
from target_service.request_path.request import ClientRequest
from target_service.request_path.validation import DEFAULT_MAX_TOKENS, InvalidRequestError

USER = [{"role": "user", "content": "hi"}]


def test_every_supported_field_lands_in_the_generate_request() -> None:
    api = parse_request(
        {
            "model": "whatever",
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "hi", "name": "ignored"},
            ],
            "max_tokens": 3,
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.25,
            "top_k": -1,
            "seed": 2**63,
            "stop": "\n",
            "stop_token_ids": [0, 7],
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "presence_penalty": 0,
            "logprobs": False,
            "user": "ignored",
            "something_new": {"ignored": True},
        },
        chat=True,
        max_len=1024,
    )
    g = api.generate
    assert [(m.role, m.content) for m in g.messages] == [("system", "ab"), ("user", "hi")]
    assert g.max_tokens == 9 and api.max_tokens_field == "max_completion_tokens"
    assert g.sampling.temperature == 0.5 and g.sampling.top_p == 0.25
    assert g.sampling.top_k == 0 and g.sampling.seed == 2**63
    assert list(g.stop) == ["\n"] and list(g.stop_token_ids) == [0, 7]
    assert api.chat and api.stream and api.include_usage


def test_omitted_fields_take_openai_defaults() -> None:
    api = parse_request({"prompt": [1, 2]}, chat=False, max_len=1024)
    assert list(api.generate.prompt_token_ids) == [1, 2] and api.generate.prompt == ""
    assert api.generate.max_tokens == DEFAULT_MAX_TOKENS
    assert api.generate.sampling.temperature == 1.0 and api.generate.sampling.top_p == 1.0
    assert api.generate.sampling.seed is None
    assert not api.stream and not api.include_usage
    assert parse_request({"prompt": ["one"]}, chat=False, max_len=1024).generate.prompt == "one"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": USER, "n": True}, "n"),  # a bool is not the integer 1
        ({"messages": USER, "echo": 0}, "echo"),
        ({"messages": USER, "temperature": float("inf")}, "temperature"),
        ({"messages": USER, "seed": 2**64}, "seed"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]}, "messages[0]"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_bad_fields_are_named(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{re.escape(field)}"):
        parse_request(body, chat=True, max_len=1024)


@pytest.mark.parametrize(
    ("message", "max_field", "param", "text"),
    [
        (
            "sampling.temperature must be >= 0, got -1.0",
            "max_tokens",
            "temperature",
            "temperature must be >= 0, got -1.0",
        ),
        (
            "prompt_token_ids[2]: 9999 is outside",
            "max_tokens",
            "prompt[2]",
            "prompt[2]: 9999 is outside",
        ),
        (
            "max_tokens: must be > 0",
            "max_completion_tokens",
            "max_completion_tokens",
            "max_completion_tokens: must be > 0",
        ),
        (
            "messages[0].content[1].type: only text",
            "max_tokens",
            "messages[0].content[1].type",
            "messages[0].content[1].type: only text",
        ),
    ],
)
def test_error_param_names_the_field_as_the_client_sent_it(
    message: str, max_field: str, param: str, text: str
) -> None:
    api = ApiRequest(ClientRequest(), chat=True, max_tokens_field=max_field)
    assert error_param(message, api) == (param, text)


def test_chunks_skip_rounds_without_text_and_finish_with_stats() -> None:
    api = parse_request({"messages": USER, "stream": True}, chat=True, max_len=1024)
    writer = ResponseWriter(api, "m")
    first = writer.chunks(
        target_pb2.GenerateResponse(request_id="r", speculative_num_steps=3), True
    )
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[0]["id"] == "chatcmpl-r" and first[0]["object"] == "chat.completion.chunk"
    empty = target_pb2.GenerateResponse(request_id="r", token_ids=[5], accept_length=0)
    assert writer.chunks(empty, False) == []  # a split character: nothing to say yet
    last = target_pb2.GenerateResponse(
        request_id="r",
        text="ok",
        finish_reason=target_pb2.FINISH_REASON_STOP,
        usage=target_pb2.Usage(prompt_tokens=2, completion_tokens=4),
        speculation=target_pb2.SpeculationStats(
            accept_lengths=[1, 2], rounds=3, plain_rounds=1, avg_accept_length=1.5
        ),
    )
    (chunk,) = writer.chunks(last, False)
    assert chunk["choices"][0] == {
        "index": 0,
        "delta": {"content": "ok"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert chunk["meta_info"] == {
        "request_id": "r",
        "accept_lengths": [1, 2],
        "avg_accept_length": 1.5,
        "rounds": 3,
        "plain_rounds": 1,
        "speculative_num_steps": 3,
    }
    assert "usage" not in chunk  # only with stream_options.include_usage


def test_the_readme_refuses_exactly_what_the_server_refuses() -> None:
    # README once listed min_p as honoured and as refused; the server honours it.
    from pathlib import Path

    from target_service.http_door.openai_request import TOOL_PARAMETERS, UNSUPPORTED

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("because speculation does not apply them exactly yet:")
    refused = set(re.findall(r"`(\w+)`", readme[start : readme.index(";", start)]))
    assert refused == set(UNSUPPORTED) - TOOL_PARAMETERS
    parsed = parse_request({"prompt": "x", "min_p": 0.1}, chat=False, max_len=64)
    assert parsed.generate.sampling.min_p == 0.1
