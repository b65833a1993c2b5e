"""Conversions between the wire messages (protos) and the runtime's typed messages."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specpair.proto.v1 import common_pb2, draft_pb2
from specpair.runtime.draft import DraftInput
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.tree import CandidateTree

_DTYPES = {
    common_pb2.D_TYPE_FLOAT32: torch.float32,
    common_pb2.D_TYPE_FLOAT16: torch.float16,
    common_pb2.D_TYPE_BFLOAT16: torch.bfloat16,
}
_CODES = {v: k for k, v in _DTYPES.items()}
_NP_DTYPES: dict[torch.dtype, np.dtype[Any]] = {  # bfloat16: its 16-bit pattern
    torch.float32: np.dtype("<f4"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
}


def tensor_into(msg: common_pb2.Tensor, t: Tensor) -> None:
    """Writes `t` into `msg` as raw little-endian bytes (bfloat16 travels as its 16-bit pattern).

    The `*_into` writers fill a message in place (`repeated.add()`): building a round's
    messages is per-request host work on the critical path, and a CopyFrom/append per
    sub-message doubled it (`bench/RESULTS.md`, 4b sixth session)."""
    t = t.detach().contiguous().cpu()
    if t.dtype not in _CODES:
        t = t.float()
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    if sys.byteorder != "little":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    msg.data = arr.tobytes()
    msg.dtype = _CODES[t.dtype]
    del msg.shape[:]
    msg.shape.extend(t.shape)


def tensor_from_proto(msg: common_pb2.Tensor, field: str) -> Tensor:
    """Decodes a Tensor message; `field` names it in the error of a malformed one."""
    if msg.dtype not in _DTYPES:
        raise ValueError(f"{field}.dtype: unsupported {msg.dtype}")
    dtype = _DTYPES[msg.dtype]
    np_dtype = _NP_DTYPES[dtype]
    shape = tuple(msg.shape)
    if any(n < 0 for n in shape) or math.prod(shape) * np_dtype.itemsize != len(msg.data):
        raise ValueError(f"{field}: {len(msg.data)} bytes do not hold shape {list(shape)}")
    arr = np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def sampling_into(msg: common_pb2.SamplingParams, p: SamplingParams) -> None:
    msg.temperature, msg.top_p, msg.top_k = p.temperature, p.top_p, p.top_k
    if p.seed is not None:
        msg.seed = p.seed


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (temperature, top_p, top_k)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def draft_input_into(msg: draft_pb2.DraftInput, item: DraftInput) -> None:
    msg.request_id = item.request_id
    msg.appended_token_ids.extend(item.appended)
    sampling_into(msg.sampling, item.sampling)
    if item.features is not None:
        tensor_into(msg.features, item.features)


def draft_input_from_proto(msg: draft_pb2.DraftInput) -> DraftInput:
    features = None
    if msg.HasField("features"):
        features = tensor_from_proto(msg.features, f"inputs[{msg.request_id}].features")
    return DraftInput(
        msg.request_id,
        tuple(msg.appended_token_ids),
        sampling_from_proto(msg.sampling),
        features,
    )


def tree_into(msg: draft_pb2.CandidateTree, request_id: str, tree: CandidateTree) -> None:
    msg.request_id = request_id
    msg.token_ids.extend(tree.tokens)
    msg.parents.extend(tree.parents)
    if tree.draft_probs is not None:
        tensor_into(msg.draft_probs, tree.draft_probs)


def tree_from_proto(msg: draft_pb2.CandidateTree) -> CandidateTree:
    probs = None
    if msg.HasField("draft_probs"):
        probs = tensor_from_proto(msg.draft_probs, f"trees[{msg.request_id}].draft_probs").float()
    return CandidateTree(tuple(msg.token_ids), tuple(msg.parents), probs)
