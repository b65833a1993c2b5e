"""Tokens/s at batch 1, 4, 16, 64 per tier and without speculation, fixed acceptance.

    python -m bench.gpu_batch [--rounds 12] [--out FILE.json]

Fixed acceptance: the draft is the target itself (same weights, its own KV cache), so greedy
drafts are accepted in full (acceptance s per round, up to bf16 ties) and every round yields
s + 1 tokens per request. This prices verify + draft at their maximum payoff; a real draft
costs less per step and accepts less.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_common import build_pair, run_rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_batch.json"))
    args = parser.parse_args()
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    worker, drafter, states, capture_s = build_pair(
        "identical", max(args.batches), args.batches, tiers, 512
    )
    print(f"captured {len(tiers)} tiers × {args.batches} in {capture_s:.1f} s")
    rows, table = [], []
    for batch in args.batches:
        prompts = [list(torch.randint(0, 128256, (128,)).tolist()) for _ in range(batch)]
        cells = [str(batch)]
        for tier in [0, *tiers]:
            if tier == 0:
                t = run_rounds(worker, None, states[1], prompts, args.rounds)
            else:
                t = run_rounds(worker, drafter, states[tier], prompts, args.rounds)
            skip = 2
            secs = (
                sum(t.extend[skip:])
                + sum(t.draft[skip:])
                + sum(t.verify[skip:])
                + sum(t.other[skip:])
            )
            toks = sum(t.tokens[skip:])
            accept = toks / (batch * (args.rounds - skip)) - 1
            rows.append({"batch": batch, "tier": tier, "tok_s": toks / secs, "accept": accept})
            cells.append(f"{toks / secs:.0f}" + ("" if tier == 0 else f" ({accept:.1f})"))
        table.append(cells)
    write_json(args.out, {"device": info, "capture_s": capture_s, "rows": rows})
    print(
        f"\nGPU tokens/s (accept length per round), 8B target, identical draft — {info.get('gpu')}"
    )
    print(format_table(["batch", "no spec", "tier 1", "tier 3", "tier 7"], table))


if __name__ == "__main__":
    main()
