"""A request as the scheduler serves it: its sequence, and the events its client reads."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specpair.runtime.target.worker import TargetSequence


@dataclass(frozen=True, slots=True)
class RoundEvent:
    """New tokens of one request from one round (or its prefill)."""

    token_ids: list[int]
    accept_length: int  # -1: the round had no drafts for this request
    tier: int
    finish_reason: str | None


@dataclass(eq=False)
class ServedRequest:
    seq: TargetSequence
    events: asyncio.Queue[RoundEvent] = field(default_factory=asyncio.Queue)
    cancelled: str | None = None  # outcome once the client went away or a stop string hit
    accept_lengths: list[int] = field(default_factory=list)
    plain_rounds: int = 0
    deadline: float | None = None  # time.monotonic() past which the client no longer waits
    arrived: float = field(default_factory=time.monotonic)  # `Scheduler._waits_for_group`

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline
