"""Paged KV cache with the `DenseKVCache` interface, attended through flashinfer on the GPU.

Memory is a pool of pages of `page_size` positions (`k`, `v`: [L, pages, page_size, Hkv, D],
flashinfer's NHD layout); each request slot owns a list of pages, allocated as it grows and
returned on `free`. A token at position p of slot s lives at flat index
`page_table[s, p // page_size] * page_size + p % page_size`:

    page_size 4, slot 2 owns pages [7, 3]: position 5 → page 3, offset 1 → flat index 13

Writes are tentative past the committed length exactly as in the dense cache; `commit` moves the
accepted entries (e.g. tree nodes [0, 2, 5]) to the front through their flat indices. K/V are
written at flat rows (the same indices flashinfer's append kernel would compute): by the fused
layer's rope kernel on the GPU (`PagedAttend.rope_write`), by `index_copy_` otherwise.
Attention is `BatchPrefillWithPagedKVCacheWrapper` with the tree as a custom mask. On CPU the
pages are gathered and attended with SDPA (tests).

Slot `max_requests` is a padding slot: CUDA-graph buckets fill their unused rows with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specpair.models.llama import AttendFn, ModelArgs
from specpair.runtime.kv_cache import BatchLayout, CacheFullError, attention_mask

WORKSPACE_BYTES = 128 << 20
# Head sizes flashinfer's paged prefill is built for; other sizes (the shipped pair's 40 and 32)
# attend eagerly through SDPA over gathered pages, and in graphs through the Triton kernel.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flat_index(page_table: Tensor, slots: Tensor, positions: Tensor, page_size: int) -> Tensor:
    # page_table: [R, P] long, slots: [B], positions: [B, T] -> flat cache rows [B, T]
    pages = page_table[slots[:, None], positions // page_size]
    return pages * page_size + positions % page_size


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
    which cost ~0.3 ms of host time per verify at 2k context (the plan sits on the round's
    critical path)."""
    t = layout.new_mask.shape[1]
    parts = []
    for b, start in enumerate(layout.starts.tolist()):
        rows = torch.ones(t, start + t, dtype=torch.bool)
        rows[:, start:] = layout.new_mask[b]
        parts.append(rows.view(-1))
    return torch.cat(parts)


