"""Tier switching: cost of the switch itself and the first round at the new tier.

    python -m bench.gpu_tier_switch [--out FILE.json]

In-process (EAGLE draft, batch 1): a switch is `state = states[new]`, a dict lookup; "first
round" is the round right after the switch, against the median steady round at that tier.
Captures and state builds are counted across all switches (must stay 0).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_common import RoundLoop, pair_workers, run_rounds
from specpair.runtime.build import StateBuilder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_tier_switch.json"))
    args = parser.parse_args()
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    worker, drafter = pair_workers("eagle", 1, 1024)
    builder = StateBuilder(worker, drafter, buckets=[1])
    states = builder.build_all(tiers)
    prompt = [list(torch.randint(0, 128256, (256,)).tolist())]
    before = builder.captures, builder.builds
    steady = {t: run_rounds(worker, drafter, states[t], prompt, 12).round_s() for t in tiers}
    rows, table = [], []
    loop = RoundLoop(worker, drafter, prompt)
    for _ in range(3):
        loop.step(states[tiers[0]])
    current = states[tiers[0]]
    for old in tiers:
        for new in tiers:
            if old == new:
                continue
            for _ in range(3):  # settle at the old tier
                loop.step(states[old])
            t0 = time.perf_counter_ns()
            current = states[new]  # what ApplyTier does, between two rounds
            switch_ns = time.perf_counter_ns() - t0
            first_s = sum(loop.step(current)[:4])
            rows.append(
                {
                    "from": old,
                    "to": new,
                    "switch_ns": switch_ns,
                    "first_round_s": first_s,
                    "steady_round_s": steady[new],
                }
            )
            table.append(
                [
                    f"{old} → {new}",
                    f"{switch_ns}",
                    f"{1e3 * first_s:.2f}",
                    f"{1e3 * steady[new]:.2f}",
                    f"{first_s / steady[new]:.2f}",
                ]
            )
    loop.close()
    after = builder.captures, builder.builds
    write_json(
        args.out,
        {
            "device": info,
            "rows": rows,
            "captures_builds_during": [after[0] - before[0], after[1] - before[1]],
        },
    )
    print(
        f"\nGPU tier switch, EAGLE draft, batch 1 — {info.get('gpu')}; captures/builds during "
        f"switching: {after[0] - before[0]}/{after[1] - before[1]}"
    )
    print(format_table(["switch", "swap ns", "first round ms", "steady ms", "first/steady"], table))


if __name__ == "__main__":
    main()
