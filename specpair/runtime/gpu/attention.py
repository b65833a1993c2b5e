"""Attention over the paged KV cache, behind one interface: torch SDPA, flashinfer, Triton tree.

A backend is *planned* for one batch layout (which pages, starts and tree mask each request
has), then *attends* any number of layers: q [B, T, Hq, D] and a layer's pages
(k, v [P, page, Hkv, D]) → [B, T, Hq, D]. `PagedAttend` is the model's `Attend` over a planned
backend: it writes the new K/V at the forward's flat rows, then runs the backend.

- `TorchAttention`: SDPA over gathered pages; every device, every head size (the CPU, and
  eager forwards whose head size flashinfer is not built for);
- `FlashInferAttention`: `BatchPrefillWithPagedKVCacheWrapper` with the tree as a custom mask
  (eager forwards on the GPU; in CUDA graphs with `graph_attention="flashinfer"`);
- `tree_attention.TreeAttention`: the Triton split-KV kernel of CUDA graphs at few tokens.
- `solo.SoloAttention`: the batch-invariant mode's eager forwards, one request at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from specpair.runtime.gpu.backend import AttentionBackend
from specpair.runtime.gpu.flashinfer_layout import flat_mask, page_metadata
from specpair.runtime.gpu.solo import SoloAttention
from specpair.runtime.gpu.staging import Staging
from specpair.runtime.layout import BatchLayout, attention_mask, flat_index

WORKSPACE_BYTES = 128 << 20
# Head sizes flashinfer's paged prefill is built for; other sizes (the shipped pair's 40 and 32)
# attend eagerly through SDPA over gathered pages, and in graphs through the Triton kernel.
if TYPE_CHECKING:
    from specpair.runtime.gpu.tree_attention import TreeAttention

FLASHINFER_HEAD_DIMS = (64, 128, 256)
GRAPH_ATTENTION = ("triton", "flashinfer")


class PagedAttend:
    """The model's `Attend` for one forward: new K/V go to flat `rows` [B * T] of the layer's
    pages, then the planned backend attends. `rope_write` then `run` is the fused layer's split
    form (rope + K/V straight into the cache rows, one Triton kernel)."""

    def __init__(
        self,
        k: Tensor,
        v: Tensor,
        heads: tuple[int, int, int],
        backend: AttentionBackend,
        rows: Tensor,
    ) -> None:
        self.k, self.v, self.heads, self.backend, self.rows = k, v, heads, backend, rows
        self.fused_write = backend.fused_write and k.is_cuda

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        _, n_kv, d = self.heads
        n = q.shape[0] * q.shape[1]
        self.k[layer].view(-1, n_kv, d).index_copy_(0, self.rows, k.reshape(n, n_kv, d))
        self.v[layer].view(-1, n_kv, d).index_copy_(0, self.rows, v.reshape(n, n_kv, d))
        return self.run(layer, q)

    def rope_write(self, layer: int, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # qkv: partials [S, N, (Hq + 2 Hkv) D], cos/sin: [N, D] -> q [N, Hq, D]
        from specpair.runtime.gpu.triton_kernels import rope_write

        n_q, n_kv, d = self.heads
        k, v = self.k[layer].view(-1, n_kv, d), self.v[layer].view(-1, n_kv, d)
        return rope_write(qkv, cos, sin, self.rows, k, v, n_q, n_kv, d)

    def run(self, layer: int, q: Tensor) -> Tensor:
        # q: [B, T, Hq, D] -> [B, T, Hq, D], over the K/V already written
        return self.backend.attend(q, (self.k[layer], self.v[layer]))


class TorchAttention:
    """SDPA over each request's keys gathered from its pages (positions 0 .. max start + T)."""

    fused_write = False

    def __init__(self, heads: tuple[int, int, int], page_size: int, device: torch.device):
        self.heads, self.page_size, self.device = heads, page_size, device
        self.mask = self.key_rows = torch.empty(0)

    def plan(self, layout: BatchLayout, page_table: Tensor, staging: Staging | None = None) -> None:
        b = len(layout.slots)
        self.mask = attention_mask(layout)[:, None].to(self.device)  # [B, 1, T, K]
        keys = torch.arange(self.mask.shape[-1]).expand(b, -1)
        self.key_rows = flat_index(page_table, layout.slots, keys, self.page_size).to(self.device)

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        _, n_kv, d = self.heads
        kc, vc = kv[0].view(-1, n_kv, d), kv[1].view(-1, n_kv, d)
        kk, vv = kc[self.key_rows].transpose(1, 2), vc[self.key_rows].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), kk, vv, attn_mask=self.mask, enable_gqa=True
        )  # [B, Hq, T, D]
        return out.transpose(1, 2)