class PagedAttend:
    """`attend` for one planned flashinfer wrapper: an `AttendFn` (write K/V, attend), and the
    split form the fused layer uses: `rope_write` (rope + K/V straight into the cache rows, one
    Triton kernel) then `run`."""

    def __init__(self, cache: PagedKVCache, wrapper: Any, rows: Tensor) -> None:
        self.cache, self.wrapper, self.rows = cache, wrapper, rows

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        _, n_kv, d = self.cache.heads
        n = q.shape[0] * q.shape[1]
        self.cache.k[layer].view(-1, n_kv, d).index_copy_(0, self.rows, k.reshape(n, n_kv, d))
        self.cache.v[layer].view(-1, n_kv, d).index_copy_(0, self.rows, v.reshape(n, n_kv, d))
        return self.run(layer, q)

    def rope_write(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # qkv: partials [S, N, (Hq + 2 Hkv) D], cos/sin: [N, D] -> q [N, Hq, D]
        from specpair.runtime.triton_kernels import rope_write

        n_q, n_kv, d = self.cache.heads
        k, v = self.cache.k[layer].view(-1, n_kv, d), self.cache.v[layer].view(-1, n_kv, d)
        return rope_write(qkv, cos, sin, self.rows, k, v, n_q, n_kv, d)

    def run(self, layer: int, q: Tensor) -> Tensor:
        # q: [B, T, Hq, D] -> [B, T, Hq, D], over the K/V already written
        b, t, n_q, d = q.shape
        # flashinfer would allocate its output with torch.zeros: one fill kernel per layer
        out = torch.empty(b * t, n_q, d, dtype=q.dtype, device=q.device)
        kv = (self.cache.k[layer], self.cache.v[layer])
        self.wrapper.run(q.reshape(b * t, n_q, d), kv, out=out)
        return out.view(b, t, n_q, d)


class PagedKVCache:
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
    ) -> None:
        if graph_attention not in ("triton", "flashinfer"):
            raise ValueError(
                f"graph_attention must be triton or flashinfer, not {graph_attention!r}"
            )
        self.graph_attention = graph_attention
        self.page_size = page_size
        self.pages_per_slot = -(-max_len // page_size)
        num_pages = (max_requests + 1) * self.pages_per_slot
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device = dtype, torch.device(device)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.max_len = max_len
        self.page_table = torch.zeros(max_requests + 1, self.pages_per_slot, dtype=torch.long)
        self._owned = [0] * (max_requests + 1)
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self.pad_slot = max_requests
        self._grow(self.pad_slot, max_len)
        self.lengths = [0] * max_requests
        self._free = list(range(max_requests - 1, -1, -1))
        self.generation = 0  # bumped by alloc/free: a plan made before one is stale
        self._workspace: Tensor | None = None
        self._eager: Any = None

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
    ) -> PagedKVCache:
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
        )

    # -- slots and pages ------------------------------------------------------------------------

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
        self._free_pages.extend(int(p) for p in self.page_table[slot, : self._owned[slot]])
        self._owned[slot] = 0
        self.page_table[slot] = 0
        self.lengths[slot] = 0
        self._free.append(slot)

    def check_room(self, slot: int, start: int, n_new: int) -> None:
        if start + n_new > self.max_len:
            raise CacheFullError(
                f"slot {slot}: {start + n_new} positions exceed max_len {self.max_len}"
            )
        needed = -(-(start + n_new) // self.page_size) - self._owned[slot]
        if needed > len(self._free_pages):
            raise CacheFullError(f"slot {slot}: {needed} more pages needed, none free")

    def reserve(self, slot: int, length: int) -> None:
        """Pages for `slot` up to `length` positions, before a graph writes there by itself."""
        if length > self.max_len:
            raise CacheFullError(f"slot {slot}: {length} positions exceed max_len {self.max_len}")
        self._grow(slot, length)

    def _grow(self, slot: int, length: int) -> None:
        """Gives `slot` pages until it covers `length` positions."""
        while self._owned[slot] * self.page_size < length:
            if not self._free_pages:
                raise CacheFullError("no free KV pages")
            self.page_table[slot, self._owned[slot]] = self._free_pages.pop()
            self._owned[slot] += 1

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)

    def commit(self, slot: int, start: int, keep: Sequence[int]) -> int:
        """Keeps new tokens `keep` (relative to `start`, increasing); see `DenseKVCache.commit`."""
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

    # -- attention ------------------------------------------------------------------------------

    def write_index(self, layout: BatchLayout) -> Tensor:
        """Grows every slot to hold the new tokens; returns their flat rows [B * T] (host)."""
        t = layout.new_mask.shape[1]
        for slot, start in zip(layout.slots.tolist(), layout.starts.tolist(), strict=True):
            if start + t > self.max_len:
                raise CacheFullError(f"a forward would write past max_len {self.max_len}")
            self._grow(slot, start + t)
        positions = layout.starts[:, None] + torch.arange(t)
        return flat_index(self.page_table, layout.slots, positions, self.page_size).view(-1)

    def bind(self, layout: BatchLayout) -> AttendFn:
        """An eager `attend` for one forward (prefill, long extends, trees without a graph)."""
        rows = self.write_index(layout).to(self.device)
        if self.device.type != "cuda" or self.heads[2] not in FLASHINFER_HEAD_DIMS:
            return self._torch_attend(layout, rows)
        if self._eager is None:
            self._eager = self.make_wrapper()
        self.plan(self._eager, layout)
        return self.attend_fn(self._eager, rows)

    def attend_fn(self, wrapper: Any, rows: Tensor) -> PagedAttend:
        """attend over flashinfer `wrapper` (planned), writing new K/V at flat `rows` [B * T]."""
        return PagedAttend(self, wrapper, rows)

    def make_wrapper(self, buffers: dict[str, Tensor] | None = None) -> Any:
        """A flashinfer paged-prefill wrapper; with `buffers`, a CUDA-graph one over them."""
        import flashinfer

        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        if buffers is None:
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend="fa2"
            )
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buffers["qo_indptr"],
            paged_kv_indptr_buf=buffers["kv_indptr"],
            paged_kv_indices_buf=buffers["kv_indices"],
            paged_kv_last_page_len_buf=buffers["last_page_len"],
            custom_mask_buf=buffers["mask"],
            mask_indptr_buf=buffers["mask_indptr"],
            backend="fa2",
        )

    def graph_wrapper(self, batch: int, tokens: int) -> Any:
        """The attention of a CUDA graph over [batch, tokens]: the Triton tree kernel where it
        fits (`tree_attention.py`), else flashinfer in CUDA-graph mode."""
        from specpair.runtime.tree_attention import TreeAttention

        if self.graph_attention == "triton" and TreeAttention.fits(tokens, self.heads):
            return TreeAttention(
                batch=batch, tokens=tokens, heads=self.heads, page_size=self.page_size,
                pages_per_slot=self.pages_per_slot, device=self.device,
            )  # fmt: skip
        if self.heads[2] not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"head_dim {self.heads[2]}: graphs of {tokens} tokens x {self.heads[0]} q heads "
                f"need flashinfer, which serves head_dim {FLASHINFER_HEAD_DIMS}"
            )
        return self.make_wrapper(self.graph_buffers(batch, tokens))

    def graph_buffers(self, batch: int, tokens: int) -> dict[str, Tensor]:
        """Static metadata buffers for a CUDA-graph wrapper of `batch` requests × `tokens`."""

        def i32(n: int) -> Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        mask_bytes = batch * (-(-tokens * self.max_len // 8) + 1) + 64
        return {
            "qo_indptr": i32(batch + 1),
            "kv_indptr": i32(batch + 1),
            "kv_indices": i32(batch * self.pages_per_slot),
            "last_page_len": i32(batch),
            "mask": torch.zeros(mask_bytes, dtype=torch.uint8, device=self.device),
            "mask_indptr": i32(batch + 1),
        }

    def plan(self, wrapper: Any, layout: BatchLayout, staging: Any = None) -> None:
        """Fills a graph wrapper's metadata for `layout` (the Triton one through `staging`)."""
        from specpair.runtime.tree_attention import TreeAttention

        if isinstance(wrapper, TreeAttention):
            wrapper.plan(layout, self.page_table, staging)
            return
        b, t = layout.new_mask.shape[:2]
        n_q, n_kv, d = self.heads
        indptr, indices, last = page_metadata(
            self.page_table, layout.slots, layout.starts + t, self.page_size
        )
        wrapper.plan(
            torch.arange(b + 1, dtype=torch.int32) * t,
            indptr,
            indices,
            last,
            n_q,
            n_kv,
            d,
            self.page_size,
            custom_mask=flat_mask(layout).to(self.device, non_blocking=True),
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def _torch_attend(self, layout: BatchLayout, rows: Tensor) -> AttendFn:
        _, n_kv, d = self.heads
        b, t = layout.new_mask.shape[:2]
        mask = attention_mask(layout)[:, None].to(self.device)  # [B, 1, T, K]
        keys = torch.arange(mask.shape[-1]).expand(b, -1)
        key_rows = flat_index(self.page_table, layout.slots, keys, self.page_size).to(self.device)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kc, vc = self.k[layer].view(-1, n_kv, d), self.v[layer].view(-1, n_kv, d)
            kc.index_copy_(0, rows, k.reshape(b * t, n_kv, d))
            vc.index_copy_(0, rows, v.reshape(b * t, n_kv, d))
            kk, vv = kc[key_rows].transpose(1, 2), vc[key_rows].transpose(1, 2)  # [B, Hkv, K, D]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), kk, vv, attn_mask=mask, enable_gqa=True
            )
            return out.transpose(1, 2)

        return attend
