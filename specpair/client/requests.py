"""Request building and response folding: everything of the SDK that does not wait on I/O."""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from google.protobuf.descriptor import FieldDescriptor

from specpair.client.results import GenerateDelta, GenerateResult, SpecpairError
from specpair.proto.v1 import common_pb2, controller_pb2, target_pb2
from specpair.runtime.shape import TreeShape, tier_name

Prompt = str | Sequence[int]
# [{"role": "system", "content": "…"}, {"role": "user", "content": "…"}, …]
Messages = Sequence[Mapping[str, str]]

FINISH_REASONS = {
    target_pb2.FINISH_REASON_LENGTH: "length",
    target_pb2.FINISH_REASON_STOP: "stop",
}


class GenerateParams(TypedDict, total=False):
    """The keyword arguments every generate/stream/chat call takes; each may be omitted. An
    omitted max_tokens is the server's default (16, on every door); an omitted temperature is
    0, greedy (README, "Defaults")."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    request_id: str | None


def build_generate_request(
    prompt: Prompt, **params: Unpack[GenerateParams]
) -> target_pb2.GenerateRequest:
    """The wire request. Values are checked by the server, which names the bad field; here we
    only reject what cannot be encoded at all, and a max_tokens the wire would misread."""
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        # 0 is proto3's unset (the server's default of 16): refused as the HTTP door refuses it
        raise ValueError(
            f"max_tokens: expected an integer of at least 1 (omit it for the server's default), "
            f"got {max_tokens}"
        )
    request = target_pb2.GenerateRequest(
        max_tokens=max_tokens or 0,  # 0: unset, the server's default
        sampling=common_pb2.SamplingParams(
            temperature=params.get("temperature", 0.0),
            top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", 0),
            min_p=params.get("min_p", 0.0),
        ),
        stop=list(params.get("stop") or ()),
        stop_token_ids=list(params.get("stop_token_ids") or ()),
        request_id=params.get("request_id") or "",
    )
    if (seed := params.get("seed")) is not None:
        request.sampling.seed = seed
    # A str is itself a Sequence, so it must be tested first.
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        try:
            # operator.index takes numpy ints too, and refuses floats and strings.
            request.prompt_token_ids.extend([operator.index(t) for t in prompt])
        except TypeError:
            raise TypeError("prompt must be a str or a sequence of int token ids") from None
    return request


def build_chat_request(
    messages: Messages, **params: Unpack[GenerateParams]
) -> target_pb2.GenerateRequest:
    """A GenerateRequest with `messages` (no prompt): the server applies its chat template."""
    request = build_generate_request((), **params)
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"messages[{i}] must map 'role' and 'content' to strings")
        request.messages.add(role=role, content=content)
    return request


def to_delta(response: target_pb2.GenerateResponse) -> GenerateDelta:
    return GenerateDelta(
        token_ids=tuple(response.token_ids),
        text=response.text,
        accept_length=response.accept_length,
        speculative_num_steps=response.speculative_num_steps,
        finish_reason=FINISH_REASONS.get(response.finish_reason),
    )


@dataclass(slots=True)
class Fold:
    """Accumulates a Generate stream into a GenerateResult."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Per-round accept lengths seen on the stream: the fallback if no stats arrive.
    round_accepts: list[int] = field(default_factory=list)
    plain_rounds: int = 0
    request_id: str = ""
    last: target_pb2.GenerateResponse | None = None

    def add(self, response: target_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        if response.token_ids:
            if response.accept_length >= 0:
                self.round_accepts.append(response.accept_length)
            else:
                self.plain_rounds += 1
        self.request_id = response.request_id or self.request_id
        self.last = response

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or last.finish_reason not in FINISH_REASONS:
            raise SpecpairError("INTERNAL", "Generate stream ended without a finish_reason")
        # The server's final stats are authoritative (they count rounds that produced no new
        # tokens for this request); the per-round values are only a fallback.
        if last.HasField("speculation"):
            spec = last.speculation
            accepts = tuple(spec.accept_lengths)
            rounds, plain, avg = spec.rounds, spec.plain_rounds, spec.avg_accept_length
        else:
            accepts = tuple(self.round_accepts)
            rounds = len(accepts) + self.plain_rounds
            plain = self.plain_rounds
            avg = sum(accepts) / len(accepts) if accepts else 0.0
        usage = last.usage if last.HasField("usage") else None
        return GenerateResult(
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=FINISH_REASONS[last.finish_reason],
            accept_lengths=accepts,
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else len(self.token_ids),
            avg_accept_length=avg,
            rounds=rounds,
            plain_rounds=plain,
            request_id=self.request_id,
        )


# The Python type of each policy key, read off UpdatePolicyRequest: the proto is the one list.
_SCALARS = {
    FieldDescriptor.CPPTYPE_DOUBLE: float,
    FieldDescriptor.CPPTYPE_FLOAT: float,
    FieldDescriptor.CPPTYPE_INT32: int,
    FieldDescriptor.CPPTYPE_INT64: int,
    FieldDescriptor.CPPTYPE_UINT32: int,
    FieldDescriptor.CPPTYPE_UINT64: int,
    FieldDescriptor.CPPTYPE_STRING: str,
    FieldDescriptor.CPPTYPE_BOOL: bool,
}
POLICY_FIELDS = {
    fd.name: (_SCALARS[fd.cpp_type], fd.is_repeated)
    for fd in controller_pb2.UpdatePolicyRequest.DESCRIPTOR.fields
    if fd.name not in ("options_json", "set_tree_shapes")  # the latter: set by tree_shapes
}
# Keys of the goodput kind and of bands, sent as UpdatePolicyRequest.options_json; None: any
# JSON value (a string is parsed as JSON: `bands='[{"min_batch_size": 16, "candidate_steps":
# [0, 1]}]'`).
POLICY_OPTIONS: dict[str, type | None] = {
    "min_gain": float,
    "explore_margin": float,
    "probe_interval": int,
    "probe_rounds": int,
    "probe_budget": float,
    "acceptance_window": int,
    "profile_ms": None,
    "sampled_profile_ms": None,
    "bands": None,
}


def build_policy_update(**changes: Any) -> controller_pb2.UpdatePolicyRequest:
    """A partial UpdatePolicyRequest. Values may be strings (`ctl policy ema_alpha=0.3`); a
    list key such as `candidate_steps` may be "1,3,7" or a sequence. Ranges are checked by the
    controller."""
    if not changes:
        raise ValueError("a policy update needs at least one KEY=VALUE")
    request = controller_pb2.UpdatePolicyRequest()
    options: dict[str, Any] = {}
    for key, value in changes.items():
        if key in POLICY_OPTIONS:
            option = POLICY_OPTIONS[key]
            options[key] = _coerce(key, option, value) if option else _json_value(key, value)
            continue
        if key not in POLICY_FIELDS:
            known = ", ".join([*POLICY_FIELDS, *POLICY_OPTIONS])
            raise ValueError(f"unknown policy key {key!r} (known: {known})")
        kind, repeated = POLICY_FIELDS[key]
        if repeated:
            items = value.split(",") if isinstance(value, str) else value
            items = [i for i in items if i != ""]  # `tree_shapes=` drops every tree shape
            getattr(request, key).extend([_coerce(key, kind, item) for item in items])
            request.set_tree_shapes |= key == "tree_shapes"
        else:
            setattr(request, key, _coerce(key, kind, value))
    if options:
        request.options_json = json.dumps(options)
    return request


def _json_value(key: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: expected JSON, got {value!r} ({exc})") from None


def _coerce(key: str, kind: type, value: Any) -> Any:
    if kind is bool:  # `ctl policy expect_tail=false`: bool("false") would be True
        if isinstance(value, bool):
            return value
        flag = {"true": True, "false": False}.get(str(value).lower())
        if flag is None:
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return flag
    # bool is an int subclass: `update_interval=True` is a mistake, not 1; and int(2.5) == 2
    # would apply a value nobody asked for, so an int field takes only integers.
    if isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{key}: expected str, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {kind.__name__}, got {value!r}") from None


def build_pin(tier: int | str) -> controller_pb2.PinTierRequest:
    """A PinTierRequest for a chain (7, "7") or a tree shape ("4x4x16": its steps in the int
    field, the shape beside it); ValueError (a ShapeError) names a tier that is none."""
    if isinstance(tier, bool) or not isinstance(tier, int | str):
        raise ValueError(f"a tier is STEPS or STEPSxTOPKxNUM_DRAFT_TOKENS, got {tier!r}")
    shape = TreeShape.parse(tier)
    return controller_pb2.PinTierRequest(speculative_num_steps=shape.steps, shape=tier_name(shape))
