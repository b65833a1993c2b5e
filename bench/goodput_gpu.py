"""The goodput policy's GPU goals, each a ratio measured in one run on one set of services.

The grown 8B-cost pair (`bench/gpu_speedup.py`; `--shape shipped` for the small pair as is).
The full stack (draft, target with tiers 0 / 1 / 3 / 7, controller under the goodput kind) is
started once and reconfigured live through the ops API: a static tier is a pin, a policy kind
an `update_policy` (a kind switch starts it afresh at tier 3). The target alone (`specpair serve
target --no-draft`) is started once more for the no-speculation baseline.

(a) `phased`: `bench/phased.py`'s workload (prose sampled at T = 1.0, then held-out code
    greedy, twice) at batch 1 under goodput, sglang and static tiers 0 / 1 / 3 / 7. Goals:
    goodput ≥ 1.05× the best static tier and ≥ 0.97× the per-phase oracle (the best static
    tier of each phase, stitched together); sglang beside it.
(b) `sweep`: held-out code, greedy, closed loop at each concurrency of `--batches` (default
    1 … 64; each client sends its next request when the last finished), `max(--min-requests,
    --per-client · batch)` requests per cell, under goodput (tiers 0 / 1 / 3 / 7), static tiers
    0 / 1 / 3 / 7, sglang (1 / 3 / 7) and the target alone. Goal: at every batch size goodput ≥
    0.97× the best of the target alone and every static tier. Greedy outputs are compared with
    the target alone's (`same`: equal on the CPU in float32; bf16 batches may differ at ties).
    All configs run at one batch size before the next (the order reversed at every other), so
    a drift of the machine weighs on each alike; a policy kind starts afresh in each cell from
    the start-up profile (as a controller meeting that load for the first time). Besides each
    cell's tokens/s, its steady tokens/s: over the rounds with at least ¾ of the batch (all of
    it below 8), without the ramp and the drain of a closed loop. `--repeat N` serves every
    config N times at each batch size (each turn in the order opposite to the last) and pools
    a config's cells as tokens over seconds: two cells of one static tier, minutes apart,
    differ by more than the goal's margin (bench/RESULTS.md, "goodput_gpu").
(c) Timelines (`<out>_phased.png`, `<out>_sweep.png`): per policy kind over rounds, the active
    tier, the policy's estimate (its pure policy replayed on the run's RoundStats, as
    `bench.cpu.adaptive` does: sglang's EMA accept length; goodput's predicted accepted drafts, and
    its predicted tokens/s of the tier each round ran at) and the measured tokens/s (tokens the
    round's requests gained over its wall time, `--smooth` rounds at a time).

Before the phased runs the costs are profiled (`bench/profile_costs.py`: each tier pinned,
greedy at every `--batches` size, sampled at batch 1) and the profile seeds goodput's cost
models (`profile_ms`, `sampled_profile_ms`; `--no-profile`: every cost learnt online).

The JSON (`--out`) is rewritten after every cell, so a run cut short keeps what finished;
`--replot JSON` redraws the PNGs and prints the tables of a written run.

    python -m bench.goodput_gpu --draft-kind eagle [--models-dir /tmp/specpair-grown]
    python -m bench.goodput_gpu --device cpu --shape shipped --per-phase 2 --phase-tokens 12 \\
        --batches 1 2 4 --min-requests 4 --new-tokens 12   # CPU smoke (~2 min)

On an H100 the default run takes about 8 minutes (~2.5 growing the pair and starting two
service sets, the rest measuring; sampled phases are the slow part).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import profile_costs
from bench.common import device_info, format_table, read_json, write_json
from bench.gpu_speedup import Cell, Workload, add_pair_args, bench_pair, make_workloads
from bench.gpu_speedup import serve_cells as serve_batch
from bench.phased import Phase, RunResult, build_phases, oracle_of, replay, round_record
from bench.phased import run_workload as run_phased
from bench.services import BenchServices, wait_draft_connected, watch_rounds
from controller.policies.bands import PolicySpec
from controller.policies.sglang import PolicyConfig
from specpair.client import ControllerClient, SpecpairClient
from specpair.models.loading import read_args
from specpair.runtime.round_messages import RoundStats

STEPS = (0, 1, 3, 7)
STATIC = tuple(f"static-{s}" for s in STEPS)
PHASED_RUNS = ("sglang", "goodput", *STATIC)  # a kind's run starts from the other kind
TARGET_ALONE = "target alone"
KIND_CONFIGS = ("goodput", "sglang")
SWEEP_CONFIGS = ("goodput", *(f"tier {s}" for s in STEPS), "sglang", TARGET_ALONE)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
GOALS = {"phased_vs_best_static": 1.05, "phased_vs_oracle": 0.97, "sweep_vs_best": 0.97}
START_TIER = 3  # a kind starts at this tier (pinned while it is switched in)


def policies(path: Path | None) -> dict[str, PolicySpec]:
    """The two kinds: goodput with tiers 0 / 1 / 3 / 7 (and `path`'s keys over them), sglang's
    defaults with 1 / 3 / 7 (its rule has no tier 0)."""
    goodput = {"kind": "goodput", "candidate_steps": list(STEPS)}
    if path is not None:
        goodput |= json.loads(path.read_text())
    return {
        "goodput": PolicySpec.from_mapping(goodput),
        "sglang": PolicySpec.of(PolicyConfig(candidate_steps=(1, 3, 7))),
    }


def start_kind(ctl: ControllerClient, specs: dict[str, PolicySpec], kind: str) -> None:
    """`kind` afresh at START_TIER: a live update of the running kind would keep what it learnt,
    so the other kind goes in between."""
    ctl.pin(START_TIER)
    if ctl.state().policy.get("kind") == kind:
        other = next(k for k in specs if k != kind)
        ctl.update_policy(**specs[other].policy_options())
    ctl.update_policy(**specs[kind].policy_options())
    ctl.unpin()
    time.sleep(0.3)


# ---------------------------------------------------------------- measuring


class Bench:
    """One run: the report (JSON-ready, rewritten after every cell) and the greedy outputs."""

    def __init__(
        self, args: argparse.Namespace, specs: dict[str, PolicySpec], phases: list[Phase],
        code: Workload, report: dict[str, Any],
    ) -> None:  # fmt: skip
        self.args, self.specs, self.phases, self.code = args, specs, phases, code
        self.report = report
        self.outputs: dict[tuple[str, int], list[list[int]]] = {}  # (config, batch) → outputs

    def save(self) -> None:
        """The JSON so far: a run cut short still leaves every finished cell."""
        for cell in self.report["sweep"]["cells"]:
            alone = self.outputs.get((TARGET_ALONE, cell["batch"]))
            if alone is not None and cell["config"] != TARGET_ALONE:
                cell["same_as_target_alone"] = self.outputs[cell["config"], cell["batch"]] == alone
        self.report["summary"] = summarize(self.report)
        write_json(self.args.out, self.report)

    def full_stack(self, target: Path, draft: Path, common: dict[str, Any]) -> None:
        """Draft, target and controller, started once: the phased runs, then the sweep's."""
        args = self.args
        with BenchServices(
            draft=draft, draft_kind=args.draft_kind, policy=self.specs["goodput"].to_dict(),
            initial_steps=START_TIER, log_dir=args.log_dir / "stack", **common,
        ) as group:  # fmt: skip
            client = SpecpairClient(group.target, timeout=600)
            wait_draft_connected(client)
            ctl = ControllerClient(group.controller, timeout=30)
            for temperature in (0.0, 1.0):  # first calls, allocator, both sampling paths
                client.generate(self.code.ids[0], max_tokens=8, temperature=temperature, seed=0)
            if args.profile:
                self.profile(client, ctl)
            if "phased" in args.parts:
                print("phased workload, batch 1", flush=True)
                self.phased(group)
            if "sweep" in args.parts:
                print("batch sweep (services)", flush=True)
                self.warm_sweep(client)
                self.sweep(client, ctl, [c for c in args.sweep_configs if c != TARGET_ALONE])

    def warm_sweep(self, client: SpecpairClient) -> None:
        """Each sweep prompt's prefill once, then a wave at the largest batch: what a process
        pays the first time (a prompt length's prefill, memory for the widest batch) falls
        here, not in the first config's cells (one cold prefill can cost a batch-1 cell a
        tenth of its time)."""
        for ids in self.code.ids:
            client.generate(ids, max_tokens=2)
        n = max(self.args.batches)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda i: client.generate(self.code.ids[i % len(self.code.ids)],
                                                    max_tokens=2), range(n)))  # fmt: skip

    def profile(self, client: SpecpairClient, ctl: ControllerClient) -> None:
        """The start-up cost profile (`bench.profile_costs`) seeds goodput's cost models:
        greedy at every batch size of the sweep, sampled at batch 1 (the phased runs')."""
        print("cost profile", flush=True)
        result = profile_costs.profile(
            client, ctl, self.code.ids[:4], batches=self.args.batches, sampled_batches=(1,)
        )
        self.report["profile"] = result
        seeded = {**self.specs["goodput"].to_dict(),
                  **{k: result[k] for k in ("profile_ms", "sampled_profile_ms")}}  # fmt: skip
        self.specs["goodput"] = PolicySpec.from_mapping(seeded)
        self.report["policies"]["goodput"] = seeded
        print(profile_costs.render(result), flush=True)

    def target_alone(self, common: dict[str, Any]) -> None:
        """`specpair serve target --no-draft` at tier 0 (plain decode rounds)."""
        print("batch sweep (the target alone)", flush=True)
        with BenchServices(
            draft=None, log_dir=self.args.log_dir / "alone", initial_steps=0,
            **{**common, "candidate_steps": (0,)},
        ) as group:  # fmt: skip
            client = SpecpairClient(group.target, timeout=600)
            self.warm_sweep(client)
            self.sweep(client, None, [TARGET_ALONE])

    def phased(self, group: BenchServices) -> None:
        args = self.args
        runs: dict[str, Any] = {}
        self.report["phased"] = {"phases": [p.name for p in self.phases], "runs": runs,
                                 "requests_per_phase": args.per_phase,
                                 "new_tokens": args.phase_tokens}  # fmt: skip
        for name in PHASED_RUNS:
            spec = self.specs.get(name, self.specs["goodput"])  # a static run pins; unused
            result = run_phased(name, group, self.phases, args.phase_tokens, 1, spec)
            runs[name] = result.__dict__
            self.save()

    def sweep(
        self, client: SpecpairClient, ctl: ControllerClient | None, configs: list[str]
    ) -> None:
        """Every config at each batch size in turn, the order reversed at every other batch
        size: cells compared with each other run minutes apart at most, and a slow drift of the
        machine (a static tier's rounds move by more than the goal's margin between sessions)
        weighs on every config alike. A kind starts afresh in each cell (from
        the start-up profile). Every config's RoundStats are kept: a static tier's say what it
        cost and accepted, which a policy's choices can be checked (or replayed) against."""
        sweep, args = self.report["sweep"], self.args
        rounds: list[RoundStats] = []
        call = watch_rounds(client.address, rounds)
        for i, batch in enumerate(args.batches):
            # `--repeat` turns at one batch size, each in the order opposite to the last
            turns = [configs if (i + t) % 2 == 0 else configs[::-1] for t in range(args.repeat)]
            for config in (c for turn in turns for c in turn):
                self.select(ctl, config)
                start = len(rounds)
                cell = self.serve_cell(client, config, batch)
                time.sleep(0.2)  # the last rounds' stats
                kept = sweep["rounds"].setdefault(config, [])
                sweep["first_round"].setdefault(config, []).append(len(kept))
                kept += [round_record(r) for r in rounds[start:]]
                sweep["cells"].append(cell)
                self.save()
        call.cancel()

    def select(self, ctl: ControllerClient | None, config: str) -> None:
        """A kind afresh, or a static tier pinned (nothing to do for the target alone)."""
        if ctl is not None and config in KIND_CONFIGS:
            start_kind(ctl, self.specs, config)
        elif ctl is not None:
            if ctl.state().policy.get("kind") != "goodput":  # sglang's tiers have no 0 to pin
                ctl.update_policy(**self.specs["goodput"].policy_options())
            ctl.pin(int(config.split()[1]))
            time.sleep(0.3)

    def serve_cell(self, client: SpecpairClient, config: str, batch: int) -> dict[str, Any]:
        args = self.args
        n = max(args.min_requests, args.per_client * batch)
        ids = [self.code.ids[i % len(self.code.ids)] for i in range(n)]
        cells: list[Cell] = []
        serve_batch(client, config, [Workload("code", 0.0, ids)], [batch], args.new_tokens,
                    cells.append)  # fmt: skip
        (cell,) = cells
        self.outputs[config, batch] = cell.outputs
        accept = "" if cell.accept_mean is None else f"  accept {cell.accept_mean:.2f}"
        print(f"  {config:12s} batch {batch:2d} {cell.tokens_per_s:8.1f} tok/s{accept}",
              flush=True)  # fmt: skip
        return {
            "config": config, "batch": batch, "requests": n, "tokens": cell.tokens,
            "seconds": cell.seconds, "tokens_per_s": cell.tokens_per_s,
            "accept_mean": cell.accept_mean, "rounds": cell.rounds, "same_as_target_alone": None,
        }  # fmt: skip


