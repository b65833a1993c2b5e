"""What the controller keeps across a restart: the pin, the live policy and each target's EMA.

Without it a restarted controller came back unpinned with a fresh EMA and moved a pinned tier.
The file is small JSON, rewritten whole (write + rename) on every pin, unpin, policy update,
tier switch and at shutdown:

    {"pinned_steps": 7, "policy": {"candidate_steps": [1, 3, 7], ...},
     "targets": {"10.0.0.5:50051": {"steps": 7, "ema": 5.8, "count": 42}}}

A tree-shaped tier is written as on the wire, its steps with its shape beside them
("pinned_shape": "4x4x16", a target's "shape"); a file without them names chains.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpair.runtime.shape import TreeShape, tier_from_wire, tier_name


@dataclass(frozen=True, slots=True)
class TargetMemory:
    tier: TreeShape  # the tier the policy chose (not the pin)
    ema: float
    count: int


@dataclass(frozen=True, slots=True)
class Memory:
    pinned: TreeShape | None = None
    policy: dict[str, Any] | None = None  # PolicyConfig.to_dict(); None: the configured one
    targets: dict[str, TargetMemory] = field(default_factory=dict)


def load(path: Path) -> Memory:
    """The saved memory, or an empty one when there is no file yet; ValueError names a bad
    file (a controller must not start on state it cannot read)."""
    if not path.exists():
        return Memory()
    try:
        raw = json.loads(path.read_text())
        steps = raw.get("pinned_steps")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)):
            raise ValueError(f"pinned_steps must be an int or null, got {steps!r}")
        shape = str(raw.get("pinned_shape") or "")
        pinned = None if steps is None else tier_from_wire(steps, shape, "pinned_shape")
        targets = {
            str(address): TargetMemory(
                tier_from_wire(int(t["steps"]), str(t.get("shape") or ""), "shape"),
                float(t["ema"]),
                int(t["count"]),
            )
            for address, t in raw.get("targets", {}).items()
        }
        policy = raw.get("policy")
        if policy is not None and not isinstance(policy, dict):
            raise ValueError(f"policy must be an object, got {policy!r}")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"controller state {path}: {exc}") from None
    return Memory(pinned, policy, targets)


def save(path: Path, memory: Memory) -> None:
    pinned = memory.pinned
    raw: dict[str, Any] = {"pinned_steps": None if pinned is None else pinned.steps}
    if pinned is not None and not pinned.is_chain:
        raw["pinned_shape"] = tier_name(pinned)
    raw["policy"] = memory.policy
    raw["targets"] = {
        address: {"steps": t.tier.steps, "ema": t.ema, "count": t.count}
        | ({} if t.tier.is_chain else {"shape": tier_name(t.tier)})
        for address, t in memory.targets.items()
    }
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(raw, indent=1))
    os.replace(partial, path)  # a crash mid-write leaves the previous file whole
