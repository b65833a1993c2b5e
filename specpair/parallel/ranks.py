"""The ranks of a tensor-parallel target: rank 0 (the target service's process) starts ranks
1 … N-1 as child processes, joins them in a process group and watches them.

Start-up: rank 0 opens a TCP store on a free loopback port and spawns the followers; each joins
the store, then the process group (gloo on the CPU; NCCL on GPUs, rank r on cuda:K+r where rank
0's device is cuda:K), then a gloo group for start-up's host objects, then loads its shard;
every rank says whether its load worked (`agree`) before any serves. A follower then runs
`Follower.run`, reading rank 0's steps from a pipe, until rank 0's `Stop`. A follower that
exits before that is reported once, from a watch thread, to the `on_exit` callback (the target
service stops with that message); rank 0's next collective fails at once too (gloo sees the
closed connection). A follower that hangs instead is found by rank 0's `Watchdog`
(`watchdog.py`), which calls `fail`: reported the same way, once, and every follower killed at
once. A follower whose rank 0 is gone fails its next collective the same way and exits, and one
that waits for no collective sees its parent go (`watch_parent`). So does a follower whose step
raises: its collectives may no longer pair up with rank 0's, and a target that diverged must
not serve.

On GPUs a follower also fuses its shard and holds a `TargetWorker` over it, whose CUDA graphs
it captures when rank 0 sends `Build` (`lockstep.py`); the fused layers all-reduce inside them.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specpair.config.target import rank_devices
from specpair.logging import get_logger
from specpair.models.args import ModelArgs
from specpair.models.parallel import (
    PEER_REDUCE_MAX_BYTES,
    Shard,
    TensorParallelLlama,
    load_shard,
    start_peer_reduce,
    stop_peer_reduce,
)
from specpair.parallel.lockstep import Follower, Lockstep
from specpair.parallel.watchdog import Watchdog, watch_parent
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.target.worker import TargetWorker

log = get_logger(__name__)

# A follower waits for rank 0's next step as long as the target idles; rank 0 waits for a
# follower no longer than a shard takes to load (its collectives answer in milliseconds).
FOLLOWER_TIMEOUT = timedelta(days=3650)
LEADER_TIMEOUT = timedelta(minutes=10)
STOP_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 2.0  # after a failure, for rank 0's step to fail out of its collective


class RankExitedError(RuntimeError):
    """A follower rank exited while the target needed it."""


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """What every rank builds: its shard of the checkpoint and a KV cache for its heads."""

    path: Path
    world: int
    max_requests: int
    max_len: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # rank 0's; on GPUs rank r takes the r-th after it (`rank_device`)
    threads: int = 1  # each rank's intra-op threads
    feature_layers: tuple[int, ...] = ()  # an EAGLE-3 draft's: every rank captures alike

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"a tensor-parallel target needs 2 or more ranks, got {self.world}")
        dev = torch.device(self.device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"a tensor-parallel target runs on cpu or cuda, not {self.device}")

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def rank_device(self, rank: int) -> str:
        """cuda:K+rank for rank 0 on cuda:K (plain `cuda`: K = 0); the CPU for every rank."""
        return rank_devices(self.device, self.world)[rank]

    def cache_options(self, args: ModelArgs, rank: int = 0) -> dict[str, Any]:
        """`KVCache`'s arguments for one rank: its heads / N of the model's."""
        return dict(
            num_layers=args.num_layers,
            num_qo_heads=args.num_heads // self.world,
            num_kv_heads=args.num_kv_heads // self.world,
            head_dim=args.head_dim,
            max_requests=self.max_requests,
            max_len=self.max_len,
            dtype=self.dtype,
            device=self.rank_device(rank),
        )


def join(spec: ShardSpec, rank: int, store: Any, timeout: timedelta) -> Any:
    """Joins the process group (NCCL on GPUs, bound to this rank's device; gloo on the CPU)
    and returns a gloo group for host objects (`agree`; None on the CPU: the group is gloo)."""
    options: dict[str, Any] = {}
    backend = "gloo"
    if spec.cuda:
        backend = "nccl"
        options["device_id"] = torch.device(spec.rank_device(rank))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("group", store),
        rank=rank,
        world_size=spec.world,
        timeout=timeout,
        **options,
    )
    if not spec.cuda:
        return None
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    peer_reduce(spec, rank, host_group)
    return host_group


# "nccl" sends every sum through NCCL (to measure what the peer-memory reduce saves)
ALL_REDUCE_ENV = "SPECPAIR_ALL_REDUCE"


def peer_reduce(spec: ShardSpec, rank: int, host_group: Any) -> None:
    """Small sums over peer memory on every rank, or on none: a rank that cannot map the
    buffer (no P2P between its GPUs) sends every rank's sums back to NCCL, so the collectives
    the graphs capture pair up."""
    if os.environ.get(ALL_REDUCE_ENV, "peer") == "nccl":
        return
    errors = agree(start_peer_reduce(torch.device(spec.rank_device(rank))), host_group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        stop_peer_reduce()
        if rank == 0:
            log.warning("all-reduce through NCCL only: no peer memory", why="; ".join(failed))
    elif rank == 0:
        log.info("small all-reduces over peer memory", max_bytes=PEER_REDUCE_MAX_BYTES)


def agree(error: str, group: Any = None) -> list[str]:
    """Every rank's load error ('' for none): the same list on every rank."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=group)
    return [str(e) for e in errors]


class RankGroup:
    """Rank 0's handle on the followers: their processes, the process group, a watch."""

    def __init__(self, spec: ShardSpec, on_exit: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.lockstep = Lockstep()
        self.procs: list[BaseProcess] = []
        self.on_exit = on_exit or (lambda message: log.error(message))
        self.watchdog: Watchdog | None = None  # times rank 0's steps once the worker is built
        self.failed = False  # a rank exited or hung: what `on_exit` heard
        self._stopping = threading.Event()
        self._reported = threading.Lock()
        self._store: Any = None  # the TCP store outlives the start-up: the group was made on it
        self._host_group: Any = None  # `join`'s

    def start(self) -> None:
        """Spawns the followers and joins them in the process group (rank 0)."""
        world = self.spec.world
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=LEADER_TIMEOUT
        )
        context = mp.get_context("spawn")
        for rank in range(1, world):
            steps, pipe = context.Pipe(duplex=False)  # the follower's end, rank 0's
            proc = context.Process(
                target=follow,
                args=(self.spec, rank, self._store.port, steps),
                name=f"specpair-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            steps.close()  # the follower's now: it reads EOF once rank 0 is gone
            self.procs.append(proc)
            self.lockstep.pipes.append(pipe)
        # The group's rendezvous would wait LEADER_TIMEOUT for a follower that died starting.
        deadline = time.monotonic() + LEADER_TIMEOUT.total_seconds()
        while not self._store.check([f"joined/{rank}" for rank in range(1, world)]):
            self._check_alive("while starting")
            if time.monotonic() > deadline:
                raise RankExitedError("tensor-parallel followers did not join in time")
            time.sleep(0.05)
        self._host_group = join(self.spec, 0, self._store, LEADER_TIMEOUT)
        log.info(
            "tensor-parallel ranks joined",
            ranks=world,
            port=self._store.port,
            devices=[self.spec.rank_device(r) for r in range(world)],
        )

    def agree(self, error: BaseException | None) -> None:
        """Raises rank 0's own load error, or a follower's, once every rank has loaded."""
        try:
            errors = agree("" if error is None else f"{error}", self._host_group)
        except RuntimeError:
            self._check_alive("while loading its shard")
            raise
        if error is not None:
            raise error
        for rank, message in enumerate(errors):
            if message:
                raise RankExitedError(f"tensor-parallel rank {rank} could not load: {message}")

    def watch(self) -> None:
        """From now on, a follower that exits before `stop` is reported to `on_exit`."""
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()

    def _watch(self) -> None:
        by_sentinel = {proc.sentinel: proc for proc in self.procs}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self._stopping.is_set():
            return
        proc = by_sentinel[ready[0]]  # type: ignore[index]
        proc.join()
        self._report(self._exited(proc, "while serving"))

    def fail(self, message: str) -> None:
        """A rank is hung (the watchdog, from its thread): reported to `on_exit`, then every
        follower killed. Killing comes second so that requests hear this message before the
        round that fails with it; it frees rank 0's blocked collective too (gloo fails it)."""
        if self._report(message):
            for proc in self.procs:
                proc.kill()

    def _report(self, message: str) -> bool:
        """Tells `on_exit` of the first failure only (a hang's kill is no second one)."""
        if self._stopping.is_set() or not self._reported.acquire(blocking=False):
            return False
        self.failed = True
        self.on_exit(message)
        return True

    def _check_alive(self, when: str) -> None:
        for proc in self.procs:
            if not proc.is_alive():
                raise RankExitedError(self._exited(proc, when))

    def _exited(self, proc: BaseProcess, when: str) -> str:
        rank = self.procs.index(proc) + 1
        return (
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
            f"{when}: the target cannot compute without it"
        )

    def stop(self, leave: bool | None = None) -> None:
        """Tells the followers to stop (once no step holds the group), waits for them, and
        kills any left; rank 0 leaves the process group if `leave` (default: on the CPU).
        After a failure the followers are killed at once: a hung step holds the group, and may
        hold it forever.

        NCCL's group can be left only once every CUDA graph that captured its collectives is
        freed: its communicator waits for them (an H100 pair's and an H200 pair's stop hung
        there). A service on GPUs exits instead; a caller that builds another group in this
        process (tests, benchmarks) drops its workers and states first, then passes True."""
        self._stopping.set()
        if self.watchdog is not None:
            self.watchdog.close()
        healthy = not self.failed and all(proc.is_alive() for proc in self.procs)
        if self.procs and healthy and dist.is_initialized():
            # a follower that goes meanwhile fails the send: the others fail their next step
            with contextlib.suppress(RuntimeError):
                self.lockstep.stop(STOP_TIMEOUT_S)
        for proc in self.procs:
            proc.join(0 if self.failed else STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if leave is None:
            leave = not self.spec.cuda
        if not leave:
            return
        # Not while the compute thread is still inside a collective: a group destroyed under
        # it may wait for it (NCCL). gloo fails that collective once the followers are gone.
        idle = self.watchdog is None or self.watchdog.wait_idle(IDLE_TIMEOUT_S)
        if dist.is_initialized() and idle:
            if self.spec.cuda:
                gc.collect()  # the graphs the caller dropped
                torch.cuda.synchronize()
            dist.destroy_process_group()


def exit_if_nccl(code: int) -> None:
    """Exits at once (no interpreter teardown) if this process is still in an NCCL group: a
    GPU rank 0 leaves it to the exit (`RankGroup.stop`), and the teardown's destroy of the
    communicator would wait for the CUDA graphs still alive."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def follow(spec: ShardSpec, rank: int, port: int, steps: Connection) -> None:
    """A follower process: joins the group, loads its shard, follows rank 0's `steps` until
    `Stop`."""
    # Ctrl-C reaches every process of the terminal's group; rank 0 decides when followers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()
    torch.set_num_threads(spec.threads)
    device = spec.rank_device(rank)
    if spec.cuda:
        torch.cuda.set_device(device)  # Triton, flashinfer and graph capture use the current
    store = dist.TCPStore("127.0.0.1", port, spec.world, is_master=False, timeout=LEADER_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    group = join(spec, rank, store, FOLLOWER_TIMEOUT)
    follower: Follower | None = None
    error = ""
    try:
        follower = load_follower(spec, rank)
        follower.pipe = steps
    except Exception as exc:  # rank 0 raises it (the same error, or this one's)
        error = f"{exc}" or repr(exc)
    if not any(agree(error, group)):
        assert follower is not None
        follower.run()
    if not spec.cuda:  # NCCL's goes with the process (see `leave`)
        dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo's and the store's C++ threads, destroyed there in no
    # fixed order, now and then abort the exit ("terminate called without an active
    # exception", exit code -6) after a clean stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_follower(spec: ShardSpec, rank: int) -> Follower:
    """This rank's shard and cache; on a GPU fused, with the worker its graphs are built for."""
    model: TensorParallelLlama = load_shard(
        spec.path,
        Shard(rank, spec.world),
        dtype=spec.dtype,
        device=spec.rank_device(rank),
        context=spec.max_len,
    )
    cache = KVCache(**spec.cache_options(model.args, rank))
    if not spec.cuda:
        return Follower(model, cache)
    from specpair.runtime.build import gpu_target

    worker = gpu_target(TargetWorker(model, cache, feature_layers=spec.feature_layers))
    return Follower(model, cache, worker)
