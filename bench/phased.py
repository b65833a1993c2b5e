"""The phased workload: the same requests through the running services under a policy or a
pinned tier, phases where the draft is rarely right (prose sampled at temperature 1.0) beside
phases where it often is (held-out code, greedy), and the per-phase oracle over pinned runs.

    low → high → low → high

`python -m bench.cpu adaptive` runs it on the CPU; `bench.gpu_speedup --phased` and
`bench.goodput_gpu` on a GPU, and `bench.goodput_sim` replays what it recorded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.prompts import code_prompts, prose_prompts
from bench.services import BenchServices, watch_rounds
from controller.policies.bands import PolicySpec
from controller.policies.interface import RoundSample, SpeculationPolicy
from controller.policies.sglang import PolicyConfig
from controller.service.controlled_target import round_sample
from specpair.client import ControllerClient, SpecpairClient
from specpair.runtime.round_messages import RoundStats

KINDS = ("sglang", "goodput")  # runs under a policy; the others pin a tier
RUNS = (*KINDS, "static-1", "static-3", "static-7")
STATIC = RUNS[len(KINDS) :]
ROUND_KEYS = (
    "steps",
    "batch_size",
    "accept_lengths",
    "total_ms",
    "verify_ms",
    "draft_ms",
    "schedule_ms",
    "admit_ms",
    "sampled",
)


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
        print(
            f"  {name:9s} {phase.name:24s} {tokens / result.phase_seconds[-1]:7.1f} tok/s",
            flush=True,
        )
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


def load_policy(path: Path | None) -> PolicySpec:
    if path is None:
        return PolicySpec.of(PolicyConfig())
    return PolicySpec.from_mapping(json.loads(path.read_text()))
