"""The policy as configured: a kind, its keys, and batch-size bands (SGLang's batch-size-aware
shape), each band with its own candidates, thresholds and learnt state.

The JSON file (and a live update) is one object; without "kind" it is SGLang's rule:

    {"kind": "goodput", "candidate_steps": [0, 1, 3, 7], "min_gain": 0.03,
     "bands": [{"min_batch_size": 16, "candidate_steps": [0, 1, 3]},
               {"min_batch_size": 64, "candidate_steps": [0, 1]}]}

The top-level keys are the band from batch size 1; each band overrides some of them from its
`min_batch_size` up to the next band's (batch 1–15: [0, 1, 3, 7], 16–63: [0, 1, 3], 64+: [0, 1]).
A round goes to the band of its batch size, and the tier commanded is that band's choice.
Tree shapes are listed beside the chains (`"tree_shapes": ["4x4x16"]`, the goodput kind only);
a band that lists its candidate_steps lists its trees too (none unless it sets tree_shapes), so
that `{"min_batch_size": 64, "candidate_steps": [0, 1]}` drops the trees from batch 64 up.
"kind" may also be "package.module:Class" (set at start-up only): a SpeculationPolicy built as
`Class(options, initial_steps)` from the other keys, which it validates itself.
"""

from __future__ import annotations

import importlib
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.policies.goodput.config import GoodputConfig
from controller.policies.goodput.policy import GoodputPolicy
from controller.policies.interface import (
    RegimePolicy,
    RoundSample,
    SpeculationPolicy,
    TierEstimate,
)
from controller.policies.sglang import (
    MAX_BATCH_SIZE,
    AdaptiveSpeculativeParams,
    PolicyConfig,
    is_int,
)
from specpair.capabilities import Modes, Policy, Tiers, check
from specpair.runtime.shape import TreeShape
from specpair.tier_estimate import RegimeSteps

KindConfig = PolicyConfig | GoodputConfig
KindPolicy = AdaptiveSpeculativeParams | GoodputPolicy
KINDS: dict[str, tuple[type[PolicyConfig] | type[GoodputConfig], Any]] = {
    "sglang": (PolicyConfig, AdaptiveSpeculativeParams),
    "goodput": (GoodputConfig, GoodputPolicy),
}


@dataclass(frozen=True, slots=True)
class Band:
    min_batch_size: int
    overrides: dict[str, Any]  # as written, so that to_dict gives the file back
    config: KindConfig


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A validated policy: `bands[0]` (from batch 1) holds the top-level keys."""

    kind: str
    bands: tuple[Band, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # a class kind's other keys
    policy_class: type | None = None
    class_steps: tuple[int, ...] = ()  # a class kind's candidates, from a trial instance

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PolicySpec:
        if not isinstance(values, Mapping):
            raise ValueError(f"policy config must be a JSON object, got {type(values).__name__}")
        rest = dict(values)
        kind = rest.pop("kind", "sglang")
        if not isinstance(kind, str):
            raise ValueError(f"kind must be a string, got {kind!r}")
        if ":" in kind:
            policy_class = load_policy_class(kind)
            # Built once here so that bad options fail at start-up or at the update, by name.
            trial = _construct(policy_class, kind, rest, 0)
            return cls(kind, (), rest, policy_class, tuple(sorted(trial.candidate_steps)))
        if kind not in KINDS:
            raise ValueError(
                f"unknown policy kind {kind!r}; known: {', '.join(KINDS)}, or module:Class"
            )
        raw_bands = rest.pop("bands", [])
        if not isinstance(raw_bands, list | tuple):
            raise ValueError(f"bands must be a list of objects, got {raw_bands!r}")
        listed = [rest, *(b for b in raw_bands if isinstance(b, Mapping))]
        check(Modes(policy=Policy(kind), tiers=Tiers.of(any(b.get("tree_shapes") for b in listed))))
        if kind == "sglang":  # its keys have no tree_shapes: an empty list names none
            rest = _chains(rest)
            raw_bands = [_chains(b) if isinstance(b, Mapping) else b for b in raw_bands]
        top = KINDS[kind][0].from_mapping(rest)
        bands = [Band(1, {}, top)]
        for i, raw in enumerate(raw_bands):
            if not isinstance(raw, Mapping):
                raise ValueError(f"bands[{i}] must be an object, got {raw!r}")
            overrides = dict(raw)
            start = overrides.pop("min_batch_size", None)
            if not is_int(start) or not bands[-1].min_batch_size < start <= MAX_BATCH_SIZE:
                raise ValueError(
                    f"bands[{i}].min_batch_size must be an int above {bands[-1].min_batch_size} "
                    f"(bands ascend; batch 1 is the top level) and at most {MAX_BATCH_SIZE}, "
                    f"got {start!r}"
                )
            own = dict(overrides)
            if "candidate_steps" in own and "tree_shapes" in top.field_names():
                own.setdefault("tree_shapes", ())  # a band lists its tiers: trees too
            try:
                config = top.replace_partial(**own)
            except ValueError as exc:
                raise ValueError(f"bands[{i}]: {exc}") from None
            bands.append(Band(start, {"min_batch_size": start, **overrides}, config))
        return cls(kind, tuple(bands))

    @classmethod
    def of(cls, config: KindConfig) -> PolicySpec:
        """One band of `config`'s kind."""
        return cls.from_mapping({"kind": kind_of(config), **config.to_dict()})

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        """Every chain some band may choose, by its steps."""
        if self.policy_class is not None:
            return self.class_steps
        return tuple(sorted({s for b in self.bands for s in b.config.candidate_steps}))

    @property
    def candidate_tiers(self) -> tuple[TreeShape, ...]:
        """Every tier some band may choose, chains and trees."""
        if self.policy_class is not None:
            return tuple(TreeShape(s) for s in self.class_steps)
        return tuple(sorted({t for b in self.bands for t in b.config.tiers}))

    def to_dict(self) -> dict[str, Any]:
        if self.policy_class is not None:
            return {"kind": self.kind, **self.options}
        out: dict[str, Any] = {"kind": self.kind, **self.bands[0].config.to_dict()}
        if len(self.bands) > 1:
            out["bands"] = [b.overrides for b in self.bands[1:]]
        return out

    def policy_options(self) -> dict[str, Any]:
        """What `reconfigure` of a policy this spec built takes."""
        return dict(self.options) if self.policy_class is not None else self.to_dict()

    def replace_partial(self, **changes: Any) -> PolicySpec:
        """A validated copy with `changes`; a new built-in kind keeps the keys it shares with
        the old one (candidate_steps, the gates) and the bands."""
        kind = changes.get("kind", self.kind)
        if ":" in str(kind) and kind != self.kind:
            raise ValueError("a policy class is chosen at start-up (--policy-class), not live")
        base = self.to_dict()
        if kind != self.kind and kind in KINDS:
            names = KINDS[kind][0].field_names()
            base = {k: v for k, v in base.items() if k in names or k == "bands"}
        return PolicySpec.from_mapping({**base, **changes, "kind": kind})

    def build(self, initial: int | TreeShape) -> SpeculationPolicy:
        if self.policy_class is not None:  # a class policy chooses among chains
            steps = initial.steps if isinstance(initial, TreeShape) else initial
            return _construct(self.policy_class, self.kind, self.options, steps)
        return BandedPolicy(self, initial)


