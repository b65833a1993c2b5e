"""A serving process keeps what it frees: a round's next buffer of the same size reuses pages
instead of faulting fresh ones in (glibc; run in a child so this process keeps its own)."""

from __future__ import annotations

import subprocess
import sys

import pytest

FAULTS = """
import resource, sys
from specpair.rpc.host_memory import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("no-glibc")
    raise SystemExit
held, faults = [], []
for _ in range(12):  # a round: a message's bytes freed while the last rounds' rows stay held
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    message = bytearray(8_000_000)  # zero-filled: every page written
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    held = [*held[-3:], bytearray(8_000_000)]
    del message
print(max(faults[4:]))
"""


def faults(mode: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_freed_message_is_reused_without_faulting_its_pages_in_again() -> None:
    kept = faults("keep")
    if kept == "no-glibc":
        pytest.skip("the C library is not glibc")
    assert int(kept) < 100  # 8 MB is 1 954 pages of 4 KB
    assert int(faults("default")) > 1000  # glibc's own thresholds unmap and map it again
