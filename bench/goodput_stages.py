"""Replays the goodput policy offline on a `gpu_speedup` run's per-cell stage times (no GPU).

Each static cell of the run (target alone, tiers, tree shapes) gives, per batch size, what a
round at that tier costs (`stage_ms`: draft, verify, rpc + schedule, admit) and how many drafts
it accepts (`accept_mean`). Rounds are drawn from them: the time with ±`--noise` uniform noise,
the accept lengths from a per-position pass rate fitted to the cell's mean (a chain's first
position passes at tier 1's mean, the rest at one rate; a tree at one rate), e.g. tier 1 0.82
and tier 7 2.76 → 0.82, then 0.74 at each position after. One GoodputPolicy (the run's profile with
`--profile`) meets the batch sizes in order, `--rounds` rounds each, as the bench's cells do;
its tokens/s at each batch is set against the best static tier's there (simulated the same way).

    python -m bench.goodput_stages --run bench/results/gpu_trees_eagle_h100_large.json \\
        [--rounds 330] [--seeds 4] [--profile] [--out bench/out/goodput_stages.json]

Run at an earlier commit's `controller/` (a `git worktree`), it compares two policies on the same
rounds: 30 seeds on `gpu_trees_eagle_h100_profiled.json` gave batch 1 / 4 / 16 / 64 means of
0.969 / 0.951 / 0.961 / 0.818 at 561b36e and 0.966 / 0.955 / 0.962 / 0.905 after tier 0's
exploration and admission per token.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench.common import format_table, read_json, write_json
from controller.policies.goodput.config import GoodputConfig, parse_profile
from controller.policies.goodput.policy import GoodputPolicy
from controller.policies.interface import RoundSample
from specpair.runtime.shape import TreeShape

NOT_TIERS = ("adaptive", "goodput")


@dataclass(frozen=True)
class Stage:
    draft: float
    verify: float
    rest: float  # rpc + schedule
    admit: float
    first: float  # pass rate at position 0
    rate: float  # at positions after

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.rest + self.admit


def tier_of(config: str) -> TreeShape:
    """'target-only' → 0, 'tier 3' → 3, 'tree 5x4x20' → 5x4x20."""
    if config == "target-only":
        return TreeShape(0)
    return TreeShape.parse(config.split()[-1])


def expected(first: float, rate: float, steps: int) -> float:
    return sum(first * rate**k for k in range(steps))


def fit_rate(first: float, steps: int, mean: float) -> float:
    """The rate after position 0 whose expected accept length at `steps` is `mean`."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(first, mid, steps) < mean else (lo, mid)
    return (lo + hi) / 2


def stages(run: dict[str, Any]) -> dict[int, dict[TreeShape, Stage]]:
    """Per batch size, per static tier: its round's stage times and fitted acceptance."""
    out: dict[int, dict[TreeShape, Stage]] = {}
    cells = [c for c in run["cells"] if c["deployment"] == "services"]
    for c in cells:
        if c["config"] in NOT_TIERS:
            continue
        tier, m = tier_of(c["config"]), c["stage_ms"]
        first = rate = 0.0
        if tier.steps:
            if tier.is_chain:
                one = next(d for d in cells if d["batch"] == c["batch"] and d["config"] == "tier 1")
                first = min(one["accept_mean"], 0.999)
                rate = fit_rate(first, tier.steps, c["accept_mean"]) if tier.steps > 1 else first
            else:
                rate = fit_rate(1.0, tier.steps + 1, c["accept_mean"] + 1.0)
                first = rate
        out.setdefault(c["batch"], {})[tier] = Stage(
            m["draft"], m["verify"], m["rpc"] + m["schedule"], m["admit"], first, rate
        )
    return out


def accepts(rng: random.Random, stage: Stage, steps: int, batch: int) -> tuple[int, ...]:
    out = []
    for _ in range(batch):
        a = 0
        while a < steps and rng.random() < (stage.first if a == 0 else stage.rate):
            a += 1
        out.append(a)
    return tuple(out)


