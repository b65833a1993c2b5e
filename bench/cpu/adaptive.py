"""Adaptive vs static tiers on a phased workload, against the running services (CPU).

The same requests run five times through real draft, target and controller processes: under
the controller's two policy kinds (`sglang`, SGLang's EMA rule; `goodput`, tokens/s from cost
and acceptance models), switched live through the ops API, and with each static tier (1, 3, 7)
pinned, on `bench/phased.py`'s workload (low → high → low → high).

Per phase and overall it reports tokens/s of each run, the per-phase oracle (the best static tier
in each phase, stitched together), the number of tier switches, and draws a timeline PNG (EMA
accept length and active tier over rounds, phase boundaries marked, one panel per kind).

    python -m bench.cpu adaptive [--requests-per-phase 12] [--new-tokens 48] [--runs goodput,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import device_info, format_table, write_json
from bench.phased import (
    KINDS,
    RUNS,
    STATIC,
    RunResult,
    build_phases,
    kind_policy,
    load_policy,
    oracle_of,
    replay,
    run_workload,
)
from bench.services import BenchServices
from controller.policies.bands import PolicySpec
from specpair.config import MODELS_DIR


def ema_timeline(result: RunResult, policy: PolicySpec, initial: int) -> list[float]:
    """The policy's headline estimate over the run's rounds (the same pure policy, replayed):
    sglang's EMA accept length, goodput's predicted accepted drafts at its tier."""
    return [p.ema for p in replay(result.rounds, policy, initial)]


def plot(results: dict[str, RunResult], policy: PolicySpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in results]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(11, 3.6 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds, strict=True):
        run = results[kind]
        rounds = range(len(run.rounds))
        spec = PolicySpec.from_mapping(kind_policy(policy, kind))
        label = "EMA accept length" if kind == "sglang" else "predicted accepted drafts"
        ax.plot(rounds, ema_timeline(run, spec, 3), label=label, color="C0")
        ax.step(
            rounds, [r["tier"] for r in run.rounds], where="post", label="active tier", color="C1"
        )
        for i, start in enumerate(run.phase_first_round):
            ax.axvline(start, color="grey", ls="--", lw=0.8)
            ax.text(start + 1, 7.3, f"phase {i + 1}", fontsize=8)
        ax.set_ylabel("tokens")
        ax.set_ylim(0, 8)
        ax.set_title(
            f"{kind} policy on a phased workload (low → high → low → high), "
            f"{run.tokens_per_s():.1f} tokens/s"
        )
        ax.legend(loc="lower right")
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu adaptive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--draft", type=Path, help="default: models/eagle or models/draft")
    # The EAGLE head by default: bench/RESULTS.md's runs of this workload use it.
    parser.add_argument("--draft-kind", choices=["model", "eagle"], default="eagle")
    parser.add_argument("--requests-per-phase", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--policy", type=Path, help="policy JSON (default: SGLang's defaults)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"some of {','.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=Path("bench/out/adaptive.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/adaptive-logs"))
    parser.add_argument("--png", type=Path, default=Path("bench/out/adaptive_timeline.png"))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    phases = build_phases(tokenizer, args.requests_per_phase)
    policy = load_policy(args.policy)
    runs = [r for r in args.runs.split(",") if r]
    if not runs or set(runs) - set(RUNS) or not set(STATIC) & set(runs):
        parser.error(f"--runs: some of {','.join(RUNS)}, at least one static-N")
    print(f"device: {device_info()}", flush=True)
    results: dict[str, RunResult] = {}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with BenchServices(
        target=args.target,
        draft=args.draft or MODELS_DIR / ("eagle" if args.draft_kind == "eagle" else "draft"),
        draft_kind=args.draft_kind,
        policy=policy.to_dict(),
        log_dir=args.log_dir,
    ) as group:
        for name in runs:
            results[name] = run_workload(
                name, group, phases, args.new_tokens, args.concurrency, policy
            )
    oracle, oracle_tiers = oracle_of(results, len(phases))
    best_static = max(results.keys() & set(STATIC), key=lambda n: results[n].tokens_per_s())
    # The timeline draws a panel per policy kind; pinned runs alone have none to draw.
    timeline = any(k in results for k in KINDS)
    if timeline:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot(results, policy, args.png)
    write_json(
        args.out,
        {
            "device": device_info(),
            "policy": policy.to_dict(),
            "phases": [p.name for p in phases],
            "new_tokens": args.new_tokens,
            "requests_per_phase": args.requests_per_phase,
            "draft_kind": args.draft_kind,
            "concurrency": args.concurrency,
            "runs": {n: r.__dict__ for n, r in results.items()},
            "oracle": {"tokens_per_s": oracle, "tiers": oracle_tiers},
            "best_static": best_static,
        },
    )
    headers = ["run", *[f"phase {i + 1}" for i in range(len(phases))], "overall", "switches"]
    rows = [
        [
            n,
            *[f"{r.tokens_per_s(i):.1f}" for i in range(len(phases))],
            f"{r.tokens_per_s():.1f}",
            str(r.switches) if n in KINDS else "-",
        ]
        for n, r in results.items()
    ]
    rows.append(
        [
            "oracle (best static per phase)",
            *[f"{results[t].tokens_per_s(i):.1f}" for i, t in enumerate(oracle_tiers)],
            f"{oracle:.1f}",
            "-",
        ]
    )
    print(f"\nphases: {json.dumps([p.name for p in phases])}; oracle tiers {oracle_tiers}")
    for kind in (k for k in KINDS if k in results):
        a = results[kind].tokens_per_s()
        vs_static = a / results[best_static].tokens_per_s()
        print(
            f"{kind} / best static ({best_static}) = {vs_static:.3f}x; "
            f"{kind} / oracle = {a / oracle:.3f}x"
        )
    if timeline:
        print(f"timeline: {args.png}")
    print(
        f"tokens/s per phase ({args.requests_per_phase} requests × {args.new_tokens} tokens, "
        f"concurrency {args.concurrency})\n"
    )
    print(format_table(headers, rows))
