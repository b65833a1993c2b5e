"""What admitting requests costs: the target's prefill time by prompts per call, eager and in
the prefill graphs (`specpair/runtime/gpu/prefill_graphs.py`).

A prefill reads every weight once however few its prompts, and eagerly a small one is bound by
its kernel launches, so admitting requests one or two at a time (as they leave a drafted batch)
costs more per prompt than admitting them in groups (`--join-group`). The grown pair's target
(`bench.gpu_speedup`'s `grown_pair`), the held-out code prompts (96–128 tokens), EAGLE features
kept as a service keeps them; median of `--iters` timed calls after a warm-up, eager and graphed
side by side on one worker.

    python -m bench.gpu_prefill [--groups 1 2 4 8 16 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.acceptance import code_prompts
from bench.common import device_info, format_table, write_json
from bench.gpu_common import median
from bench.gpu_speedup import add_pair_args, bench_pair
from specpair.runtime.build import StateBuilder, build_target
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.target.worker import TargetSequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(parser)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_prefill.json"))
    args = parser.parse_args()
    target, _ = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    most = max(args.groups)
    worker = build_target(target, max_requests=most, max_len=512, keep_features=True,
                          dtype=dtype, device=args.device)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [p.ids for p in code_prompts(tokenizer, 8, 96, 128)]

    def prefill(n: int) -> float:
        seqs = [
            TargetSequence(f"p{i}", prompts[i % len(prompts)], SamplingParams(), 4)
            for i in range(n)
        ]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        worker.prefill(seqs)  # reads the first tokens and features back: synchronous
        seconds = time.perf_counter() - t0
        for seq in seqs:
            worker.release(seq)
        return seconds

    def timed(n: int) -> float:
        for _ in range(2):
            prefill(n)
        return median([1e3 * prefill(n) for _ in range(args.iters)])

    eager = {n: timed(n) for n in args.groups}
    if cuda:
        StateBuilder(worker)  # captures the prefill graphs
    graphed = {n: timed(n) for n in args.groups} if worker.prefill_graphs is not None else {}
    rows, cells = [], []
    for n in args.groups:
        g = graphed.get(n)
        cells.append({"prompts": n, "eager_ms": eager[n], "graph_ms": g})
        rows.append([str(n), f"{eager[n]:.2f}", f"{eager[n] / n:.2f}"] + (
            [f"{g:.2f}", f"{g / n:.2f}", f"{eager[n] / g:.2f}"] if g is not None else ["-"] * 3
        ))  # fmt: skip
    write_json(args.out, {"device": device_info(), "target": str(target), "cells": cells})
    headers = ["prompts a call", "eager ms", "a prompt", "graph ms", "a prompt", "eager/graph"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
