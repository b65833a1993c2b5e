"""A serving process keeps the memory it frees, so that the next round's buffers reuse it.

A round at load moves megabytes through fresh host buffers: at 64 requests the target's
message (7.9 MB of EAGLE-3 features), the bytes gRPC receives and the draft's copy of the
run, each round. glibc maps an allocation that large on its own and unmaps it when freed (or
trims the heap's top back to the kernel), so the next round's buffer faults every 4 KB page
in again: 1 930 minor faults a message, ~2 ms of a 4.6 ms encode on a 2-core dev CPU
(`bench.wire_round`'s target table). Told to serve such sizes from the heap and to keep its
top, glibc hands the freed pages back out instead: the same encode took 2.8 ms, with 2 faults.
The process's resident size stays at its peak, as with any caching allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below it come from the heap (a wave of prompts: 173 MB)
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds for this process; False where the C library is not glibc (musl,
    macOS), which is left as it is."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
