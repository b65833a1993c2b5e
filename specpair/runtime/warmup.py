"""The warm-up both services run before they report SERVING: every path their first rounds take,
run once on dummy requests that are released after.

What compiles on first use compiles there, not inside a user's first request: on a GPU,
flashinfer's prefill module (JIT-compiled the first time an eager prefill or extend runs, e.g.
the draft's first prompt) and Triton kernels outside the captured graphs. Unwarmed, with a 1B
draft LM on a GPU, the draft said SERVING before it had compiled flashinfer's prefill: the first
round timed out (the target's `--draft-timeout`) and speculation was lost for 32 s. On the CPU
the same rounds take milliseconds and prove the paths once more.

Each service's own file says which rounds it runs (`draft_service/warmup.py`,
`runtime/target/warmup.py`); here are the pieces they share: the progress lines, the dummy
tokens, trees and sampling, and the check that the warm-up gave back every slot and page.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from specpair.runtime.kv_cache import KVCache
from specpair.runtime.sampling import DRAFT_SUPPORT, SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.tree import CandidateTree

# Past every graph of a tier's extend (s + 1 rows), so a warm-up prompt runs the eager
# prefill a real prompt runs; short, so that it fits any cache a service is given.
PROMPT_TOKENS = 24
# A sampled request with every warp on: temperature, top-k, top-p and min-p each run.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, min_p=0.01, seed=1)
GREEDY = SamplingParams()


@contextmanager
def warming(log: Any, what: str) -> Iterator[None]:
    """Logs "warming up WHAT …", then "warmed up WHAT in 3.20 s" (with `s` for JSON logs)."""
    log.info(f"warming up {what} …")
    t0 = time.perf_counter()
    yield
    took = time.perf_counter() - t0
    log.info(f"warmed up {what} in {took:.2f} s", stage=what, s=round(took, 3))


def dummy_tokens(n: int, vocab_size: int, offset: int = 0) -> tuple[int, ...]:
    """n token ids spread over the vocabulary (any ids do: nothing reads the text)."""
    return tuple((7 * (i + offset) + 3) % vocab_size for i in range(n))


def dummy_tree(shape: TreeShape, vocab_size: int, sampled: bool = False) -> CandidateTree:
    """A tree of `shape`'s size, breadth first: each level's first `topk` nodes expanded `topk`
    ways until it holds `num_draft_tokens` nodes, at most `steps` deep (a chain for a chain's
    shape; 4x4x16 fills two levels: the verify's rows, not its depth, are what its graph has).

        TreeShape(2, 2, 5) → parents (-1, -1, 0, 0, 1)

    `sampled`: with the sparse q a sampled draft sends (`draft_support`: K = DRAFT_SUPPORT
    distinct ids a node, the drawn token first), all its mass on the node's token."""
    parents: list[int] = []
    frontier = [-1]
    for _ in range(shape.steps):
        level = []
        for parent in frontier:
            for _ in range(shape.topk):
                if len(parents) < shape.num_draft_tokens:
                    parents.append(parent)
                    level.append(len(parents) - 1)
        frontier = level[: shape.topk]
    tokens = dummy_tokens(len(parents), vocab_size, offset=1)
    if not sampled:
        return CandidateTree(tokens, tuple(parents))
    k = min(DRAFT_SUPPORT, vocab_size)
    ids = (torch.tensor(tokens)[:, None] + torch.arange(k)) % vocab_size  # [n, K], distinct
    probs = torch.zeros(len(tokens), k)
    probs[:, 0] = 1.0
    return CandidateTree(tokens, tuple(parents), probs, ids)


class Held:
    """A cache's slots and pages as the warm-up found them; `check` raises if any are missing
    after it (a warm-up that leaked would shrink what every later request may hold)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.slots, self.pages = cache.free_slots, len(cache.pages.free)

    def check(self, who: str) -> None:
        slots, pages = self.cache.free_slots, len(self.cache.pages.free)
        if (slots, pages) != (self.slots, self.pages):
            raise RuntimeError(
                f"{who} warm-up leaked: {self.slots - slots} slots and {self.pages - pages} "
                "KV pages still held after it released its requests"
            )
