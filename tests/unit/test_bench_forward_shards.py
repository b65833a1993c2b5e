"""`bench.gpu_kernels forward --shards N` times one rank's part of the 8B shape as a model of its
own: that model must hold exactly the layers' weights a rank of `TensorParallelLlama` holds, or
the floor it measures is some other model's."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_common import LLAMA3_8B
from bench.gpu_kernels import shard_of
from specpair.models.llama import LlamaModel
from specpair.models.parallel import Shard, TensorParallelLlama


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_shard_model_holds_a_ranks_weights(world: int) -> None:
    with torch.device("meta"):
        rank = TensorParallelLlama(LLAMA3_8B, Shard(rank=0, world=world))
        alone = LlamaModel(shard_of(LLAMA3_8B, world))
    ranks = {n: p.shape for n, p in rank.named_parameters() if "embed" not in n}
    alones = {n: p.shape for n, p in alone.named_parameters() if "embed" not in n}
    assert alones == ranks
    # the rank's own widths, not the whole model's: a quarter of the MLP at TP=4, and so on
    assert ranks["model.layers.0.mlp.down_proj.weight"] == (4096, 14336 // world)
    assert ranks["lm_head.weight"][0] == -(-128256 // world)
