"""What the draft and the target both take (`ModelServiceConfig`), and its fields' values."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from specpair.config.option import lab, option
from specpair.runtime.shape import TreeShape, parse_tiers

CANDIDATE_STEPS = (1, 3, 7)
# The bundled model pair; `specpair up` falls back to a generated tiny pair without it.
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def _check_steps(steps: tuple[int, ...]) -> None:
    """Tier 0 (no drafts: target-only rounds) is a tier like any other, built when listed."""
    if len(steps) < 1 or any(s < 0 for s in steps) or list(steps) != sorted(set(steps)):
        raise ValueError(
            f"candidate_steps must be sorted distinct ints >= 0 (0: no drafts), got {steps}"
        )


class DType(StrEnum):
    AUTO = "auto"  # float32 on the CPU, bfloat16 on CUDA
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def check_device(device: str) -> str:
    kind, sep, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (sep and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return device


BUSY_POLL_MS_CUDA = 20.0


def compute_threads(requested: int) -> int:
    """`requested` intra-op threads, or for 0 half the cores (ModelServiceConfig says why)."""
    return requested if requested > 0 else max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelServiceConfig:
    """What the draft and the target both take; every "auto" is resolved here, at construction.

    threads 0 → half the cores: draft and target usually share the machine, and torch ops
    launched from a non-main thread with more OpenMP threads than that ran much slower on a
    2-core CPU (`bench/CHOICES.md`).

    busy_poll_ms None → 20 on CUDA, 0 on the CPU: a loop that sleeps in epoll while the peer
    computes wakes up cold, so each one-way message arrives later than between two loops that
    never sleep, and the compute right after runs slower. Polling costs a core while a round
    is out, so only a CUDA service, whose compute does not need that core, polls by default.
    """

    candidate_steps: tuple[int, ...] = field(
        default=CANDIDATE_STEPS,
        metadata=option("tiers (speculative_num_steps) to build; 0: no drafts"),
    )
    tree_shapes: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "tree-shaped tiers to build beside the chains, STEPSxTOPKxNODES "
            "(e.g. 4x4x16; repeat the flag for more)"
        ),
    )
    max_len: int = field(
        default=1024,
        metadata=option("context length served: prompt + max_tokens must fit"),
    )
    device: str = field(default="cpu", metadata=option("cpu | cuda | cuda:N"))
    dtype: DType = field(default=DType.AUTO, metadata=option("weights and activations"))
    threads: int = field(
        default=0, metadata=option("intra-op threads of the compute thread (0: half the cores)")
    )
    busy_poll_ms: float | None = field(
        default=None,
        metadata=lab(
            "poll for the peer's next message this long, in ms, before sleeping "
            f"(default: {BUSY_POLL_MS_CUDA:g} on CUDA, 0 on the CPU)"
        ),
    )
    no_gc_freeze: bool = field(
        default=False,
        metadata=lab(
            "leave the heap unfrozen once serving: Python's full collections then walk every "
            "object start-up made (`specpair/rpc/gc_heap.py`)"
        ),
    )

    def _resolve(self) -> None:
        _check_steps(self.candidate_steps)
        check_device(self.device)
        tiers = parse_tiers(self.candidate_steps, self.tree_shapes)  # ShapeError names the shape
        # canonical ("4X4X16" → "4x4x16"), as the controller keeps them: GetServerInfo reports them
        object.__setattr__(self, "tree_shapes", tuple(str(t) for t in tiers if not t.is_chain))
        if self.max_len < 1:
            raise ValueError("max_len must be >= 1")
        cuda = self.device.startswith("cuda")
        dtype = DType(self.dtype)  # ValueError names the bad value
        if dtype is DType.AUTO:
            dtype = DType.BFLOAT16 if cuda else DType.FLOAT32
        object.__setattr__(self, "dtype", dtype)
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        object.__setattr__(self, "threads", compute_threads(self.threads))
        poll = self.busy_poll_ms
        if poll is None:
            poll = BUSY_POLL_MS_CUDA if cuda else 0.0
        object.__setattr__(self, "busy_poll_ms", max(float(poll), 0.0))

    @property
    def tiers(self) -> tuple[TreeShape, ...]:
        """Every tier to build: candidate_steps' chains and tree_shapes, sorted."""
        return parse_tiers(self.candidate_steps, self.tree_shapes)

    @property
    def busy_poll_s(self) -> float:
        return (self.busy_poll_ms or 0.0) / 1e3
