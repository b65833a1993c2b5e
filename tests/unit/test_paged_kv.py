"""Paged KV cache bookkeeping, flashinfer's page metadata, the fused decoder, on CPU (the GPU
attention is in tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import torch

from specpair.models.args import ModelArgs
from specpair.models.loading import load_eagle, load_llama
from specpair.runtime.build import build_states
from specpair.runtime.draft.drafters import EagleDrafter
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.gpu.capture import bucket_of, buckets_for, pad_layout, verify_buckets
from specpair.runtime.gpu.flashinfer_layout import flat_mask, page_metadata
from specpair.runtime.gpu.fused import fuse_decoder
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.layout import (
    PAD_FREE,
    BatchLayout,
    attention_mask,
    flat_index,
    padded_groups,
)
from specpair.runtime.target.worker import TargetWorker
from tests.unit.test_kv_cache import make_cache


def test_page_metadata_worked_example() -> None:
    table = torch.tensor([[4, 0], [2, 0], [7, 3]])
    indptr, indices, last = page_metadata(
        table, torch.tensor([0, 1, 2]), torch.tensor([5, 16, 17]), 16
    )
    assert indptr.tolist() == [0, 1, 2, 4]
    assert indices.tolist() == [4, 2, 7, 3]
    assert last.tolist() == [5, 16, 1]
    # page size 4, slot 2 owns [7, 3]: position 5 -> page 3, offset 1 -> 13
    assert flat_index(table, torch.tensor([2]), torch.tensor([[5]]), 4).item() == 13


def test_flat_mask_equals_the_dense_attention_mask_rows() -> None:
    torch.manual_seed(0)
    starts = torch.tensor([0, 7, 3, 20])
    new_mask = torch.rand(4, 5, 5) > 0.5
    layout = BatchLayout(torch.arange(4), starts, new_mask)
    full = attention_mask(layout)  # [B, T, K]
    expected = torch.cat([full[b, :, : int(s) + 5].reshape(-1) for b, s in enumerate(starts)])
    assert torch.equal(flat_mask(layout), expected)


def test_flat_mask_concatenates_rows_of_each_request() -> None:
    layout = BatchLayout(
        torch.tensor([0, 1]), torch.tensor([1, 0]), torch.eye(2, dtype=torch.bool).repeat(2, 1, 1)
    )
    # request 0: kv_len 3, rows [1,1,0],[1,0,1]; request 1: kv_len 2, rows [1,0],[0,1]
    assert flat_mask(layout).int().tolist() == [1, 1, 0, 1, 0, 1, 1, 0, 0, 1]


def test_layout_lengths_are_each_requests_real_rows() -> None:
    causal = BatchLayout.causal([0, 1, 2], [0, 4, 0], [3, 1, 5])
    assert causal.lengths() == [3, 1, 5]
    tree = torch.eye(5, dtype=torch.bool)
    tree[1:4, 0] = True  # root 0 with children 1, 2, 3; row 4 is padding
    layout = BatchLayout(torch.tensor([0]), torch.tensor([2]), tree[None])
    assert layout.lengths() == [4]
    alone = causal.request(2, 5)
    assert alone.slots.tolist() == [2]
    assert torch.equal(alone.new_mask[0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_the_invariant_modes_eager_attention_gives_each_request_its_batch_of_one_result() -> None:
    """`SoloAttention`: prompts of 5, 2 and 7 tokens after contexts of 0, 3 and 6 attend in one
    batch exactly as each does alone (same bits), and padding rows come back zero."""
    torch.manual_seed(0)
    starts, lengths = [0, 3, 6], [5, 2, 7]

    def run(cache: KVCache, slots: list[int], rows: list[int]) -> torch.Tensor:
        layout = BatchLayout.causal(slots, [starts[r] for r in rows], [lengths[r] for r in rows])
        q, k, v = (x[rows, : max(lengths[r] for r in rows)] for x in qkv)
        return cache.bind(layout)(0, q, k, v)

    cache = KVCache(
        num_layers=1,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_requests=3,
        max_len=32,
        page_size=4,
        invariant=True,
    )
    slots = [cache.alloc() for _ in starts]
    for slot, start in zip(slots, starts, strict=True):
        if start:  # the context: random keys and values, committed
            attend = cache.bind(BatchLayout.causal([slot], [0], [start]))
            attend(0, *(torch.randn(1, start, n, 8) for n in (4, 2, 2)))
            cache.commit(slot, 0, range(start))
    qkv = [torch.randn(3, 7, n, 8) for n in (4, 2, 2)]
    together = run(cache, slots, [0, 1, 2])
    for r, slot in enumerate(slots):
        alone = run(cache, [slot], [r])
        assert torch.equal(together[r, : lengths[r]], alone[0]), f"request {r}"
        assert not together[r, lengths[r] :].any()


def write(cache: KVCache, slot: int, start: int, values: list[float]) -> None:
    n = len(values)
    layout = BatchLayout(
        torch.tensor([slot]), torch.tensor([start]), torch.eye(n, dtype=torch.bool)[None]
    )
    attend = cache.bind(layout)
    kv = torch.tensor(values, dtype=torch.float32).view(1, n, 1, 1).expand(1, n, 1, 2).contiguous()
    for layer in range(2):
        attend(layer, torch.zeros(1, n, 1, 2), kv, kv)


def values(cache: KVCache, slot: int, n: int) -> list[float]:
    rows = flat_index(cache.page_table, torch.tensor([slot]), torch.arange(n)[None], 4)[0]
    assert torch.equal(cache.k[1].view(-1, 1, 2)[rows], cache.read(1, slot, n)[0])
    return cache.k[1].view(-1, 1, 2)[rows, 0, 0].tolist()


def test_commit_moves_non_contiguous_path_across_pages_and_free_returns_pages() -> None:
    cache = make_cache()
    other = cache.alloc()
    slot = cache.alloc()
    write(cache, other, 0, [9.0] * 5)  # interleave page ownership between the slots
    write(cache, slot, 0, [1.0, 2.0, 3.0])
    cache.commit(slot, 0, range(3))
    write(cache, slot, 3, [10, 11, 12, 13, 14, 15])  # spans pages 0..2 of the slot
    assert cache.commit(slot, 3, [0, 2, 5]) == 6
    assert values(cache, slot, 6) == [1, 2, 3, 10, 12, 15]
    free_before = len(cache.pages.free)
    cache.free(slot)
    assert len(cache.pages.free) == free_before + 3 and cache.free_slots == 1


def test_buckets_and_padding() -> None:
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    # a verify's: a quarter of the bucket below (at least 8) between two
    assert verify_buckets(buckets_for(64)) == [1, 2, 4, 8, *range(16, 65, 8)]
    assert verify_buckets(buckets_for(12)) == [1, 2, 4, 8, 12]
    assert verify_buckets(buckets_for(256))[10:] == [64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert bucket_of(3, [1, 2, 4]) == 4 and bucket_of(5, [1, 2, 4]) is None
    layout = BatchLayout.causal([0], [7], [2])
    padded = pad_layout(layout, 2, 3, pad_slot=9)
    assert padded.slots.tolist() == [0, 9] and padded.starts.tolist() == [7, 0]
    # the padded column is invisible to the real tokens
    assert padded.new_mask[0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


def test_padded_groups_keep_each_forward_inside_the_cache() -> None:
    # A 150-token prompt joining a request at 1000: padded together, 1000 + 150 > 1031.
    assert padded_groups([1000, 0], [100, 150], 1031) == [[1], [0]]
    assert padded_groups([1000, 0], [100, 150], 1150) == [[1, 0]]
    # Longest first; a short row joins the first group it fits in.
    assert padded_groups([0, 10, 900], [3, 5, 2], 1000) == [[1, 0, 2]]


def test_padded_groups_do_not_pad_short_rows_to_a_prompt() -> None:
    # A 120-token prompt beside 63 rounds' rows of 1–8 tokens: the prompt alone, the rest as
    # one forward (a CUDA graph's), not 64 rows of 120.
    lengths = [120] + [1 + i % 8 for i in range(63)]
    groups = padded_groups([0] + [200] * 63, lengths, 2048)
    assert groups[0] == [0] and sorted(groups[1]) == list(range(1, 64)) and len(groups) == 2
    # Over half the longest joins it; rows up to PAD_FREE pad one another whatever they are.
    assert padded_groups([0, 0, 0], [100, 51, 50], 2048) == [[0, 1], [2]]
    assert padded_groups([0, 0], [PAD_FREE, 1], 2048) == [[0, 1]]
    assert padded_groups([0, 0], [PAD_FREE + 1, 1], 2048) == [[0], [1]]


def test_fused_decoder_matches_reference(ckpts: dict[str, Path]) -> None:
    ref = load_llama(ckpts["target"])
    fused = fuse_decoder(load_llama(ckpts["target"]))
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    positions = torch.arange(4).expand(2, 4)
    outs = []
    for model in (ref, fused):
        cache = KVCache.for_model(model.args, max_requests=2, max_len=8)  # type: ignore[arg-type]
        layout = BatchLayout.causal([cache.alloc(), cache.alloc()], [0, 0], [4, 4])
        outs.append(model(tokens, positions, cache.bind(layout)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def cache(args: ModelArgs, page_size: int) -> KVCache:
    return KVCache.for_model(args, max_requests=2, max_len=96, page_size=page_size)


def test_speculative_engine_is_the_same_whatever_the_page_size(ckpts: dict[str, Path]) -> None:
    """Pages of 4 positions (commits and steps cross page boundaries every round) decode what
    one page per request does."""
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
    outputs = []
    for page_size in (96, 4):
        model = load_llama(ckpts["target"])
        head = load_eagle(ckpts["eagle"], ckpts["target"])
        worker = TargetWorker(model, cache(model.args, page_size), keep_features=True)
        drafter = EagleDrafter(head, cache(head.args, page_size))
        states = build_states([3], worker, drafter)
        results = SpeculativeEngine(worker, drafter).generate(
            prompts, max_new_tokens=20, state=states[3]
        )
        outputs.append([r.token_ids for r in results])
    assert outputs[0] == outputs[1]
