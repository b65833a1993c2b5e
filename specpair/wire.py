"""Conversions between the wire messages (protos) and the runtime's typed messages."""

from __future__ import annotations

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


def tensor_to_proto(t: Tensor) -> common_pb2.Tensor:
    """Raw little-endian bytes (bfloat16 travels as its 16-bit pattern)."""
    t = t.detach().contiguous().cpu()
    if t.dtype not in _CODES:
        t = t.float()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
    return common_pb2.Tensor(data=data, dtype=_CODES[t.dtype], shape=list(t.shape))


def tensor_from_proto(msg: common_pb2.Tensor, field: str) -> Tensor:
    """Decodes a Tensor message; `field` names it in the error of a malformed one."""
    if msg.dtype not in _DTYPES:
        raise ValueError(f"{field}.dtype: unsupported {msg.dtype}")
    dtype = _DTYPES[msg.dtype]
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}[dtype]
    count = int(np.prod(msg.shape)) if len(msg.shape) else 0
    if count * np.dtype(np_dtype).itemsize != len(msg.data):
        raise ValueError(f"{field}: {len(msg.data)} bytes do not hold shape {list(msg.shape)}")
    arr = np.frombuffer(msg.data, dtype=np_dtype).reshape(tuple(msg.shape))
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field (temperature, top_p, top_k)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def draft_input_to_proto(item: DraftInput) -> draft_pb2.DraftInput:
    msg = draft_pb2.DraftInput(
        request_id=item.request_id,
        appended_token_ids=list(item.appended),
        sampling=sampling_to_proto(item.sampling),
    )
    if item.features is not None:
        msg.features.CopyFrom(tensor_to_proto(item.features))
    return msg


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


def tree_to_proto(request_id: str, tree: CandidateTree) -> draft_pb2.CandidateTree:
    msg = draft_pb2.CandidateTree(
        request_id=request_id, token_ids=list(tree.tokens), parents=list(tree.parents)
    )
    if tree.draft_probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_proto(tree.draft_probs))
    return msg


def tree_from_proto(msg: draft_pb2.CandidateTree) -> CandidateTree:
    probs = None
    if msg.HasField("draft_probs"):
        probs = tensor_from_proto(msg.draft_probs, f"trees[{msg.request_id}].draft_probs").float()
    return CandidateTree(tuple(msg.token_ids), tuple(msg.parents), probs)
