"""The target's eager verify: the forward over a batch of candidate trees through
`KVCache.bind` (the CPU's stage, and the GPU's where no graph fits)."""

from __future__ import annotations

from torch import Tensor

from specpair.models.llama import LlamaModel
from specpair.runtime.accept_batch import ChainBatch, TreeBatch
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import BatchLayout


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
        self.rows = 0  # the last run's requests × tokens

    def prepare(self, positions: Tensor, layout: BatchLayout, key: object) -> None:
        return None  # nothing to plan ahead: bind plans at run time

    def plan(self, positions: Tensor, layout: BatchLayout) -> None:
        self._planned = (positions, layout)

    def planned_for(self, key: object) -> bool:
        return False

    def padded(self, batch: int) -> int | None:
        return batch

    def run(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        assert self._planned is not None, "run without a plan"
        (positions, layout), self._planned = self._planned, None
        self.rows = tokens.numel()
        dev = self.cache.device
        hidden, features = self.model.forward_aux(
            tokens.to(dev), positions.to(dev), self.cache.bind(layout), self.feature_layers
        )
        return features, self.model.logits(hidden)

    def accept(self, batch: ChainBatch | TreeBatch) -> list[list[int]] | None:
        return None

    def read_gpu_ms(self) -> float:
        return 0.0
