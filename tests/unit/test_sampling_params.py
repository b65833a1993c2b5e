"""SamplingParams refuses every value the warp cannot turn into a distribution."""

from __future__ import annotations

import math

import pytest
import torch

from specpair.runtime.sampling import SamplingParams, derived_seed, make_generator, warp


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1e-45}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 1e6}, "temperature"),
        ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
        ({"temperature": 1.0, "top_p": -math.inf}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-3, 0.7, 100.0])
def test_accepted_temperatures_warp_to_a_distribution(temperature: float) -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 30
    probs = warp(logits, SamplingParams(temperature=temperature, top_p=1e-30))
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_derived_seed_of_the_largest_seed_wraps_and_seeds_a_generator() -> None:
    assert derived_seed(None, 5) is None
    assert derived_seed(2**64 - 1, 0x5EED) == 0x5EED - 1
    make_generator(derived_seed(2**64 - 1, 0x5EED))  # raised OverflowError before the wrap
