"""One target as the controller sees it, and its tier switches: made by the controller, read
back by the SDK (which re-exports both), so that neither imports the other."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specpair.proto.v1 import controller_pb2
from specpair.tier_estimate import TierEstimate


class JSONReady:
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
class TierSwitch(JSONReady):
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
class TargetState(JSONReady):
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