# ---------------------------------------------------------------- ratios


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The goals' ratios from what the report holds so far (a cut-short run: what finished)."""
    out: dict[str, Any] = {"goals": GOALS}
    phased = report.get("phased") or {}
    runs = {n: RunResult(**r) for n, r in phased.get("runs", {}).items()}
    statics = [n for n in STATIC if n in runs]
    if statics:
        tps = {n: r.tokens_per_s() for n, r in runs.items()}
        best = max(statics, key=tps.__getitem__)
        oracle, tiers = oracle_of(runs, len(phased["phases"]), statics)
        p: dict[str, Any] = {"tokens_per_s": tps, "best_static": best, "oracle": oracle,
                             "oracle_runs": tiers, "switches": {}}  # fmt: skip
        for kind in (k for k in KIND_CONFIGS if k in runs):
            p[f"{kind}_vs_best_static"] = tps[kind] / tps[best]
            p[f"{kind}_vs_oracle"] = tps[kind] / oracle
            p["switches"][kind] = runs[kind].switches
        if "goodput" in runs:
            p["goals_met"] = {
                "vs_best_static": p["goodput_vs_best_static"] >= GOALS["phased_vs_best_static"],
                "vs_oracle": p["goodput_vs_oracle"] >= GOALS["phased_vs_oracle"],
            }
        out["phased"] = p
    sweep = report.get("sweep") or {}
    cells = sweep.get("cells", [])
    rows = []
    for batch in dict.fromkeys(c["batch"] for c in cells):
        tps = pooled_tokens_per_s([c for c in cells if c["batch"] == batch])
        base = [c for c in tps if c == TARGET_ALONE or c.startswith("tier ")]
        row: dict[str, Any] = {"batch": batch, "tokens_per_s": tps}
        if base:
            best = max(base, key=tps.__getitem__)
            row |= {"best": best, "best_tokens_per_s": tps[best]}
            for kind in (k for k in KIND_CONFIGS if k in tps):
                row[f"{kind}_vs_best"] = tps[kind] / tps[best]
            if "goodput" in tps:
                row["goal_met"] = row["goodput_vs_best"] >= GOALS["sweep_vs_best"]
        if TARGET_ALONE in tps and "tier 0" in tps:
            row["tier0_vs_target_alone"] = tps["tier 0"] / tps[TARGET_ALONE]
        if "goodput" in tps and "goodput" in sweep.get("first_round", {}):
            row["goodput_tiers"] = tier_share(sweep, "goodput", batch)
        steady = {c: v for c in tps if c in sweep.get("first_round", {})
                  and (v := steady_tokens_per_s(sweep, c, batch)) is not None}  # fmt: skip
        row["steady_tokens_per_s"] = steady
        base = [c for c in steady if c == TARGET_ALONE or c.startswith("tier ")]
        if base and "goodput" in steady:
            row["goodput_vs_best_steady"] = steady["goodput"] / max(steady[c] for c in base)
        rows.append(row)
    if rows:
        met = [r["goal_met"] for r in rows if "goal_met" in r]
        out["sweep"] = {"batches": rows, "all_goals_met": bool(met) and all(met)}
    return out


