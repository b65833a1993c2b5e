"""Where one forward's new tokens go in the KV cache, and which keys each of them sees.

Every forward writes its new tokens' keys/values *tentatively* after each request's committed
length; the cache's `commit` then keeps a subset of them (the accepted path).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def place_rows(dst: Tensor, rows: Sequence[Tensor]) -> Tensor:
    """rows[b] [n_b, ...] into dst[b, :n_b] (cast to dst's dtype and device); the rest of dst
    is left as it is. Returns dst."""
    for b, r in enumerate(rows):
        dst[b, : len(r)].copy_(r)
    return dst


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

    def lengths(self) -> list[int]:
        """Each request's real rows: those that see its first new token (the pending root or a
        prompt's first), every row of a tree or causal run but none of the padding, which sees
        only itself. Causal over lengths [3, 1] -> [3, 1]."""
        sees_first = self.new_mask[:, :, 0]  # [B, T]; row 0 is real in every request
        rows = torch.arange(1, sees_first.shape[1] + 1)
        return (sees_first * rows).amax(1).tolist()

    def request(self, b: int, n: int) -> BatchLayout:
        """Request b alone, its first n rows (`lengths`): the layout it has in a batch of one."""
        mask = self.new_mask[b : b + 1, :n, :n]
        return BatchLayout(self.slots[b : b + 1], self.starts[b : b + 1], mask)


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


def flat_index(page_table: Tensor, slots: Tensor, positions: Tensor, page_size: int) -> Tensor:
    # page_table: [R, P] long, slots: [B], positions: [B, T] -> flat cache rows [B, T]
    pages = page_table[slots[:, None], positions // page_size]
    return pages * page_size + positions % page_size


def _long(values: Sequence[int]) -> Tensor:
    return torch.tensor(list(values), dtype=torch.long)


# Rows this short pad one another freely: a round's appended tokens (accepted + bonus, at most
# the tier + 1) stay one forward, a CUDA graph's.
PAD_FREE = 16


def padded_groups(starts: Sequence[int], lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Rows (a start and a length each) that can share one padded forward, longest first; each
    group's first member is its longest. Every row of a forward is padded to its longest, so a
    row joins a group while (a) the group's furthest start plus its longest row fits the cache,
    and (b) padding it costs less than its own tokens: it is over half the longest, or the
    longest is at most `PAD_FREE`. Usually one group holds the whole batch.

    Worked examples: a 150-token prompt joining a request that appends 100 at position 1000,
    cache 1031 positions: starts [1000, 0], lengths [100, 150] -> [[1], [0]] (together the
    padding would write the request's slot up to 1150, though each alone fits). A 120-token
    prompt joining 63 requests that appended 1–8 tokens each: two forwards, 120 + 63 × 8 rows,
    not 64 × 120.
    """
    groups: list[list[int]] = []
    for i in sorted(range(len(starts)), key=lambda i: -lengths[i]):
        for group in groups:
            longest = lengths[group[0]]
            fits = max(starts[i], *(starts[j] for j in group)) + longest <= max_len
            if fits and (2 * lengths[i] > longest or longest <= PAD_FREE):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups
