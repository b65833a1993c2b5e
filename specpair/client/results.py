"""What the SDK hands back: typed results of the target and the controller, and its error (a
target's state as the controller reports it is `specpair/target_state.py`'s, which the controller
shares)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from specpair.proto.v1 import controller_pb2
from specpair.target_state import JSONReady, TargetState


class SpecpairError(RuntimeError):
    """A failed RPC: `code` is the gRPC status name (e.g. "INVALID_ARGUMENT"), `details` the
    server's message, which names the offending field."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    @staticmethod
    def from_rpc(error: grpc.RpcError) -> SpecpairError:
        # Both grpc.Call (sync) and grpc.aio.AioRpcError carry code() and details().
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else None
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        return SpecpairError(name, details or str(error))


@dataclass(frozen=True, slots=True)
class GenerateDelta(JSONReady):
    """One streamed message: the tokens a round produced. The last delta has `finish_reason`
    set (and may carry no tokens)."""

    token_ids: tuple[int, ...]
    text: str
    accept_length: int  # accepted drafts of the round; -1 for a round decoded without drafts
    speculative_num_steps: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult(JSONReady):
    """A finished generation, folded from its stream."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "length" | "stop"
    accept_lengths: tuple[int, ...]  # per speculative round, bonus token excluded
    prompt_tokens: int
    completion_tokens: int
    avg_accept_length: float
    rounds: int
    plain_rounds: int
    request_id: str


@dataclass(frozen=True, slots=True)
class ControllerState(JSONReady):
    """GetState: the live policy (its keys as in a policy JSON file) and every target."""

    policy: dict[str, Any]
    targets: tuple[TargetState, ...]


def targets_from_pb(targets: Any) -> tuple[TargetState, ...]:
    return tuple(TargetState.from_pb(t) for t in targets)


def policy_from_pb(message: controller_pb2.PolicyConfig) -> dict[str, Any]:
    """The policy as its keys are written in a policy file: the wire carries the keys beyond
    SGLang's (the goodput kind's, bands) as one JSON string, `options_json`, unpacked here."""
    policy = message_to_dict(message)
    options = policy.pop("options_json")
    return policy | (json.loads(options) if options else {})


def message_to_dict(message: Message) -> dict[str, Any]:
    """Every field by its proto name, defaults included; 64-bit ints stay ints and enums become
    their names (json_format would quote uint64s as strings)."""
    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.is_repeated:
            out[fd.name] = [_field_value(fd, v) for v in value]
        elif fd.has_presence and fd.type != FieldDescriptor.TYPE_MESSAGE:
            out[fd.name] = _field_value(fd, value) if message.HasField(fd.name) else None
        else:
            out[fd.name] = _field_value(fd, value)
    return out


def _field_value(fd: Any, value: Any) -> Any:  # fd: a FieldDescriptor (python or upb)
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if fd.type == FieldDescriptor.TYPE_ENUM:
        enum_value = fd.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    return value
