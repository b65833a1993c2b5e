"""Adaptive vs static tiers on a phased workload, against the running services (CPU).

The same requests run five times through real draft, target and controller processes: under
the controller's two policy kinds (`sglang`, SGLang's EMA rule; `goodput`, tokens/s from cost
and acceptance models), switched live through the ops API, and with each static tier (1, 3, 7)
pinned. The workload alternates phases where the draft is rarely right (prose sampled at
temperature 1.0) and phases where it often is (held-out code, greedy):

    low → high → low → high

Per phase and overall it reports tokens/s of each run, the per-phase oracle (the best static tier
in each phase, stitched together), the number of tier switches, and draws a timeline PNG (EMA
accept length and active tier over rounds, phase boundaries marked, one panel per kind).

    python -m bench.adaptive [--requests-per-phase 12] [--new-tokens 48] [--runs goodput,...]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.acceptance import code_prompts, prose_prompts
from bench.common import device_info, format_table, write_json
from bench.services import BenchServices, watch_rounds
from controller.policies.bands import PolicySpec
from controller.policies.interface import RoundSample, SpeculationPolicy
from controller.policies.sglang import PolicyConfig
from controller.service.controlled_target import round_sample
from specpair.client import ControllerClient, SpecpairClient
from specpair.config import MODELS_DIR
from specpair.runtime.round_messages import RoundStats

KINDS = ("sglang", "goodput")  # runs under a policy; the others pin a tier
RUNS = (*KINDS, "static-1", "static-3", "static-7")
STATIC = RUNS[len(KINDS) :]
ROUND_KEYS = ("steps", "batch_size", "accept_lengths", "total_ms", "verify_ms", "draft_ms",
              "schedule_ms", "admit_ms", "sampled")  # fmt: skip


@dataclass(frozen=True)
class Phase:
    name: str
    prompts: list[list[int]]
    temperature: float


@dataclass
class RunResult:
    name: str
    phase_seconds: list[float] = field(default_factory=list)
    phase_tokens: list[int] = field(default_factory=list)
    phase_first_round: list[int] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # RoundSample fields + tier
    switches: int = 0

    def tokens_per_s(self, i: int | None = None) -> float:
        if i is None:
            return sum(self.phase_tokens) / sum(self.phase_seconds)
        return self.phase_tokens[i] / self.phase_seconds[i]


def build_phases(tokenizer: Any, per_phase: int) -> list[Phase]:
    code = [p.ids for p in code_prompts(tokenizer, 2 * per_phase, 96, 128)]
    prose = [p.ids for p in prose_prompts(tokenizer)]
    # Prose prompts repeat across requests; each request samples with its own seed.
    prose = [prose[i % len(prose)] for i in range(2 * per_phase)]
    return [
        Phase("low-1 (prose, T=1.0)", prose[:per_phase], 1.0),
        Phase("high-1 (code, greedy)", code[:per_phase], 0.0),
        Phase("low-2 (prose, T=1.0)", prose[per_phase:], 1.0),
        Phase("high-2 (code, greedy)", code[per_phase:], 0.0),
    ]


def run_workload(
    name: str,
    group: BenchServices,
    phases: list[Phase],
    new_tokens: int,
    concurrency: int,
    policy: PolicySpec,
) -> RunResult:
    client = SpecpairClient(group.target, timeout=120)
    ctl = ControllerClient(group.controller, timeout=30)
    if name in KINDS:
        # A kind switch starts the policy afresh at the running tier; 3 for every run.
        ctl.pin(3)
        ctl.update_policy(**kind_policy(policy, name))
        ctl.unpin()
    else:
        ctl.pin(int(name.split("-")[1]))
    time.sleep(0.3)
    rounds: list[RoundStats] = []
    call = watch_rounds(group.target, rounds)
    time.sleep(0.3)
    switches_before = len(ctl.state().targets[0].recent_switches)
    result = RunResult(name)
    for p_index, phase in enumerate(phases):
        result.phase_first_round.append(len(rounds))

        def one(i: int, phase: Phase = phase, p_index: int = p_index) -> int:
            seed = 1000 * p_index + i
            r = client.generate(
                phase.prompts[i], max_tokens=new_tokens, temperature=phase.temperature, seed=seed
            )
            return len(r.token_ids)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, range(len(phase.prompts))))
        result.phase_seconds.append(time.perf_counter() - t0)
        result.phase_tokens.append(tokens)
        print(f"  {name:9s} {phase.name:24s} {tokens / result.phase_seconds[-1]:7.1f} tok/s",
              flush=True)  # fmt: skip
    time.sleep(0.3)
    call.cancel()
    # Every round (plain ones carry no accept lengths and leave the EMA alone).
    result.rounds = [round_record(r) for r in rounds]
    state = ctl.state().targets[0]
    result.switches = sum(
        1 for s in state.recent_switches[switches_before:] if s.reason == "policy"
    )
    if name in KINDS:
        print(f"  {name}: {state.model}", flush=True)
    return result


def kind_policy(policy: PolicySpec, kind: str) -> dict[str, Any]:
    """The ops update that runs `kind`: `policy`'s keys if it is of that kind, else that kind's
    defaults over `policy`'s tiers."""
    if policy.kind != kind:
        return {"kind": kind, "candidate_steps": policy.candidate_steps}
    return policy.to_dict()


