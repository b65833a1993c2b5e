"""Tensors on the wire (`common.proto`'s Tensor): raw little-endian bytes of a dtype, or EAGLE
features as float8 scaled per row. Decoding names the field of anything malformed."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specpair.proto.v1 import common_pb2, draft_pb2
from specpair.runtime.feature_ring import RingHandle
from specpair.runtime.feature_rows import FeatureRows, Fp8Rows, quantize_rows

_DTYPES = {
    common_pb2.D_TYPE_FLOAT32: torch.float32,
    common_pb2.D_TYPE_FLOAT16: torch.float16,
    common_pb2.D_TYPE_BFLOAT16: torch.bfloat16,
    common_pb2.D_TYPE_INT32: torch.int32,
}
_CODES = {v: k for k, v in _DTYPES.items()}
_NP_DTYPES: dict[torch.dtype, np.dtype[Any]] = {  # bfloat16: its 16-bit pattern
    torch.float32: np.dtype("<f4"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
    torch.int32: np.dtype("<i4"),
}


# Where a writer puts a tensor's bytes: None, into its message's `data`; a list, appended to
# it (as a view, not a copy) for the caller to send as one run (RoundRequest.feature_data).
DataSink = list[memoryview] | None


def tensor_into(msg: common_pb2.Tensor, t: Tensor, data: DataSink = None) -> None:
    """Writes `t` into `msg` as raw little-endian bytes (bfloat16 travels as its 16-bit pattern).

    The `*_into` writers fill a message in place (`repeated.add()`): building a round's
    messages is per-request host work on the critical path, and a CopyFrom/append per
    sub-message copies each one twice."""
    t = t.detach().contiguous().cpu()
    if t.dtype not in _CODES:
        t = t.float()
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    if sys.byteorder != "little":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    _put(msg, arr, data)
    msg.dtype = _CODES[t.dtype]
    del msg.shape[:]
    msg.shape.extend(t.shape)


def _put(msg: common_pb2.Tensor, arr: np.ndarray[Any, Any], data: DataSink) -> None:
    if data is None:
        msg.data = arr.tobytes()
    else:
        data.append(np.ascontiguousarray(arr).data.cast("B"))


def fp8_rows_into(msg: common_pb2.Tensor, rows: Tensor | Fp8Rows, data: DataSink = None) -> None:
    """Writes `rows` [n, W] as float8 e4m3 with one float32 scale per row (`quantize_rows`;
    rows quantized already are written as they are). 1 + 4/W bytes a value: a row of
    W = 4096 takes 4100 bytes (bfloat16: 8192). An all-zero row has scale 0."""
    shape = rows.shape
    if isinstance(rows, Tensor):
        rows = quantize_rows([rows])[0]
    _put(msg, rows.q.numpy(), data)
    msg.dtype = common_pb2.D_TYPE_FLOAT8_E4M3
    del msg.shape[:]
    msg.shape.extend(shape)
    del msg.row_scales[:]
    msg.row_scales.extend(rows.scale.tolist())


def feature_rows_into(
    msg: common_pb2.Tensor, rows: FeatureRows, fp8: bool, data: DataSink = None
) -> None:
    """EAGLE feature rows: as float8 scaled per row when `fp8` (or quantized already), else as
    computed."""
    if fp8 or isinstance(rows, Fp8Rows):
        fp8_rows_into(msg, rows, data)
    else:
        tensor_into(msg, rows, data)


def data_size(msg: common_pb2.Tensor) -> int:
    """The bytes `msg`'s shape and dtype take (-1: an unknown dtype or a negative dimension,
    which decoding reports by field)."""
    if msg.dtype == common_pb2.D_TYPE_FLOAT8_E4M3:
        itemsize = 1
    elif msg.dtype in _DTYPES:
        itemsize = _NP_DTYPES[_DTYPES[msg.dtype]].itemsize
    else:
        return -1
    shape = tuple(msg.shape)
    return -1 if any(n < 0 for n in shape) else math.prod(shape) * itemsize


def fp8_rows_from_proto(
    msg: common_pb2.Tensor, field: str, data: bytes | memoryview | None = None
) -> Fp8Rows:
    """A float8 Tensor as `Fp8Rows` [rows, W], its bytes and scales as they came (no
    conversion: the rows are dequantized where they are placed). `data`: its bytes, where
    they came apart from it (RoundRequest.feature_data); default `msg.data`."""
    data = msg.data if data is None else data
    shape = tuple(msg.shape)
    if not shape or data_size(msg) != len(data):
        raise ValueError(f"{field}: {len(data)} bytes do not hold float8 shape {list(shape)}")
    rows = math.prod(shape[:-1])
    scales = np.asarray(msg.row_scales, dtype=np.float32)
    if len(scales) != rows:
        raise ValueError(f"{field}.row_scales: {len(scales)} scales for {rows} rows")
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise ValueError(f"{field}.row_scales: each scale must be finite and >= 0")
    q = torch.from_numpy(_owned(np.frombuffer(data, dtype=np.uint8)))
    return Fp8Rows(q.view(rows, shape[-1]), torch.from_numpy(scales))


def tensor_from_proto(
    msg: common_pb2.Tensor, field: str, data: bytes | memoryview | None = None
) -> Tensor:
    """Decodes a Tensor message; `field` names it in the error of a malformed one. A float8
    one decodes to float32 on the host (`feature_rows_from_proto` keeps it float8). `data`
    as in `fp8_rows_from_proto`."""
    data = msg.data if data is None else data
    if msg.dtype == common_pb2.D_TYPE_FLOAT8_E4M3:
        return fp8_rows_from_proto(msg, field, data).dequantize().view(tuple(msg.shape))
    if msg.dtype not in _DTYPES:
        raise ValueError(f"{field}.dtype: unsupported {msg.dtype}")
    dtype = _DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if data_size(msg) != len(data):
        raise ValueError(f"{field}: {len(data)} bytes do not hold shape {list(shape)}")
    arr = np.frombuffer(data, dtype=_NP_DTYPES[dtype]).reshape(shape)
    t = torch.from_numpy(_owned(arr))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _owned(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """`arr`, copied unless it is writable already: a message's bytes are immutable, a run
    `read_round` decodes is a buffer of its own (`wire._inputs_from_proto`)."""
    return arr if arr.flags.writeable else arr.copy()


def feature_rows_from_proto(
    msg: common_pb2.Tensor, field: str, data: bytes | memoryview | None = None
) -> FeatureRows:
    """EAGLE feature rows [n, W]: float8 ones as `Fp8Rows`, others as a floating tensor.
    `data` as in `fp8_rows_from_proto`."""
    if msg.dtype != common_pb2.D_TYPE_FLOAT8_E4M3:
        return float_tensor(msg, field, data)
    if len(msg.shape) != 2:
        raise ValueError(f"{field}: float8 rows [n, W] expected, got shape {list(msg.shape)}")
    return fp8_rows_from_proto(msg, field, data)


def float_tensor(
    msg: common_pb2.Tensor, field: str, data: bytes | memoryview | None = None
) -> Tensor:
    t = tensor_from_proto(msg, field, data)
    if not t.dtype.is_floating_point:
        raise ValueError(f"{field}: floating point expected, got {t.dtype}")
    return t


def ring_into(msg: draft_pb2.FeatureRing, handle: RingHandle) -> None:
    msg.rows, msg.width, msg.dtype = handle.rows, handle.width, _CODES[handle.dtype]
    if handle.path:
        msg.path = handle.path
        return
    ipc, fields = msg.cuda, handle.cuda
    ipc.device_uuid = handle.device_uuid
    ipc.handle, ipc.storage_size_bytes, ipc.storage_offset_bytes = fields[0:3]  # type: ignore[assignment]
    ipc.ref_counter_handle, ipc.ref_counter_offset = fields[3:5]  # type: ignore[assignment]
    ipc.event_handle = fields[5] or b""  # type: ignore[assignment]
    ipc.event_sync_required = bool(fields[6])


def ring_from_proto(msg: draft_pb2.FeatureRing) -> RingHandle:
    """Raises ValueError naming the malformed field."""
    if msg.dtype not in _DTYPES or not _DTYPES[msg.dtype].is_floating_point:
        raise ValueError(f"feature_ring.dtype: unsupported {msg.dtype}")
    dtype = _DTYPES[msg.dtype]
    if msg.WhichOneof("memory") == "path":
        return RingHandle(msg.rows, msg.width, dtype, path=msg.path)
    if msg.WhichOneof("memory") != "cuda":
        raise ValueError("feature_ring: neither a path nor a CUDA buffer")
    c = msg.cuda
    fields = (
        c.handle,
        c.storage_size_bytes,
        c.storage_offset_bytes,
        c.ref_counter_handle,
        c.ref_counter_offset,
        c.event_handle,
        c.event_sync_required,
    )
    return RingHandle(msg.rows, msg.width, dtype, device_uuid=c.device_uuid, cuda=fields)