def simulate(
    table: dict[int, dict[TreeShape, Stage]], rounds: int, seed: int, noise: float,
    profile: Any = (), pinned: TreeShape | None = None, min_gain: float = 0.05,
) -> dict[int, float]:  # fmt: skip
    """Tokens per ms at each batch size, one policy (or a pinned tier) meeting them in order."""
    rng = random.Random(seed)
    batches = sorted(table)
    tiers = {t for b in batches for t in table[b]}
    chains = tuple(sorted(t.steps for t in tiers if t.is_chain))
    trees = tuple(str(t) for t in sorted(tiers, key=str) if not t.is_chain)
    config = GoodputConfig(
        candidate_steps=chains, tree_shapes=trees, profile_ms=profile, min_gain=min_gain
    )
    start = 3 if 3 in chains else max(chains)
    policy = GoodputPolicy(config, start)
    rates = {}
    for b in batches:
        tokens, ms = 0, 0.0
        for i in range(rounds):
            t = pinned if pinned is not None else policy.current_tier
            st = table[b][t]
            scale = rng.uniform(1.0 - noise, 1.0 + noise)
            got = accepts(rng, st, t.steps, b) if t.steps else ()
            ids = tuple(f"b{b}-r{(i * b + j) // (b * 40)}-{j}" for j in range(b))
            policy.observe(RoundSample(
                t.steps, b, got, st.total * scale, st.verify * scale, st.draft * scale,
                st.rest * scale * 0.3, admit_ms=st.admit * scale, request_ids=ids,
                shape=None if t.is_chain else t,
            ))  # fmt: skip
            tokens += b + sum(got)
            ms += st.total * scale
        rates[b] = tokens / ms
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path,
                        default=Path("bench/results/gpu_trees_eagle_h100_large.json"))  # fmt: skip
    parser.add_argument("--rounds", type=int, default=330, help="rounds at each batch size")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--profile", action="store_true", help="seed goodput with the run's")
    default_gain = next(f.default for f in fields(GoodputConfig) if f.name == "min_gain")
    parser.add_argument("--min-gain", type=float, default=default_gain)
    parser.add_argument("--out", type=Path, default=Path("bench/out/goodput_stages.json"))
    args = parser.parse_args(argv)
    run = read_json(args.run)
    table = stages(run)
    profile = parse_profile(run["profile"]["profile_ms"]) if args.profile else ()
    tiers = sorted({t for b in table for t in table[b]}, key=lambda t: (t.verified, str(t)))
    common = set.intersection(*(set(table[b]) for b in table))
    static = {
        t: simulate(table, args.rounds * 4, 1, args.noise, pinned=t)
        for t in tiers if t in common
    }  # fmt: skip
    runs = [
        simulate(table, args.rounds, s, args.noise, profile, min_gain=args.min_gain)
        for s in range(args.seeds)
    ]
    rows, report = [], {}
    for b in sorted(table):
        best_tier = max(static, key=lambda t: static[t][b])
        ratios = [r[b] / static[best_tier][b] for r in runs]
        report[b] = {"best": str(best_tier), "ratios": ratios,
                     "static": {str(t): static[t][b] for t in static}}  # fmt: skip
        mean = sum(ratios) / len(ratios)
        rows.append(
            [str(b), str(best_tier), f"{mean:.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}"]
        )
    write_json(args.out, {"run": str(args.run), "rounds": args.rounds, "profile": args.profile,
                          "batches": report})  # fmt: skip
    print(f"goodput replayed on {args.run}'s stage times, {args.rounds} rounds a batch size, "
          f"{args.seeds} seeds{' with its profile' if args.profile else ''}:\n")  # fmt: skip
    print(format_table(["batch", "best static", "goodput / best, mean", "min", "max"], rows))


if __name__ == "__main__":
    main()
