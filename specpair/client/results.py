"""What the SDK hands back: typed results of the target and the controller, and its error."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from specpair.proto.v1 import controller_pb2
from specpair.tiers import TierEstimate


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


class _JSONReady:
    """`to_dict()`: every field, tuples as lists, ready for json.dumps."""

    def to_dict(self) -> dict[str, Any]:
        return _lists(asdict(self))  # type: ignore[call-overload]


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class GenerateDelta(_JSONReady):
    """One streamed message: the tokens a round produced. The last delta has `finish_reason`
    set (and may carry no tokens)."""

    token_ids: tuple[int, ...]
    text: str
    accept_length: int  # accepted drafts of the round; -1 for a round decoded without drafts
    speculative_num_steps: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult(_JSONReady):
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
class TierSwitch(_JSONReady):
    round_id: int
    from_steps: int
    to_steps: int
    reason: str  # "policy", "pin", "unpin" or "reconnect"
    ema: float
    unix_time: float
    from_shape: str = ""  # set where a tier is a tree ("4x4x16"; the steps are its depth)
    to_shape: str = ""

    @property
    def from_tier(self) -> str:
        return self.from_shape or str(self.from_steps)

    @property
    def to_tier(self) -> str:
        return self.to_shape or str(self.to_steps)


@dataclass(frozen=True, slots=True)
class TargetState(_JSONReady):
    """One target as the controller sees it; active_steps 0 until first contact."""

    target_address: str
    connected: bool
    active_steps: int
    ema: float
    pinned_steps: int | None  # None: the policy decides
    rounds_seen: int
    batches_counted: int
    recent_switches: tuple[TierSwitch, ...]
    estimates: tuple[TierEstimate, ...] = ()  # the policy's tokens/s per tier
    model: str = ""  # one line on the model behind the estimates
    # Set where the active or the pinned tier is a tree ("4x4x16"; the steps are its depth).
    active_shape: str = ""
    pinned_shape: str = ""

    @property
    def active_tier(self) -> str:
        """The active tier as written: "7", "4x4x16"."""
        return self.active_shape or str(self.active_steps)

    @property
    def pinned_tier(self) -> str | None:
        return None if self.pinned_steps is None else self.pinned_shape or str(self.pinned_steps)

    @staticmethod
    def from_pb(t: controller_pb2.TargetState) -> TargetState:
        return TargetState(
            target_address=t.target_address,
            connected=t.connected,
            active_steps=t.active_steps,
            ema=t.ema,
            pinned_steps=t.pinned_steps if t.pinned else None,
            rounds_seen=t.rounds_seen,
            batches_counted=t.batches_counted,
            recent_switches=tuple(
                TierSwitch(
                    s.round_id,
                    s.from_steps,
                    s.to_steps,
                    s.reason,
                    s.ema,
                    s.unix_time,
                    s.from_shape,
                    s.to_shape,
                )
                for s in t.recent_switches
            ),
            estimates=tuple(
                TierEstimate(
                    e.steps,
                    e.tokens_per_s,
                    e.round_ms,
                    e.tokens_per_round,
                    e.observed_rounds,
                    e.shape,
                )
                for e in t.estimates
            ),
            model=t.model,
            active_shape=t.active_shape,
            pinned_shape=t.pinned_shape if t.pinned else "",
        )


@dataclass(frozen=True, slots=True)
class ControllerState(_JSONReady):
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
