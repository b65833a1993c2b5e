"""Adaptive vs static tiers on a phased workload, against the running services (CPU).

The same requests run four times through real draft, target and controller processes: once
under the controller's adaptive policy and once with each static tier (1, 3, 7) pinned through
the ops API. The workload alternates phases where the draft is rarely right (prose sampled at
temperature 1.0) and phases where it often is (held-out code, greedy):

    low → high → low → high

Per phase and overall it reports tokens/s of each run, the per-phase oracle (the best static tier
in each phase, stitched together), the number of tier switches, and draws a timeline PNG (EMA
accept length and active tier over rounds, phase boundaries marked).

    python -m bench.adaptive [--requests-per-phase 12] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.acceptance import code_prompts, prose_prompts
from bench.common import device_info, format_table, write_json
from bench.services import BenchServices, watch_rounds
from controller.policy import AdaptiveSpeculativeParams, PolicyConfig
from specpair.client import ControllerClient, SpecpairClient
from specpair.config import MODELS_DIR
from specpair.proto.v1 import target_pb2

RUNS = ("adaptive", "static-1", "static-3", "static-7")


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
    rounds: list[dict[str, Any]] = field(default_factory=list)  # tier, accept lengths per round
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
    name: str, group: BenchServices, phases: list[Phase], new_tokens: int, concurrency: int
) -> RunResult:
    client = SpecpairClient(group.target, timeout=120)
    ctl = ControllerClient(group.controller, timeout=30)
    if name == "adaptive":
        ctl.unpin()
    else:
        ctl.pin(int(name.split("-")[1]))
    time.sleep(0.3)
    rounds: list[target_pb2.RoundStats] = []
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
    result.rounds = [
        {"tier": r.speculative_num_steps, "accepts": list(r.accept_lengths)} for r in rounds
    ]
    state = ctl.state().targets[0]
    result.switches = sum(
        1 for s in state.recent_switches[switches_before:] if s.reason == "policy"
    )
    return result


def oracle_of(results: dict[str, RunResult], n_phases: int) -> tuple[float, list[str]]:
    """(tokens/s, static run per phase) of the per-phase oracle: the best static tier in each
    phase, stitched together."""
    seconds, tokens, best_runs = 0.0, 0, []
    for i in range(n_phases):
        best = max(RUNS[1:], key=lambda n: results[n].tokens_per_s(i))
        best_runs.append(best)
        seconds += results[best].phase_seconds[i]
        tokens += results[best].phase_tokens[i]
    return tokens / seconds, best_runs


def ema_timeline(result: RunResult, policy: PolicyConfig, initial: int) -> list[float]:
    """The controller's EMA over the run's rounds (the same pure policy, replayed)."""
    params = AdaptiveSpeculativeParams(policy, initial)
    out = []
    for r in result.rounds:
        params.update(r["accepts"])
        out.append(params.ema)
    return out


def plot(results: dict[str, RunResult], policy: PolicyConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adaptive = results["adaptive"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    rounds = range(len(adaptive.rounds))
    ax.plot(rounds, ema_timeline(adaptive, policy, 3), label="EMA accept length", color="C0")
    ax.step(rounds, [r["tier"] for r in adaptive.rounds], where="post", label="active tier",
            color="C1")  # fmt: skip
    for i, start in enumerate(adaptive.phase_first_round):
        ax.axvline(start, color="grey", ls="--", lw=0.8)
        ax.text(start + 1, 7.3, f"phase {i + 1}", fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel("tokens")
    ax.set_ylim(0, 8)
    ax.set_title("adaptive speculation on a phased workload (low → high → low → high)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--draft", type=Path, help="default: models/eagle or models/draft")
    # On a CPU the one-layer EAGLE head is the draft that pays: a standalone LM's step costs
    # over half a target forward here (see bench/RESULTS.md).
    parser.add_argument("--draft-kind", choices=["model", "eagle"], default="eagle")
    parser.add_argument("--requests-per-phase", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--policy", type=Path, help="policy JSON (default: SGLang's defaults)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/adaptive.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/adaptive-logs"))
    parser.add_argument("--png", type=Path, default=Path("bench/out/adaptive_timeline.png"))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    phases = build_phases(tokenizer, args.requests_per_phase)
    policy = PolicyConfig.from_json_file(args.policy) if args.policy else PolicyConfig()
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
        for name in RUNS:
            results[name] = run_workload(name, group, phases, args.new_tokens, args.concurrency)
    oracle, oracle_tiers = oracle_of(results, len(phases))
    best_static = max(RUNS[1:], key=lambda n: results[n].tokens_per_s())
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
         f"{r.tokens_per_s():.1f}", str(r.switches) if n == "adaptive" else "-"]
        for n, r in results.items()
    ]  # fmt: skip
    rows.append(["oracle (best static per phase)", *[f"{results[t].tokens_per_s(i):.1f}"
                 for i, t in enumerate(oracle_tiers)], f"{oracle:.1f}", "-"])  # fmt: skip
    a = results["adaptive"].tokens_per_s()
    vs_static = a / results[best_static].tokens_per_s()
    print(f"\nphases: {json.dumps([p.name for p in phases])}; oracle tiers {oracle_tiers}")
    print(f"adaptive / best static ({best_static}) = {vs_static:.3f}x; "
          f"adaptive / oracle = {a / oracle:.3f}x; timeline: {args.png}")  # fmt: skip
    print(f"tokens/s per phase ({args.requests_per_phase} requests × {args.new_tokens} tokens, "
          f"concurrency {args.concurrency})\n")  # fmt: skip
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
