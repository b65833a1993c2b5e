"""A start-up cost profile for the goodput policy: the median round time at each tier, batch
size and sampling regime, measured through running services and written as the policy file's
`profile_ms` / `sampled_profile_ms` keys.

Only time is profiled: acceptance belongs to the workload and is learnt online. With the costs
known, a policy that meets a batch size or a regime for the first time picks from predictions
grounded in this hardware instead of learning each tier in turn, which in a short cell can take
a third of its rounds.

Each cell pins one tier through the controller and runs `batch` concurrent requests of
`--new-tokens`; a round counts if it ran at that tier with the full batch and admitted nobody
(a joining request's prefill is not the tier's cost), and not right after the pin (the draft
catching up on tokens it missed at tier 0).

    python -m bench.profile_costs --target HOST:PORT --controller HOST:PORT \\
        --prompt "def parse(argv):" --batches 1 2 4 8 16 [--tree-shapes 5x4x20] --out policy.json
    specpair serve controller --policy policy.json ...   # with "kind": "goodput" added
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import format_table, median, write_json
from bench.services import rounds_watched
from specpair.client import ControllerClient, SpecpairClient
from specpair.client.requests import Prompt
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.shape import TreeShape

TIERS = tuple(map(TreeShape, (0, 1, 3, 7)))
SKIP_AFTER_PIN = 2  # rounds: the draft's catch-up after tier 0, and the pin landing
# Tier 0 gains a token a round and its rounds are short: at a large batch the requests still
# trickle in (one admission a round) when the first of 24 tokens finishes, and no round runs the
# whole batch without admitting. Its cells run this many times the tokens.
TIER0_TOKENS = 4
NEW_TOKENS = 24  # per request at tiers > 0


def longest(new_tokens: int = NEW_TOKENS) -> int:
    """The most tokens a profile request generates (the services' max_len must allow it)."""
    return new_tokens * TIER0_TOKENS


def counted_ms(rounds: Sequence[RoundStats], tier: TreeShape, batch: int) -> list[float]:
    """Round times of `rounds` that show the cost of `tier` (a chain or a tree) at `batch`: at
    that tier (with drafts, unless 0), the whole batch, no admission."""
    out = []
    for r in rounds[SKIP_AFTER_PIN:]:
        drafted = r.speculative and len(r.accept_lengths) > 0
        if r.batch_size != batch or r.timings.admit_ms > 0 or drafted != (tier.steps > 0):
            continue
        if tier.steps > 0 and r.tier != tier:
            continue
        out.append(r.timings.total_ms)
    return out


def profile(
    client: SpecpairClient,
    ctl: ControllerClient,
    prompts: Sequence[Prompt],
    *,
    tiers: Sequence[TreeShape] = TIERS,
    batches: Sequence[int] = (1,),
    sampled_batches: Sequence[int] = (1,),
    new_tokens: int = NEW_TOKENS,
) -> dict[str, Any]:
    """{"profile_ms": {batch: {tier: ms}}, "sampled_profile_ms": …, "rounds": {…}} (keys as
    strings, the policy file's shape: a tree by its shape, "5x4x20"); the controller is left
    unpinned."""
    out: dict[str, Any] = {"profile_ms": {}, "sampled_profile_ms": {}, "rounds": {}}
    try:
        for tier in tiers:
            ctl.pin(str(tier))
            time.sleep(0.1)
            for key, temperature, sizes in (
                ("profile_ms", 0.0, batches),
                ("sampled_profile_ms", 1.0, sampled_batches),
            ):
                for batch in sizes:
                    rounds: list[RoundStats] = []
                    tokens = new_tokens * (TIER0_TOKENS if tier.steps == 0 else 1)

                    def one(i: int, temperature: float = temperature, tokens: int = tokens) -> None:
                        client.generate(
                            prompts[i % len(prompts)],
                            max_tokens=tokens,
                            temperature=temperature,
                            seed=i,
                        )

                    with rounds_watched(client.address, rounds), ThreadPoolExecutor(batch) as pool:
                        list(pool.map(one, range(batch)))
                    times = counted_ms(rounds, tier, batch)
                    out["rounds"][f"{key} {batch} {tier}"] = len(times)
                    if times:
                        out[key].setdefault(str(batch), {})[str(tier)] = median(times)
                    print(
                        f"  profile {key:18s} batch {batch:2d} tier {tier}: {len(times)} rounds",
                        flush=True,
                    )
    finally:
        ctl.unpin()
    return out


def render(result: dict[str, Any]) -> str:
    names = {
        t for key in ("profile_ms", "sampled_profile_ms") for b in result[key].values() for t in b
    }
    columns = sorted({*map(str, TIERS), *names}, key=TreeShape.parse)
    rows = []
    for key in ("profile_ms", "sampled_profile_ms"):
        for batch, tiers in sorted(result[key].items(), key=lambda kv: int(kv[0])):
            cells = [f"{tiers[t]:.1f}" if t in tiers else "-" for t in columns]
            rows.append(["sampled" if key.startswith("sampled") else "greedy", batch, *cells])
    return format_table(["regime", "batch", *(f"tier {t} ms" for t in columns)], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--controller", required=True)
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text (repeat for more); default: one code prompt",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--sampled-batches", type=int, nargs="+", default=[1])
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument(
        "--tree-shapes",
        nargs="+",
        default=[],
        metavar="SHAPE",
        help="tree shapes to profile beside the chains (the services' and the "
        "controller's tree_shapes)",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/specpair-profile.json"))
    args = parser.parse_args()
    prompts: list[Prompt] = args.prompt or ["def parse_args(argv):\n    parser = "]
    result = profile(
        SpecpairClient(args.target, timeout=600),
        ControllerClient(args.controller, timeout=30),
        prompts,
        tiers=(*TIERS, *map(TreeShape.parse, args.tree_shapes)),
        batches=args.batches,
        sampled_batches=args.sampled_batches,
        new_tokens=args.new_tokens,
    )
    write_json(args.out, {k: result[k] for k in ("profile_ms", "sampled_profile_ms")})
    print(render(result))


if __name__ == "__main__":
    main()
