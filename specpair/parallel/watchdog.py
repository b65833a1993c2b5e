"""Rank 0's watchdog over a tensor-parallel target's steps, and a follower's watch on rank 0.

A rank that hangs (stopped, deadlocked, a GPU that stopped answering) leaves rank 0's compute
thread blocked inside a collective: gloo waits out its timeout (ours is minutes, to let shards
load), and on a GPU a graph replay returns at once and the hang shows at the next host sync.
So rank 0 times each whole worker call its compute thread makes (`WatchedWorker`: prefill,
prepare, verify), keeps each kind's recent cost per token, and declares the group hung when a
call runs past

    bound = max(floor, FACTOR × p99(recent seconds per token of this kind) × this call's tokens)

e.g. verifies at 4 ms a token (p99), a verify of 12 tokens: max(30 s, 8 × 4 ms × 12) = 30 s;
a 20 000-token prompt after prefills at 2 ms a token: max(30 s, 8 × 2 ms × 20 000) = 320 s.
Per token, because a call's cost grows with its tokens: a long prompt after short ones must
not look hung. The floor covers a healthy host that stalls a step for a while (a loaded CPU,
another process's burst); no healthy step of ours takes 30 s once its kind has run, and a hung
one is found in about that long instead of gloo's 10 minutes. A kind's first call, with
nothing measured yet, may take FIRST_CALL_S: it may compile kernels (flashinfer's JIT of one
prefill module took 20–40 s on an H200, and a 30 s bound failed a healthy TP=2 target there).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from specpair.config import DEFAULT_RANK_TIMEOUT_FLOOR_S
from specpair.models.llama import LlamaModel
from specpair.runtime.kv_cache import KVCache
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetSequence, TargetWorker, VerifyResult
from specpair.runtime.tree import CandidateTree

DEFAULT_FLOOR_S = DEFAULT_RANK_TIMEOUT_FLOOR_S
# A healthy step's cost per token moves with its batch's make-up and the host's load, by a
# few times at most; 8× the 99th percentile is past that, short of a stall the floor covers.
FACTOR = 8.0
WINDOW = 512  # recent calls of each kind the percentile reads
FIRST_CALL_S = 600.0  # the bound of a kind's first call (see above)
REFRESH = 32  # calls of a kind between re-reads of its p99 (every call until its 32nd)
WATCH_POLL_S = 0.1  # how often the watching thread looks at the call in progress
PARENT_POLL_S = 0.5


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank: [1, 2, …, 100], 0.99 → 99."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def step_bound(
    rates: Sequence[float], tokens: int, floor_s: float, factor: float = FACTOR
) -> float:
    """Seconds a call of `tokens` tokens may take, given its kind's recent seconds per token."""
    return bound_from(percentile(rates, 0.99) if rates else None, tokens, floor_s, factor)


def bound_from(p99: float | None, tokens: int, floor_s: float, factor: float = FACTOR) -> float:
    """`step_bound` from the kind's p99 seconds per token (None: nothing measured yet)."""
    if p99 is None:
        return max(floor_s, FIRST_CALL_S)
    return max(floor_s, factor * p99 * max(1, tokens))


@dataclass(frozen=True, slots=True)
class _Call:
    step: str
    tokens: int
    started: float
    bound_s: float
    p99_s: float | None  # seconds per token the bound came from (None: the floor alone)


