"""Triton kernels of the fused decoder layer (GPU only): see `fused.py` for how they chain.

- `gemv_partials`: few-row matmuls (M <= 16) as split-K fp32 partials [S, M, N], no reduce
  kernel: every consumer below sums the S partials as it loads them;
- `rmsnorm` / `add_rmsnorm`: one program per row, fp32 statistics;
- `rope_write`: rotates q and k and writes k and v straight into the paged cache rows;
- `silu_mul`: the SwiGLU activation.
Elementwise kernels exist to cut kernel count, not flops: at batch 1 every launch is idle bus.

On Hopper and newer every kernel here is launched with programmatic dependent launch (PDL): it
lets the next kernel in the stream launch early (`gdc_launch_dependents`) and waits for the
previous one (`gdc_wait`) before touching anything it wrote. Before that wait a kernel may only
read what no kernel ever writes, the weights: a GEMV fetches its first weight tile while the
norm, rope or attention before it still runs. The short kernels release their successor at
once; a GEMV only after its loop (a GEMV launched beside another slowed both). What it saves:
`bench.gpu_kernels forward`'s "no-PDL" row (bench/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_pdl = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def set_pdl(enabled: bool) -> None:
    """PDL on (the default on Hopper and newer) or off, for launches from now on (benchmarks)."""
    global _pdl
    _pdl = enabled and torch.cuda.get_device_capability()[0] >= 9


def pdl() -> dict[str, bool]:
    """Launch options of a kernel with a `PDL` constexpr: pass as `**pdl()`."""
    return {"PDL": _pdl, "launch_pdl": _pdl}


@triton.jit
def await_previous(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """PDL: let the next kernel launch now; wait until the previous one's writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    h,
    n_rows,
    eps,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # one program per row; x += the sum of SPLITS delta rows [SPLITS, n_rows, h] (0: none).
    # SPLITS is a compile-time constant so the partial loads are all issued at once.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < h
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)  # a weight: before the wait
    await_previous(PDL)
    x = tl.load(x_ptr + row * h + cols, mask=m, other=0.0).to(tl.float32)
    if SPLITS > 0:
        for s in tl.static_range(SPLITS):
            d = tl.load(d_ptr + (s * n_rows + row) * h + cols, mask=m, other=0.0)
            x += d.to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * h + cols, x, mask=m)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / h + eps)
    # Like RMSNorm: normalize in fp32, round to the activation dtype, then scale by the weight.
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * h + cols, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    n, h = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _rmsnorm_kernel[(n,)](
        x, x, weight, x, out, h, n, eps, SPLITS=0, BLOCK=block, num_warps=16, **pdl()
    )
    return out