def round_record(stats: RoundStats) -> dict[str, Any]:
    """A round as a run keeps it (JSON-ready): the RoundSample the policy saw, and the tier the
    target ran it at (`steps` is 0 for a round without drafts)."""
    sample = round_sample(stats)
    return {"tier": stats.speculative_num_steps, **{k: getattr(sample, k) for k in ROUND_KEYS}}


def oracle_of(
    results: dict[str, RunResult], n_phases: int, statics: Iterable[str] = STATIC
) -> tuple[float, list[str]]:
    """(tokens/s, static run per phase) of the per-phase oracle: the best of the `statics` runs
    in each phase, stitched together."""
    seconds, tokens, best_runs = 0.0, 0, []
    for i in range(n_phases):
        best = max(results.keys() & set(statics), key=lambda n: results[n].tokens_per_s(i))
        best_runs.append(best)
        seconds += results[best].phase_seconds[i]
        tokens += results[best].phase_tokens[i]
    return tokens / seconds, best_runs


def replay(
    rounds: Iterable[dict[str, Any]], policy: PolicySpec, initial: int
) -> Iterator[SpeculationPolicy]:
    """The same pure policy fed a run's rounds (as `round_record` keeps them), started afresh at
    tier `initial` as a kind switch starts it; yields the policy after each round."""
    policy_now = policy.build(initial)
    for r in rounds:
        policy_now.observe(RoundSample(**{k: r.get(k, 0.0) for k in ROUND_KEYS}))
        yield policy_now


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
        ax.step(rounds, [r["tier"] for r in run.rounds], where="post", label="active tier",
                color="C1")  # fmt: skip
        for i, start in enumerate(run.phase_first_round):
            ax.axvline(start, color="grey", ls="--", lw=0.8)
            ax.text(start + 1, 7.3, f"phase {i + 1}", fontsize=8)
        ax.set_ylabel("tokens")
        ax.set_ylim(0, 8)
        ax.set_title(f"{kind} policy on a phased workload (low → high → low → high), "
                     f"{run.tokens_per_s():.1f} tokens/s")  # fmt: skip
        ax.legend(loc="lower right")
    axes[-1, 0].set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def load_policy(path: Path | None) -> PolicySpec:
    if path is None:
        return PolicySpec.of(PolicyConfig())
    return PolicySpec.from_mapping(json.loads(path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    args = parser.parse_args()
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
    ) as group:  # fmt: skip
        for name in runs:
            results[name] = run_workload(name, group, phases, args.new_tokens, args.concurrency,
                                         policy)  # fmt: skip
    oracle, oracle_tiers = oracle_of(results, len(phases))
    best_static = max(results.keys() & set(STATIC), key=lambda n: results[n].tokens_per_s())
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(results, policy, args.png)
    write_json(args.out, {
        "device": device_info(), "policy": policy.to_dict(), "phases": [p.name for p in phases],
        "new_tokens": args.new_tokens, "requests_per_phase": args.requests_per_phase,
        "draft_kind": args.draft_kind, "concurrency": args.concurrency,
        "runs": {n: r.__dict__ for n, r in results.items()},
        "oracle": {"tokens_per_s": oracle, "tiers": oracle_tiers}, "best_static": best_static,
    })  # fmt: skip
    headers = ["run", *[f"phase {i + 1}" for i in range(len(phases))], "overall", "switches"]
    rows = [
        [n, *[f"{r.tokens_per_s(i):.1f}" for i in range(len(phases))],
         f"{r.tokens_per_s():.1f}", str(r.switches) if n in KINDS else "-"]
        for n, r in results.items()
    ]  # fmt: skip
    rows.append(["oracle (best static per phase)", *[f"{results[t].tokens_per_s(i):.1f}"
                 for i, t in enumerate(oracle_tiers)], f"{oracle:.1f}", "-"])  # fmt: skip
    print(f"\nphases: {json.dumps([p.name for p in phases])}; oracle tiers {oracle_tiers}")
    for kind in (k for k in KINDS if k in results):
        a = results[kind].tokens_per_s()
        vs_static = a / results[best_static].tokens_per_s()
        print(f"{kind} / best static ({best_static}) = {vs_static:.3f}x; "
              f"{kind} / oracle = {a / oracle:.3f}x")  # fmt: skip
    print(f"timeline: {args.png}")
    print(f"tokens/s per phase ({args.requests_per_phase} requests × {args.new_tokens} tokens, "
          f"concurrency {args.concurrency})\n")  # fmt: skip
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