def pooled_tokens_per_s(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Per config, its cells' tokens over their seconds: `--repeat` turns pooled, e.g. 1024
    tokens in 3.4 s and 1024 in 3.6 s → 292.6 tokens/s."""
    tokens: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    for c in cells:
        tokens[c["config"]] += c["tokens"]
        seconds[c["config"]] += c["seconds"]
    return {config: tokens[config] / seconds[config] for config in tokens}


def cell_rounds(sweep: dict[str, Any], config: str, batch: int) -> list[dict[str, Any]]:
    """The rounds `config` ran while serving `batch` clients (in every turn)."""
    rounds, first = sweep["rounds"][config], sweep["first_round"][config]
    batches = [c["batch"] for c in sweep["cells"] if c["config"] == config]
    ends = [*first[1:], len(rounds)]
    return [r for i, b in enumerate(batches) if b == batch for r in rounds[first[i] : ends[i]]]


def tier_share(sweep: dict[str, Any], config: str, batch: int) -> dict[int, float]:
    """Share of the rounds at each tier while `config` served `batch` clients."""
    counts = Counter(r["tier"] for r in cell_rounds(sweep, config, batch))
    total = sum(counts.values()) or 1
    return {t: n / total for t, n in sorted(counts.items())}


def round_tokens(r: dict[str, Any]) -> int:
    """Tokens a recorded round's requests gained: one each, plus the drafts accepted."""
    return int(r["batch_size"] + sum(r["accept_lengths"]))


def steady_tokens_per_s(sweep: dict[str, Any], config: str, batch: int) -> float | None:
    """Tokens per second of round time over the rounds that ran at least ¾ of `batch` (all of
    it below 8): the closed loop's ramp and drain, a large and noisy share of a short cell,
    left out. E.g. batch 16: rounds of 12–16 requests."""
    least = batch if batch < 8 else (3 * batch + 3) // 4
    full = [r for r in cell_rounds(sweep, config, batch) if r["batch_size"] >= least]
    ms = sum(r["total_ms"] for r in full)
    tokens = sum(map(round_tokens, full))
    return 1e3 * tokens / ms if ms > 0 else None


# ---------------------------------------------------------------- timelines


def measured_tokens_per_s(rounds: list[dict[str, Any]], window: int) -> list[float]:
    """Tokens the rounds' requests gained (`round_tokens`) per second of round wall time, over
    the last `window` rounds."""
    tokens = [round_tokens(r) for r in rounds]
    ms = [r["total_ms"] for r in rounds]
    out = []
    for i in range(len(rounds)):
        lo = max(0, i + 1 - window)
        spent = sum(ms[lo : i + 1])
        out.append(1e3 * sum(tokens[lo : i + 1]) / spent if spent > 0 else float("nan"))
    return out


def draw_panel(
    ax: Any, rounds: list[dict[str, Any]], spec: PolicySpec, marks: list[tuple[int, str]],
    title: str, window: int, log_rate: bool,
) -> None:  # fmt: skip
    xs = range(len(rounds))
    ema, predicted = [], []
    # The policy restarted at each mark (a phase: no; a sweep cell: a kind starts afresh).
    cuts = [m for m, _ in marks] if log_rate else []
    for a, b in zip([0, *cuts[1:]], [*cuts[1:], len(rounds)], strict=True):
        for r, policy in zip(rounds[a:b], replay(rounds[a:b], spec, START_TIER), strict=True):
            ema.append(policy.ema)
            rates = {e.steps: e.tokens_per_s for e in policy.estimates()}
            predicted.append(rates.get(r["tier"], float("nan")))
    label = "EMA accept length" if spec.kind == "sglang" else "predicted accepted drafts"
    ax.step(xs, [r["tier"] for r in rounds], where="post", color="C1", label="active tier")
    ax.plot(xs, ema, color="C0", lw=1, label=label)
    ax.set_ylim(-0.3, 8)
    ax.set_ylabel("tier / tokens")
    rate = ax.twinx()
    rate.plot(xs, measured_tokens_per_s(rounds, window), color="C2", lw=1,
              label=f"measured tokens/s ({window} rounds)")  # fmt: skip
    if spec.kind == "goodput":
        rate.plot(xs, predicted, color="C3", lw=1, ls=":",
                  label="predicted tokens/s of the active tier")  # fmt: skip
    if log_rate:
        rate.set_yscale("log")
    rate.set_ylabel("tokens/s")
    for start, text in marks:
        ax.axvline(start, color="grey", ls="--", lw=0.8)
        ax.text(start + 1, 7.4, text, fontsize=8)
    ax.set_title(title, fontsize=10)
    lines = ax.get_legend_handles_labels()
    more = rate.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=7)


