"""The tensor-parallel target in process: TP=1 against TP=2 (one process per GPU, NCCL inside the
CUDA graphs) on the grown 8B target with the EAGLE-3 head, held-out code, the engine as client.

Per TP and cell (target alone at tier 0's graphs, batch 1 and 8; the EAGLE-3 head at a static
tier, greedy and T 0.7, batch 1): tokens/s, the verify's wall ms a round and its graphs' GPU ms
(on rank 0), and for TP > 1 what keeping the ranks in step costs: rank 0's host time sending
one step (the plan, loads and replay order, down a pipe), and steps a round. Small sums go over
peer memory (`models/parallel.PeerReduce`); `SPECPAIR_ALL_REDUCE=nccl` sends them all through
NCCL, to measure what that saves (a process joins NCCL's group once: one run each).
`bench/tensor_parallel.py` measures the same through `specpair up` and the SDK.

    python -m bench.tp_forward [--tp 1 2] [--requests 8] [--new-tokens 128] [--tier 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_speedup import grown_pair, make_workloads
from specpair.parallel.build import build_parallel_states, build_parallel_target
from specpair.parallel.ranks import ALL_REDUCE_ENV, exit_if_nccl
from specpair.runtime.build import StateBuilder, build_drafter, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine, StageTimes
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import tier_state


def cells_at(tp: int, target: Path, draft: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_device(0)
    tier = TreeShape(args.tier)
    tiers = [TreeShape(0), tier]
    options: dict[str, Any] = dict(
        max_requests=8,
        max_len=1024,
        keep_features=True,
        dtype=torch.bfloat16,
        device="cuda:0",
        feature_layers=feature_layers(draft, target),
    )
    t0 = time.perf_counter()
    ranks = None
    if tp == 1:
        worker = build_target(target, **options)
        builder = StateBuilder(worker)
        states = builder.build_all(tiers)
    else:
        worker, ranks = build_parallel_target(target, tensor_parallel=tp, **options)
        builder, states = build_parallel_states(worker, ranks.lockstep, tiers)
    drafter = build_drafter(
        draft,
        target_path=target,
        max_requests=8,
        max_len=1024,
        dtype=torch.bfloat16,
        device="cuda:0",
    )
    drafts = StateBuilder(None, drafter).build_all(tiers)
    start_s = time.perf_counter() - t0
    memory = [torch.cuda.mem_get_info(i) for i in range(tp)]
    spec = tier_state(tier, states[tier].verify, drafts[tier].extend, drafts[tier].draft)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    greedy, sampled = make_workloads(tokenizer, args.requests, (0.0, 0.7))[:2]
    runs = [
        ("target alone", greedy, 1, None, states[TreeShape(0)]),
        ("target alone", greedy, 8, None, states[TreeShape(0)]),
        (f"tier {tier}", greedy, 1, drafter, spec),
        (f"tier {tier}", sampled, 1, drafter, spec),
    ]
    out = []
    try:
        for config, wl, batch, drafts_with, state in runs:
            engine = SpeculativeEngine(worker, drafts_with)  # type: ignore[arg-type]
            engine.generate(wl.ids[:batch], max_new_tokens=8, state=state)  # warm
            engine.times = StageTimes()
            sent0 = ranks.lockstep.sent if ranks else 0
            send0 = ranks.lockstep.send_s if ranks else 0.0
            tokens, t0 = 0, time.perf_counter()
            for lo in range(0, len(wl.ids), batch):
                group = range(lo, min(lo + batch, len(wl.ids)))
                results = engine.generate(
                    [wl.ids[i] for i in group],
                    max_new_tokens=args.new_tokens,
                    state=state,
                    sampling=[wl.sampling(i) for i in group],
                )
                tokens += sum(len(r.token_ids) for r in results)
            seconds = time.perf_counter() - t0
            times = engine.times
            rounds = max(times.rounds, 1)
            steps, send_s = 0, 0.0
            if ranks is not None:
                steps, send_s = ranks.lockstep.sent - sent0, ranks.lockstep.send_s - send0
            out.append(
                {
                    "tp": tp,
                    "all_reduce": os.environ.get(ALL_REDUCE_ENV, "peer") if tp > 1 else "-",
                    "config": config,
                    "workload": wl.name,
                    "batch": batch,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "verify_ms": 1e3 * times.verify / rounds,
                    "verify_gpu_ms": sum(v for _, v in times.gpu_ms) / rounds,
                    "steps_per_round": steps / rounds,
                    "step_send_us": 1e6 * send_s / steps if steps else 0.0,
                    "start_s": start_s,
                    "gpu_used_gib": [(total - free) / 2**30 for free, total in memory],
                }
            )
            print(out[-1], flush=True)
    finally:
        if ranks is not None:
            ranks.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tier", type=int, default=7)
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/specpair-grown"))
    parser.add_argument("--out", type=Path, default=Path("bench/out/tp_forward.json"))
    args = parser.parse_args()
    target, draft = grown_pair(args.models_dir, "eagle3", "cuda")
    cells = [c for tp in args.tp for c in cells_at(tp, target, draft, args)]
    base = {(c["config"], c["workload"], c["batch"]): c for c in cells if c["tp"] == 1}
    alone = {(c["tp"], c["batch"]): c for c in cells if c["config"] == "target alone"}
    rows = []
    for c in cells:
        one = base.get((c["config"], c["workload"], c["batch"]))
        own = alone.get((c["tp"], c["batch"]), alone[(c["tp"], 1)])  # this TP's target alone
        rows.append(
            [
                str(c["tp"]),
                c["all_reduce"],
                c["config"],
                c["workload"],
                str(c["batch"]),
                f"{c['tokens_per_s']:.1f}",
                "-" if one is None else f"{c['tokens_per_s'] / one['tokens_per_s']:.2f}",
                f"{c['tokens_per_s'] / own['tokens_per_s']:.2f}",
                f"{c['verify_ms']:.2f}",
                f"{c['verify_gpu_ms']:.2f}",
                f"{c['steps_per_round']:.1f}",
                f"{c['step_send_us']:.0f}",
            ]
        )
    write_json(args.out, {"device": device_info(), "args": vars(args), "cells": cells})
    print(f"wrote {args.out}")
    print(
        format_table(
            [
                "TP",
                "all-reduce",
                "config",
                "workload",
                "batch",
                "tok/s",
                "x TP=1",
                "x alone",
                "verify ms",
                "verify GPU ms",
                "steps/round",
                "step send us",
            ],
            rows,
        )
    )
    exit_if_nccl(0)


if __name__ == "__main__":
    main()
