"""The fused layer's Triton kernels against the plain torch they replace (bf16, on the GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from specpair.runtime.gpu import fused, triton_kernels

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize(("m", "n", "k"), [(1, 6144, 4096), (8, 4096, 14336), (16, 1000, 256)])
def test_gemv_partials_sum_to_the_matmul(m: int, n: int, k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=BF16, device="cuda")
    w = torch.randn(n, k, dtype=BF16, device="cuda") * 0.02
    cfg = triton_kernels.gemv_config(n, k)
    assert cfg is not None
    parts = triton_kernels.gemv_partials(x, w, *cfg)
    assert parts.shape == (cfg[0], m, n) and parts.dtype == torch.float32
    ref = x.float() @ w.float().T
    torch.testing.assert_close(parts.sum(0), ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("n, k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_invariant_tiles_give_a_row_the_same_bits_in_any_batch(n: int, k: int) -> None:
    """The batch-invariant mode's matmul (`fused.linear_parts`): row 3's result alone, among 16
    rows (the GEMV's tiles), 17, 64 and 150 (64 × 128 tiles, the row in each position) and 1100
    (a prefill), bit for bit; the matmul's. The weights: Llama-3-8B's QKV, gate-up, down."""
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=BF16, device="cuda") * 0.02
    rows = torch.randn(1100, k, dtype=BF16, device="cuda")

    def row_sum(x: torch.Tensor, i: int) -> torch.Tensor:
        return fused.linear_parts(x, w, invariant=True)[:, i].sum(0)

    alone = row_sum(rows[3:4], 0)
    for m, at in ((16, 3), (17, 3), (64, 3), (150, 3), (150, 70), (150, 140), (1100, 1000)):
        x = rows[:m].clone()
        x[at] = rows[3]
        assert torch.equal(row_sum(x, at), alone), (m, at)
    ref = rows[3].float() @ w.float().T
    torch.testing.assert_close(alone, ref, atol=1e-3, rtol=1e-3)


def test_gemv_config_fills_the_gpu_and_splits_k_evenly() -> None:
    assert triton_kernels.gemv_config(4096, 4096) == (4, 64, 128, 4, 4)  # 64 tiles x 4 splits
    assert triton_kernels.gemv_config(128256, 4096) == (1, 64, 128, 4, 3)
    assert triton_kernels.gemv_config(4096, 100) is None  # K not a multiple of the K tile
    splits, _, bk, _, _ = triton_kernels.gemv_config(512, 256)  # type: ignore[misc]
    assert 256 % (splits * bk) == 0


def test_add_rmsnorm_sums_partials() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 4096, dtype=BF16, device="cuda")
    parts = torch.randn(4, 5, 4096, device="cuda")
    w = torch.rand(4096, dtype=BF16, device="cuda")
    total, normed = triton_kernels.add_rmsnorm(x, parts, w, 1e-5)
    ref_total = (x.float() + parts.sum(0)).to(BF16)
    # fp32 sums in another order: at most one bf16 rounding step apart
    torch.testing.assert_close(total, ref_total, atol=1e-5, rtol=2**-7)
    ref = fused.add_rmsnorm(x.cpu(), ref_total.cpu()[None] - x.cpu()[None], w.cpu(), 1e-5)[1]
    torch.testing.assert_close(normed.cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d", [128, 64, 40, 32])  # 40: the shipped target's half of 20 lanes
def test_rope_write_equals_rope_then_index_copy(d: int) -> None:
    torch.manual_seed(2)
    n, n_q, n_kv = 6, 8, 2
    parts = torch.randn(2, n, (n_q + 2 * n_kv) * d, device="cuda")
    # rope_cos_sin's layout: both halves of a row carry the same angles
    angles = torch.rand(n, d // 2, device="cuda") * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(BF16)
    sin = torch.cat([angles.sin()] * 2, -1).to(BF16)
    rows = torch.tensor([7, 3, 0, 12, 5, 9], device="cuda")
    k_cache = torch.zeros(16, n_kv, d, dtype=BF16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q = triton_kernels.rope_write(parts, cos, sin, rows, k_cache, v_cache, n_q, n_kv, d)
    qkv = parts.sum(0).to(BF16)
    ref_q, ref_k = fused.rope_qk(qkv.float(), cos.float(), sin.float(), n_q, n_kv, d)
    torch.testing.assert_close(q.float(), ref_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache[rows].float(), ref_k, atol=3e-2, rtol=2e-2)
    ref_v = qkv[:, (n_q + n_kv) * d :].view(n, n_kv, d)
    assert torch.equal(v_cache[rows], ref_v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert not k_cache[untouched.cuda()].any() and not v_cache[untouched.cuda()].any()


def test_silu_mul_sums_partials() -> None:
    torch.manual_seed(3)
    parts = torch.randn(2, 3, 2 * 1536, device="cuda")
    out = triton_kernels.silu_mul(parts, BF16)
    gate, up = parts.sum(0).to(BF16).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("config", "d", "t"),
    [
        (None, 128, 4),
        ((8, 64, True), 128, 4),
        ((64, 16, True, 8), 128, 4),
        ((16, 32, False, 4), 128, 4),
        ((32, 64, True, 8), 128, 4),
        (None, 40, 4),
        ((8, 64, True), 40, 4),
        (None, 32, 4),
        (None, 80, 4),
        (None, 128, 32),
        (None, 128, 17),
    ],
)
def test_tree_attention_equals_masked_sdpa_over_the_pages(
    config: tuple | None, d: int, t: int
) -> None:
    """t 32: 128 query rows per KV head (the kernel's most, at 8 warps); 17 pads rows to 128."""
    from specpair.runtime.gpu.tree_attention import TreeAttention, TreeConfig
    from specpair.runtime.kv_cache import KVCache
    from specpair.runtime.layout import BatchLayout, attention_mask, flat_index
    from specpair.runtime.tree import tree_mask

    torch.manual_seed(4)
    n_q, n_kv = 8, 2
    cache = KVCache(
        num_layers=1,
        num_qo_heads=n_q,
        num_kv_heads=n_kv,
        head_dim=d,
        max_requests=3,
        max_len=700,
        page_size=16,
        dtype=BF16,
        device="cuda",
    )
    cache.k.normal_()
    cache.v.normal_()
    slots = [cache.alloc() for _ in range(3)]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    if t > 4:  # a random tree: each node's parent an earlier node
        tree = tree_mask([-1] + [int(torch.randint(0, i, (1,))) for i in range(1, t)])
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    layout = BatchLayout(
        torch.tensor(slots), torch.tensor([0, 37, 611]), torch.stack([tree, causal, tree])
    )
    cache.write_index(layout)  # gives the slots their pages
    attn = TreeAttention(
        batch=3,
        tokens=t,
        heads=(n_q, n_kv, d),
        page_size=16,
        pages_per_slot=cache.pages_per_slot,
        device=torch.device("cuda"),
        config=None if config is None else TreeConfig(*config),
    )
    attn.plan(layout, cache.page_table)
    q = torch.randn(3 * t, n_q, d, dtype=BF16, device="cuda")
    out = attn.run(q, (cache.k[0], cache.v[0]), out=torch.empty_like(q))
    # the backend interface's `attend` is the same kernel pair over [B, T, Hq, D]
    attended = attn.attend(q.view(3, t, n_q, d), (cache.k[0], cache.v[0]))
    assert torch.equal(attended, out.view(3, t, n_q, d))
    mask = attention_mask(layout).cuda()  # [B, T, K]
    keys = torch.arange(mask.shape[-1]).expand(3, -1)
    rows = flat_index(cache.page_table, layout.slots, keys, 16).cuda()
    kk = cache.k[0].view(-1, n_kv, d)[rows].transpose(1, 2).float()  # [B, Hkv, K, D]
    vv = cache.v[0].view(-1, n_kv, d)[rows].transpose(1, 2).float()
    ref = F.scaled_dot_product_attention(
        q.view(3, t, n_q, d).transpose(1, 2).float(),
        kk,
        vv,
        attn_mask=mask[:, None],
        enable_gqa=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out.view(3, t, n_q, d).float(), ref, atol=2e-2, rtol=2e-2)


def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl() -> None:
    """Norm -> GEMV -> silu -> GEMV -> add+norm, six layers deep under one CUDA graph: with
    programmatic dependent launch every kernel starts early and must wait for its input, so a
    missing wait would read a half-written partial and change the result."""
    torch.manual_seed(5)
    h, inter, eps = 1024, 2816, 1e-5
    layers = [
        (
            torch.randn(2 * inter, h, dtype=BF16, device="cuda") * 0.02,
            torch.randn(h, inter, dtype=BF16, device="cuda") * 0.02,
            torch.rand(h, dtype=BF16, device="cuda") + 0.5,
        )
        for _ in range(6)
    ]
    x0 = torch.randn(4, h, dtype=BF16, device="cuda")

    def chain() -> torch.Tensor:
        x, normed = x0, triton_kernels.rmsnorm(x0, layers[0][2], eps)
        for gate_up, down, norm in layers:
            act = triton_kernels.silu_mul(fused.linear_parts(normed, gate_up), BF16)
            x, normed = triton_kernels.add_rmsnorm(x, fused.linear_parts(act, down), norm, eps)
        return normed

    was = triton_kernels.pdl()["PDL"]
    outs = {}
    try:
        for enabled in (False, True):
            triton_kernels.set_pdl(enabled)
            eager = chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain()
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, eager, atol=0, rtol=0)
            outs[enabled] = out.clone()
    finally:
        triton_kernels.set_pdl(was)
    assert torch.equal(outs[True], outs[False])