class Watchdog:
    """Times one call at a time (the compute thread's) and calls `on_hang` once, from its own
    thread, with one line naming the step that overran its bound.

    The timed path costs a few microseconds: no lock, no wake-up of the watching thread (which
    looks every WATCH_POLL_S, or at the call's deadline if sooner), and each kind's p99 is
    re-read from its window every REFRESH calls, not sorted per call (that was ~100 µs a call
    on a 2-core host, two or three calls a round)."""

    def __init__(
        self,
        on_hang: Callable[[str], None],
        *,
        floor_s: float = DEFAULT_FLOOR_S,
        factor: float = FACTOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not floor_s > 0:
            raise ValueError(f"rank_timeout_floor_s must be > 0, got {floor_s}")
        self.on_hang = on_hang
        self.floor_s, self.factor, self.clock = floor_s, factor, clock
        self.rates: dict[str, collections.deque[float]] = {}
        self.fired = False
        self._p99: dict[str, float] = {}  # each kind's, as of its last refresh
        self._since: dict[str, int] = {}  # calls recorded since that refresh
        self._call: _Call | None = None  # the compute thread's; the watcher only reads it
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="tensor-parallel-watchdog", daemon=True
        )
        self._thread.start()

    def bound(self, step: str, tokens: int) -> float:
        return bound_from(self._p99.get(step), tokens, self.floor_s, self.factor)

    @contextmanager
    def timing(self, step: str, tokens: int) -> Iterator[None]:
        """Watches the block as one call of `step` over `tokens` tokens; records its time
        per token when it returns."""
        tokens = max(1, tokens)
        call = _Call(step, tokens, self.clock(), self.bound(step, tokens), self._p99.get(step))
        self._call = call
        try:
            yield
        finally:
            self._call = None  # a call that raised is no hang, and is not recorded
        self._record(step, (self.clock() - call.started) / tokens)

    def _record(self, step: str, rate: float) -> None:
        rates = self.rates.setdefault(step, collections.deque(maxlen=WINDOW))
        rates.append(rate)
        since = self._since.get(step, 0) + 1
        if len(rates) <= REFRESH or since >= REFRESH:
            self._p99[step] = percentile(rates, 0.99)
            since = 0
        self._since[step] = since

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether the call in progress (if any) returned or raised within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._call is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.is_set():
            call = self._call
            if call is None:
                self._closed.wait(WATCH_POLL_S)
                continue
            left = call.started + call.bound_s - self.clock()
            if left > 0:
                self._closed.wait(min(left, WATCH_POLL_S))
                continue
            if self._call is not call:  # it returned meanwhile
                continue
            self.fired = True
            self.on_hang(hang_message(call, self.clock() - call.started, self.factor))
            return


def hang_message(call: _Call, took: float, factor: float) -> str:
    """One line: `tensor-parallel step verify (12 tokens) did not finish in 30.0 s (bound
    30.0 s: the floor; p99 4.1 ms a token): a rank is hung; the target exits`."""
    if call.p99_s is None:
        basis = f"a first {call.step}'s, none measured yet"
    else:
        scaled = factor * call.p99_s * call.tokens
        p99 = f"p99 {call.p99_s * 1e3:.2g} ms a token"
        basis = f"the floor; {p99}" if call.bound_s > scaled else f"{factor:g} × {p99}"
    return (
        f"tensor-parallel step {call.step} ({call.tokens} tokens) did not finish in "
        f"{took:.1f} s (bound {call.bound_s:.1f} s: {basis}): a rank is hung; the target exits"
    )


class WatchedWorker(TargetWorker):
    """Rank 0's worker whose collective calls `watchdog` times."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        watchdog: Watchdog,
        *,
        keep_features: bool = False,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__(model, cache, keep_features=keep_features, feature_layers=feature_layers)
        self.watchdog = watchdog

    def prefill(self, seqs: Sequence[TargetSequence]) -> list[Tensor | None]:
        with self.watchdog.timing("prefill", sum(len(s.prompt) for s in seqs)):
            return super().prefill(seqs)

    def prepare(
        self,
        seqs: Sequence[TargetSequence],
        state: SpecRuntimeState,
        depths: Sequence[int] | None = None,
        riders: Sequence[TargetSequence] = (),
    ) -> None:
        with self.watchdog.timing("prepare", len(seqs)):
            super().prepare(seqs, state, depths, riders)

    def verify(
        self,
        seqs: Sequence[TargetSequence],
        trees: Sequence[CandidateTree],
        state: SpecRuntimeState | None = None,
        riders: Sequence[TargetSequence] = (),
    ) -> list[VerifyResult]:
        # the forward's tokens: every row padded to the largest tree (and its root), and the
        # riders' prompts (their chunks' padding aside)
        tokens = len(seqs) * (1 + max((len(tree) for tree in trees), default=0))
        tokens += sum(len(seq.prompt) for seq in riders)
        with self.watchdog.timing("verify", tokens):
            return super().verify(seqs, trees, state, riders)


def watch_parent(poll_s: float = PARENT_POLL_S) -> None:
    """In a follower: exits the process once rank 0 (its parent) is gone, however it went. A
    SIGKILLed rank 0 runs no `stop`, and a follower blocked in a collective may never hear of
    it (NCCL does not fail on a peer's death); re-parented, the follower sees a new parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        gone = f"rank 0 (pid {parent}) is gone"
        with contextlib.suppress(OSError):  # stdout may have been a pipe rank 0 read
            print(f"tensor-parallel follower (pid {os.getpid()}): {gone}; exiting", flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="tensor-parallel-parent", daemon=True).start()
