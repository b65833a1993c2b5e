"""GenerateRequest validation: every error names the field, as INVALID_ARGUMENT reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specpair.proto.v1 import target_pb2
from specpair.runtime.sampling import SamplingParams
from specpair.wire import sampling_from_proto
from target_service.chat import chat_prompt_ids

# A served context of max_len tokens holds at most this many bytes of prompt text; real
# tokenizers average ~4 bytes a token, and a whitespace run is one token of up to ~32.
MAX_BYTES_PER_TOKEN = 32


def request_bytes_limit(max_len: int) -> int:
    """The largest GenerateRequest worth reading: a prompt that fills the context, plus 64 KiB
    for stop strings and the rest. A 64 MB prompt is refused before it is parsed, let alone
    tokenized."""
    return 64 * 1024 + MAX_BYTES_PER_TOKEN * max_len


class InvalidRequestError(ValueError):
    """Bad client input; the message starts with the offending field."""


@dataclass(frozen=True, slots=True)
class ValidRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]


def validate_generate(
    request: target_pb2.GenerateRequest,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_len: int,
    bos: int | None = None,
) -> ValidRequest:
    """`bos` (from `special_tokens.prompt_bos`) starts a text prompt; token ids are taken as
    sent, and a chat template writes its own."""
    if request.messages:
        if request.prompt or request.prompt_token_ids:
            raise InvalidRequestError("messages: give either messages or a prompt, not both")
        try:
            ids = chat_prompt_ids(request.messages, tokenizer)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    elif request.prompt and request.prompt_token_ids:
        raise InvalidRequestError("prompt: give either prompt or prompt_token_ids, not both")
    elif request.prompt_token_ids:
        ids = list(request.prompt_token_ids)
        for i, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids[{i}]: {token} is outside the vocabulary [0, {vocab_size})"
                )
    elif request.prompt:
        if tokenizer is None:
            raise InvalidRequestError("prompt: this model has no tokenizer; send prompt_token_ids")
        if len(request.prompt) > MAX_BYTES_PER_TOKEN * max_len:
            raise InvalidRequestError(
                f"prompt: {len(request.prompt)} characters cannot fit the context of "
                f"{max_len} tokens"
            )
        ids = list(tokenizer.encode(request.prompt, add_special_tokens=False))
        if bos is not None:
            ids.insert(0, bos)
    else:
        raise InvalidRequestError("prompt: empty (give prompt text or prompt_token_ids)")
    if not ids:
        raise InvalidRequestError("prompt: encodes to zero tokens")
    if request.max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens: must be > 0, got {request.max_tokens}")
    if len(ids) + request.max_tokens > max_len:
        raise InvalidRequestError(
            f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) "
            f"exceeds the context length {max_len}"
        )
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as exc:
        raise InvalidRequestError(f"sampling.{exc}") from exc
    for i, token in enumerate(request.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids[{i}]: {token} is outside the vocabulary [0, {vocab_size})"
            )
    for i, text in enumerate(request.stop):
        if not text:
            raise InvalidRequestError(f"stop[{i}]: empty stop string")
    return ValidRequest(
        ids, request.max_tokens, sampling, frozenset(request.stop_token_ids), tuple(request.stop)
    )
