"""Replays the goodput policy offline (no GPU), on what a GPU run recorded.

    python -m bench.goodput_sim [phases] [--run RUN.json.gz] [--lag 1 10] [--regime-map] …
    python -m bench.goodput_sim stages --run RUN.json [--profile] [--seeds 4] [--noise 0.1]

`phases` (the default) replays a policy closed loop on a `goodput_gpu` phased run's per-tier round
traces; `stages` draws rounds from a `gpu_speedup` run's per-cell stage times and accept means,
batch by batch. `python -m bench.goodput_sim MODE -h` gives a mode's options; `stages` was
bench/goodput_stages.py (git history).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from itertools import accumulate
from pathlib import Path
from typing import Any, Protocol

from bench.common import format_table, median, read_json, write_json
from bench.phased import ROUND_KEYS, RunResult, oracle_of
from controller.policies.bands import PolicySpec
from controller.policies.goodput.config import GoodputConfig, parse_profile
from controller.policies.goodput.policy import GoodputPolicy
from controller.policies.interface import RoundSample
from specpair.runtime.shape import TreeShape

# --- phases (was bench/goodput_sim.py) ---

PHASES_DOC = """\
Replays a speculation policy offline, closed loop, on a recorded phased run (no GPU).

`bench/goodput_gpu.py`'s phased part runs the same requests (batch 1, one after another) at
each static tier, so the static runs' rounds say what every tier costs and accepts at every
point of every request. A policy is simulated round by round: the round runs at the tier the
target applies then, is taken from that tier's trace at the request's current token position,
adds its time to the clock and its tokens to the position, and is fed to the pure policy as the
RoundSample the target would have sent (costs, accept lengths, sampled flag as recorded).

- Positions count per request: a round gains 1 + accepted drafts (1 without drafts), and the
  round that admits the request also the prefill's token. E.g. static-3 rounds gaining 2+1, 4,
  1, … start at positions 0, 3, 7, 8, …; a simulated round at position 5 on tier 3 replays the
  round starting at 3 (the one covering 5). Requests, and so phases, are split at admission
  rounds: `phase_first_round` can lag the round stream (static-0 of run 4: 184 where the 5th
  admission is round 188). A request ends at static-0's token count (tier 0 never overshoots).
- A tier the policy picks after round n applies from round n + 1 + `--lag` (lag 1: the target
  starts round n + 1 before it publishes round n). With `--regime-map`, a policy with a
  `regime_steps` (`RegimePolicy`: a tier per sampling regime, or None) sets the tier at once on
  the first round whose regime differs from the last round's (the target's own map).
- The first round with drafts after a tier-0 round, unless it admits the request (the draft
  prefills the prompt then anyway), pays the draft's catch-up: `--catchup-ms` more, in total
  and draft time (the default: about what the default run's catch-up rounds cost beyond a
  round at tier 3).
- A phase's time is its rounds' plus the time between rounds (client, wire), the median of the
  static runs' recorded phase seconds less their rounds'.

    python -m bench.goodput_sim [phases] [--run bench/results/goodput_gpu_eagle_h100_run4.json.gz]
        [--lag 1 10] [--set min_gain=0.05 ...] [--policy-class module:Class] [--regime-map]
        [--catchup-ms 28] [--png /tmp/goodput_sim.png] [--out /tmp/goodput_sim.json]
