"""What an attention backend over the paged KV cache does (`attention.py` has them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from specpair.runtime.gpu.staging import Staging
    from specpair.runtime.layout import BatchLayout


class AttentionBackend(Protocol):
    # True: the fused GPU layer may write rope'd K/V itself (`PagedAttend.rope_write`) and call
    # `attend`; False: it hands q, k, v to `PagedAttend.__call__` (the torch path).
    fused_write: bool

    def plan(self, layout: BatchLayout, page_table: Tensor, staging: Staging | None = None) -> None:
        """Metadata for `layout` (a graph's static buffers go through `staging`)."""

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        """q [B, T, Hq, D], one layer's (k, v) pages -> [B, T, Hq, D] over the planned layout."""