def add_rmsnorm(x: Tensor, parts: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """x [N, H] + the sum of parts [S, N, H] (any float dtype) -> (sum, rmsnorm(sum))."""
    n, h = x.shape
    x, parts = x.contiguous(), parts.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(h)
    _rmsnorm_kernel[(n,)](
        x,
        parts,
        weight,
        total,
        out,
        h,
        n,
        eps,
        SPLITS=parts.shape[0],
        BLOCK=block,
        num_warps=16,
        **pdl(),
    )
    return total, out


@triton.jit
def _rope_write_kernel(
    parts_ptr,
    n_rows,
    width,
    cos_ptr,
    sin_ptr,
    q_ptr,
    rows_ptr,
    k_ptr,
    v_ptr,
    n_q,
    n_kv,
    SPLITS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (N, Hq + 2 Hkv): one head of one token from the summed QKV partials. q heads are
    # rotated into q [N, Hq, D]; k heads rotated and v heads copied into the cache rows
    # k/v [rows, Hkv, D] at rows[token] (the paged cache's flat write index). HALF_P is HALF
    # rounded up to a power of two (tl.arange's rule): head_dim 40 -> 20 lanes of 32 live.
    await_previous(PDL)
    row, head = tl.program_id(0), tl.program_id(1)
    d = 2 * HALF
    cols = tl.arange(0, HALF_P)
    live = cols < HALF
    x1 = tl.zeros((HALF_P,), dtype=tl.float32)
    x2 = tl.zeros((HALF_P,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        src = parts_ptr + (s * n_rows + row) * width + head * d
        x1 += tl.load(src + cols, mask=live, other=0.0).to(tl.float32)
        x2 += tl.load(src + HALF + cols, mask=live, other=0.0).to(tl.float32)
    # round to the activation dtype first, as the unfused QKV matmul's output would be
    x1 = x1.to(q_ptr.dtype.element_ty).to(tl.float32)
    x2 = x2.to(q_ptr.dtype.element_ty).to(tl.float32)
    if head < n_q + n_kv:
        c = tl.load(cos_ptr + row * d + cols, mask=live, other=0.0).to(tl.float32)
        s_ = tl.load(sin_ptr + row * d + cols, mask=live, other=0.0).to(tl.float32)
        o1 = x1 * c - x2 * s_
        o2 = x2 * c + x1 * s_
    else:
        o1, o2 = x1, x2
    if head < n_q:
        dst = q_ptr + (row * n_q + head) * d
    elif head < n_q + n_kv:
        dst = k_ptr + (tl.load(rows_ptr + row) * n_kv + head - n_q) * d
    else:
        dst = v_ptr + (tl.load(rows_ptr + row) * n_kv + head - n_q - n_kv) * d
    tl.store(dst + cols, o1.to(q_ptr.dtype.element_ty), mask=live)
    tl.store(dst + HALF + cols, o2.to(q_ptr.dtype.element_ty), mask=live)


def rope_write(
    parts: Tensor,
    cos: Tensor,
    sin: Tensor,
    rows: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    n_q: int,
    n_kv: int,
    head_dim: int,
) -> Tensor:
    """QKV partials [S, N, (Hq + 2 Hkv) D] -> rotated q [N, Hq, D]; rotated k and v are written
    into the cache rows k_cache/v_cache [R, Hkv, D] at rows [N] (one kernel, no index_copy)."""
    splits, n, width = parts.shape
    q = torch.empty(n, n_q, head_dim, dtype=k_cache.dtype, device=parts.device)
    cos, sin, parts = cos.contiguous(), sin.contiguous(), parts.contiguous()
    half = head_dim // 2
    _rope_write_kernel[(n, n_q + 2 * n_kv)](
        parts,
        n,
        width,
        cos,
        sin,
        q,
        rows,
        k_cache,
        v_cache,
        n_q,
        n_kv,
        SPLITS=splits,
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        **pdl(),
    )
    return q


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, inter, n_rows, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    await_previous(PDL)
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        base = gu_ptr + (s * n_rows + row) * 2 * inter
        g += tl.load(base + cols, mask=m, other=0.0).to(tl.float32)
        u += tl.load(base + inter + cols, mask=m, other=0.0).to(tl.float32)
    # Round as the unfused path does: matmul output, then F.silu, to bf16 before the product.
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """gate/up partials [S, N, 2I] -> silu(gate) * up [N, I] in `dtype`."""
    splits, n, two_i = parts.shape
    inter = two_i // 2
    parts = parts.contiguous()
    out = torch.empty(n, inter, dtype=dtype, device=parts.device)
    block = 1024
    grid = (n, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](parts, out, inter, n, SPLITS=splits, BLOCK=block, **pdl())
    return out


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    m,
    n,
    k,
    k_per_split,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (cdiv(m, BM), cdiv(n, BN), splits): rows [pid_n * BN, +BN) of w over k range pid_k
    # for x rows [pid_m * BM, +BM); fp32 partials. Each x row's sum runs the same tiles in the
    # same order whatever m is: a row's result does not depend on the rows beside it. The row
    # tiles vary fastest, so the programs that read one weight tile run side by side and the
    # later ones can find it in L2 (M = 128 at BM 64: each weight tile read twice, together).
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k0 = pid_k * k_per_split
    if PDL:  # the first weight tile is in flight while the previous kernel finishes
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[None, :] * k + rk[:, None], mask=rn[None, :] < n, other=0.0)
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + rm[:, None] * k + rk[None, :], mask=rm[:, None] < m, other=0.0)
        acc += tl.dot(x, w)
        k0 += BK
        k_per_split -= BK
    for kk in range(k0, k0 + k_per_split, BK):
        rk = kk + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * k + rk[None, :], mask=rm[:, None] < m, other=0.0)
        w = tl.load(w_ptr + rn[None, :] * k + rk[:, None], mask=rn[None, :] < n, other=0.0)
        acc += tl.dot(x, w)
    if PDL:  # only now: a GEMV launched during this one would contend for its SMs
        tl.extra.cuda.gdc_launch_dependents()
    out = part_ptr + pid_k * m * n + rm[:, None] * n + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < m) & (rn[None, :] < n))


def gemv_config(n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """(splits, BN, BK, warps, stages) for an [N, K] weight, or None where the GEMV can't run.

    Enough programs to keep every SM streaming (>= 256 on 132 SMs): 64-row tiles, K split in
    two until there are (against cuBLAS: `bench/gpu_kernels.py`, bench/RESULTS.md)."""
    bn, bk = 64, 128
    if k % bk:
        return None
    splits = 1
    while -(-n // bn) * splits < 256 and splits < 8 and k % (2 * splits * bk) == 0:
        splits *= 2
    return splits, bn, bk, 4, 3 if splits == 1 else 4


def gemv_partials(
    x: Tensor,
    w: Tensor,
    splits: int,
    bn: int = 64,
    bk: int = 128,
    warps: int = 4,
    stages: int = 3,
    bm: int = 16,
) -> Tensor:
    """x [M, K] @ w[N, K]^T as fp32 split-K partials [splits, M, N]: a consumer kernel sums
    them, so no reduce kernel runs. For the few-row matmuls of batch-1 decoding (M <= 16), and
    for every matmul of the batch-invariant mode (tiles of `bm` rows, one size for every M).
    Each tile of rows reads the whole weight; the tiles of one weight tile run together (L2)."""
    m, k = x.shape
    n = w.shape[0]
    assert k % (splits * bk) == 0, (k, splits, bk)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    _gemv_kernel[grid](
        x.contiguous(),
        w,
        part,
        m,
        n,
        k,
        k // splits,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
        **pdl(),
    )
    return part
