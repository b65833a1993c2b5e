"""A tensor-parallel target worker: rank 0's `TargetWorker` over its shard, followers started,
and its runtime states built on every rank together."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from specpair.capabilities import Modes, check
from specpair.models.args import ModelArgs
from specpair.models.loading import read_args
from specpair.models.parallel import Shard, check_shardable, load_shard
from specpair.parallel.lockstep import Build, LeaderModel, Lockstep, LockstepCache
from specpair.parallel.ranks import RankGroup, ShardSpec
from specpair.parallel.watchdog import DEFAULT_FLOOR_S, Watchdog, WatchedWorker
from specpair.runtime.build import StateBuilder, gpu_target
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetWorker


def build_parallel_target(
    path: str | Path,
    *,
    tensor_parallel: int,
    max_requests: int,
    max_len: int,
    keep_features: bool = False,
    feature_layers: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    threads: int = 1,
    deterministic: bool = False,
    on_exit: Callable[[str], None] | None = None,
    rank_timeout_floor_s: float = DEFAULT_FLOOR_S,
) -> tuple[TargetWorker, RankGroup]:
    """`build_target` over `tensor_parallel` ranks: this process is rank 0 (on `device`; on a
    GPU the caller has made it the current device) and returns its worker; ranks 1 … N-1 run
    in child processes until `RankGroup.stop`. `on_exit` hears of a follower that exits, or
    of a step that overran its bound (a rank hung; `watchdog.py`, whose floor is
    `rank_timeout_floor_s`), before then (from a thread). On GPUs build the states with
    `build_parallel_states`."""
    check(Modes(deterministic=deterministic, tensor_parallel=tensor_parallel > 1))
    path = Path(path)
    check_shardable(read_args(path), tensor_parallel, path / "config.json")  # before any spawn
    spec = ShardSpec(
        path, tensor_parallel, max_requests, max_len, dtype, device, threads, feature_layers
    )
    group = RankGroup(spec, on_exit)
    try:
        group.start()

        def leader(args: ModelArgs, shard: Shard) -> LeaderModel:
            return LeaderModel(args, shard, group.lockstep)

        model: LeaderModel | None = None
        error: Exception | None = None
        try:
            model = load_shard(
                path,
                Shard(0, tensor_parallel),
                dtype=dtype,
                device=spec.rank_device(0),
                context=max_len,
                make=leader,
            )
        except Exception as exc:
            error = exc
        group.agree(error)  # raises this rank's error or a follower's
        assert model is not None
        cache = LockstepCache(group.lockstep, **spec.cache_options(model.args))
        group.watchdog = Watchdog(group.fail, floor_s=rank_timeout_floor_s)
        worker = WatchedWorker(
            model,
            cache,
            group.watchdog,
            keep_features=keep_features,
            feature_layers=feature_layers,
        )
        if spec.cuda:
            gpu_target(worker)
        group.watch()
    except BaseException:
        group.stop()
        raise
    return worker, group


def build_parallel_states(
    worker: TargetWorker,
    lockstep: Lockstep,
    tiers: Iterable[TreeShape],
    *,
    buckets: Sequence[int] | None = None,
) -> tuple[StateBuilder, dict[TreeShape, SpecRuntimeState]]:
    """`StateBuilder(worker).build_all(tiers)` on every rank at once (a GPU's graphs capture
    their all-reduces with every rank); then rank 0's collective graphs report to the lockstep,
    which the followers replay with it."""
    tiers = sorted(set(tiers))
    if worker.cache.device.type != "cuda":  # eager states: nothing to capture, nothing to send
        builder = StateBuilder(worker, buckets=buckets)
        return builder, builder.build_all(tiers)
    with lockstep.building(Build(tuple(tiers), None if buckets is None else tuple(buckets))):
        builder = StateBuilder(worker, buckets=buckets)
        states = builder.build_all(tiers)
    if builder.target_graphs is not None:
        for graph in builder.target_graphs.graphs:
            if graph.collective:
                graph.mirror_to(lockstep)
    return builder, states
