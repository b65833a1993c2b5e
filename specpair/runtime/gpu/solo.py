"""The batch-invariant mode's eager attention: a batch's requests attend one at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specpair.runtime.layout import BatchLayout

if TYPE_CHECKING:
    from specpair.runtime.gpu.backend import AttentionBackend
    from specpair.runtime.gpu.staging import Staging


class SoloAttention:
    """The batch-invariant mode's eager attention: each request's rows attend by themselves,
    through a backend planned for that request alone (`BatchLayout.request`), so a prompt
    attends the same prefilled alone or beside others: flashinfer picks its tiles by the
    batch's lengths. The forward's GEMMs stay batched (the mode's tiles make a row's result
    independent of the rows around it), so a batch of 8 prompts reads the weights once and
    makes 8 attention calls a layer, not 8 forwards."""

    def __init__(self, backend: Callable[[int], AttentionBackend], fused_write: bool) -> None:
        self.backend = backend  # the b-th request's, planned anew each forward
        self.fused_write = fused_write
        self.lengths: list[int] = []

    def plan(self, layout: BatchLayout, page_table: Tensor, staging: Staging | None = None) -> None:
        self.lengths = layout.lengths()
        for b, n in enumerate(self.lengths):
            self.backend(b).plan(layout.request(b, n), page_table)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        out = torch.zeros_like(q)  # padding rows: unused, but finite
        for b, n in enumerate(self.lengths):
            out[b, :n] = self.backend(b).attend(q[b : b + 1, :n], kv)[0]
        return out
