"""EAGLE feature rows as a round carries them: a plain tensor [n, W], or float8 e4m3 with one
float32 scale per row (`Fp8Rows`, `serve target --feature-dtype float8`).

Float8 rows stay compact on the host, 1 + 4/W bytes a value, and are dequantized on the device
they are placed on (`place_features`): converting them on the CPU is slow, and float32 would
then cross to the device at 4 bytes a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Rows [n, W] as e4m3 bytes and a scale each: row i is `q[i] as e4m3 * scale[i]`."""

    # uint8, not float8: numpy (the wire, the lockstep pickler) has no float8
    q: Tensor  # [n, W] uint8, the e4m3 bit patterns
    scale: Tensor  # [n] float32, >= 0; 0 for an all-zero row

    def __len__(self) -> int:
        return self.q.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """[n, W] on `device` in `dtype`: computed in float32 and cast once, the values a
        float32 decode gives when later placed into `dtype`."""
        return _dequantize(self.q.to(device), self.scale.to(device), dtype)


FeatureRows = Tensor | Fp8Rows


def _dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.view(FP8).float() * scale[:, None]).to(dtype)


def quantize_rows(rows: Sequence[Tensor]) -> list[Fp8Rows]:
    """Each of `rows` [n_b, W] (one width, one device) as host `Fp8Rows`: each row's largest
    magnitude maps to e4m3's 448, so a row keeps ~2 significant bits below its own top value
    whatever its range. Rows on a GPU are quantized together and come to the host in one copy
    (one device sync a round, not two a request); on the host each is quantized alone (no
    sync to save, and a request's temporaries stay in cache where a round's would not)."""
    if rows and rows[0].is_cuda:
        return quantize_together(rows)
    return [Fp8Rows(*_quantize(r.reshape(-1, r.shape[-1]))) for r in rows]


def quantize_together(rows: Sequence[Tensor]) -> list[Fp8Rows]:
    """`quantize_rows` of rows on one device as one tensor, brought to the host in one copy."""
    q, scale = _quantize(torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]))
    n, w = q.shape
    # [N·W e4m3 bytes | N float32 scales]: one device-to-host copy
    host = torch.cat([q.reshape(-1), scale.view(torch.uint8)]).cpu()
    q_host, scale_host = host[: n * w].view(n, w), host[n * w :].view(torch.float32)
    out, start = [], 0
    for r in rows:
        m = r.reshape(-1, r.shape[-1]).shape[0]
        out.append(Fp8Rows(q_host[start : start + m], scale_host[start : start + m]))
        start += m
    return out


def _quantize(rows: Tensor) -> tuple[Tensor, Tensor]:
    """rows [n, W] -> e4m3 bytes [n, W] uint8 and scales [n] float32, on rows' device."""
    x = rows.detach().float()
    scale = x.abs().amax(-1) / FP8_MAX
    q = (x / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).to(FP8)
    return q.view(torch.uint8), scale


def place_features(dst: Tensor, rows: Sequence[FeatureRows]) -> Tensor:
    """rows[b] [n_b, W] into dst[b, :n_b] (dst [B, T, W], contiguous, on its device, in its
    dtype); the rest of dst is left as it is. Returns dst.

    Float8 rows travel to dst's device as their bytes and scales (through pinned memory to a
    GPU: asynchronous copies, three for all of them) and are dequantized there, in float32 then
    cast to dst's dtype; plain rows are copied as `place_rows` does."""
    fp8: list[tuple[int, Fp8Rows]] = []
    for b, r in enumerate(rows):
        if isinstance(r, Fp8Rows):
            fp8.append((b, r))
        else:
            dst[b, : len(r)].copy_(r)
    if not fp8:
        return dst
    t, w = dst.shape[1], dst.shape[-1]
    # flat row index of each float8 row in dst viewed [B·T, W]: request b's row j at b·T + j
    index = _gather([torch.arange(len(r)) + b * t for b, r in fp8], dst)
    q, scale = _gather([r.q for _, r in fp8], dst), _gather([r.scale for _, r in fp8], dst)
    dst.view(-1, w).index_copy_(0, index, _dequantize(q, scale, dst.dtype))
    return dst


def _gather(parts: list[Tensor], dst: Tensor) -> Tensor:
    """`parts` concatenated on dst's device: to a GPU through pinned memory, asynchronously
    (the caching host allocator keeps the buffer until the copy has run)."""
    if not dst.is_cuda:
        return torch.cat(parts)
    n = sum(p.shape[0] for p in parts)
    host = torch.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=True)
    return torch.cat(parts, out=host).to(dst.device, non_blocking=True)
