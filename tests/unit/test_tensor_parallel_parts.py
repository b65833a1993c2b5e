"""The pieces of a tensor-parallel target that need no second process: the shards of the
weights, the refusals, and the lockstep's mirror of rank 0's cache (`replay`)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specpair.config import ServerConfig, TargetConfig
from specpair.models.loading import CheckpointError, load_llama, read_args
from specpair.models.parallel import (
    COLUMN,
    Shard,
    TensorParallelLlama,
    check_shardable,
    shard_state,
)
from specpair.parallel.build import build_parallel_target
from specpair.parallel.lockstep import (
    Alloc,
    Bind,
    LeaderModel,
    Lockstep,
    LockstepCache,
    LockstepError,
    replay,
)
from specpair.parallel.ranks import ShardSpec
from specpair.runtime.kv_cache import CacheFullError, KVCache
from specpair.runtime.layout import BatchLayout
from specpair.runtime.tree import tree_mask

VOCAB = 7  # over 2 ranks: 4 rows each, the last one's 4th row padding


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specpair.models.tiny import make_tiny_family

    return make_tiny_family(
        tmp_path_factory.mktemp("tp") / "m",
        LlamaConfig,
        LlamaForCausalLM,
        seed=5,
        vocab_size=VOCAB,
        attention_bias=True,
        mlp_bias=True,
    )


def test_the_shards_put_together_are_the_full_weights(biased: Path) -> None:
    full = load_llama(biased).state_dict()
    shards = [shard_state(full, Shard(rank, 2)) for rank in range(2)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if name.split(".")[-2] in COLUMN:  # q/k/v, gate/up: weight and bias rows
            torch.testing.assert_close(torch.cat(parts, 0), tensor, rtol=0, atol=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(parts, 1), tensor, rtol=0, atol=0)
        elif name == "lm_head.weight":
            assert parts[1].shape == (4, 64) and not parts[1][3].any()
            torch.testing.assert_close(torch.cat(parts)[:VOCAB], tensor, rtol=0, atol=0)
        else:  # embedding, norms, the row-parallel biases: whole on every rank
            assert all(p.equal(tensor) for p in parts), name
    with torch.device("meta"):  # each shard fits the sharded model, key for key, shape for shape
        model = TensorParallelLlama(read_args(biased), Shard(1, 2))
    model.load_state_dict(shards[1], assign=True)
    assert model.model.layers[0].self_attn.n_heads == 2  # type: ignore[union-attr]


def test_heads_that_do_not_split_are_refused_naming_the_field(tmp_path: Path) -> None:
    from specpair.models.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path / "m", seed=1, num_heads=6, num_kv_heads=3, hidden_size=48)
    with pytest.raises(CheckpointError, match=r"config.json: num_key_value_heads \(3\) is not "):
        build_parallel_target(path, tensor_parallel=2, max_requests=1, max_len=8)
    assert not multiprocessing.active_children()  # refused before any follower started
    with pytest.raises(CheckpointError, match=r"num_attention_heads \(6\) is not divisible by"):
        check_shardable(read_args(path), 4)
    with pytest.raises(CheckpointError, match=r"intermediate_size \(128\) is not divisible"):
        check_shardable(read_args(path), 3)


def test_tensor_parallel_is_refused_below_one_and_shards_on_cuda() -> None:
    server = ServerConfig("127.0.0.1:0")
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1"):
        TargetConfig(server, Path("m"), tensor_parallel=0)
    with pytest.raises(ValueError, match="runs on cpu or cuda, not mps"):
        ShardSpec(Path("m"), 2, 1, 8, device="mps")


def test_ranks_take_the_gpus_after_rank_0s() -> None:
    spec = ShardSpec(Path("m"), 4, 1, 8, device="cuda:2")
    assert [spec.rank_device(r) for r in range(4)] == ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    assert ShardSpec(Path("m"), 2, 1, 8, device="cuda").rank_device(1) == "cuda:1"
    assert ShardSpec(Path("m"), 2, 1, 8).rank_device(1) == "cpu"


CACHE: dict[str, Any] = dict(
    num_layers=1,
    num_qo_heads=2,
    num_kv_heads=1,
    head_dim=4,
    max_requests=3,
    max_len=12,
    page_size=4,
)


def test_a_follower_replaying_the_changes_holds_rank_0s_cache() -> None:
    """Allocs, a prefill, a tree whose path [0, 2] is kept, a free and a reuse, a bind that
    fails part-way (slot 1 grew, slot 2 ran past max_len), a truncate."""
    lockstep = Lockstep()
    leader = LockstepCache(lockstep, **CACHE)
    a, b = leader.alloc(), leader.alloc()
    leader.bind(BatchLayout.causal([a, b], [0, 0], [5, 3]))
    leader.commit(a, 0, range(5))
    leader.commit(b, 0, range(3))
    tree = tree_mask([-1, 0, 0, 2])[None].expand(2, -1, -1)
    leader.bind(BatchLayout(torch.tensor([a, b]), torch.tensor([5, 3]), tree.clone()))
    leader.commit(a, 5, [0, 2])
    leader.free(b)
    c = leader.alloc()
    leader.bind(BatchLayout.causal([c], [0], [2]))
    leader.commit(c, 0, range(2))
    with pytest.raises(CacheFullError):
        leader.bind(BatchLayout.causal([c, a], [2, 7], [6, 6]))
    leader.truncate(a, 6)
    assert isinstance(lockstep.changes[-2], Bind) and lockstep.changes[-2].failed

    follower = KVCache(**CACHE)
    for change in lockstep.changes:
        replay(follower, change)
    assert follower.lengths == leader.lengths == [6, 2, 0]
    assert follower.page_table.equal(leader.page_table)
    assert follower.pages.free == leader.pages.free and follower.free_slots == leader.free_slots


def test_a_follower_that_diverges_says_so() -> None:
    cache = KVCache(**CACHE)
    with pytest.raises(LockstepError, match="alloc gave slot 0, rank 0's gave 1"):
        replay(cache, Alloc(1))
    with pytest.raises(LockstepError, match="rank 0's bind failed"):
        replay(cache, Bind(BatchLayout.causal([0], [0], [2]), failed=True))


def test_rank_0_forwards_only_over_the_attend_it_just_bound(biased: Path) -> None:
    """The followers attend over the layout of the cache's last bind: a forward over another
    attend would pair rank 0's heads with other K/V than theirs."""
    with torch.device("meta"):
        model = LeaderModel(read_args(biased), Shard(0, 2), Lockstep())
    tokens = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(LockstepError, match="did not just bind"):
        model.forward_aux(
            tokens, tokens, KVCache(**CACHE).bind(BatchLayout.causal([0], [0], [1])), ()
        )


def test_up_passes_tensor_parallel_to_the_target() -> None:
    from specpair.cli.launcher import up_services
    from specpair.cli.main import build_parser

    services, _ = up_services(build_parser().parse_args(["up", "--tensor-parallel", "2"]))
    args = next(s.args for s in services if s.name == "target")
    assert args[args.index("--tensor-parallel") + 1] == "2"
    plain, _ = up_services(build_parser().parse_args(["up"]))
    assert "--tensor-parallel" not in next(s.args for s in plain if s.name == "target")
