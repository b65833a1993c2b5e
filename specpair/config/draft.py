"""The draft service's settings (`specpair serve draft`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from specpair.capabilities import Device, Draft, Modes, Tiers, check
from specpair.config.model_service import ModelServiceConfig
from specpair.config.option import option
from specpair.config.server_config import ServerConfig

# A hand-off graph per batch bucket holds bucket × rows of the draft's activations (64 × 256
# rows of an 8B-sized EAGLE-3 layer: ~1 GB at its MLP); a wider window's hand-offs run eagerly.
MAX_HANDOFF_ROWS = 256


class DraftKind(StrEnum):
    MODEL = "model"  # a standalone small LM sharing the target's tokenizer
    EAGLE = "eagle"  # an EAGLE head over the target's features (needs the target checkpoint)


@dataclass(frozen=True, slots=True)
class DraftConfig(ModelServiceConfig):
    server: ServerConfig
    model_path: Path = field(metadata=option("draft LM or EAGLE head dir", flag="--model"))
    draft_kind: DraftKind = field(default=DraftKind.MODEL, metadata=option("what --model is"))
    target_path: Path | None = field(
        default=None, metadata=option("target checkpoint (EAGLE only)", flag="--target-model")
    )
    token_map: Path | None = field(
        default=None,
        metadata=option(
            "the ids an EAGLE-1/2 head drafts over (a frequency-ranked token map, "
            "SGLang's .pt or a JSON list; python -m specpair.models.token_map "
            "writes one): its LM head keeps only their rows"
        ),
    )
    max_requests: int = field(default=64, metadata=option("requests drafted for at once"))
    max_target_requests: int = field(
        default=0,
        metadata=option(
            "requests one target (all its Round streams) may hold; lower it when "
            "several targets share this draft (0: max_requests with an ops token; "
            "without one, where a target is only the host it connects from, half "
            "of max_requests)"
        ),
    )
    handoff_rows: int = field(
        default=0,
        metadata=option(
            "a target's prompt hand-off up to this many rows (its --draft-window) extends in "
            "CUDA graphs of that width, one a batch bucket, on a GPU; 0: eagerly"
        ),
    )

    def __post_init__(self) -> None:
        self._resolve()
        object.__setattr__(self, "draft_kind", DraftKind(self.draft_kind))
        check(self.modes)
        if self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if not 0 <= self.handoff_rows <= MAX_HANDOFF_ROWS:
            raise ValueError(
                f"handoff_rows must be in [0, {MAX_HANDOFF_ROWS}] (0: eagerly), "
                f"got {self.handoff_rows}"
            )
        if not 0 <= self.max_target_requests <= self.max_requests:
            raise ValueError(
                f"max_target_requests must be in [0, max_requests {self.max_requests}], "
                f"got {self.max_target_requests}"
            )
        if self.max_target_requests == 0:
            # Without a token no stream proves who opened it: no one host may hold it all.
            share = self.max_requests if self.server.ops_token else max(1, self.max_requests // 2)
            object.__setattr__(self, "max_target_requests", share)

    @property
    def modes(self) -> Modes:
        """The axes of `capabilities` this draft sets; an EAGLE head's generation (EAGLE-3 or
        not) is its checkpoint's, checked where it loads (`runtime.build.check_drafter`)."""
        return Modes(
            device=Device.of(self.device),
            draft=Draft.EAGLE if self.draft_kind is DraftKind.EAGLE else Draft.MODEL,
            tiers=Tiers.of(self.tree_shapes),
            token_map=self.token_map is not None,
            target_model=self.target_path is not None,
        )

    @property
    def cache_len(self) -> int:
        """Positions a request may hold: the context served plus the deepest tier's drafts."""
        return self.max_len + max(t.draft_headroom for t in self.tiers)
