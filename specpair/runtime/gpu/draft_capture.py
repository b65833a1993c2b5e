"""What the draft's CUDA graphs compute: the bodies `DraftGraphs` captures per batch bucket.

- `extend_graph`: B × T appended tokens → hidden of each request's last row [B, 1, H];
- `step_graph`: s steps of one token per request → tokens [s, B]: greedy (argmax inside the
  graph), or sampled (`gpu/draft_sampling.py`'s one-kernel `draft_support` inside a graph of
  its own: per-row parameters and uniforms in, each step's sparse q out, [s, B, K]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpair.runtime.gpu.capture import GraphAttention, GraphCapture, StageGraph
from specpair.runtime.sampling import RowParams
from specpair.runtime.stages import DraftModel


def extend_graph(capture: GraphCapture, d: DraftModel, batch: int, tokens: int) -> StageGraph:
    """`batch` requests appending `tokens` rows each → `hidden` [B, 1, H] at each one's `last`."""
    dev = capture.cache.device
    inputs = {
        "tokens": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        "positions": torch.zeros(batch, tokens, dtype=torch.long, device=dev),
        "last": torch.zeros(batch, dtype=torch.long, device=dev),
    }
    if d.needs_features:
        # the model's dtype, as the eager extend casts them: half the bytes of float32 to stage
        width, dtype = d.feature_width, capture.cache.dtype
        inputs["features"] = torch.zeros(batch, tokens, width, dtype=dtype, device=dev)
    attn = capture.attention(batch, tokens)
    inputs["rows"] = torch.arange(batch, device=dev)  # static: read by the graph's gather
    rows = inputs["rows"]

    def body() -> dict[str, Tensor]:
        feats = inputs.get("features")
        hidden = d.forward(inputs["tokens"], feats, inputs["positions"], attn.attend)
        return {"hidden": hidden[rows, inputs["last"]][:, None]}  # [B, 1, H]

    return capture.capture(body, inputs, [attn])


def step_graph(
    capture: GraphCapture,
    d: DraftModel,
    attns: list[GraphAttention],
    batch: int,
    s: int,
    sampled: bool = False,
) -> StageGraph:
    """s greedy steps → tokens [s, B]. `sampled`: each step draws by `draft_support` from
    the rows' `params` [B, 5] and `uniform` [s, B]; its q comes out as `q_ids`, `q`
    [s, B, K]. `attns`: one step attention per forward after the first token (s - 1)."""
    dev, forwards = capture.cache.device, len(attns)
    inputs = {
        "hidden": torch.zeros(batch, 1, d.args.hidden_size, dtype=capture.cache.dtype, device=dev),
        "starts": torch.zeros(batch, dtype=torch.long, device=dev),
    }
    if sampled:
        # Triton: imported where a GPU captures, not by the CPU builds that import this module
        from specpair.runtime.gpu.draft_sampling import draft_support

        inputs["params"] = torch.ones(batch, 5, device=dev)  # RowParams.table
        inputs["uniform"] = torch.zeros(s, batch, device=dev)

    def body() -> dict[str, Tensor]:
        hidden, out, ids, ps = inputs["hidden"], [], [], []
        for k in range(forwards + 1):
            if sampled:
                params = RowParams(inputs["params"])  # every branch: rows differ
                logits, names = d.named_logits(hidden)
                token, support, q = draft_support(logits, params, inputs["uniform"][k], names=names)
                ids.append(support)
                ps.append(q)
            else:
                token = d.greedy(hidden)  # [B]: an EAGLE-3 head's argmax skips the full vocab
            out.append(token)
            if k < forwards:
                pos = inputs["starts"] + k  # [B]
                if attns[k].on_device:
                    attns[k].follow(pos)
                hidden = d.forward(token[:, None], hidden, pos[:, None], attns[k].attend)
        result = {"tokens": torch.stack(out)}  # [s, B]
        if sampled:
            result |= {"q_ids": torch.stack(ids), "q": torch.stack(ps)}
        return result

    return capture.capture(body, inputs, attns)
