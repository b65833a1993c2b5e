"""The tensor-parallel watchdog: its bound's arithmetic, and that it fires once, naming the
step, for a call past the bound and never for calls within it; a follower's watch on its
parent."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specpair.parallel.watchdog import (
    FACTOR,
    FIRST_CALL_S,
    Watchdog,
    _Call,
    hang_message,
    percentile,
    step_bound,
)


def test_percentile_by_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 50.0
    assert percentile([7.0], 0.99) == 7.0


def test_the_bound_scales_the_recent_cost_per_token_and_keeps_the_floor() -> None:
    # nothing measured yet: a first call's bound (it may compile kernels)
    assert step_bound([], 12, floor_s=30.0) == FIRST_CALL_S
    assert step_bound([], 12, floor_s=900.0) == 900.0
    verifies = [0.004] * 200  # 4 ms a token
    assert step_bound(verifies, 12, floor_s=30.0) == 30.0  # 8 × 4 ms × 12 = 0.38 s < floor
    assert step_bound(verifies, 12, floor_s=0.1) == pytest.approx(FACTOR * 0.004 * 12)
    # a 20 000-token prompt after prefills at 2 ms a token: 8 × 2 ms × 20 000 = 320 s
    assert step_bound([0.002] * 10, 20_000, floor_s=30.0) == pytest.approx(320.0)
    # one slow call in a hundred is the 99th percentile: it raises the bound, it is not noise
    mixed = [0.001] * 98 + [0.01, 0.01]
    assert step_bound(mixed, 1000, floor_s=1.0) == pytest.approx(FACTOR * 0.01 * 1000)


def test_a_healthy_record_never_reaches_its_own_bound() -> None:
    """Every call of a record jittering 3× about its median stays well inside the bound
    that record sets for the next call of its size."""
    rates = [0.004 * (1 + 2 * ((i * 37) % 100) / 100) for i in range(512)]  # 4 to 12 ms a token
    for tokens in (1, 12, 64, 4096):
        bound = step_bound(rates, tokens, floor_s=1e-6)
        assert max(rates) * tokens < bound / 2


def hangs(watchdog: Watchdog, step: str, tokens: int, release: threading.Event) -> None:
    with watchdog.timing(step, tokens):
        release.wait(10)


def test_fires_once_naming_the_step_that_overran() -> None:
    heard: list[str] = []
    watchdog = Watchdog(heard.append, floor_s=0.3)
    try:
        for _ in range(5):
            with watchdog.timing("verify", 4):
                time.sleep(0.001)
        release = threading.Event()
        started = time.monotonic()
        hung = threading.Thread(target=hangs, args=(watchdog, "verify", 12, release))
        hung.start()
        deadline = time.monotonic() + 5
        while not heard and time.monotonic() < deadline:
            time.sleep(0.01)
        waited = time.monotonic() - started
        release.set()
        hung.join()
        with watchdog.timing("prefill", 3):  # after it fired: nothing more is reported
            time.sleep(0.4)
    finally:
        watchdog.close()
    assert 0.3 <= waited < 2.0
    assert len(heard) == 1 and watchdog.fired
    assert heard[0].startswith("tensor-parallel step verify (12 tokens) did not finish in 0.3 s")
    assert "bound 0.3 s: the floor" in heard[0]
    assert heard[0].endswith("a rank is hung; the target exits")


def test_calls_within_the_bound_are_never_flagged() -> None:
    heard: list[str] = []
    watchdog = Watchdog(heard.append, floor_s=0.2)
    try:
        for step in ("prefill", "verify", "prepare") * 10:
            with watchdog.timing(step, 8):
                time.sleep(0.01)
        time.sleep(0.4)  # idle past the floor: no call, nothing to flag
        # a call that raises is no hang either
        with pytest.raises(RuntimeError), watchdog.timing("verify", 8):
            raise RuntimeError("a collective failed")
        time.sleep(0.3)
        assert watchdog.wait_idle(0.1)
    finally:
        watchdog.close()
    assert heard == [] and not watchdog.fired
    assert len(watchdog.rates["verify"]) == 10  # the raising call is not recorded


def test_each_kind_is_bounded_by_its_own_record() -> None:
    now = [0.0]
    watchdog = Watchdog(lambda message: None, floor_s=0.05, clock=lambda: now[0])
    try:
        for _ in range(3):
            with watchdog.timing("prefill", 10):
                now[0] += 0.01  # 1 ms a token
        assert watchdog.bound("prefill", 100) == pytest.approx(FACTOR * 0.001 * 100)
        assert watchdog.bound("verify", 100) == FIRST_CALL_S  # nothing measured yet
    finally:
        watchdog.close()


def test_the_line_names_the_scaled_bound() -> None:
    call = _Call("prefill", 500, 0.0, FACTOR * 0.002 * 500, 0.002)
    assert hang_message(call, 8.04, FACTOR) == (
        "tensor-parallel step prefill (500 tokens) did not finish in 8.0 s (bound 8.0 s: "
        "8 × p99 2 ms a token): a rank is hung; the target exits"
    )


def test_a_floor_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rank_timeout_floor_s must be > 0, got 0"):
        Watchdog(lambda message: None, floor_s=0)


# The child says when it watches (its imports take seconds on a loaded machine): a parent killed
# before that would leave it watching its new parent.
ORPHAN = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", (
    "import time; from specpair.parallel.watchdog import watch_parent; "
    "watch_parent(0.05); print('watching', flush=True); time.sleep(60)"
)], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_follower_exits_once_its_parent_is_killed() -> None:
    """No collective to fail here (as under NCCL): only the watch on the parent ends it."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())  # once it watches
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie of ours, or one re-parented and reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
