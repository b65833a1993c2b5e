"""Round time per tier (1, 3, 7) for the 8B target with realistic drafts, split by stage.

    python -m bench.gpu_rounds [--rounds 30] [--out FILE.json]

Drafts: an EAGLE head at hidden 4096 (one decoder layer + fc, the target's embedding and LM
head) and a ~1.2B standalone LM. Random weights: acceptance is ~0, so each round extends the
draft by one token (the bonus); stage costs are what matter here. In-process only (two
services: bench/round_overhead.py).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from bench.common import device_info, format_table, write_json
from bench.gpu_common import build_pair, median, run_rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--drafts", nargs="+", default=["none", "eagle", "1b"])
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_rounds.json"))
    args = parser.parse_args()
    info = device_info()
    print(f"device: {info.get('gpu')}")
    tiers = [1, 3, 7]
    rows, table = [], []
    prompt = [list(torch.randint(0, 128256, (args.prompt,)).tolist())]
    for draft in args.drafts:
        worker, drafter, states, capture_s = build_pair(draft, 1, [1], tiers, args.prompt + 256)
        for tier in tiers if draft != "none" else [1]:
            t = run_rounds(worker, drafter, states[tier], prompt, args.rounds)
            skip = 2  # first rounds: the draft's eager prompt extend
            ms = {
                k: 1e3 * median(getattr(t, k)[skip:])
                for k in ("extend", "draft", "verify", "other")
            }
            total = 1e3 * median(
                [
                    e + d + v + o
                    for e, d, v, o in zip(
                        t.extend[skip:],
                        t.draft[skip:],
                        t.verify[skip:],
                        t.other[skip:],
                        strict=True,
                    )
                ]
            )
            label = "target only" if draft == "none" else draft
            rows.append(
                {"draft": label, "tier": tier, "capture_s": capture_s, "round_ms": total, **ms}
            )
            table.append(
                [
                    label,
                    "-" if draft == "none" else str(tier),
                    f"{ms['extend']:.2f}",
                    f"{ms['draft']:.2f}",
                    f"{ms['verify']:.2f}",
                    f"{ms['other']:.2f}",
                    f"{total:.2f}",
                    f"{capture_s:.1f}",
                ]
            )
        del worker, drafter, states
        gc.collect()
        torch.cuda.empty_cache()
    write_json(args.out, {"device": info, "rows": rows})
    print(f"\nGPU round time per tier, batch 1, prompt {args.prompt} — {info.get('gpu')}")
    print(
        format_table(
            [
                "draft",
                "tier",
                "extend ms",
                "draft ms",
                "verify ms",
                "accept ms",
                "round ms",
                "capture s",
            ],
            table,
        )
    )


if __name__ == "__main__":
    main()
