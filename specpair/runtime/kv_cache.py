"""The KV cache: request slots over a pool of pages, one implementation on CPU and GPU.

Memory is a pool of pages of `page_size` positions (`k`, `v`: [L, pages, page_size, Hkv, D],
flashinfer's NHD layout); each request slot owns a list of pages, allocated as it grows and
returned on `free`. A token at position p of slot s lives at flat row
`page_table[s, p // page_size] * page_size + p % page_size`:

    page_size 4, slot 2 owns pages [7, 3]: position 5 → page 3, offset 1 → flat row 13

Every forward writes its new tokens' K/V *tentatively* after each request's committed length;
`commit` keeps a subset of them (the accepted path, possibly non-contiguous, e.g. full-tree
nodes [0, 2, 5]) by moving them to the front through their flat rows, and everything else is
dropped by not advancing the length. How a forward attends is the backend's business
(`attention.py`); the cache only grows pages and hands out write rows.

Slot `max_requests` is a padding slot: CUDA-graph buckets fill their unused rows with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specpair.models.args import ModelArgs
from specpair.runtime.gpu.attention import AttentionBackend, Backends, PagedAttend
from specpair.runtime.layout import BatchLayout, flat_index


class CacheFullError(RuntimeError):
    """No free request slot, or a request would outgrow its slot."""


class SlotTable:
    """Request slots: which are free and each one's committed length. `generation` changes
    with every alloc and free: a plan made before one may name a slot that changed hands."""

    def __init__(self, max_requests: int) -> None:
        self.lengths = [0] * max_requests
        self._free = list(range(max_requests - 1, -1, -1))
        self.generation = 0

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {len(self.lengths)} KV cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        self.generation += 1
        return slot

    def free(self, slot: int) -> None:
        self.generation += 1
        self.lengths[slot] = 0
        self._free.append(slot)


class PagePool:
    """The page table ([slots, pages_per_slot] long) and the free pages; a slot grows a page
    at a time and gives all of its pages back at once."""

    def __init__(self, slots: int, pages_per_slot: int, page_size: int) -> None:
        self.page_size, self.pages_per_slot = page_size, pages_per_slot
        self.num_pages = slots * pages_per_slot
        self.table = torch.zeros(slots, pages_per_slot, dtype=torch.long)
        self.owned = [0] * slots
        self.free = list(range(self.num_pages - 1, -1, -1))

    def missing(self, slot: int, length: int) -> int:
        """Pages `slot` lacks to cover `length` positions."""
        return max(0, -(-length // self.page_size) - self.owned[slot])

    def grow(self, slot: int, length: int) -> None:
        """Gives `slot` pages until it covers `length` positions."""
        while self.owned[slot] * self.page_size < length:
            if not self.free:
                raise CacheFullError("no free KV pages")
            self.table[slot, self.owned[slot]] = self.free.pop()
            self.owned[slot] += 1

    def release(self, slot: int) -> None:
        self.free.extend(self.table[slot, : self.owned[slot]].tolist())
        self.owned[slot] = 0
        self.table[slot] = 0


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_len: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        graph_attention: str = "triton",
        invariant: bool = False,
    ) -> None:
        self.max_len, self.page_size = max_len, page_size
        self.slots = SlotTable(max_requests)
        self.pages = PagePool(max_requests + 1, -(-max_len // page_size), page_size)
        shape = (num_layers, self.pages.num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, torch.device(device)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.pad_slot = max_requests
        self.pages.grow(self.pad_slot, max_len)
        self.attention = Backends(
            self.heads,
            page_size,
            self.pages_per_slot,
            max_len,
            dtype,
            self.device,
            graph_attention,
            invariant,
        )

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        *,
        max_requests: int,
        max_len: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        graph_attention: str = "triton",
        invariant: bool = False,
    ) -> KVCache:
        return cls(
            num_layers=args.num_layers,
            num_qo_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            max_requests=max_requests,
            max_len=max_len,
            page_size=page_size,
            dtype=dtype,
            device=device,
            graph_attention=graph_attention,
            invariant=invariant,
        )

    # -- slots and pages ------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        """Each slot's committed length."""
        return self.slots.lengths

    @property
    def generation(self) -> int:
        return self.slots.generation

    @property
    def page_table(self) -> Tensor:
        return self.pages.table

    @property
    def pages_per_slot(self) -> int:
        return self.pages.pages_per_slot

    @property
    def free_slots(self) -> int:
        return self.slots.free_slots

    def alloc(self) -> int:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.pages.release(slot)
        self.slots.free(slot)

    def check_room(self, slot: int, start: int, n_new: int) -> None:
        if start + n_new > self.max_len:
            raise CacheFullError(
                f"slot {slot}: {start + n_new} positions exceed max_len {self.max_len}"
            )
        needed = self.pages.missing(slot, start + n_new)
        if needed > len(self.pages.free):
            raise CacheFullError(f"slot {slot}: {needed} more pages needed, none free")

    def reserve(self, slot: int, length: int) -> None:
        """Pages for `slot` up to `length` positions, before a graph writes there by itself."""
        if length > self.max_len:
            raise CacheFullError(f"slot {slot}: {length} positions exceed max_len {self.max_len}")
        self.pages.grow(slot, length)

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)

    def commit(self, slot: int, start: int, keep: Sequence[int]) -> int:
        """Keeps new tokens `keep` (indices relative to `start`, increasing) as the prefix.

        Returns the new committed length. keep=[0, 2, 5] moves positions start+2 → start+1 and
        start+5 → start+2; the rest of the tentative writes are dropped.
        """
        keep = list(keep)
        if keep != list(range(len(keep))):
            pos = torch.tensor([keep, list(range(len(keep)))]) + start  # [2, n]: src, dst
            src, dst = flat_index(self.page_table, torch.tensor([slot, slot]), pos, self.page_size)
            src, dst = src.to(self.device), dst.to(self.device)
            for cache in (self.k, self.v):
                flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
                flat[:, dst] = flat[:, src]
        self.lengths[slot] = start + len(keep)
        return self.lengths[slot]

    def read(self, layer: int, slot: int, n: int) -> tuple[Tensor, Tensor]:
        """K and V [n, Hkv, D] of `slot`'s first n positions (tests, debugging)."""
        rows = flat_index(
            self.page_table, torch.tensor([slot]), torch.arange(n)[None], self.page_size
        )[0].to(self.device)
        _, n_kv, d = self.heads
        return self.k[layer].view(-1, n_kv, d)[rows], self.v[layer].view(-1, n_kv, d)[rows]

    # -- attention ------------------------------------------------------------------------------

    def write_index(self, layout: BatchLayout) -> Tensor:
        """Grows every slot to hold the new tokens; returns their flat rows [B * T] (host)."""
        t = layout.new_mask.shape[1]
        for slot, start in zip(layout.slots.tolist(), layout.starts.tolist(), strict=True):
            if start + t > self.max_len:
                raise CacheFullError(f"a forward would write past max_len {self.max_len}")
            self.pages.grow(slot, start + t)
        positions = layout.starts[:, None] + torch.arange(t)
        return flat_index(self.page_table, layout.slots, positions, self.page_size).view(-1)

    def bind(self, layout: BatchLayout) -> PagedAttend:
        """An eager `attend` for one forward (prefill, extends and trees without a graph)."""
        rows = self.write_index(layout).to(self.device)
        backend = self.attention.eager()
        backend.plan(layout, self.page_table)
        return self.attend(backend, rows)

    def attend(self, backend: AttentionBackend, rows: Tensor) -> PagedAttend:
        """The `attend` over `backend` (planned), writing new K/V at flat `rows` [B * T]."""
        return PagedAttend(self.k, self.v, self.heads, backend, rows)
