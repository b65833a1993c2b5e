"""A round's stages as each tier's state holds them: verify (target), extend and draft (draft).

Every stage is *planned* for one batch — in line (`plan`), or ahead by a service while its peer
computes (`prepare`; only CUDA graphs have anything to plan ahead) — then *run*. Two kinds
implement each protocol: the eager stages (`target/verify.py`, `draft/eager.py`) serve the CPU
and are what a GPU falls back to where no graph fits; the CUDA-graph stages
(`gpu/verify_graphs.py`, `gpu/draft_graphs.py`) are handed those eager stages at build time
(`build.py`), so no graph module reaches back into a side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from specpair.models.args import ModelArgs
from specpair.models.llama import Attend
from specpair.runtime.accept_batch import ChainBatch, TreeBatch
from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.sampling import RowParams
from specpair.runtime.tree import CandidateTree

DraftQ = tuple[Tensor, Tensor]  # a sampled chain's sparse q on the host: ids, probs [d, K]


@dataclass(frozen=True, slots=True)
class DraftSampling:
    """A round's sampling rows on the host: per request its parameters, its uniforms [B, s]
    (one per step, from its own generator) and whether it is greedy (it sends no q)."""

    params: RowParams
    u: Tensor
    greedy: list[bool]


class DraftModel(Protocol):
    """The drafter's pieces a graph captures (`Drafter` is one): its forward, its logits and
    the host half of an extend."""

    cache: KVCache
    args: ModelArgs
    needs_features: bool  # EAGLE: the extend reads the target's features
    feature_width: int  # their row width (EAGLE-3: three target layers, 3H)

    def forward(
        self, tokens: Tensor, features: Tensor | None, positions: Tensor, attend: Attend
    ) -> Tensor:
        """tokens, positions: [B, T] (+ features [B, T, H]) on the device -> hidden [B, T, H]."""

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] -> float logits of the last row [B, V]."""

    def greedy(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] -> the last row's argmax token [B] (as `logits(hidden).argmax`)."""

    def named_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [B, T, H] -> the last row's float logits over the ids the draft can name
        [B, N] and those ids on the target's vocabulary [N] (None: N is all of it): what a
        sampled step draws from (`draft_support`), without the -inf elsewhere."""

    def extend_inputs(
        self, inputs: Sequence[DraftInput], slots: list[int]
    ) -> tuple[Tensor, list[FeatureRows] | None, Tensor, BatchLayout, list[int]]:
        """Commits the extend rows; returns host tokens and positions [B, T], each request's
        feature rows [n_b, W] (EAGLE), layout."""

    def extend_forward(
        self,
        tokens: Tensor,
        features: list[FeatureRows] | None,
        positions: Tensor,
        layout: BatchLayout,
        lengths: list[int],
    ) -> Tensor:
        """The eager forward of `extend_inputs`' rows: each request's last hidden [B, 1, H]."""


class PrefillStage(Protocol):
    """Prompts prefilled in CUDA graphs (`gpu/prefill_graphs.py`); the target's worker
    prefills eagerly where none fits."""

    @property
    def longest(self) -> int:
        """The longest prompt a graph takes: one past it runs eagerly."""

    def run(
        self, layout: BatchLayout, tokens: Tensor, lengths: Sequence[int]
    ) -> tuple[Tensor, Tensor] | None:
        """Features [B', T', F] and last rows' logits [B', V] of prompts `tokens` [B, T] on the
        host; None where no graph fits."""


class DrawStage(Protocol):
    """Sampled rows' next tokens in CUDA graphs (`gpu/draw_graphs.py`); the target's worker
    draws eagerly where none fits or a row's cut lies past its candidates."""

    def run(self, logits: Tensor, params: RowParams, u: Tensor) -> list[int] | None:
        """Each row's token from logits [B, V] on the device, host `params` and uniforms
        `u` [B]; None where it cannot (the caller draws eagerly from the same uniforms)."""


class VerifyStage(Protocol):
    """The target's forward over a batch of candidate trees."""

    cache: KVCache  # the target worker's: a stage serves that worker only
    plans_ahead: bool  # whether `prepare` does anything
    ahead: int  # verifies that ran on a plan made ahead
    rows: int  # the rows (requests × tokens) the last `run` computed, a graph's padding included

    def prepare(self, positions: Tensor, layout: BatchLayout, key: object) -> None:
        """Plans ahead the verify whose plan key will be `key` (see `planned_for`)."""

    def plan(self, positions: Tensor, layout: BatchLayout) -> None:
        """Plans the next `run` for positions [B, T] placed by `layout`."""

    def padded(self, batch: int) -> int | None:
        """The rows a verify of `batch` rows runs at (a graph's bucket); None: no graph fits."""

    def planned_for(self, key: object) -> bool:
        """Whether a plan made ahead serves the verify of `key` (then it needs no `plan`)."""

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Host tokens [B, T] -> hidden [B, T, H], float logits [B, T, V] (device)."""

    def accept(self, batch: ChainBatch | TreeBatch) -> list[list[int]] | None:
        """The sampled accept of the batch `run` just verified, in a graph of its own: per
        request, of chains [accepted drafts, last token], of trees [last token, accepted
        full-tree nodes…]; None where none serves (the caller accepts eagerly from the
        logits, left in place)."""

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
    (`run`) or sampled on the device (`run_sampled`)."""

    def plan(self, slots: list[int]) -> None:
        """Plans the steps after each slot's committed length."""

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

    def run_tree(
        self,
        hidden: Tensor,
        slots: list[int],
        sampling: DraftSampling | None = None,
        depths: Sequence[int] | None = None,
    ) -> list[CandidateTree]:
        """A tree shape's draft (EAGLE-2 style, `draft/tree_draft.py`): a tree per request,
        `depths[b]` deep at most (default the shape's steps)."""

    def read_gpu_ms(self) -> float:
        """GPU time of the extend's and the steps' graph replays since the last read."""
