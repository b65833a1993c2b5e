"""Tier 0 and per-request tiers against the running services (CPU).

Each configuration runs in fresh service processes (a policy class is chosen at start-up), on
the same requests, closed loop: `clients` threads each send their next request when the last
one finished. Two workloads:

- `load`: many concurrent clients (64) of held-out code, greedy. The target alone
  (`--no-draft`) vs the full stack under the goodput kind with tier 0 among its candidates
  (the goal: no worse than the target alone), the stack held at tier 0 without a controller
  (what the extra processes cost by themselves) and static tier 3 beside them.
- `mixed`: code greedy beside prose sampled at T = 1.0, alternating, so that every batch holds
  both: one batch tier (goodput) vs per-request tiers (`controller.policies.request_tiers`),
  static 3.

It reports tokens/s per configuration, the share of request-rounds at each tier (from
RoundStats: drafted requests at their own tier, the rest at 0) and writes JSON.

    python -m bench.cpu tiers [--workloads load,mixed] [--load-requests 192] [--new-tokens 32]
        [--configs "target alone,goodput (profiled)"] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import profile_costs
from bench.common import device_info, format_table, median, write_json
from bench.prompts import code_prompts, prose_prompts
from bench.services import BenchServices, wait_draft_connected, watch_rounds
from controller.policies.bands import PolicySpec
from specpair.client import ControllerClient, SpecpairClient
from specpair.config import MODELS_DIR
from specpair.runtime.round_messages import RoundStats

STEPS = (0, 1, 3, 7)
CODE_PROMPTS = 24  # held-out stdlib windows this Python's stdlib gives (bench.prompts)
GOODPUT = {"kind": "goodput", "candidate_steps": list(STEPS)}
PROFILED = "goodput (profiled)"
MAX_BATCH = 16  # the target decodes this many at once; the other clients' requests queue
PER_REQUEST = {
    "kind": "controller.policies.request_tiers:RequestTiers",
    "candidate_steps": list(STEPS),
}
# name → (draft?, controller policy or None: the initial tier stays, initial tier)
CONFIGS: dict[str, dict[str, tuple[bool, dict[str, Any] | None, int]]] = {
    "load": {
        "target alone": (False, None, 3),  # no draft: its rounds are plain whatever the tier
        # the stack held at tier 0, no controller: what two more processes cost by themselves
        "static 0": (True, None, 0),
        "static 3": (True, None, 3),
        "goodput": (True, GOODPUT, 3),
        # each probe of tier 1 costs a catch-up extend of everything since the last one
        "goodput probe-512": (True, {**GOODPUT, "probe_interval": 512}, 3),
        # costs profiled at start-up (bench.profile_costs at every batch range the load
        # passes, `seed_profile`), as a deployment would pass them in its policy file
        PROFILED: (True, GOODPUT, 3),
    },
    "mixed": {
        "static 3": (True, None, 3),
        "goodput (batch tier)": (True, GOODPUT, 3),
        "per-request tiers": (True, PER_REQUEST, 3),
    },
}


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    temperature: float
    seed: int


@dataclass
class RunResult:
    name: str
    seconds: float = 0.0
    tokens: int = 0
    tiers: dict[int, int] = field(default_factory=dict)  # tier → request-rounds there
    rounds: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def tier_share(self) -> str:
        total = sum(self.tiers.values()) or 1
        return " ".join(f"{s}:{100 * n / total:.0f}%" for s, n in sorted(self.tiers.items()))


def jobs_of(workload: str, tokenizer: Any, requests: int) -> list[Job]:
    # Held-out code windows repeat across requests (as bench.phased's 24): there is no
    # prefix cache, so a repeat costs what a new prompt would.
    code = [p.ids for p in code_prompts(tokenizer, min(requests, CODE_PROMPTS), 96, 128)]
    code = [code[i % len(code)] for i in range(requests)]
    if workload == "load":
        return [Job(ids, 0.0, i) for i, ids in enumerate(code)]
    prose = [p.ids for p in prose_prompts(tokenizer)]
    return [
        Job(code[i], 0.0, i) if i % 2 == 0 else Job(prose[i % len(prose)], 1.0, i)
        for i in range(requests)
    ]


def seed_profile(
    client: SpecpairClient,
    ctl: ControllerClient,
    policy: dict[str, Any],
    jobs: list[Job],
    args: argparse.Namespace,
) -> None:
    """Profiles each tier's round time at the clients' batch size and the powers of two below
    it (greedy) and hands it to the running goodput kind (a live update keeps the kind; the
    profile seeds its cost model)."""
    prompts = [job.prompt for job in jobs[:8]]
    # The batch the clients make, and the smaller ones the load ramps up and drains through:
    # a batch range without a profile is one the policy explores, and on two cores each move
    # off tier 0 costs the draft a catch-up extend of every running request.
    top = min(args.clients, len(jobs), MAX_BATCH)
    batches = sorted({min(1 << k, top) for k in range(top.bit_length())})
    result = profile_costs.profile(client, ctl, prompts, batches=batches, sampled_batches=())
    print(profile_costs.render(result), flush=True)
    seeded = {**policy, "profile_ms": result["profile_ms"]}
    ctl.update_policy(**PolicySpec.from_mapping(seeded).policy_options())
    time.sleep(0.3)


def run_config(
    name: str,
    draft: bool,
    policy: dict[str, Any] | None,
    initial: int,
    jobs: list[Job],
    args: argparse.Namespace,
) -> RunResult:
    log_dir = args.log_dir / name.replace(" ", "_").replace("(", "").replace(")", "")
    log_dir.mkdir(parents=True, exist_ok=True)
    with BenchServices(
        target=args.target,
        draft=args.draft if draft else None,
        draft_kind=args.draft_kind,
        policy=policy,
        log_dir=log_dir,
        initial_steps=initial,
        candidate_steps=STEPS if draft else None,
        target_options=("--max-batch", str(MAX_BATCH)),
    ) as group:
        client = SpecpairClient(group.target, timeout=600)
        if draft:
            wait_draft_connected(client)
        for job in jobs[:4]:  # warm-up: first calls, allocator
            client.generate(job.prompt, max_tokens=8, temperature=job.temperature, seed=job.seed)
        if name == PROFILED and policy is not None:
            seed_profile(client, ControllerClient(group.controller, timeout=30), policy, jobs, args)
        rounds: list[RoundStats] = []
        call = watch_rounds(group.target, rounds)
        time.sleep(0.3)

        def one(job: Job) -> int:
            r = client.generate(
                job.prompt, max_tokens=args.new_tokens, temperature=job.temperature, seed=job.seed
            )
            return len(r.token_ids)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(min(args.clients, len(jobs))) as pool:
            tokens = sum(pool.map(one, jobs))
        seconds = time.perf_counter() - t0
        time.sleep(0.3)
        call.cancel()
    tiers: Counter[int] = Counter()
    for r in rounds:
        tiers.update(r.request_steps)
        tiers[0] += r.batch_size - len(r.request_steps)
    result = RunResult(name, seconds, tokens, dict(tiers), len(rounds))
    print(f"  {name:22s} {result.tokens_per_s:7.1f} tok/s  {result.tier_share()}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu tiers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "target")
    parser.add_argument("--draft", type=Path, default=MODELS_DIR / "eagle")
    parser.add_argument("--draft-kind", choices=["model", "eagle"], default="eagle")
    parser.add_argument("--workloads", default="load,mixed")
    parser.add_argument("--configs", default="", help="only configs named so (comma-separated)")
    parser.add_argument("--load-requests", type=int, default=192)
    parser.add_argument("--mixed-requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (load)")
    parser.add_argument("--mixed-clients", type=int, default=8, help="concurrent clients (mixed)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the configs this many times in turn; report medians",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/tiers.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("bench/out/tiers-logs"))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(CONFIGS):
        parser.error(f"--workloads: some of {','.join(CONFIGS)}")
    print(f"device: {device_info()}", flush=True)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    # workload → config → its runs: the configs take turns, so a drift of this machine (a
    # shared VM's drifts by more than the differences measured) weighs on each alike
    results: dict[str, dict[str, list[RunResult]]] = {}
    for workload in workloads:
        requests = args.load_requests if workload == "load" else args.mixed_requests
        jobs = jobs_of(workload, tokenizer, requests)
        clients = args.clients if workload == "load" else args.mixed_clients
        run_args = argparse.Namespace(**{**vars(args), "clients": clients})
        print(f"{workload}: {len(jobs)} requests × {args.new_tokens} tokens, {clients} clients")
        only = {c for c in args.configs.split(",") if c}
        chosen = {n: c for n, c in CONFIGS[workload].items() if not only or n in only}
        runs: dict[str, list[RunResult]] = {name: [] for name in chosen}
        for _ in range(args.repeat):
            for name, (draft, policy, initial) in chosen.items():
                runs[name].append(run_config(name, draft, policy, initial, jobs, run_args))
        results[workload] = runs
    write_json(
        args.out,
        {
            "device": device_info(),
            "new_tokens": args.new_tokens,
            "draft_kind": args.draft_kind,
            "clients": {"load": args.clients, "mixed": args.mixed_clients},
            "requests": {"load": args.load_requests, "mixed": args.mixed_requests},
            "policies": {"goodput": GOODPUT, "per-request": PER_REQUEST},
            "repeat": args.repeat,
            "results": {
                w: {
                    n: {
                        "median_tokens_per_s": median_rate(rs),
                        "runs": [{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in rs],
                    }
                    for n, rs in by_name.items()
                }
                for w, by_name in results.items()
            },
        },
    )
    rows = []
    for workload, by_name in results.items():
        base = median_rate(next(iter(by_name.values())))
        for name, rs in by_name.items():
            rates = sorted(r.tokens_per_s for r in rs)
            rows.append(
                [
                    f"{workload}: {name}",
                    f"{median_rate(rs):.1f}",
                    f"{median_rate(rs) / base:.3f}",
                    f"{rates[0]:.0f}–{rates[-1]:.0f}",
                    rs[-1].tier_share(),
                ]
            )
    print(
        f"\ntokens/s, closed loop, median of {args.repeat} run(s); ratio vs each workload's "
        f"first row; written {args.out}\n"
    )
    print(format_table(["workload: config", "tokens/s", "ratio", "range", "tiers (last)"], rows))


def median_rate(runs: list[RunResult]) -> float:
    return median([r.tokens_per_s for r in runs])
