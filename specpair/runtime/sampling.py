"""Sampling parameters and the logits → probabilities warp shared by draft and target."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# A temperature divides the logits: below ~1e-3 float32 logits overflow to inf (1e-45 makes
# every row NaN after softmax), and past 100 the distribution is uniform to within 1e-2 for
# logits spanning a few units, so neither end buys the client anything.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
SEED_LIMIT = 2**64  # seeds are uint64 on the wire and in torch.Generator.manual_seed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → whole vocabulary
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not (t == 0.0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {t}"
            )
        # NaN fails every comparison, so the range check below refuses it too.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    Draft and target use the same warp, so rejection sampling recovers exactly the
    distribution that plain sampling with these parameters would produce.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def derived_seed(seed: int | None, salt: int) -> int | None:
    """A second seed from `seed`, still a valid uint64: 2**64 - 1 with salt 1 wraps to 0."""
    return None if seed is None else (seed + salt) % SEED_LIMIT


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
