"""Paged tree attention for few query tokens per request, in Triton (CUDA graphs only).

flashinfer's paged prefill kernel (with the tree as custom mask) costs the same per layer at
batch 1 whatever q ≤ 8 is (split-KV prefill + merge; `bench/gpu_kernels.py` compares the two,
bench/RESULTS.md), a large share of an 8B model's forward. Verify and the draft's
multi-step run at most a few tokens per request, so their graphs use this split-KV kernel
instead (flash-decoding: every program streams one chunk of one request's keys for all of a
KV head's query rows, a second kernel merges the chunks). Prefill and long extends stay on
flashinfer (`KVCache.bind`).

Visibility of key position p to new token i of request b (start = its committed length):

    p < start                 → always (the committed prefix)
    start ≤ p < start + T     → tree_mask[b, i, p - start]
    otherwise                 → never

It is an `attention.AttentionBackend` (`plan`, `attend`; `run(q, (k, v), out=)` is the bare
kernel pair), and its metadata lives in static buffers so a graph replays it with a new layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from specpair.runtime.gpu.staging import Staging
from specpair.runtime.gpu.triton_kernels import await_previous, pdl
from specpair.runtime.layout import BatchLayout

# query rows per KV head (tokens x GQA group) the kernel holds at once: 128 holds a tree verify
# of 32 tokens at Llama-3's 4 q heads per KV head (flashinfer's graph attention, past it, is
# planned on the host: ~2 ms a round on an H100 for a 21-token tree)
MAX_ROWS = 128


@triton.jit
def _kv_block(
    k_ptr,
    v_ptr,
    pages_ptr,
    mask_ptr,
    b,
    h,
    start,
    hi,
    n0,
    tok,
    live,
    d,
    pages_stride,
    n_kv,
    T: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys, values and tree-mask bits of key positions [n0, n0 + BLOCK_N) (masked at hi)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < hi
    page = tl.load(pages_ptr + b * pages_stride + pos // PAGE, mask=valid, other=0)
    kv_row = (page.to(tl.int64) * PAGE + pos % PAGE) * n_kv + h
    kv_live = valid[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + kv_row[:, None] * D + d[None, :], mask=kv_live, other=0.0)
    v = tl.load(v_ptr + kv_row[:, None] * D + d[None, :], mask=kv_live, other=0.0)
    new = pos - start
    tree = tl.load(
        mask_ptr + (b * T + tok[:, None]) * T + new[None, :],
        mask=live[:, None] & ((new >= 0) & valid)[None, :],
        other=0,
    )
    vis = valid[None, :] & ((pos[None, :] < start) | (tree != 0))  # [R, BLOCK_N]
    return k, v, vis


@triton.jit
def _tree_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pages_ptr,
    starts_ptr,
    mask_ptr,
    part_o_ptr,
    part_ml_ptr,
    sm_scale,
    pages_stride,
    n_q,
    n_kv,
    T: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PAGE: tl.constexpr,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # grid (B, Hkv, SPLITS); rows r = token * G + group head, for r < T * G; head dims d < D of
    # DP lanes (D rounded up to a power of two, at least 16 for tl.dot)
    await_previous(PDL)
    b, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + b)
    length = start + T
    if CHUNK:  # noqa: SIM108 - a constexpr branch; fixed key positions per chunk
        chunk = CHUNK
    else:
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, length)
    rows = tl.arange(0, R)
    tok, grp = rows // G, rows % G
    live = rows < T * G
    d = tl.arange(0, DP)
    q_off = ((b * T + tok) * n_q + h * G + grp) * D
    row_live = live[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_live, other=0.0)
    m_i = tl.full((R,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((R,), dtype=tl.float32)
    acc = tl.zeros((R, DP), dtype=tl.float32)
    # Each block's loads are a chain of memory round trips (page row -> K/V rows): with
    # PREFETCH the next block's are in flight while this one's softmax runs.
    if PREFETCH:
        k, v, vis = _kv_block(
            k_ptr,
            v_ptr,
            pages_ptr,
            mask_ptr,
            b,
            h,
            start,
            hi,
            lo,
            tok,
            live,
            d,
            pages_stride,
            n_kv,
            T,
            D,
            DP,
            PAGE,
            BLOCK_N,
        )
    for n0 in range(lo, hi, BLOCK_N):
        if PREFETCH:
            k_next, v_next, vis_next = _kv_block(
                k_ptr,
                v_ptr,
                pages_ptr,
                mask_ptr,
                b,
                h,
                start,
                hi,
                n0 + BLOCK_N,
                tok,
                live,
                d,
                pages_stride,
                n_kv,
                T,
                D,
                DP,
                PAGE,
                BLOCK_N,
            )
        else:
            k, v, vis = _kv_block(
                k_ptr,
                v_ptr,
                pages_ptr,
                mask_ptr,
                b,
                h,
                start,
                hi,
                n0,
                tok,
                live,
                d,
                pages_stride,
                n_kv,
                T,
                D,
                DP,
                PAGE,
                BLOCK_N,
            )
        s = tl.where(vis, tl.dot(q, tl.trans(k)) * sm_scale, -1.0e30)  # [R, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(vis, tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if PREFETCH:
            k, v, vis = k_next, v_next, vis_next
    base = ((b * tl.num_programs(1) + h) * SPLITS + sp) * R + rows
    tl.store(part_o_ptr + base[:, None] * D + d[None, :], acc, mask=row_live)
    tl.store(part_ml_ptr + base * 2, m_i, mask=live)
    tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=live)


@triton.jit
def _merge_kernel(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    n_q,
    n_kv,
    T: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    R: tl.constexpr,
    SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (B * T, Hq): one output row from the SPLITS chunk partials of its KV head
    await_previous(PDL)
    bt, hq = tl.program_id(0), tl.program_id(1)
    b, tok = bt // T, bt % T
    h, grp = hq // G, hq % G
    r = tok * G + grp
    sp = tl.arange(0, SPLITS)
    base = ((b * n_kv + h) * SPLITS + sp) * R + r
    m = tl.load(part_ml_ptr + base * 2)
    lsum = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - m_max)
    d = tl.arange(0, DP)
    o = tl.load(part_o_ptr + base[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + (bt * n_q + hq) * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """How the kernel splits one request's keys: `splits` chunks (a power of two: the merge's
    tl.arange), `block_n` keys per step, the next block's loads issued ahead (`prefetch`),
    warps per program. `chunk` > 0: chunk i holds key positions [i·chunk, (i + 1)·chunk)
    whatever the request's length (the batch-invariant mode: `splits` covers the cache);
    0: the length cut in `splits` equal chunks."""

    splits: int
    block_n: int = 32
    prefetch: bool = False
    warps: int = 4
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.splits < 1 or self.splits & (self.splits - 1):
            raise ValueError(f"splits {self.splits}: a power of two")
        if self.chunk % self.block_n:
            raise ValueError(f"chunk {self.chunk}: a multiple of block_n {self.block_n}")


def tree_config(batch: int, n_kv: int, tokens: int) -> TreeConfig:
    """~256 programs, each a chunk of one request's keys for one KV head. Prefetch pays at one
    query token, not at 8 (`bench/gpu_kernels.py`)."""
    splits = max(1, min(32, 256 // (batch * n_kv)))
    return TreeConfig(1 << (splits.bit_length() - 1), prefetch=tokens == 1)


INVARIANT_CHUNK = 256  # keys per chunk in the batch-invariant mode


def invariant_tree_config(max_len: int) -> TreeConfig:
    """The batch-invariant mode's: chunks of INVARIANT_CHUNK fixed key positions, as many as
    the cache's longest request needs (a program past a request's length exits at once, and
    its empty partial adds exactly 0 in the merge).

    Worked example: max_len 2056 → 9 chunks → splits 16; a request of 700 keys fills chunks
    0–2 (keys 0–255, 256–511, 512–699) at batch 1 and at batch 32, in a verify of 1 token or 8."""
    chunks = -(-max_len // INVARIANT_CHUNK)
    splits = 1 << max(chunks - 1, 0).bit_length()
    # no prefetch at any width: the two loops compile to different instruction streams, whose
    # fp32 accumulation into the output need not agree bit for bit (a verify of 1 token
    # against one of 2 gave other tokens on an H100)
    return TreeConfig(splits, chunk=INVARIANT_CHUNK)


class TreeAttention:
    """A graph-friendly stand-in for flashinfer's paged prefill at few query tokens. Its
    `pages` and `starts` are plain device buffers: a graph may fill them itself
    (`graphs.capture.GraphAttention.follow`)."""

    fused_write = True

    def __init__(
        self,
        *,
        batch: int,
        tokens: int,
        heads: tuple[int, int, int],
        page_size: int,
        pages_per_slot: int,
        device: torch.device,
        config: TreeConfig | None = None,
    ) -> None:
        n_q, n_kv, d = heads
        self.batch, self.tokens, self.heads, self.page_size = batch, tokens, heads, page_size
        self.group = n_q // n_kv
        self.rows = max(16, triton.next_power_of_2(tokens * self.group))
        self.lanes = max(16, triton.next_power_of_2(d))  # head dims held per row (DP)
        self.config = config or tree_config(batch, n_kv, tokens)
        self.splits = self.config.splits
        # 128 rows of fp32 accumulator over 128 head dims: 128 registers a thread at 4 warps
        self.warps = self.config.warps if self.rows <= 64 else max(self.config.warps, 8)
        self.pages = torch.zeros(batch, pages_per_slot, dtype=torch.int32, device=device)
        self.starts = torch.zeros(batch, dtype=torch.int32, device=device)
        self.mask = torch.zeros(batch, tokens, tokens, dtype=torch.int8, device=device)
        shape = (batch, n_kv, self.splits, self.rows)
        self.part_o = torch.empty(*shape, d, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(*shape, 2, dtype=torch.float32, device=device)
        self.sm_scale = 1.0 / math.sqrt(d)

    @staticmethod
    def fits(tokens: int, heads: tuple[int, int, int]) -> bool:
        n_q, n_kv, d = heads
        return tokens * (n_q // n_kv) <= MAX_ROWS and d % 2 == 0 and d <= 256

    def plan(self, layout: BatchLayout, page_table: Tensor, staging: Staging | None = None) -> None:
        """Copies one padded layout's pages, starts and tree mask into the static buffers
        (through `staging`'s pinned twins when given)."""
        sources = (page_table[layout.slots], layout.starts, layout.new_mask)
        for dst, src in zip((self.pages, self.starts, self.mask), sources, strict=True):
            if staging is None:
                dst.copy_(src, non_blocking=True)
            else:
                staging.copy(dst, src)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        # q: [B, T, Hq, D] -> [B, T, Hq, D]
        b, t, n_q, d = q.shape
        out = torch.empty(b * t, n_q, d, dtype=q.dtype, device=q.device)
        self.run(q.reshape(b * t, n_q, d), kv, out=out)
        return out.view(b, t, n_q, d)

    def run(self, q: Tensor, kv: tuple[Tensor, Tensor], out: Tensor) -> Tensor:
        # q: [B * T, Hq, D]; kv: the layer's pages [P, page, Hkv, D] each -> out [B * T, Hq, D]
        n_q, n_kv, d = self.heads
        k, v, cfg = *kv, self.config
        _tree_attn_kernel[(self.batch, n_kv, self.splits)](
            q,
            k,
            v,
            self.pages,
            self.starts,
            self.mask,
            self.part_o,
            self.part_ml,
            self.sm_scale,
            self.pages.stride(0),
            n_q,
            n_kv,
            T=self.tokens,
            G=self.group,
            D=d,
            DP=self.lanes,
            PAGE=self.page_size,
            R=self.rows,
            BLOCK_N=cfg.block_n,
            SPLITS=cfg.splits,
            PREFETCH=cfg.prefetch,
            num_warps=self.warps,
            CHUNK=cfg.chunk,
            **pdl(),
        )
        _merge_kernel[(self.batch * self.tokens, n_q)](
            self.part_o,
            self.part_ml,
            out,
            n_q,
            n_kv,
            T=self.tokens,
            G=self.group,
            D=d,
            DP=self.lanes,
            R=self.rows,
            SPLITS=self.splits,
            **pdl(),
        )
        return out
