"""The target's host work on a sampled round's trees, without any model: what the services pay
per round besides the GPU, by batch and tier, over a Llama-3 vocabulary.

Per round of B sampled chains of s drafts, each with a 64-token q (as the draft sends them),
median µs of: the draft's `RoundResponse` encoded, the target decoding it, checking the trees
(`validate_tree`, then the round's sparse qs at once; beside it, each tree's alone), and
`chain_inputs` (uniforms, drafts, q for the accept); and the message's bytes.

    python -m bench.host_round [--batches 1 8 16] [--tiers 3 7] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import add_output_args, device_info, format_table, write_json
from specpair.proto.v1 import draft_pb2
from specpair.rpc import wire
from specpair.runtime.round_messages import RoundResponse
from specpair.runtime.sampling import DRAFT_SUPPORT, SamplingParams, make_generator
from specpair.runtime.target.accepting import chain_inputs
from specpair.runtime.tree import CandidateTree, chain, sparse_q_faults, validate_tree

VOCAB = 128256


class Sampled:
    """What `chain_inputs` reads of a request."""

    def __init__(self, seed: int) -> None:
        self.sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=seed)
        self.generator = make_generator(seed)


def sampled_chain(s: int, gen: torch.Generator) -> CandidateTree:
    """A chain of s drafts, each drawn from its own 64-token q (the draft is its first id)."""
    ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:DRAFT_SUPPORT] for _ in range(s)])
    q = torch.softmax(torch.randn(s, DRAFT_SUPPORT, generator=gen), -1)
    return chain(ids[:, 0].tolist(), q, ids.int())


def median_us(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(batch: int, s: int, iters: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(batch * 100 + s)
    trees = {f"r{i}": sampled_chain(s, gen) for i in range(batch)}
    response = RoundResponse(round_id=1, trees=trees)
    data = wire.response_to_proto(response).SerializeToString()
    seqs = [Sampled(i) for i in range(batch)]

    def check() -> None:  # as served: structure per tree, then the round's sparse qs at once
        for tree in trees.values():
            validate_tree(tree, max_nodes=64, max_depth=s, vocab_size=VOCAB, sparse_q=False)
        assert not any(sparse_q_faults(list(trees.values()), VOCAB))

    def check_alone() -> None:  # each tree's sparse q on its own
        for tree in trees.values():
            validate_tree(tree, max_nodes=64, max_depth=s, vocab_size=VOCAB)

    return {
        "bytes": float(len(data)),
        "encode": median_us(lambda: wire.response_to_proto(response).SerializeToString(), iters),
        "decode": median_us(
            lambda: wire.response_from_proto(draft_pb2.RoundResponse.FromString(data)), iters
        ),
        "check": median_us(check, iters),
        "check_alone": median_us(check_alone, iters),
        "chain_inputs": median_us(lambda: chain_inputs(seqs, list(trees.values()), s + 1), iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--tiers", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--iters", type=int, default=200)
    add_output_args(parser, "bench/out/host_round.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a service's event loop runs it
    cells = [
        {"batch": b, "tier": s, **measure(b, s, args.iters)}
        for s in args.tiers
        for b in args.batches
    ]
    write_json(Path(args.out), {"device": device_info(), "vocab": VOCAB, "cells": cells})
    keys = ["encode", "decode", "check", "chain_inputs"]
    rows = [
        [str(c["batch"]), str(c["tier"]), f"{c['bytes'] / 1024:.1f}",
         *(f"{c[k]:.0f}" for k in keys), f"{sum(c[k] for k in keys):.0f}",
         f"{c['check_alone']:.0f}"]
        for c in cells
    ]  # fmt: skip
    headers = ["batch", "tier", "KB", *(f"{k} us" for k in keys), "total us", "check alone us"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