class FlashInferAttention:
    """flashinfer's paged prefill with the tree as a custom mask; `wrapper` is eager or, over
    static buffers, a CUDA-graph one (flashinfer copies its plan into them itself)."""

    fused_write = True

    def __init__(
        self,
        wrapper: Any,
        heads: tuple[int, int, int],
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        invariant: bool = False,
    ) -> None:
        self.wrapper, self.heads, self.page_size = wrapper, heads, page_size
        self.dtype, self.device = dtype, device
        # flashinfer splits a long request's keys by the batch's shape unless told not to
        self.invariant = invariant

    def plan(self, layout: BatchLayout, page_table: Tensor, staging: Staging | None = None) -> None:
        b, t = layout.new_mask.shape[:2]
        n_q, n_kv, d = self.heads
        indptr, indices, last = page_metadata(
            page_table, layout.slots, layout.starts + t, self.page_size
        )
        self.wrapper.plan(
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
            disable_split_kv=self.invariant,
        )

    def attend(self, q: Tensor, kv: tuple[Tensor, Tensor]) -> Tensor:
        b, t, n_q, d = q.shape
        # flashinfer would allocate its output with torch.zeros: one fill kernel per layer
        out = torch.empty(b * t, n_q, d, dtype=q.dtype, device=q.device)
        self.wrapper.run(q.reshape(b * t, n_q, d), kv, out=out)
        return out.view(b, t, n_q, d)


class Backends:
    """Makes one cache's backends: the eager one of each forward, and those of CUDA graphs."""

    def __init__(
        self,
        heads: tuple[int, int, int],
        page_size: int,
        pages_per_slot: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        graph_attention: str = "triton",
        invariant: bool = False,
    ) -> None:
        """`invariant`: the batch-invariant mode: the tree kernel's fixed key chunks
        (`invariant_tree_config`) in every graph, flashinfer without split KV."""
        self.heads, self.page_size, self.pages_per_slot = heads, page_size, pages_per_slot
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.graph_attention = graph_attention
        self.invariant = invariant
        self._workspace: Tensor | None = None
        self._eager: FlashInferAttention | None = None
        self._solo: list[AttentionBackend] = []  # `SoloAttention`'s, one per batch row

    @property
    def graph_attention(self) -> str:
        """The attention of graphs that fit the Triton tree kernel: "triton" or "flashinfer"."""
        return self._graph_attention

    @graph_attention.setter
    def graph_attention(self, kind: str) -> None:
        if kind not in GRAPH_ATTENTION:
            raise ValueError(f"graph_attention must be triton or flashinfer, not {kind!r}")
        self._graph_attention = kind

    def eager(self) -> AttentionBackend:
        """flashinfer on the GPU where it serves the head size (one wrapper, replanned per
        forward), else SDPA over gathered pages; request by request in the batch-invariant
        mode (`SoloAttention`)."""
        if self.invariant:
            return SoloAttention(self._solo_backend, self.flashinfer_serves)
        if not self.flashinfer_serves:
            return self._new_eager()
        if self._eager is None:
            self._eager = self._new_flashinfer()
        return self._eager

    @property
    def flashinfer_serves(self) -> bool:
        """Whether flashinfer serves this cache: on CUDA, at one of its head sizes."""
        return self.device.type == "cuda" and self.heads[2] in FLASHINFER_HEAD_DIMS

    def _new_flashinfer(self) -> FlashInferAttention:
        # wrappers share the float workspace: a run's temporaries live within the run, and the
        # runs of one stream are sequential; each has its own plan (int workspace)
        return FlashInferAttention(
            self.flashinfer_wrapper(),
            self.heads,
            self.page_size,
            self.dtype,
            self.device,
            self.invariant,
        )

    def _new_eager(self) -> AttentionBackend:
        """A new eager backend: flashinfer where it serves the head size, else SDPA."""
        if self.flashinfer_serves:
            return self._new_flashinfer()
        return TorchAttention(self.heads, self.page_size, self.device)

    def _solo_backend(self, b: int) -> AttentionBackend:
        while len(self._solo) <= b:
            self._solo.append(self._new_eager())
        return self._solo[b]

    def tree_fits(self, tokens: int) -> bool:
        """Whether a graph of `tokens` rows per request gets the Triton tree kernel."""
        from specpair.runtime.gpu.tree_attention import TreeAttention

        return self.graph_attention == "triton" and TreeAttention.fits(tokens, self.heads)

    def tree(self, batch: int, tokens: int) -> TreeAttention | None:
        """The Triton tree kernel of a graph over [batch, tokens] where it serves, else None
        (imported here: the CPU never imports Triton)."""
        from specpair.runtime.gpu.tree_attention import TreeAttention, invariant_tree_config

        fits = TreeAttention.fits(tokens, self.heads)
        if self.invariant and not (fits and self.graph_attention == "triton"):
            raise ValueError(
                f"the batch-invariant mode's graphs need the Triton tree kernel: {tokens} tokens "
                f"x {self.heads[0] // self.heads[1]} q heads per KV head exceed its rows"
            )
        if self.graph_attention != "triton" or not fits:
            return None
        config = invariant_tree_config(self.max_len) if self.invariant else None
        return TreeAttention(
            batch=batch,
            tokens=tokens,
            heads=self.heads,
            page_size=self.page_size,
            pages_per_slot=self.pages_per_slot,
            device=self.device,
            config=config,
        )

    def flashinfer_graph(self, batch: int, tokens: int) -> FlashInferAttention:
        """flashinfer in CUDA-graph mode over static metadata buffers of [batch, tokens]."""
        if self.heads[2] not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"head_dim {self.heads[2]}: graphs of {tokens} tokens x {self.heads[0]} q heads "
                f"need flashinfer, which serves head_dim {FLASHINFER_HEAD_DIMS}"
            )
        wrapper = self.flashinfer_wrapper(self.graph_buffers(batch, tokens))
        return FlashInferAttention(wrapper, self.heads, self.page_size, self.dtype, self.device)

    def flashinfer_wrapper(self, buffers: dict[str, Tensor] | None = None) -> Any:
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
