"""Per-request KV cache: append, place a candidate tree after the prefix, commit the accepted path.

Every forward writes its new tokens' keys/values *tentatively* after each request's committed
length; `commit` then keeps a subset of them (the accepted path, possibly non-contiguous, e.g.
full-tree nodes [0, 2, 5]) by moving them to the front, and everything else is dropped by
simply not advancing the length. Callers see only `alloc / free / bind / commit / truncate`, so
the GPU issue can back the same interface with paged memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specpair.models.llama import AttendFn, ModelArgs


class CacheFullError(RuntimeError):
    """No free request slot, or a request would outgrow its slot."""


@functools.cache
def tril_mask(t: int) -> Tensor:
    """[t, t] causal mask (shared: read it, expand it, never write it)."""
    return torch.ones(t, t, dtype=torch.bool).tril()


@functools.cache
def eye_mask(t: int) -> Tensor:
    """[t, t] identity mask (shared: read it, expand it, never write it)."""
    return torch.eye(t, dtype=torch.bool)


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where one forward's new tokens go: per request a slot, a start position and a mask."""

    slots: Tensor  # [B] long
    starts: Tensor  # [B] long: position of each request's first new token
    new_mask: Tensor  # [B, T, T] bool: which new tokens each new token sees (causal or tree)

    @staticmethod
    def causal(slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> BatchLayout:
        """Extend/prefill layout: request b appends lengths[b] tokens (padded to the longest)."""
        t = max(lengths)
        mask = tril_mask(t).expand(len(slots), t, t).clone()
        for b, n in enumerate(lengths):
            if n < t:
                # Padding rows see only themselves so softmax stays finite; output unused.
                mask[b, n:, :] = eye_mask(t)[n:]
        return BatchLayout(_long(slots), _long(starts), mask)


class KVCache(Protocol):
    """What the stages use of a cache: `DenseKVCache` (CPU) or `PagedKVCache` (GPU)."""

    lengths: list[int]
    max_len: int

    @property
    def free_slots(self) -> int: ...
    def alloc(self) -> int: ...
    def free(self, slot: int) -> None: ...
    def check_room(self, slot: int, start: int, n_new: int) -> None: ...
    def bind(self, layout: BatchLayout) -> AttendFn: ...
    def commit(self, slot: int, start: int, keep: Sequence[int]) -> int: ...
    def truncate(self, slot: int, length: int) -> None: ...


def attention_mask(layout: BatchLayout) -> Tensor:
    """[B, T, K] bool over key positions 0..K-1, K = max(starts) + T.

    Prefix keys (< start) are visible to every new token; new keys follow the tree/causal mask.
    """
    b, t = layout.new_mask.shape[:2]
    steps = torch.arange(t)
    write_pos = layout.starts[:, None] + steps  # [B, T]
    keys = torch.arange(int(layout.starts.max()) + t)
    mask = (keys[None, None, :] < layout.starts[:, None, None]).expand(b, t, len(keys)).clone()
    rows = torch.arange(b)[:, None, None]
    mask[rows, steps[None, :, None], write_pos[:, None, :]] = layout.new_mask
    return mask


def _long(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.long)


class DenseKVCache:
    """Contiguous rows of `max_len` positions, one per request slot (the CPU backend)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        shape = (num_layers, max_requests, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * max_requests
        self._free = list(range(max_requests - 1, -1, -1))

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        *,
        max_requests: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> DenseKVCache:
        return cls(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            max_requests=max_requests,
            max_len=max_len,
            dtype=dtype,
            device=device,
        )

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {len(self.lengths)} KV cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def check_room(self, slot: int, start: int, n_new: int) -> None:
        if start + n_new > self.max_len:
            raise CacheFullError(
                f"slot {slot}: {start + n_new} positions exceed max_len {self.max_len}"
            )

    def bind(self, layout: BatchLayout) -> AttendFn:
        """An `attend` for one forward: writes new K/V tentatively, attends prefix + new tokens."""
        b, t = layout.new_mask.shape[:2]
        write_pos = layout.starts[:, None] + torch.arange(t)  # [B, T]
        if int(write_pos.max()) >= self.max_len:
            raise CacheFullError(f"a forward would write past max_len {self.max_len}")
        kv_len = int(layout.starts.max()) + t
        mask = attention_mask(layout)[:, None]  # [B, 1, T, K]
        slots = layout.slots.to(self.k.device)
        slot_idx = slots[:, None].expand(b, t)
        write_pos, mask = write_pos.to(self.k.device), mask.to(self.k.device)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.k[layer, slot_idx, write_pos] = k
            self.v[layer, slot_idx, write_pos] = v
            kk = self.k[layer, slots, :kv_len].transpose(1, 2)  # [B, Hkv, K, D]
            vv = self.v[layer, slots, :kv_len].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), kk, vv, attn_mask=mask, enable_gqa=True
            )
            return out.transpose(1, 2)  # [B, T, Hq, D]

        return attend

    def commit(self, slot: int, start: int, keep: Sequence[int]) -> int:
        """Keeps new tokens `keep` (indices relative to `start`, increasing) as the prefix.

        Returns the new committed length. keep=[0, 2, 5] moves positions start+2 → start+1 and
        start+5 → start+2; the rest of the tentative writes are dropped.
        """
        keep = list(keep)
        if keep != list(range(len(keep))):
            src = torch.tensor(keep, device=self.k.device) + start
            dst = torch.arange(len(keep), device=self.k.device) + start
            self.k[:, slot, dst] = self.k[:, slot, src]
            self.v[:, slot, dst] = self.v[:, slot, src]
        self.lengths[slot] = start + len(keep)
        return self.lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)
