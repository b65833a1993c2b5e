"""The drafter's forward and its *extend*: the appended rows committed to its KV cache, run
in one padded forward (or a few: `padded_groups`), each request's last hidden returned.

`Drafter` (`drafter.py`) is this plus the round; the two drafters (`drafters.py`) supply the
extend rows, the forward and the logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.models.llama import Attend
from specpair.runtime.feature_rows import FeatureRows, place_features
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout, padded_groups
from specpair.runtime.round_messages import DraftInput


class DraftForward(ABC):
    cache: KVCache
    device: torch.device
    needs_features = False  # EAGLE: extend rows carry target features
    feature_width = 0  # their row width

    @abstractmethod
    def extend_rows(
        self, inputs: Sequence[DraftInput]
    ) -> tuple[list[Sequence[int]], list[FeatureRows] | None]:
        """Per request the token rows extend runs (and, for EAGLE, their features [n, H])."""

    @abstractmethod
    def forward(
        self, tokens: Tensor, features: Tensor | None, positions: Tensor, attend: Attend
    ) -> Tensor:
        """tokens, positions: [B, T] (+ features [B, T, H]) on the device -> hidden [B, T, H]."""

    @abstractmethod
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] -> float logits of the last row [B, V]."""

    def greedy(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] -> the last row's argmax token [B]: `logits(hidden).argmax(-1)`."""
        return self.logits(hidden).argmax(-1)

    def named_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [B, T, H] -> the last row's logits over the ids the draft names [B, N], and
        those ids [N] (None: the whole vocabulary, as here)."""
        return self.logits(hidden), None

    def extend_inputs(
        self, inputs: Sequence[DraftInput], slots: list[int]
    ) -> tuple[Tensor, list[FeatureRows] | None, Tensor, BatchLayout, list[int]]:
        """Commits the extend rows; returns host tokens and positions [B, T], each request's
        feature rows [n_b, W] as they came (padded only where they are placed), layout."""
        rows, feats = self.extend_rows(inputs)
        tokens, positions, layout, lengths = self._commit_rows(rows, slots)
        return tokens, feats, positions, layout, lengths

    def extend(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        """Eager extend: commits the rows, returns each request's last hidden [B, 1, H]."""
        starts = [self.cache.lengths[s] for s in slots]
        lengths = [len(item.appended) for item in inputs]  # EAGLE runs as many rows or one less
        groups = padded_groups(starts, lengths, self.cache.max_len)
        if len(groups) == 1:
            return self._extend_group(inputs, slots)
        out: list[Tensor] = [torch.empty(0)] * len(inputs)
        for group in groups:
            hidden = self._extend_group([inputs[i] for i in group], [slots[i] for i in group])
            for row, i in enumerate(group):
                out[i] = hidden[row]
        return torch.stack(out)

    def _extend_group(self, inputs: Sequence[DraftInput], slots: list[int]) -> Tensor:
        return self.extend_forward(*self.extend_inputs(inputs, slots))

    def extend_forward(
        self,
        tokens: Tensor,
        features: list[FeatureRows] | None,
        positions: Tensor,
        layout: BatchLayout,
        lengths: list[int],
    ) -> Tensor:
        """The eager forward of `extend_inputs`' rows: each request's last hidden [B, 1, H]."""
        padded = None
        if features is not None:
            # in the cache's (the model's) dtype; float8 rows are dequantized on the device
            width, dtype = features[0].shape[-1], self.cache.dtype
            padded = place_features(
                torch.zeros(*tokens.shape, width, dtype=dtype, device=self.device), features
            )
        hidden = self.forward(
            tokens.to(self.device), padded, positions.to(self.device), self.cache.bind(layout)
        )
        return hidden[torch.arange(len(lengths)), torch.tensor(lengths) - 1][:, None]

    def _step(self, tokens: Tensor, hidden: Tensor, layout: BatchLayout) -> Tensor:
        positions = layout.starts[:, None]
        return self.forward(
            tokens.to(self.device), hidden, positions.to(self.device), self.cache.bind(layout)
        )

    def _commit_rows(
        self, rows: Sequence[Sequence[int]], slots: list[int]
    ) -> tuple[Tensor, Tensor, BatchLayout, list[int]]:
        """Pads per-request rows into [B, T] tokens + positions after each committed prefix."""
        lengths = [len(r) for r in rows]
        starts = [self.cache.lengths[s] for s in slots]
        t = max(lengths)
        tokens = torch.zeros(len(rows), t, dtype=torch.long)
        for b, row in enumerate(rows):
            self.cache.check_room(slots[b], starts[b], t)
            tokens[b, : lengths[b]] = torch.tensor(list(row))
        positions = torch.tensor(starts)[:, None] + torch.arange(t)
        layout = BatchLayout.causal(slots, starts, lengths)
        for slot, start, n in zip(slots, starts, lengths, strict=True):
            self.cache.commit(slot, start, range(n))
        return tokens, positions, layout, lengths