def plot_timelines(report: dict[str, Any], out: Path, window: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = {k: PolicySpec.from_mapping(v) for k, v in report["policies"].items()}
    panels: dict[str, list[tuple[str, list[dict[str, Any]], list[tuple[int, str]], str]]] = {}
    phased = report.get("phased") or {}
    for kind in (k for k in KIND_CONFIGS if k in phased.get("runs", {})):
        run = RunResult(**phased["runs"][kind])
        marks = [(s, f"phase {i + 1}") for i, s in enumerate(run.phase_first_round)]
        title = (f"{kind}, phased workload at batch 1 (low → high → low → high), "
                 f"{run.tokens_per_s():.1f} tokens/s")  # fmt: skip
        panels.setdefault("phased", []).append((kind, run.rounds, marks, title))
    sweep = report.get("sweep") or {}
    for kind in (k for k in KIND_CONFIGS if k in sweep.get("rounds", {})):
        batches = [c["batch"] for c in sweep["cells"] if c["config"] == kind]
        marks = [(s, f"b={b}") for s, b in zip(sweep["first_round"][kind], batches, strict=True)]
        title = f"{kind}, held-out code greedy, closed loop at each batch size"
        panels.setdefault("sweep", []).append((kind, sweep["rounds"][kind], marks, title))
    paths = []
    for workload, rows in panels.items():
        fig, axes = plt.subplots(len(rows), 1, figsize=(12, 3.8 * len(rows)), squeeze=False)
        for ax, (kind, rounds, marks, title) in zip(axes[:, 0], rows, strict=True):
            draw_panel(ax, rounds, specs[kind], marks, title, window, workload == "sweep")
        axes[-1, 0].set_xlabel("round")
        fig.tight_layout()
        stem = out.name.removesuffix(".gz").removesuffix(".json")
        path = out.with_name(f"{stem}_{workload}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- tables


def render(report: dict[str, Any]) -> str:
    summary = summarize(report)
    parts = []
    if "phased" in summary:
        parts.append(render_phased(report["phased"], summary["phased"]))
    if "sweep" in summary:
        parts.append(render_sweep(report["sweep"]["cells"], summary["sweep"]))
    return "\n\n".join(parts)


def ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.3f}x" if key in row else "-"


def render_phased(phased: dict[str, Any], p: dict[str, Any]) -> str:
    runs = {n: RunResult(**r) for n, r in phased["runs"].items()}
    n = len(phased["phases"])
    rows = [
        [name, *(f"{r.tokens_per_s(i):.1f}" for i in range(n)), f"{r.tokens_per_s():.1f}",
         ratio(p, f"{name}_vs_best_static"), ratio(p, f"{name}_vs_oracle")]
        for name, r in runs.items()
    ]  # fmt: skip
    oracle = [f"{runs[t].tokens_per_s(i):.1f}" for i, t in enumerate(p["oracle_runs"])]
    rows.append(["oracle", *oracle, f"{p['oracle']:.1f}", "-", "-"])
    headers = ["phased (batch 1)", *(f"phase {i + 1}" for i in range(n)), "overall",
               f"/ best static ({p['best_static']})", "/ oracle"]  # fmt: skip
    goals = (f"goals: goodput >= {GOALS['phased_vs_best_static']}x the best static tier, >= "
             f"{GOALS['phased_vs_oracle']}x the oracle")  # fmt: skip
    title = f"phases: {', '.join(phased['phases'])}; tokens/s; {goals}"
    return f"{title}\n{format_table(headers, rows)}"


def render_sweep(cells: list[dict[str, Any]], s: dict[str, Any]) -> str:
    configs = [c for c in SWEEP_CONFIGS if any(c in r["tokens_per_s"] for r in s["batches"])]
    rows = []
    for r in s["batches"]:
        same = [c["same_as_target_alone"] for c in cells if c["batch"] == r["batch"]]
        same = [v for v in same if v is not None]
        tiers = " ".join(f"{t}:{100 * v:.0f}%" for t, v in r.get("goodput_tiers", {}).items())
        tps = r["tokens_per_s"]
        rows.append(
            [str(r["batch"]), *(f"{tps[c]:.1f}" if c in tps else "-" for c in configs),
             r.get("best", "-"), ratio(r, "goodput_vs_best"),
             ratio(r, "goodput_vs_best_steady"), ratio(r, "sglang_vs_best"),
             ratio(r, "tier0_vs_target_alone"), tiers or "-",
             "-" if not same else ("yes" if all(same) else "NO")]
        )  # fmt: skip
    headers = ["batch", *configs, "best baseline", "goodput / best", "steady", "sglang / best",
               "tier 0 / alone", "goodput tiers", "greedy = alone"]  # fmt: skip
    title = (f"batch sweep: tokens/s, closed loop, held-out code greedy; goal: goodput >= "
             f"{GOALS['sweep_vs_best']}x the best of the target alone and every static tier at "
             f"every batch size (all met: {s['all_goals_met']})")  # fmt: skip
    return f"{title}\n{format_table(headers, rows)}"


def replot(path: Path, window: int) -> None:
    report = read_json(path)
    for png in plot_timelines(report, path, window):
        print(f"timeline: {png}")
    print(render(report))


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--parts", nargs="+", choices=["phased", "sweep"],
                        default=["phased", "sweep"])  # fmt: skip
    parser.add_argument("--per-phase", type=int, default=4,
                        help="requests per phase (the GPU machine's stdlib gives 8 code windows: "
                             "at most 4)")  # fmt: skip
    parser.add_argument("--phase-tokens", type=int, default=48, help="new tokens per request")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--per-client", type=int, default=2, help="sweep requests per client")
    parser.add_argument("--min-requests", type=int, default=8, help="sweep requests per cell")
    parser.add_argument("--repeat", type=int, default=1,
                        help="sweep turns per batch size (cells pooled per config)")  # fmt: skip
    # Short requests make a cell mostly admission and drain, which every tier pays alike; 128
    # tokens measure decoding, which is what a tier changes.
    parser.add_argument("--new-tokens", type=int, default=128, help="sweep tokens per request")
    parser.add_argument("--sweep-configs", nargs="+", choices=SWEEP_CONFIGS,
                        default=list(SWEEP_CONFIGS))  # fmt: skip
    parser.add_argument("--policy", type=Path, help="goodput keys over its defaults (JSON)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="no start-up cost profile: every cost learnt online")  # fmt: skip
    parser.add_argument("--smooth", type=int, default=10, help="rounds per measured tokens/s")
    parser.add_argument("--out", type=Path, default=Path("bench/results/goodput_gpu.json"))
    parser.add_argument(
        "--replot", type=Path, metavar="JSON", help="only redraw an earlier run's PNGs and tables"
    )
    args = parser.parse_args()
    if args.replot:
        replot(args.replot, args.smooth)
        return
    for name in ("per_phase", "phase_tokens", "per_client", "min_requests", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batches) < 1:
        parser.error("--batches must be >= 1")
    from transformers import AutoTokenizer

    args.log_dir = args.out.parent / f"{args.out.stem}_logs"
    for group in ("stack", "alone"):
        (args.log_dir / group).mkdir(parents=True, exist_ok=True)
    info = device_info()
    print(f"device: {info}", flush=True)
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    specs = policies(args.policy)
    phases = build_phases(tokenizer, args.per_phase) if "phased" in args.parts else []
    code = make_workloads(tokenizer, 8, [0.0])[0]  # the 8 held-out code windows
    prompts = [p for ph in phases for p in ph.prompts] + code.ids
    new = max(args.phase_tokens, args.new_tokens, profile_costs.longest() if args.profile else 0)
    common: dict[str, Any] = dict(
        target=target, device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
        max_len=max(256, max(map(len, prompts)) + new + 16), candidate_steps=STEPS,
        target_options=("--max-batch", str(max(args.batches))),
    )  # fmt: skip
    report: dict[str, Any] = {
        "device": info, "shape": args.shape, "draft_kind": args.draft_kind,
        "models": {"target": str(read_args(target)),
                   "draft": str(read_args(draft, allow_eagle=True))},
        "date": time.strftime("%Y-%m-%d"), "policies": {k: v.to_dict() for k, v in specs.items()},
        "phased": None, "sweep": {"batches": args.batches, "new_tokens": args.new_tokens,
                                  "per_client": args.per_client,
                                  "min_requests": args.min_requests, "repeat": args.repeat,
                                  "cells": [], "rounds": {}, "first_round": {}},
    }  # fmt: skip
    bench = Bench(args, specs, phases, code, report)
    t0 = time.perf_counter()
    bench.full_stack(target, draft, common)
    if "sweep" in args.parts and TARGET_ALONE in args.sweep_configs:
        bench.target_alone(common)
    bench.save()
    print(f"\n{time.perf_counter() - t0:.0f} s measuring; JSON {args.out}", flush=True)
    for png in plot_timelines(report, args.out, args.smooth):
        print(f"timeline: {png}")
    print(f"\n{args.draft_kind} draft, {args.shape} pair, {info.get('gpu', info['cpu'])}\n")
    print(render(report))


if __name__ == "__main__":
    main()
