"""A round's stages as each tier's state holds them: verify (target), extend and draft (draft).

Every stage is *planned* for one batch — in line (`plan`), or ahead by a service while its peer
computes (`prepare`; only CUDA graphs have anything to plan ahead) — then *run*. The eager
stages here serve the CPU, and the GPU where no graph fits (`graphs/` falls back to them); the
CUDA-graph stages of `graphs/verify.py` and `graphs/draft.py` have the same interfaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from specpair.models.llama import LlamaModel
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.lookahead import Lookahead

if TYPE_CHECKING:
    from specpair.runtime.accept import ChainBatch
    from specpair.runtime.draft import Drafter, DraftQ, DraftSampling
    from specpair.runtime.round import DraftInput


class VerifyStage(Protocol):
    """The target's forward over a batch of candidate trees."""

    cache: KVCache  # the target worker's: a stage serves that worker only
    plans_ahead: bool  # whether `prepare` does anything
    ahead: int  # verifies that ran on a plan made ahead

    def prepare(self, positions: Tensor, layout: BatchLayout, key: object) -> None:
        """Plans ahead the verify whose plan key will be `key` (see `planned_for`)."""

    def plan(self, positions: Tensor, layout: BatchLayout) -> None:
        """Plans the next `run` for positions [B, T] placed by `layout`."""

    def planned_for(self, key: object) -> bool:
        """Whether a plan made ahead serves the verify of `key` (then it needs no `plan`)."""

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Host tokens [B, T] -> hidden [B, T, H], float logits [B, T, V] (device)."""

    def accept(self, chains: ChainBatch) -> list[list[int]] | None:
        """The sampled accept of the batch `run` just verified, in a graph of its own: per
        request [accepted drafts, last token]; None where none serves (the caller accepts
        eagerly from the logits, left in place)."""

    def read_gpu_ms(self) -> float:
        """GPU time of the graph replays since the last read (0: none ran)."""


class ExtendStage(Protocol):
    """The draft's forward over what the target appended; commits the rows to its cache."""

    cache: KVCache  # the drafter's: a stage serves that drafter only
    plans_ahead: bool
    ahead: int  # extends that ran on a plan made ahead

    def prepare(self, slots: list[int]) -> None:
        """Plans the next extend of `slots` before its tokens arrive."""

    def run(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        """Hidden of each request's last appended row, [B', 1, H] with B' >= B (rows past B:
        a graph's padding) on the device."""


class DraftStage(Protocol):
    """s draft steps of one token per request after the extend (s = the tier): greedy
    (`run`, `run_ahead`) or sampled on the device (`run_sampled`)."""

    def plan(self, slots: list[int], ahead: bool = False) -> None:
        """Plans the steps after each slot's committed length (`ahead`: for `run_ahead`)."""

    def run(
        self, hidden: Tensor, slots: list[int], depths: Sequence[int] | None = None
    ) -> list[list[int]]:
        """hidden [B', 1, H] from the extend -> per request its draft tokens: s, or at least
        `depths[b]` (an eager stage stops each request there; a graph runs all s)."""

    def run_sampled(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        """`run` drawing each sampling request's tokens (`draft_support`): its tokens and
        the sparse q it drew them from (None for a greedy request)."""

    def run_ahead(
        self, hidden: Tensor, slots: list[int], top: int
    ) -> tuple[list[list[int]], list[Lookahead]]:
        """`run` for s tokens each, and one step more: every request's `Lookahead` with the
        `top` likeliest tokens at each depth (planned with `plan(slots, ahead=True)`)."""

    def read_gpu_ms(self) -> float:
        """GPU time of the extend's and the steps' graph replays since the last read."""


class EagerVerify:
    """The verify forward run eagerly through `KVCache.bind`; `run` returns the features an
    EAGLE draft reads (the final hidden states, or `feature_layers`' outputs for EAGLE-3)."""

    plans_ahead = False
    ahead = 0

    def __init__(
        self, model: LlamaModel, cache: KVCache, feature_layers: tuple[int, ...] = ()
    ) -> None:
        self.model, self.cache, self.feature_layers = model, cache, feature_layers
        self._planned: tuple[Tensor, BatchLayout] | None = None

    def prepare(self, positions: Tensor, layout: BatchLayout, key: object) -> None:
        return None  # nothing to plan ahead: bind plans at run time

    def plan(self, positions: Tensor, layout: BatchLayout) -> None:
        self._planned = (positions, layout)

    def planned_for(self, key: object) -> bool:
        return False

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        assert self._planned is not None, "run without a plan"
        (positions, layout), self._planned = self._planned, None
        dev = self.cache.device
        hidden, features = self.model.forward_aux(
            tokens.to(dev), positions.to(dev), self.cache.bind(layout), self.feature_layers
        )
        return features, self.model.logits(hidden)

    def accept(self, chains: ChainBatch) -> list[list[int]] | None:
        return None

    def read_gpu_ms(self) -> float:
        return 0.0


class EagerExtend:
    """The drafter's own extend (`Drafter.extend`)."""

    plans_ahead = False
    ahead = 0

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.cache = drafter, drafter.cache

    def prepare(self, slots: list[int]) -> None:
        return None

    def run(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        return self.drafter.extend(inputs, slots)


class EagerDraft:
    """The drafter's own step loop (`Drafter.draft_steps`)."""

    def __init__(self, drafter: Drafter, tier: int) -> None:
        self.drafter, self.tier = drafter, tier

    def plan(self, slots: list[int], ahead: bool = False) -> None:
        return None

    def run(
        self, hidden: Tensor, slots: list[int], depths: Sequence[int] | None = None
    ) -> list[list[int]]:
        return self.drafter.draft_steps(hidden[: len(slots)], slots, self.tier, None, depths)[0]

    def run_sampled(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[DraftQ | None]]:
        steps, qs, _ = self.drafter.draft_steps(
            hidden[: len(slots)], slots, self.tier, sampling, depths
        )
        return steps, qs

    def run_ahead(
        self, hidden: Tensor, slots: list[int], top: int
    ) -> tuple[list[list[int]], list[Lookahead]]:
        steps, _, aheads = self.drafter.draft_steps(
            hidden[: len(slots)], slots, self.tier, None, None, top
        )
        return steps, aheads

    def read_gpu_ms(self) -> float:
        return 0.0
