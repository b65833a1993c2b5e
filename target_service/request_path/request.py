"""What a client asks of the target, whichever door it came in by, as it was sent.

The gRPC door decodes its GenerateRequest (`from_proto`), the HTTP door parses its JSON body
(`openai_request.parse_request`); both hand a `ClientRequest` to the one request path
(`frontend.py`), whose validation (`validation.validate_generate`) checks every field, naming
it. Nothing here is checked yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from specpair.proto.v1 import target_pb2


class ChatTurn(NamedTuple):
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingAsked:
    """The sampling parameters as sent (`SamplingParams` once validated)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    seed: int | None = None
    min_p: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """Exactly one of `prompt` (text), `prompt_token_ids` and `messages` is expected."""

    prompt: str = ""
    prompt_token_ids: Sequence[int] = ()
    messages: Sequence[ChatTurn] = ()
    max_tokens: int = 0  # 0: the default (validation.DEFAULT_MAX_TOKENS)
    sampling: SamplingAsked = field(default_factory=SamplingAsked)
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    request_id: str = ""  # the client's, echoed in logs and responses


def from_proto(msg: target_pb2.GenerateRequest) -> ClientRequest:
    """A GenerateRequest as the request path reads it (the gRPC door counts its lists first:
    `validation.check_sizes`)."""
    return ClientRequest(
        prompt=msg.prompt,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        messages=tuple(ChatTurn(m.role, m.content) for m in msg.messages),
        max_tokens=msg.max_tokens,
        sampling=SamplingAsked(
            temperature=msg.sampling.temperature,
            top_p=msg.sampling.top_p if msg.sampling.HasField("top_p") else 1.0,
            top_k=msg.sampling.top_k,
            seed=msg.sampling.seed if msg.sampling.HasField("seed") else None,
            min_p=msg.sampling.min_p,
        ),
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        request_id=msg.request_id,
    )