"""


STATIC = "static-"


DEFAULT_RUN = Path("bench/results/goodput_gpu_eagle_h100_run4.json.gz")


class Stepper(Protocol):
    """What the simulation needs of a policy (every SpeculationPolicy has it)."""

    @property
    def current_steps(self) -> int: ...
    def observe(self, sample: RoundSample) -> bool: ...


@dataclass
class Pinned:
    """A static tier."""

    current_steps: int

    def observe(self, sample: RoundSample) -> bool:
        return False


def gain(r: dict[str, Any]) -> int:
    """Tokens a recorded round emits (see the module docstring)."""
    drafted = sum(1 + a for a in r["accept_lengths"]) if r["accept_lengths"] else r["batch_size"]
    return drafted + (1 if r["admit_ms"] > 0 else 0)


@dataclass(frozen=True)
class Trace:
    """One request's rounds at one static tier; `starts[i]` is round i's token position."""

    rounds: tuple[dict[str, Any], ...]
    starts: tuple[int, ...]

    @classmethod
    def of(cls, rounds: list[dict[str, Any]]) -> Trace:
        return cls(tuple(rounds), tuple(accumulate((gain(r) for r in rounds[:-1]), initial=0)))

    @property
    def tokens(self) -> int:
        return self.starts[-1] + gain(self.rounds[-1])

    def at(self, pos: int) -> dict[str, Any]:
        """The round covering position `pos` (the last one past the end)."""
        return self.rounds[max(bisect_right(self.starts, pos) - 1, 0)]


@dataclass(frozen=True)
class Recorded:
    """A phased run: `traces[tier][phase][request]`, and per phase and request its token count
    and regime."""

    phases: list[str]
    runs: dict[str, RunResult]
    traces: dict[int, list[list[Trace]]]
    targets: list[list[int]]
    sampled: list[list[bool]]
    between_s: list[float]  # per phase, time outside rounds


def split_requests(rounds: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    starts = [i for i, r in enumerate(rounds) if r["admit_ms"] > 0]
    if len(starts) != n:
        raise ValueError(f"{len(starts)} admission rounds where {n} requests ran")
    return [rounds[a:b] for a, b in zip(starts, [*starts[1:], len(rounds)], strict=True)]


def load(report: dict[str, Any]) -> Recorded:
    """The static runs of `report` (bench/goodput_gpu.py's JSON) as traces."""
    phased = report["phased"]
    phases, per = phased["phases"], phased["requests_per_phase"]
    runs = {n: RunResult(**r) for n, r in phased["runs"].items()}
    statics = {int(n.removeprefix(STATIC)): r for n, r in runs.items() if n.startswith(STATIC)}
    if 0 not in statics:
        raise ValueError("the run needs static-0 (its requests' token counts are exact)")
    traces: dict[int, list[list[Trace]]] = {}
    between: list[list[float]] = [[] for _ in phases]
    for s, run in sorted(statics.items()):
        requests = split_requests(run.rounds, len(phases) * per)
        traces[s] = [
            [Trace.of(q) for q in requests[p * per : (p + 1) * per]] for p in range(len(phases))
        ]
        for p in range(len(phases)):
            ms = sum(r["total_ms"] for t in traces[s][p] for r in t.rounds)
            between[p].append(run.phase_seconds[p] - ms / 1e3)
    targets = [[t.tokens for t in phase] for phase in traces[0]]
    for name, run in runs.items():
        if run.phase_tokens != [sum(t) for t in targets]:
            raise ValueError(
                f"{name} made {run.phase_tokens} tokens per phase, static-0 "
                f"{[sum(t) for t in targets]}"
            )
    sampled = [[t.rounds[0]["sampled"] > 0 for t in phase] for phase in traces[0]]
    return Recorded(phases, runs, traces, targets, sampled, [median(b) for b in between])


@dataclass
class Sim:
    result: RunResult
    tiers: list[int] = field(default_factory=list)  # the applied tier of each round


def simulate(
    rec: Recorded,
    policy: Stepper,
    name: str,
    *,
    lag: int = 1,
    catchup_ms: float = 28.0,
    regime_map: bool = False,
) -> Sim:
    applied = policy.current_steps
    pending: deque[tuple[int, int]] = deque()  # (first round it applies to, tier)
    sim, last_sampled = Sim(RunResult(name)), None
    for p in range(len(rec.phases)):
        sim.result.phase_first_round.append(len(sim.tiers))
        ms = 0.0
        for q, target in enumerate(rec.targets[p]):
            pos, sampled = 0, rec.sampled[p][q]
            while pos < target:
                n = len(sim.tiers)
                while pending and pending[0][0] <= n:
                    applied = pending.popleft()[1]
                regimes = getattr(policy, "regime_steps", None) if regime_map else None
                if regimes is not None and last_sampled not in (None, sampled):
                    applied = regimes.of(sampled).steps  # the replays are of chains
                last_sampled = sampled
                if applied not in rec.traces:
                    raise ValueError(f"{name}: tier {applied} has no static run to replay")
                r = rec.traces[applied][p][q].at(pos)
                catchup = applied > 0 and n > 0 and sim.tiers[-1] == 0 and not r["admit_ms"] > 0
                extra = catchup_ms if catchup else 0.0
                sim.tiers.append(applied)
                ms += r["total_ms"] + extra
                pos += gain(r)
                sample = {k: r[k] for k in ROUND_KEYS} | {
                    "accept_lengths": tuple(r["accept_lengths"]),
                    "total_ms": r["total_ms"] + extra,
                    "draft_ms": r["draft_ms"] + extra,
                }
                if policy.observe(RoundSample(**sample)):
                    pending.append((n + 1 + lag, policy.current_steps))
        sim.result.phase_seconds.append(ms / 1e3 + rec.between_s[p])
        sim.result.phase_tokens.append(sum(rec.targets[p]))
    sim.result.switches = sum(a != b for a, b in zip(sim.tiers, sim.tiers[1:], strict=False))
    return sim


def parse_sets(items: list[str]) -> dict[str, Any]:
    """["min_gain=0.05", "candidate_steps=[0,3]"] → {"min_gain": 0.05, ...} (JSON, else text)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def variants(recorded: dict[str, Any], sets: dict[str, Any], cls: str | None) -> dict:
    """The recorded policy, with `sets` over it, and a `--policy-class` (through the
    controller's loader, given the recorded keys with `sets` over them) → PolicySpec."""
    out = {"recorded policy": PolicySpec.from_mapping(recorded)}
    if sets:
        label = ", ".join(f"{k}={json.dumps(v)}" for k, v in sets.items())
        out[f"recorded + {label}"] = PolicySpec.from_mapping({**recorded, **sets})
    if cls:
        options = {k: v for k, v in recorded.items() if k != "kind"}
        out[cls] = PolicySpec.from_mapping({**options, **sets, "kind": cls})
    return out


def row(label: str, run: RunResult, best: float, oracle: float, tiers: list[int]) -> list[str]:
    tps, counts = run.tokens_per_s(), sorted(Counter(tiers).items())
    return [
        label,
        *[f"{run.tokens_per_s(i):.1f}" for i in range(len(run.phase_seconds))],
        f"{tps:.1f}",
        f"{tps / best:.3f}",
        f"{tps / oracle:.3f}",
        str(run.switches),
        " ".join(f"{s}:{n}" for s, n in counts),
    ]


def plot(panels: list[tuple[str, list[int], list[int]]], path: Path) -> None:
    """One panel per (title, tier per round, phase first rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.2 * len(panels)), squeeze=False)
    for ax, (title, tiers, starts) in zip(axes[:, 0], panels, strict=True):
        ax.step(range(len(tiers)), tiers, where="post", color="C1")
        for s in starts:
            ax.axvline(s, color="grey", ls="--", lw=0.8)
        ax.set(ylim=(-0.5, 7.5), ylabel="tier")
        ax.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def phases_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput_sim phases", description=PHASES_DOC
    )
    parser.add_argument("--run", type=Path, default=DEFAULT_RUN, help="goodput_gpu.py JSON")
    parser.add_argument("--lag", type=int, nargs="+", default=[1], help="rounds; several: each")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--policy-class", help="module:Class, built as Class(options, initial)")
    parser.add_argument("--regime-map", action="store_true")
    parser.add_argument("--catchup-ms", type=float, default=28.0)
    parser.add_argument("--initial", type=int, default=3, help="the tier a policy starts at")
    parser.add_argument("--out", type=Path, default=Path("/tmp/goodput_sim.json"))
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    report, sets = read_json(args.run), parse_sets(args.set)
    rec = load(report)
    n_phases = len(rec.phases)
    opts = {"catchup_ms": args.catchup_ms, "regime_map": args.regime_map}
    statics = {f"{STATIC}{s}": simulate(rec, Pinned(s), f"{STATIC}{s}", **opts) for s in rec.traces}
    results = {n: s.result for n, s in statics.items()}
    oracle, oracle_runs = oracle_of(results, n_phases, statics)
    best = max(results[n].tokens_per_s() for n in statics)
    sims: dict[str, Sim] = {}
    for label, spec in variants(report["policies"]["goodput"], sets, args.policy_class).items():
        if args.regime_map and not hasattr(spec.build(args.initial), "regime_steps"):
            print(f"{label}: no regime_steps, --regime-map does nothing")
        for lag in args.lag:
            name = f"{label}, lag {lag}"
            sims[name] = simulate(rec, spec.build(args.initial), name, lag=lag, **opts)
    error = max(
        abs(results[n].phase_seconds[i] / rec.runs[n].phase_seconds[i] - 1)
        for n in statics
        for i in range(n_phases)
    )
    rows = [row(f"{n} (sim)", results[n], best, oracle, s.tiers) for n, s in statics.items()]
    rows.append(
        [
            "oracle (sim)",
            *[f"{results[n].tokens_per_s(i):.1f}" for i, n in enumerate(oracle_runs)],
            f"{oracle:.1f}",
            "",
            "",
            "",
            "",
        ]
    )
    panels = [
        (f"{n}: {s.result.tokens_per_s():.1f} tok/s", s.tiers, s.result.phase_first_round)
        for n, s in sims.items()
    ]
    if measured := rec.runs.get("goodput"):  # its ratios: against the recorded statics
        r_oracle, _ = oracle_of(rec.runs, n_phases, statics)
        r_best = max(rec.runs[n].tokens_per_s() for n in statics)
        tiers = [r["tier"] for r in measured.rounds]
        rows.append(row("goodput (recorded on the GPU)", measured, r_best, r_oracle, tiers))
        title = f"recorded goodput run: {measured.tokens_per_s():.1f} tok/s"
        panels.insert(0, (title, tiers, measured.phase_first_round))
    rows += [row(n, s.result, best, oracle, s.tiers) for n, s in sims.items()]
    runs = {
        n: {**s.result.__dict__, "rounds": [], "tiers": s.tiers}
        for n, s in {**statics, **sims}.items()
    }
    write_json(
        args.out,
        {
            "run": args.run,
            "options": {
                **opts,
                "lag": args.lag,
                "set": sets,
                "initial": args.initial,
                "policy_class": args.policy_class,
            },
            "phases": rec.phases,
            "between_s": rec.between_s,
            "static_max_error": error,
            "oracle": {"tokens_per_s": oracle, "runs": oracle_runs},
            "runs": runs,
        },
    )
    if args.png:
        plot(panels, args.png)
        print(f"timeline: {args.png}")
    print(
        f"phases: {json.dumps(rec.phases)}; time between rounds per phase "
        f"(s): {[round(b, 4) for b in rec.between_s]}; simulated statics vs recorded phase "
        f"seconds: max error {error:.2%}"
    )
    print(
        f"tokens/s per phase, simulated from {args.run} (catch-up {args.catchup_ms} ms, "
        f"regime map {'on' if args.regime_map else 'off'}); the recorded run's ratios are "
        "against the recorded statics\n"
    )
    headers = [
        "run",
        *[f"phase {i + 1}" for i in range(n_phases)],
        "overall",
        "/ best static",
        "/ oracle",
        "switches",
        "rounds per tier",
    ]
    print(format_table(headers, rows))


# --- stages (was bench/goodput_stages.py) ---

STAGES_DOC = """\
Replays the goodput policy offline on a `gpu_speedup` run's per-cell stage times (no GPU).

Each static cell of the run (target alone, tiers, tree shapes) gives, per batch size, what a
round at that tier costs (`stage_ms`: draft, verify, rpc + schedule, admit) and how many drafts
it accepts (`accept_mean`). Rounds are drawn from them: the time with ±`--noise` uniform noise,
the accept lengths from a per-position pass rate fitted to the cell's mean (a chain's first
position passes at tier 1's mean, the rest at one rate; a tree at one rate), e.g. tier 1 0.82
and tier 7 2.76 → 0.82, then 0.74 at each position after. One GoodputPolicy (the run's profile with
`--profile`) meets the batch sizes in order, `--rounds` rounds each, as the bench's cells do;
its tokens/s at each batch is set against the best static tier's there (simulated the same way).

    python -m bench.goodput_sim stages --run bench/results/gpu_trees_eagle_h100_large.json \\
        [--rounds 330] [--seeds 4] [--profile] [--out bench/out/goodput_stages.json]

Run at an earlier commit's `controller/` (a `git worktree`), it compares two policies on the same
rounds: 30 seeds on `gpu_trees_eagle_h100_profiled.json` gave batch 1 / 4 / 16 / 64 means of
0.969 / 0.951 / 0.961 / 0.818 at 561b36e and 0.966 / 0.955 / 0.962 / 0.905 after tier 0's
exploration and admission per token.
"""


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


def simulate_stages(
    table: dict[int, dict[TreeShape, Stage]],
    rounds: int,
    seed: int,
    noise: float,
    profile: Any = (),
    pinned: TreeShape | None = None,
    min_gain: float = 0.05,
) -> dict[int, float]:
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
            policy.observe(
                RoundSample(
                    t.steps,
                    b,
                    got,
                    st.total * scale,
                    st.verify * scale,
                    st.draft * scale,
                    st.rest * scale * 0.3,
                    admit_ms=st.admit * scale,
                    request_ids=ids,
                    shape=None if t.is_chain else t,
                )
            )
            tokens += b + sum(got)
            ms += st.total * scale
        rates[b] = tokens / ms
    return rates


def stages_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput_sim stages",
        description=STAGES_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--run", type=Path, default=Path("bench/results/gpu_trees_eagle_h100_large.json")
    )
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
        t: simulate_stages(table, args.rounds * 4, 1, args.noise, pinned=t)
        for t in tiers
        if t in common
    }
    runs = [
        simulate_stages(table, args.rounds, s, args.noise, profile, min_gain=args.min_gain)
        for s in range(args.seeds)
    ]
    rows, report = [], {}
    for b in sorted(table):
        best_tier = max(static, key=lambda t: static[t][b])
        ratios = [r[b] / static[best_tier][b] for r in runs]
        report[b] = {
            "best": str(best_tier),
            "ratios": ratios,
            "static": {str(t): static[t][b] for t in static},
        }
        mean = sum(ratios) / len(ratios)
        rows.append(
            [str(b), str(best_tier), f"{mean:.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}"]
        )
    write_json(
        args.out,
        {"run": str(args.run), "rounds": args.rounds, "profile": args.profile, "batches": report},
    )
    print(
        f"goodput replayed on {args.run}'s stage times, {args.rounds} rounds a batch size, "
        f"{args.seeds} seeds{' with its profile' if args.profile else ''}:\n"
    )
    print(format_table(["batch", "best static", "goodput / best, mean", "min", "max"], rows))


MODES = {
    "phases": phases_main,
    "stages": stages_main,
}


def main(argv: list[str] | None = None) -> None:
    """`MODE [options]`; without a mode, phases's options."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    mode = args.pop(0) if args and args[0] in MODES else "phases"
    MODES[mode](args)


if __name__ == "__main__":
    main()
