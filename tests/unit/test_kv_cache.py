"""KV cache: tentative writes, commit of a non-contiguous accepted path, rollback, capacity.

Pages of 4 positions, so the rows these tests write and move cross page boundaries."""

from __future__ import annotations

import pytest
import torch

from specpair.runtime.kv_cache import CacheFullError, KVCache
from specpair.runtime.layout import BatchLayout


def make_cache(max_requests: int = 2, max_len: int = 16) -> KVCache:
    return KVCache(
        num_layers=2,
        num_qo_heads=1,
        num_kv_heads=1,
        head_dim=2,
        max_requests=max_requests,
        max_len=max_len,
        page_size=4,
    )


def keys(cache: KVCache, layer: int, slot: int, n: int) -> list[float]:
    return cache.read(layer, slot, n)[0][:, 0, 0].tolist()


def write(cache: KVCache, slot: int, start: int, values: list[float], mask=None) -> None:
    n = len(values)
    layout = BatchLayout.causal([slot], [start], [n])
    if mask is not None:
        layout = BatchLayout(layout.slots, layout.starts, mask[None])
    attend = cache.bind(layout)
    kv = torch.tensor(values, dtype=torch.float32).view(1, n, 1, 1).expand(1, n, 1, 2).contiguous()
    for layer in range(2):
        attend(layer, torch.zeros(1, n, 1, 2), kv, kv)


def test_commit_non_contiguous_path_moves_accepted_slots() -> None:
    cache = make_cache()
    slot = cache.alloc()
    write(cache, slot, 0, [1.0, 2.0, 3.0])
    assert cache.commit(slot, 0, range(3)) == 3
    # a tree of 6 nodes placed after the prefix; accept full-tree nodes 0, 2, 5
    write(cache, slot, 3, [10, 11, 12, 13, 14, 15], mask=torch.eye(6, dtype=torch.bool))
    assert cache.commit(slot, 3, [0, 2, 5]) == 6
    assert [keys(cache, layer, slot, 6) for layer in (0, 1)] == [[1, 2, 3, 10, 12, 15]] * 2
    assert cache.read(1, slot, 6)[1][:, 0, 1].tolist() == [1, 2, 3, 10, 12, 15]


def test_attention_sees_prefix_and_tree_ancestors_only() -> None:
    cache = make_cache()
    slot = cache.alloc()
    write(cache, slot, 0, [1.0, 1.0])
    cache.commit(slot, 0, range(2))
    # two siblings after the prefix: each must see the prefix and itself, not the other
    mask = torch.eye(2, dtype=torch.bool)
    layout = BatchLayout(torch.tensor([slot]), torch.tensor([2]), mask[None])
    attend = cache.bind(layout)
    k = torch.zeros(1, 2, 1, 2)
    v = torch.tensor([[[[100.0, 100.0]], [[-100.0, -100.0]]]])
    out = attend(0, torch.zeros(1, 2, 1, 2), k, v)
    # uniform weights over 3 visible keys: (1 + 1 + own) / 3
    assert out[0, 0, 0, 0].item() == pytest.approx(102 / 3)
    assert out[0, 1, 0, 0].item() == pytest.approx(-98 / 3)


def test_rollback_by_not_committing() -> None:
    cache = make_cache()
    slot = cache.alloc()
    write(cache, slot, 0, [1.0, 2.0])
    cache.commit(slot, 0, range(2))
    write(cache, slot, 2, [7.0, 8.0])  # tentative drafts
    assert cache.lengths[slot] == 2
    write(cache, slot, 2, [3.0])  # next round overwrites from the committed length
    cache.commit(slot, 2, [0])
    assert keys(cache, 0, slot, 3) == [1, 2, 3]
    cache.truncate(slot, 1)
    assert cache.lengths[slot] == 1


def test_capacity_errors() -> None:
    cache = make_cache(max_requests=1, max_len=4)
    slot = cache.alloc()
    with pytest.raises(CacheFullError, match="slots are in use"):
        cache.alloc()
    with pytest.raises(CacheFullError, match="max_len"):
        write(cache, slot, 2, [1.0, 2.0, 3.0])
    cache.free(slot)
    assert cache.alloc() == slot


def test_pages_are_granted_as_slots_grow_and_returned_on_free() -> None:
    cache = make_cache(max_requests=2, max_len=16)  # 4 pages per slot, + the padding slot's
    free = len(cache.pages.free)
    slot = cache.alloc()
    cache.check_room(slot, 0, 16)
    with pytest.raises(CacheFullError, match="max_len"):
        cache.check_room(slot, 10, 7)
    write(cache, slot, 0, [1.0] * 5)  # positions 0..4: two pages
    assert cache.pages.owned[slot] == 2 and len(cache.pages.free) == free - 2
    generation = cache.generation
    cache.free(slot)
    assert len(cache.pages.free) == free and cache.generation > generation