def _construct(
    policy_class: type, kind: str, options: dict[str, Any], initial_steps: int
) -> SpeculationPolicy:
    try:
        policy = policy_class(dict(options), initial_steps)
    except TypeError as exc:
        raise ValueError(f"policy class {kind} (options, initial_steps) failed: {exc}") from None
    if not isinstance(policy, SpeculationPolicy):
        raise ValueError(f"policy class {kind} does not implement SpeculationPolicy")
    return policy


def _chains(values: Mapping[str, Any]) -> dict[str, Any]:
    """The sglang kind's keys, without `tree_shapes` (checked empty by `from_mapping`)."""
    return {k: v for k, v in values.items() if k != "tree_shapes"}


def kind_of(config: KindConfig) -> str:
    return next(k for k, (cfg, _) in KINDS.items() if isinstance(config, cfg))


def load_policy_class(path: str) -> type:
    """`package.module:Class` → the class; ValueError says what is missing."""
    module_name, _, name = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"policy class {path!r} cannot be loaded: {exc}") from None
    if not isinstance(obj, type):
        raise ValueError(f"policy class {path!r} is not a class")
    return obj


class BandedPolicy:
    """One kind policy per band; a round feeds its batch size's band, whose tier is current."""

    def __init__(self, spec: PolicySpec, initial: int | TreeShape) -> None:
        self._start(spec, initial)

    def _start(self, spec: PolicySpec, initial: int | TreeShape) -> None:
        self.spec = spec
        policy_cls = KINDS[spec.kind][1]
        self._starts = [b.min_batch_size for b in spec.bands]
        self._policies: list[KindPolicy] = [policy_cls(b.config, initial) for b in spec.bands]
        self._active = 0

    @property
    def band(self) -> KindPolicy:
        return self._policies[self._active]

    @property
    def candidate_steps(self) -> tuple[int, ...]:
        return self.spec.candidate_steps

    @property
    def candidate_tiers(self) -> tuple[TreeShape, ...]:
        return self.spec.candidate_tiers

    @property
    def current_steps(self) -> int:
        return self.band.current_steps

    @property
    def current_tier(self) -> TreeShape:
        return self.band.current_tier

    @property
    def ema(self) -> float:
        return self.band.ema

    @property
    def count(self) -> int:
        return self.band.count

    @property
    def regime_steps(self) -> RegimeSteps | None:
        return self.band.regime_steps if isinstance(self.band, RegimePolicy) else None

    def observe(self, sample: RoundSample) -> bool:
        old = self.current_tier
        self._active = bisect_right(self._starts, max(sample.batch_size, 1)) - 1
        self.band.observe(sample)
        return self.current_tier != old

    def resume(self, ema: float, count: int) -> None:
        for policy in self._policies:
            policy.resume(ema, count)

    def reconfigure(self, options: Mapping[str, Any]) -> bool:
        """Same kind and band starts: each band keeps what it learnt; otherwise a fresh start
        at the current tier."""
        spec = PolicySpec.from_mapping(options)
        old = self.current_tier
        same_shape = (
            spec.kind == self.spec.kind and [b.min_batch_size for b in spec.bands] == self._starts
        )
        if same_shape:
            for policy, band in zip(self._policies, spec.bands, strict=True):
                policy.reconfigure(band.config)  # type: ignore[arg-type]
            self.spec = spec
        else:
            self._start(spec, old)
        return self.current_tier != old

    def estimates(self) -> tuple[TierEstimate, ...]:
        return self.band.estimates()

    def describe(self) -> str:
        if len(self._starts) == 1:
            return self.band.describe()
        end = self._starts[self._active + 1] - 1 if self._active + 1 < len(self._starts) else "∞"
        return f"band {self._starts[self._active]}–{end}: {self.band.describe()}"
