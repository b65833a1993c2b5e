"""The two drafters: a standalone causal LM, and an EAGLE head that drafts from the target's
features. They share `Drafter`'s round and differ in its extend rows and one forward.

- `LMDrafter`: extend runs the appended tokens.
- `EagleDrafter`: extend runs rows (token x[j+1], target feature f[j]) and each draft step feeds
  the head its own previous output as the feature. An EAGLE-3 head (`eagle3.py`) drafts the same
  way from three target layers; its logits come back on the target's vocabulary, so tokens and
  q are the target's.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from specpair.models.eagle import EagleHead
from specpair.models.eagle3 import Eagle3Head
from specpair.models.llama import Attend, LlamaModel
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.feature_rows import FeatureRows
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.round_messages import DraftInput


class LMDrafter(Drafter):
    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        super().__init__(cache, model.lm_head.weight.device, model.args)
        self.model = model

    def extend_rows(
        self, inputs: Sequence[DraftInput]
    ) -> tuple[list[Sequence[int]], list[FeatureRows] | None]:
        return [i.appended for i in inputs], None

    def forward(
        self, tokens: Tensor, features: Tensor | None, positions: Tensor, attend: Attend
    ) -> Tensor:
        return self.model(tokens, positions, attend)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.logits(hidden[:, -1])


class EagleDrafter(Drafter):
    needs_features = True

    def __init__(self, head: EagleHead | Eagle3Head, cache: KVCache) -> None:
        super().__init__(cache, head.fc.weight.device, head.args)
        self.head = head
        self.feature_width = head.feature_width

    def extend_rows(
        self, inputs: Sequence[DraftInput]
    ) -> tuple[list[Sequence[int]], list[FeatureRows] | None]:
        rows: list[Sequence[int]] = []
        feats: list[FeatureRows] = []
        for item in inputs:
            if item.features is None or len(item.features) == 0:
                raise ValueError(f"request {item.request_id}: the EAGLE drafter needs features")
            n = len(item.features)
            if n not in (len(item.appended), len(item.appended) - 1):
                raise ValueError(
                    f"request {item.request_id}: {n} feature rows for {len(item.appended)} "
                    "appended tokens (expected as many, or one fewer in the first round)"
                )
            if item.features.shape[-1] != self.feature_width:
                raise ValueError(
                    f"request {item.request_id}: feature rows {item.features.shape[-1]} wide; "
                    f"this head reads {self.feature_width} (an EAGLE-3 head: the target's "
                    "--feature-layers)"
                )
            rows.append(item.appended[len(item.appended) - n :])
            feats.append(item.features)
        return rows, feats

    def forward(
        self, tokens: Tensor, features: Tensor | None, positions: Tensor, attend: Attend
    ) -> Tensor:
        assert features is not None, "EAGLE rows need features"
        return self.head(tokens, features, positions, attend)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head.logits(hidden[:, -1])

    def greedy(self, hidden: Tensor) -> Tensor:
        return self.head.greedy(hidden[:, -1])

    def named_logits(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        # a draft vocabulary's 32 000 columns, not 128 256 with -inf at the rest
        return self.head.named_logits(hidden[:, -1])
