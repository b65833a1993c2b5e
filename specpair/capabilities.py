"""What specpair serves: the mode axes, and the one table of the combinations it refuses.

Every refusal of a combination of modes is a row of `REFUSALS`, read through `check`: the
configs at construction (`TargetConfig`, `DraftConfig`), the runtime's builders where only a
checkpoint says which mode it is (an EAGLE head is EAGLE-3 by its files) and the controller's
policy kinds (`PolicySpec`, `RequestTiers`). A caller names the axes it knows; an axis it cannot
know is None (the target does not know the draft's kind), and a row on it fires where that axis
is known. Every combination no row refuses is served.

    axis            values                       who knows it
    device          cpu, cuda                    target, draft
    draft           none, model, eagle, eagle3   draft (eagle3: its checkpoint); target: none
    tiers           chains, trees                target, draft, policy (`tree_shapes` given)
    deterministic   off, on                      target
    tensor_parallel one rank, several            target
    token_map       off, on                      draft
    target_model    absent, given                draft (the target checkpoint, `--target-model`)
    policy          sglang, goodput, request     controller (request: per-request tiers,
                                                 `controller.policies.request_tiers:RequestTiers`)

Sampling is per request, not a mode: every combination above serves greedy and sampled
requests alike; which acceptance rule a batch takes is `ACCEPTS` (`runtime/target/accepting.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, device: str) -> Device:
        """`cuda:1` → CUDA."""
        return cls(device.partition(":")[0])


class Draft(StrEnum):
    NONE = "none"  # the target alone (--no-draft)
    MODEL = "model"  # a standalone LM
    EAGLE = "eagle"  # an EAGLE-1/2 head
    EAGLE3 = "eagle3"  # an EAGLE-3 head (its checkpoint says so; --draft-kind eagle)


class Tiers(StrEnum):
    CHAINS = "chains"  # candidate_steps alone
    TREES = "trees"  # tree_shapes too

    @classmethod
    def of(cls, tree_shapes: object) -> Tiers:
        return cls.TREES if tree_shapes else cls.CHAINS


class Policy(StrEnum):
    SGLANG = "sglang"
    GOODPUT = "goodput"
    REQUEST = "request"  # per-request tiers (RequestTiers)


@dataclass(frozen=True, slots=True)
class Modes:
    """One point of the axes; None: not known where it is checked."""

    device: Device | None = None
    draft: Draft | None = None
    tiers: Tiers | None = None
    deterministic: bool | None = None
    tensor_parallel: bool | None = None  # more than one rank
    token_map: bool | None = None
    target_model: bool | None = None
    policy: Policy | None = None


# Every value of every axis, for walking all the combinations (tests, docs).
AXES: dict[str, tuple[object, ...]] = {
    "device": tuple(Device),
    "draft": tuple(Draft),
    "tiers": tuple(Tiers),
    "deterministic": (False, True),
    "tensor_parallel": (False, True),
    "token_map": (False, True),
    "target_model": (False, True),
    "policy": tuple(Policy),
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """A combination refused: when every axis in `when` takes one of its values. `field`: the
    setting the error names (where the combination is set, a flag's field)."""

    field: str
    when: Mapping[str, frozenset[object]]
    reason: str

    def fires(self, modes: Modes) -> bool:
        return all(
            (value := getattr(modes, axis)) is not None and value in values
            for axis, values in self.when.items()
        )

    @property
    def message(self) -> str:
        return f"{self.field}: {self.reason}"


def _refuse(field: str, reason: str, **when: object) -> Refusal:
    sets = {a: frozenset(v if isinstance(v, tuple) else (v,)) for a, v in when.items()}
    unknown = set(sets) - set(AXES)
    assert not unknown, f"no axis {unknown}"
    return Refusal(field, sets, reason)


REFUSALS = (
    _refuse(
        "deterministic",
        "the batch-invariant mode is a GPU mode (--device cuda), not --device cpu",
        deterministic=True,
        device=Device.CPU,
    ),
    # A chain's node at depth d sits at cache position prompt + d, where the target alone puts
    # that token; a tree's sits after its siblings, so its verify sums the same keys in another
    # order (on an H100, 4x4x16 gave other tokens than the target alone at batch 1).
    _refuse(
        "tree_shapes",
        "the batch-invariant mode (--deterministic) serves chains only: a tree node's keys sit "
        "among its siblings', so its attention sums them in another order than the target "
        "alone does",
        deterministic=True,
        tiers=Tiers.TREES,
    ),
    _refuse(
        "tensor_parallel",
        "the batch-invariant mode (--deterministic) runs on one GPU (its kernels' fixed "
        "reduction order does not cover an all-reduce); drop one of the two",
        deterministic=True,
        tensor_parallel=True,
    ),
    _refuse(
        "target_path",
        "an EAGLE head drafts from the target's features and embeddings: it needs the target "
        "checkpoint (--target-model)",
        draft=(Draft.EAGLE, Draft.EAGLE3),
        target_model=False,
    ),
    _refuse(
        "token_map",
        "a token map applies to an EAGLE-1/2 head (--draft-kind eagle), not a draft LM",
        token_map=True,
        draft=Draft.MODEL,
    ),
    _refuse(
        "token_map",
        "an EAGLE-3 head drafts over its own d2t; a token map applies to EAGLE-1/2 heads",
        token_map=True,
        draft=Draft.EAGLE3,
    ),
    # SGLang's adaptive rule moves along one line of tiers by accept length (its topk > 1
    # support, PR #24054, keeps one topk and num_draft_tokens for every tier); a chain and a
    # tree of one depth accept and cost differently, which the rule cannot weigh.
    _refuse(
        "tree_shapes",
        "sglang's rule chooses among chains by accept length; choose tree shapes with kind "
        '"goodput"',
        policy=Policy.SGLANG,
        tiers=Tiers.TREES,
    ),
    # ApplyTier.request_steps carries ints: a request's own tier is a chain.
    _refuse(
        "tree_shapes",
        'per-request tiers are chains; choose tree shapes with kind "goodput"',
        policy=Policy.REQUEST,
        tiers=Tiers.TREES,
    ),
)


class UnsupportedModes(ValueError):
    """A combination of modes `REFUSALS` refuses; the message names the field."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal
        self.field = refusal.field


def refusal(modes: Modes) -> Refusal | None:
    """The first row of `REFUSALS` that refuses `modes`, or None: served."""
    return next((r for r in REFUSALS if r.fires(modes)), None)


def check(modes: Modes) -> None:
    """Raises `UnsupportedModes` (a ValueError naming the field) where `REFUSALS` refuses
    `modes`."""
    if (found := refusal(modes)) is not None:
        raise UnsupportedModes(found)


def combinations() -> Iterator[Modes]:
    """Every point of `AXES`."""
    names = [f.name for f in fields(Modes)]
    for values in itertools.product(*(AXES[n] for n in names)):
        yield Modes(**dict(zip(names, values, strict=True)))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Accept:
    """How a verified batch accepts (`runtime/target/accepting.py`); served in every mode."""

    batch: str  # what the batch's requests and trees are
    rule: str  # `runtime/accept.py`'s function
    paths: tuple[str, ...]  # where it may run (`accepting.ACCEPT_PATHS`)


ACCEPTS = (
    Accept("all greedy, chains or trees", "accept_greedy_argmax", ("greedy",)),
    Accept("sampled, all chains", "accept_chains", ("graph", "device")),
    Accept("sampled trees without q (a tree shape's)", "accept_trees", ("graph", "device")),
    Accept("sampled trees with q, or --deterministic", "accept_sampling", ("host",)),
)
