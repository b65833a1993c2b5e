"""flashinfer's description of a batch on the paged KV cache: its pages and its custom mask."""

from __future__ import annotations

import torch
from torch import Tensor

from specpair.runtime.layout import BatchLayout


def page_metadata(
    page_table: Tensor, slots: Tensor, kv_lens: Tensor, page_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """flashinfer's page description of a batch: (indptr [B+1], indices [nnz], last_len [B]).

    kv_lens [5, 16, 17], page_size 16 → pages per request [1, 1, 2], indptr [0, 1, 2, 4],
    last page lengths [5, 16, 1].
    """
    npages = (kv_lens + page_size - 1) // page_size
    indptr = torch.zeros(len(slots) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(npages, 0)
    cols = torch.arange(page_table.shape[1])
    indices = page_table[slots][cols[None, :] < npages[:, None]]  # row-major: request order
    last = kv_lens - (npages - 1) * page_size
    return indptr, indices.to(torch.int32), last.to(torch.int32)


def flat_mask(layout: BatchLayout) -> Tensor:
    """flashinfer's custom mask: per request its [T, start + T] rows, concatenated, flat bool.

    Each request's rows are its whole visible prefix (start keys) followed by its [T, T] tree
    mask; built per request rather than through the batch's dense [B, T, max start + T] mask,
    whose size grows with the longest context (the plan sits on the round's critical path)."""
    t = layout.new_mask.shape[1]
    parts = []
    for b, start in enumerate(layout.starts.tolist()):
        rows = torch.ones(t, start + t, dtype=torch.bool)
        rows[:, start:] = layout.new_mask[b]
        parts.append(rows.view(-1))
    return torch.cat(parts)
