"""A client's request checked (`ClientRequest`, from either door): every error names the field,
as INVALID_ARGUMENT reports it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from specpair.proto.v1 import target_pb2
from specpair.runtime.sampling import SamplingParams
from target_service.request_path.chat import chat_prompt_ids
from target_service.request_path.request import ClientRequest

# A served context of max_len tokens holds at most this many bytes of prompt text; real
# tokenizers average ~4 bytes a token, and a whitespace run is one token of up to ~32.
MAX_BYTES_PER_TOKEN = 32
# Per-request bounds that every door applies before any per-item work. OpenAI's API takes at
# most 4 stop sequences; each is scanned against the tail of the text at every round, so its
# length is bounded too. A request id rides in every response and log line.
# One defaults rule for every door (README, "Defaults"): an omitted max_tokens is OpenAI's
# completions default, 16, on gRPC (0, proto3's unset value) and HTTP alike. An omitted
# temperature is OpenAI's 1.0 on the OpenAI door and 0 (greedy) on specpair's own, gRPC and the
# SDK and CLI over it: proto3 cannot tell an unset float from 0.
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256


def request_bytes_limit(max_len: int) -> int:
    """The largest GenerateRequest worth reading: a prompt that fills the context, plus 64 KiB
    for stop strings and the rest. A 64 MB prompt is refused before it is parsed, let alone
    tokenized."""
    return 64 * 1024 + MAX_BYTES_PER_TOKEN * max_len


class InvalidRequestError(ValueError):
    """Bad client input; the message starts with the offending field."""


def check_sizes(request: ClientRequest | target_pb2.GenerateRequest, max_len: int) -> None:
    """The bounds that cost nothing to check: counts and lengths, before any per-item work (a
    prompt of a million ids, or megabytes of chat messages, is refused before templating; the
    gRPC door counts its message's before decoding it)."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id: {len(request.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}"
        )
    if len(request.prompt_token_ids) > max_len:
        raise InvalidRequestError(
            f"prompt_token_ids: {len(request.prompt_token_ids)} tokens cannot fit the context "
            f"of {max_len} tokens"
        )
    check_messages_size(
        (len(m.role) + len(m.content) for m in request.messages), len(request.messages), max_len
    )
    check_stop(request.stop)
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"stop_token_ids: {len(request.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}"
        )


def check_messages_size(sizes: Iterable[int], count: int, max_len: int) -> None:
    """Chat messages whose text (`sizes`: characters per message) cannot fit the context, judged
    before the template renders them: every message is at least one token."""
    if count > max_len:
        raise InvalidRequestError(
            f"messages: {count} messages cannot fit the context of {max_len} tokens"
        )
    chars = sum(sizes)
    if chars > MAX_BYTES_PER_TOKEN * max_len:
        raise InvalidRequestError(
            f"messages: {chars} characters cannot fit the context of {max_len} tokens"
        )


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop: {len(stop)} stop strings, at most {MAX_STOP_STRINGS}")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidRequestError(f"stop[{i}]: empty stop string")
        if len(text) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop[{i}]: {len(text)} characters, at most {MAX_STOP_CHARS}"
            )


@dataclass(frozen=True, slots=True)
class ValidRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stop: tuple[str, ...]


def validate_generate(
    request: ClientRequest,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_len: int,
    bos: int | None = None,
) -> ValidRequest:
    """`bos` (from `special_tokens.prompt_bos`) starts a text prompt; token ids are taken as
    sent, and a chat template writes its own."""
    check_sizes(request, max_len)
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
    max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
    if max_tokens < 0:
        raise InvalidRequestError(f"max_tokens: must be > 0, got {max_tokens}")
    if len(ids) + max_tokens > max_len:
        raise InvalidRequestError(
            f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the context length {max_len}"
        )
    asked = request.sampling
    try:
        sampling = SamplingParams(
            temperature=asked.temperature,
            top_p=asked.top_p,
            top_k=asked.top_k,
            seed=asked.seed,
            min_p=asked.min_p,
        )
    except ValueError as exc:
        raise InvalidRequestError(f"sampling.{exc}") from exc
    for i, token in enumerate(request.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids[{i}]: {token} is outside the vocabulary [0, {vocab_size})"
            )
    return ValidRequest(
        ids, max_tokens, sampling, frozenset(request.stop_token_ids), tuple(request.stop)
    )
