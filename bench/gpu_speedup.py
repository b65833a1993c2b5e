"""The headline benchmark: how much faster specpair decodes than the target alone, with real
acceptance at a real model's cost.

The grown pair (`training.grow`): the shipped target as a Llama-3-8B, its EAGLE head at hidden
4096 and the shipped draft LM as a Llama-3.2-1B. Each computes exactly what the small trained
model computes, so drafts are accepted at the rate the trained pair achieves while every forward
pays the big model's memory traffic. Built from `models/` on the device (~1 minute, kept in
`--models-dir`).

Workloads: the acceptance benchmark's held-out code prompts and its prose prompts (repeated
with new seeds up to `--requests`), greedy and T = 0.7; batch = concurrent requests. Per draft
kind, tokens/s and the mean accept length of target-only, static tiers 1 / 3 / 7 and adaptive
(SGLang's policy in the controller), through the real services (`specpair serve` draft, target
and controller as processes; target-only is `specpair serve target --no-draft`) and in-process
beside them (the engine at a fixed tier per batch; adaptive needs the controller, so services
only). `speedup` = tokens/s over target-only of the same deployment, workload and batch.
`--phased` adds `bench/phased.py`'s phased workload on the services (adaptive vs each static
tier vs the per-phase oracle).

    python -m bench.gpu_speedup --draft-kind eagle [--models-dir /tmp/specpair-grown] [--phased]
    python -m bench.gpu_speedup --draft-kind model
    python -m bench.gpu_speedup --device cpu --shape shipped --batches 1 --requests 2 \\
        --new-tokens 8   # a CPU smoke run of the whole pipeline

On an H100 a greedy-only run of one draft kind (both deployments, 32 tokens) takes ~4.5 min;
the JSON is rewritten after every cell, and `--replot` redraws what a cut-short run left.
Sampled workloads use `--top-p` (0.95: the sampled-decoding goal's setting) besides T.
`--repeats N` runs each services cell's workload N times back to back and prints the spread of
their tokens/s: a 16-request cell at batch 8 moved ~15 % run to run on an H100.
`--requests` takes one count per batch: `--batches 1 8 --requests 16 64` runs 64 requests at batch
8, where 16 left only 6.5 requests a round on average (ragged finishes), against 7.3 with 64.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from bench.common import device_info, format_table, write_json
from bench.phased import KINDS, RUNS, STATIC, build_phases, load_policy, oracle_of, run_workload
from bench.profile_costs import TIERS as PROFILED_TIERS
from bench.profile_costs import profile
from bench.prompts import code_prompts, prose_prompts
from bench.services import (
    BenchServices,
    add_lab_arg,
    lab_fields,
    rounds_watched,
    wait_draft_connected,
)
from controller.policies.bands import PolicySpec
from controller.policies.sglang import PolicyConfig
from specpair.client import ControllerClient, SpecpairClient
from specpair.config import MODELS_DIR, compute_threads
from specpair.models.loading import read_args
from specpair.rpc.serving import compute_executor
from specpair.runtime.build import build_drafter, build_states, build_target, feature_layers
from specpair.runtime.engine import SpeculativeEngine, StageTimes
from specpair.runtime.round_messages import RoundStats
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from target_service.request_path.special_tokens import eos_ids
from training.grow import SHAPES, grow

TIERS = (1, 3, 7)
TEMPERATURES = (0.0, 0.7)
WARMUP_TOKENS = 8
# draft kind -> (shipped folder, grown shape)
# --draft-kind: (the shipped folder, the shape it grows to); EAGLE-3 is served as `eagle`
DRAFTS = {
    "eagle": ("eagle", "llama3-8b"),
    "eagle3": ("eagle3", "llama3-8b"),
    "model": ("draft", "llama3.2-1b"),
}
GOODPUT = {"kind": "goodput", "candidate_steps": [0, *TIERS]}


@dataclass(frozen=True)
class Workload:
    prompts: str  # "code" | "prose"
    temperature: float
    ids: list[list[int]]
    top_p: float = 1.0  # sampled workloads only

    @property
    def name(self) -> str:
        if self.temperature == 0:
            return f"{self.prompts} greedy"
        top_p = f" p={self.top_p}" if self.top_p < 1 else ""
        return f"{self.prompts} T={self.temperature}{top_p}"

    def sampling(self, i: int) -> SamplingParams:
        top_p = self.top_p if self.temperature else 1.0
        return SamplingParams(temperature=self.temperature, top_p=top_p, seed=i)


@dataclass
class Cell:
    deployment: str  # "services" | "in-process"
    config: str  # "target-only" | "tier 1" | … | "adaptive"
    workload: str
    batch: int
    tokens: int
    seconds: float
    accept_mean: float | None  # accepted drafts per speculative round (bonus excluded)
    rounds: int
    outputs: list[list[int]] = field(repr=False)
    device: str = ""
    speedup: float | None = None
    # over the in-process engine's target-only (the same for both deployments): the services
    # admit concurrent requests over several rounds, the engine prefills them together
    speedup_vs_engine: float | None = None
    same_as_target_only: bool | None = None  # greedy: every output equals target-only's
    # where a round's time goes, ms per batch round (wall: draft, verify, accept; GPU: the
    # draft and verify graphs; services: rpc, schedule, admit too) and the ms outside rounds
    # (in process: prefill, set-up; services: the target idle, `round_ms`)
    stage_ms: dict[str, float] | None = None
    runs: list[float] | None = None  # services: tokens/s of each of the cell's runs (--repeats)

    @property
    def spread(self) -> float | None:
        """(fastest − slowest run) / the pooled tokens/s; None with one run."""
        if not self.runs or len(self.runs) < 2:
            return None
        return (max(self.runs) - min(self.runs)) / self.tokens_per_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def grown_pair(root: Path, draft_kind: str, device: str) -> tuple[Path, Path]:
    """(target, draft) grown from `models/` into `root`, reusing complete ones."""
    folder, shape = DRAFTS[draft_kind]
    paths = {}
    for name, src, shape_name in (("target", "target", "llama3-8b"), (folder, folder, shape)):
        dst = root / name
        if not (dst / "config.json").is_file():
            t0 = time.perf_counter()
            print(f"growing models/{src} into {shape_name} at {dst}", flush=True)
            grow(MODELS_DIR / src, dst, SHAPES[shape_name], device=device,
                 progress=lambda m: print(f"  {m}", flush=True))  # fmt: skip
            print(f"  {time.perf_counter() - t0:.0f} s", flush=True)
        paths[name] = dst
    return paths["target"], paths[folder]


def bench_pair(shape: str, root: Path, draft_kind: str, device: str) -> tuple[Path, Path]:
    """(target, draft): the grown pair (`grown_pair`), or the shipped one as it is."""
    if shape == "grown":
        return grown_pair(root, draft_kind, device)
    return MODELS_DIR / "target", MODELS_DIR / DRAFTS[draft_kind][0]


def add_pair_args(parser: argparse.ArgumentParser) -> None:
    """--draft-kind, --shape, --models-dir and --device: the pair `bench_pair` picks, and where
    it runs."""
    parser.add_argument("--draft-kind", choices=sorted(DRAFTS), default="eagle")
    parser.add_argument("--shape", choices=["grown", "shipped"], default="grown",
                        help="the grown 8B-cost pair, or the shipped small pair as is")  # fmt: skip
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/specpair-grown"))
    parser.add_argument("--device", default="cuda")


def make_workloads(
    tokenizer: Any,
    requests: int,
    temperatures: Sequence[float] = TEMPERATURES,
    top_p: float = 1.0,
    prompt_tokens: tuple[int, int] = (96, 128),
    distinct: int = 8,
) -> list[Workload]:
    """`prompt_tokens`: the code windows' lengths, LO to HI tokens; `distinct`: code prompts
    at most, repeated to `requests`."""
    # 8: the GPU machine's stdlib (3.12) has 8 held-out files that give a window of 96-128
    # tokens (7 of 400-512); repeats sample with new seeds
    code = [p.ids for p in code_prompts(tokenizer, min(requests, distinct), *prompt_tokens)]
    prose = [p.ids for p in prose_prompts(tokenizer)]
    code, prose = ([ids[i % len(ids)] for i in range(requests)] for ids in (code, prose))
    return [
        Workload(name, t, ids, top_p) for name, ids in (("code", code), ("prose", prose))
        for t in temperatures
    ]  # fmt: skip


def request_counts(
    parser: argparse.ArgumentParser, batches: Sequence[int], requests: Sequence[int]
) -> dict[int, int]:
    """batch → requests of its cells, from `--batches` and `--requests` (one count for all, or
    one per batch); a mismatch is a usage error."""
    if len(requests) not in (1, len(batches)):
        parser.error("--requests: one count, or one per batch")
    per_batch = requests if len(requests) > 1 else list(requests) * len(batches)
    return dict(zip(batches, per_batch, strict=True))


def requests_at(wl: Workload, batch: int, counts: Mapping[int, int] | None) -> int:
    """How many of `wl`'s requests a cell at `batch` runs: `counts[batch]`, default all."""
    return (counts or {}).get(batch, len(wl.ids))


def accept_stats(per_request: Sequence[Sequence[int]]) -> tuple[float | None, int]:
    rounds = [a for accepts in per_request for a in accepts]
    return (sum(rounds) / len(rounds) if rounds else None), len(rounds)


def in_process(
    target: Path, draft: Path, workloads: list[Workload], batches: list[int], *,
    new_tokens: int, device: str, dtype: torch.dtype, max_len: int, eos: frozenset[int],
    record: Callable[[Cell], None], deterministic: bool = False,
    trees: Sequence[TreeShape] = (), counts: Mapping[int, int] | None = None,
    token_map: Path | None = None,
) -> None:  # fmt: skip
    """Target-only and each static tier in the engine: the requests in groups of `batch`, each
    group decoded to completion (static batching) and stopped at `eos`, as the target service
    stops them. Target-only replays tier 1's verify graph with no drafts (one token per
    request, padded to two). `trees`: tree shapes beside the chains ("tree 4x4x16")."""
    size = max(batches)
    worker = build_target(target, max_requests=size, max_len=max_len, keep_features=True,
                          feature_layers=feature_layers(draft, target), dtype=dtype,
                          device=device, deterministic=deterministic)  # fmt: skip
    drafter = build_drafter(draft, target_path=target, max_requests=size,
                            max_len=max_len, dtype=dtype, device=device,
                            token_map=token_map)  # fmt: skip
    states = build_states([*map(TreeShape, TIERS), *trees], worker, drafter)
    configs = [("target-only", TreeShape(1)), *((f"tier {t}", TreeShape(t)) for t in TIERS)]
    configs += [(f"tree {t}", t) for t in trees]
    for config, tier in configs:
        engine = SpeculativeEngine(worker, None if config == "target-only" else drafter)
        engine.generate(workloads[0].ids[:size], max_new_tokens=WARMUP_TOKENS,
                        state=states[tier])  # fmt: skip
        for wl in workloads:
            for batch in batches:
                outputs, accepts = [], []
                engine.times = StageTimes()
                worker.accept_paths.clear()
                t0 = time.perf_counter()
                n = requests_at(wl, batch, counts)
                for lo in range(0, n, batch):
                    group = range(lo, min(lo + batch, n))
                    results = engine.generate(
                        [wl.ids[i] for i in group], max_new_tokens=new_tokens, state=states[tier],
                        sampling=[wl.sampling(i) for i in group],
                        stop_token_ids=eos,
                    )  # fmt: skip
                    outputs += [r.token_ids for r in results]
                    accepts += [r.accept_lengths for r in results]
                seconds = time.perf_counter() - t0
                mean, rounds = accept_stats(accepts)  # target-only rounds have none
                tokens = sum(map(len, outputs))
                stages = stage_ms(engine.times, seconds)
                paths = worker.accept_paths  # a sampled cell: how many accepts ran in a graph
                if sampled := sum(paths.values()) - paths["greedy"]:
                    stages["accept_in_graph"] = paths["graph"] / sampled
                record(Cell("in-process", config, wl.name, batch, tokens, seconds, mean, rounds,
                            outputs, stage_ms=stages))  # fmt: skip


def stage_ms(times: StageTimes, seconds: float) -> dict[str, float]:
    """Mean ms per batch round of each stage, and the ms spent outside rounds in total."""
    n = max(times.rounds, 1)
    gpu = [sum(col) / n for col in zip(*times.gpu_ms, strict=True)] or [0.0, 0.0]
    return {
        "draft": 1e3 * times.draft / n,
        "verify": 1e3 * times.verify / n,
        "accept": 1e3 * times.accept / n,
        "draft_gpu": gpu[0],
        "verify_gpu": gpu[1],
        "outside_rounds": 1e3 * (seconds - times.draft - times.verify - times.accept),
        "rounds": times.rounds,
    }


def round_ms(rounds: Sequence[RoundStats], seconds: float) -> dict[str, float]:
    """`stage_ms` of a services cell from the target's round stats: mean ms per batch round of
    each stage (admit: prefill of the requests joining the round, within total) and the ms
    outside rounds (the target idle between a reply and the next arrival)."""
    n = max(len(rounds), 1)
    stages = {
        key: sum(getattr(r.timings, f"{key}_ms") for r in rounds) / n
        for key in ("draft", "draft_gpu", "verify", "verify_gpu", "rpc", "schedule", "admit")
    }
    busy = sum(r.timings.total_ms for r in rounds)
    return stages | {"outside_rounds": 1e3 * seconds - busy, "rounds": len(rounds)}


def serve_cells(
    client: SpecpairClient, config: str, workloads: list[Workload], batches: list[int],
    new_tokens: int, record: Callable[[Cell], None], repeats: int = 1,
    counts: Mapping[int, int] | None = None,
) -> None:  # fmt: skip
    """Every workload at every batch size: `batch` clients at a time over the requests (the
    first `counts[batch]` of them, default all), the whole workload `repeats` times back to
    back (a cell pools them; `runs` keeps each run's tokens/s); the target's round stats of
    each cell give its `stage_ms`."""
    client.generate(workloads[0].ids[0], max_tokens=WARMUP_TOKENS)
    for wl in workloads:
        for batch in batches:
            n = requests_at(wl, batch, counts)

            def one(i: int, wl: Workload = wl) -> Any:
                p = wl.sampling(i)
                return client.generate(
                    wl.ids[i], max_tokens=new_tokens, temperature=p.temperature, top_p=p.top_p,
                    seed=i,
                )  # fmt: skip

            stats: list[RoundStats] = []
            runs, results, seconds = [], [], 0.0
            for _ in range(repeats):
                with rounds_watched(client.address, stats, before_s=0.3):
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(batch) as pool:
                        run = list(pool.map(one, range(n)))
                    elapsed = time.perf_counter() - t0
                runs.append(sum(len(r.token_ids) for r in run) / elapsed)
                results += run
                seconds += elapsed
            mean, rounds = accept_stats([r.accept_lengths for r in results])
            outputs = [list(r.token_ids) for r in results[:n]]  # the first run's
            tokens = sum(len(r.token_ids) for r in results)
            record(Cell("services", config, wl.name, batch, tokens, seconds, mean, rounds,
                        outputs, stage_ms=round_ms(stats, seconds), runs=runs))  # fmt: skip


def services(
    target: Path, draft: Path, draft_kind: str, workloads: list[Workload], batches: list[int],
    *, new_tokens: int, device: str, dtype: str, max_len: int, log_dir: Path,
    phased: Callable[[BenchServices], dict[str, Any]] | None, record: Callable[[Cell], None],
    goodput: bool = False, deterministic: bool = False, trees: Sequence[TreeShape] = (),
    repeats: int = 1, counts: Mapping[int, int] | None = None, threads: int = 0,
    profiled: dict[str, Any] | None = None, token_map: Path | None = None,
    tiers: Sequence[int] = TIERS, adaptive: bool = True, target_flags: Sequence[str] = (),
    lab: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """Target-only (`--no-draft`), then static `tiers` (`trees` too, pinned by shape) and
    adaptive through the controller (SGLang's rule over the chains, unless not `adaptive`;
    then with `goodput` the goodput kind, over the trees too; given `profiled`, seeded with a
    start-up profile, written there). `target_flags` go to both target services, `lab`
    switches (field → value) to every service."""
    common: dict[str, Any] = dict(
        target=target, log_dir=log_dir, device=device, dtype=dtype, max_len=max_len,
        threads=threads, lab=lab,
        candidate_steps=(0, *TIERS),  # the goodput kind's tier 0 is the target alone
        # the target's default max_batch (16) would run a batch-64 cell 16 at a time
        target_options=("--max-batch", str(max(batches)),
                        *(("--deterministic",) if deterministic else ()), *target_flags),
    )  # fmt: skip

    def serve(client: SpecpairClient, config: str) -> None:
        serve_cells(client, config, workloads, batches, new_tokens, record, repeats, counts)

    with BenchServices(draft=None, initial_steps=1, **common) as group:
        serve(SpecpairClient(group.target, timeout=600), "target-only")
    policy = PolicyConfig(candidate_steps=TIERS)
    flags = tuple(arg for t in trees for arg in ("--tree-shapes", str(t)))
    common["target_options"] += flags
    mapped = ("--token-map", str(token_map)) if token_map else ()
    with BenchServices(
        draft=draft, draft_kind=draft_kind.removesuffix("3"), policy=policy.to_dict(),
        draft_options=flags + mapped, **common,
    ) as group:  # fmt: skip
        client = SpecpairClient(group.target, timeout=600)
        wait_draft_connected(client)
        ctl = ControllerClient(group.controller, timeout=30)
        for tier in tiers:
            ctl.pin(tier)
            time.sleep(0.3)
            serve(client, f"tier {tier}")
        ctl.unpin()
        if adaptive:
            time.sleep(0.3)
            serve(client, "adaptive")
        # the goodput kind over tiers 0 / 1 / 3 / 7 and the trees (SGLang's rule knows chains
        # only, so the trees are pinned under it)
        options = GOODPUT | {"tree_shapes": [str(t) for t in trees]}
        spec = PolicySpec.from_mapping(options)
        if trees:
            ctl.update_policy(**spec.policy_options())
        for tree in trees:
            ctl.pin(str(tree))
            time.sleep(0.3)
            serve(client, f"tree {tree}")
        if goodput:  # afresh from tier 3
            if profiled is not None:
                ctl.update_policy(**spec.policy_options())  # its tiers: 0 too, to pin
                profiled.update(start_up_profile(client, ctl, workloads, batches, trees))
                seeds = ("profile_ms", "sampled_profile_ms")
                spec = PolicySpec.from_mapping(options | {k: profiled[k] for k in seeds})
            ctl.pin(3)
            ctl.update_policy(**spec.policy_options())
            ctl.unpin()
            time.sleep(0.3)
            serve(client, "goodput")
        return phased(group) if phased is not None else None


def start_up_profile(
    client: SpecpairClient, ctl: ControllerClient, workloads: list[Workload],
    batches: list[int], trees: Sequence[TreeShape],
) -> dict[str, Any]:  # fmt: skip
    """`bench.profile_costs` at every tier and batch of the run, in the regimes its workloads
    sample in, on their prompts: what a deployment measures once before serving."""
    sampled = any(wl.sampling(0).temperature > 0 for wl in workloads)
    greedy = any(wl.sampling(0).temperature == 0 for wl in workloads)
    prompts = [ids for wl in workloads for ids in wl.ids[:8]]
    return profile(
        client, ctl, prompts, tiers=(*PROFILED_TIERS, *trees),
        batches=batches if greedy else (), sampled_batches=batches if sampled else (),
    )  # fmt: skip


def phased_workload(tokenizer: Any, per_phase: int, new_tokens: int) -> Callable[..., Any]:
    phases = build_phases(tokenizer, per_phase)

    def run(group: BenchServices) -> dict[str, Any]:
        policy = load_policy(None)
        results = {
            n: run_workload(n, group, phases, new_tokens, concurrency=1, policy=policy)
            for n in RUNS
        }
        oracle, oracle_tiers = oracle_of(results, len(phases))
        return {
            "phases": [p.name for p in phases], "requests_per_phase": per_phase,
            "tokens_per_s": {n: r.tokens_per_s() for n, r in results.items()},
            "phase_tokens_per_s": {
                n: [r.tokens_per_s(i) for i in range(len(phases))] for n, r in results.items()
            },
            "switches": {k: results[k].switches for k in KINDS},
            "oracle": {"tokens_per_s": oracle, "tiers": oracle_tiers},
        }  # fmt: skip

    return run


def fill_ratios(cells: list[Cell], gpu: str, compare_outputs: bool = True) -> None:
    """speedup over target-only and greedy agreement with it, per deployment/workload/batch
    (`compare_outputs` False: a JSON read back, whose outputs were not kept)."""
    base = {(c.deployment, c.workload, c.batch): c for c in cells if c.config == "target-only"}
    engine = {(c.workload, c.batch): c for c in cells
              if c.config == "target-only" and c.deployment == "in-process"}  # fmt: skip
    for c in cells:
        c.device = gpu
        if (key := (c.deployment, c.workload, c.batch)) in base:
            c.speedup = c.tokens_per_s / base[key].tokens_per_s
        if (c.workload, c.batch) in engine:
            c.speedup_vs_engine = c.tokens_per_s / engine[c.workload, c.batch].tokens_per_s
        if compare_outputs and "greedy" in c.workload and (c.workload, c.batch) in engine:
            c.same_as_target_only = c.outputs == engine[c.workload, c.batch].outputs


def plot(cells: list[Cell], path: Path, title: str) -> None:
    """Tokens/s by configuration, a panel per batch size: services plain, in process hatched
    (the deployments the run has), each bar labelled with its x over target-only and, with
    `--repeats`, spanning its runs' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c.workload for c in cells))
    batches = sorted({c.batch for c in cells})
    configs = list(dict.fromkeys(c.config for c in cells))
    present = {c.deployment for c in cells}
    deployments = [d for d in (("services", ""), ("in-process", "//")) if d[0] in present]
    fig, axes = plt.subplots(len(batches), 1, figsize=(13, 3.2 * len(batches)), squeeze=False)
    width = 0.8 / (len(deployments) * len(configs))
    for ax, batch in zip(axes[:, 0], batches, strict=True):
        for k, (deployment, hatch) in enumerate(deployments):
            for j, config in enumerate(configs):
                xs, ys, lo, hi, tags = [], [], [], [], []
                for i, wl in enumerate(workloads):
                    match = [c for c in cells if (c.deployment, c.config, c.workload, c.batch)
                             == (deployment, config, wl, batch)]  # fmt: skip
                    if match:
                        c = match[0]
                        runs = c.runs or [c.tokens_per_s]
                        xs.append(i + (k * len(configs) + j) * width)
                        ys.append(c.tokens_per_s)
                        lo.append(max(c.tokens_per_s - min(runs), 0.0))
                        hi.append(max(max(runs) - c.tokens_per_s, 0.0))
                        tags.append(f"{c.speedup:.2f}x" if c.speedup is not None else "")
                if not xs:
                    continue
                label = f"{config} ({deployment})" if batch == batches[0] else None
                bars = ax.bar(xs, ys, width, color=f"C{j}", hatch=hatch, edgecolor="white",
                              label=label, yerr=[lo, hi], capsize=2)  # fmt: skip
                ax.bar_label(bars, tags, fontsize=7, padding=2)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.margins(y=0.12)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def render(cells: list[Cell]) -> str:
    headers = ["workload", "batch", "config", "svc tok/s", "svc x", "svc x eng", "svc accept",
               "svc spread", "in-proc tok/s", "in-proc x", "in-proc accept",
               "greedy = t-o"]  # fmt: skip
    rows = []
    index = {(c.deployment, c.config, c.workload, c.batch): c for c in cells}
    keys = dict.fromkeys((c.workload, c.batch, c.config) for c in cells)
    for wl, batch, config in sorted(keys, key=lambda k: (k[1], list(keys).index(k))):
        row = [wl, str(batch), config]
        same = []
        for deployment in ("services", "in-process"):
            c = index.get((deployment, config, wl, batch))
            services = deployment == "services"
            if c is None:
                row += ["-"] * (5 if services else 3)
                continue
            accept = "-" if c.accept_mean is None else f"{c.accept_mean:.2f}"
            ratios = [c.speedup] + ([c.speedup_vs_engine] if services else [])
            row += [f"{c.tokens_per_s:.1f}", *("-" if r is None else f"{r:.2f}x" for r in ratios)]
            row.append(accept)
            if services:
                row.append("-" if c.spread is None else f"{100 * c.spread:.0f} %")
            if c.same_as_target_only is not None:
                same.append(c.same_as_target_only)
        row.append("-" if not same else ("yes" if all(same) else "NO"))
        rows.append(row)
    return format_table(headers, rows)


def render_stages(cells: list[Cell]) -> str:
    """Where a round's time goes, per cell (ms per batch round; in process the engine's
    stages, through the services the target's round stats, `round_ms`)."""
    keys = ["draft", "draft_gpu", "verify", "verify_gpu", "accept", "rpc", "schedule", "admit"]

    def ms(c: Cell, key: str, digits: int = 2) -> str:
        value = (c.stage_ms or {}).get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [
        [c.deployment, c.workload, str(c.batch), c.config, ms(c, "rounds", 0),
         *(ms(c, k) for k in keys), ms(c, "outside_rounds", 0), ms(c, "accept_in_graph")]
        for c in cells if c.stage_ms is not None
    ]  # fmt: skip
    headers = ["deployment", "workload", "batch", "config", "batch rounds",
               *(f"{k} ms" for k in keys), "outside ms", "sampled accepts in a graph"]  # fmt: skip
    return format_table(headers, rows) if rows else ""


def replot(path: Path) -> None:
    """The PNG beside `path` and the table, from a written JSON (outputs are not kept there)."""
    data = json.loads(path.read_text())
    names = {f.name for f in fields(Cell)}
    cells = [Cell(**{k: v for k, v in c.items() if k in names}, outputs=[]) for c in data["cells"]]
    gpu = data["device"].get("gpu", data["device"]["cpu"])
    fill_ratios(cells, gpu, compare_outputs=False)
    title = f"{data['draft_kind']} draft, {data['shape']} pair, {gpu}: tokens/s by configuration"
    plot(cells, path.with_suffix(".png"), title)
    if stages := render_stages(cells):
        print(f"{stages}\n")
    print(render(cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--requests", type=int, nargs="+", default=[16],
        help="requests per workload: one count, or one per batch (e.g. --batches 1 8 "
        "--requests 16 64: a longer cell where a batch's ragged finishes would weigh)",
    )  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    parser.add_argument("--top-p", type=float, default=0.95, help="of the sampled workloads")
    parser.add_argument(
        "--prompts", nargs="+", choices=["code", "prose"], default=["code", "prose"]
    )
    parser.add_argument("--deployments", nargs="+", choices=["services", "in-process"],
                        default=["services", "in-process"])  # fmt: skip
    parser.add_argument("--phased", action="store_true", help="also the phased workload")
    parser.add_argument("--goodput", action="store_true", help="also the goodput policy kind")
    parser.add_argument(
        "--deterministic", action="store_true", help="the target's batch-invariant mode"
    )
    parser.add_argument(
        "--tree-shapes", nargs="+", default=[], metavar="SHAPE",
        help="tree shapes (STEPSxTOPKxNODES) measured beside the chains, and offered to goodput",
    )  # fmt: skip
    parser.add_argument("--per-phase", type=int, default=8, help="requests per phase")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="services: each cell's workload this many times back to back (its spread shown)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=0,
        help="services: each model service's --threads (0: its default, half the cores)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="seed the goodput kind with a start-up profile (bench.profile_costs) of the run's "
        "tiers and batches, as a deployment would",
    )  # fmt: skip
    parser.add_argument(
        "--token-map", type=Path, metavar="FILE",
        help="an EAGLE-1/2 head drafts over these ids (`serve draft --token-map`)",
    )  # fmt: skip
    parser.add_argument("--tiers", type=int, nargs="+", default=list(TIERS),
                        choices=TIERS, help="services: the chain tiers measured")  # fmt: skip
    parser.add_argument("--no-adaptive", action="store_true",
                        help="services: no cell of SGLang's rule (adaptive)")  # fmt: skip
    parser.add_argument(
        "--target-flags",
        default="",
        metavar="FLAGS",
        help="more flags for the target service, e.g. '--join-group 1'",
    )
    add_lab_arg(parser, "no_prompt_handoff=1")
    parser.add_argument("--out", type=Path, help="JSON (default: bench/results/…_<kind>.json)")
    parser.add_argument(
        "--replot", type=Path, metavar="JSON", help="only redraw an earlier run's PNG and table"
    )
    args = parser.parse_args()
    if args.replot:
        replot(args.replot)
        return
    trees = [TreeShape.parse(t) for t in args.tree_shapes]  # a bad one fails before any run
    counts = request_counts(parser, args.batches, args.requests)
    per_batch = list(counts.values())
    if short := [b for b, n in counts.items() if n < b]:
        parser.error(f"--requests: fewer requests than batch {short[0]}")
    requests = max(counts.values())
    from transformers import AutoTokenizer

    out = args.out or Path(f"bench/results/gpu_speedup_{args.draft_kind}.json")
    log_dir = out.parent / f"{out.stem}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    info = device_info()
    gpu = info.get("gpu", info["cpu"])
    print(f"device: {info}", flush=True)
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    workloads = [
        wl
        for wl in make_workloads(tokenizer, requests, args.temperatures, args.top_p)
        if wl.prompts in args.prompts
    ]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    room = 16 + max((t.verified for t in trees), default=0)  # a round's verify past the end
    max_len = max(256, max(len(p) for wl in workloads for p in wl.ids) + args.new_tokens + room)
    cells: list[Cell] = []
    shape = {"target": str(read_args(target)), "draft": str(read_args(draft, allow_eagle=True))}
    phased = None
    profiled: dict[str, Any] = {}  # the goodput kind's start-up profile (--profile)

    def save() -> None:
        """The JSON so far: a run cut short still leaves every finished cell."""
        fill_ratios(cells, gpu)
        write_json(out, {
            "device": info, "draft_kind": args.draft_kind, "shape": args.shape, "models": shape,
            "new_tokens": args.new_tokens, "requests": per_batch,
            "batches": args.batches,
            "date": time.strftime("%Y-%m-%d"),
            "cells": [{k: v for k, v in asdict(c).items() if k != "outputs"}
                      | {"tokens_per_s": c.tokens_per_s} for c in cells],
            "phased": phased,
            "profile": profiled or None,
            "token_map": args.token_map and str(args.token_map),
        })  # fmt: skip

    def record(cell: Cell) -> None:
        cells.append(cell)
        print(f"  {cell.deployment:10s} {cell.config:11s} {cell.workload:13s} batch "
              f"{cell.batch:2d} {cell.tokens_per_s:8.1f} tok/s", flush=True)  # fmt: skip
        if cell.config != "target-only" or cell.deployment == "in-process":
            save()  # (ratios need this deployment's target-only cells)

    if "in-process" in args.deployments:
        print("in-process", flush=True)
        with compute_executor("bench-compute", compute_threads(0)) as pool:
            pool.submit(
                in_process, target, draft, workloads, args.batches, new_tokens=args.new_tokens,
                device=args.device, dtype=getattr(torch, dtype), max_len=max_len,
                eos=eos_ids(target, tokenizer), record=record, deterministic=args.deterministic,
                trees=trees, counts=counts, token_map=args.token_map,
            ).result()  # fmt: skip
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the services get the GPU
    if "services" in args.deployments:
        print("services", flush=True)
        run_phased = (
            phased_workload(tokenizer, args.per_phase, args.new_tokens) if args.phased else None
        )
        phased = services(
            target, draft, args.draft_kind, workloads, args.batches, new_tokens=args.new_tokens,
            device=args.device, dtype=dtype, max_len=max_len, log_dir=log_dir, phased=run_phased,
            record=record, goodput=args.goodput, deterministic=args.deterministic, trees=trees,
            repeats=args.repeats, counts=counts, threads=args.threads,
            profiled=profiled if args.profile else None, token_map=args.token_map,
            tiers=args.tiers, adaptive=not args.no_adaptive,
            target_flags=shlex.split(args.target_flags),
            lab=lab_fields(args.lab),
        )  # fmt: skip
    save()
    title = f"{args.draft_kind} draft, {args.shape} pair, {gpu}: tokens/s by configuration"
    plot(cells, out.with_suffix(".png"), title)
    if phased is not None:
        tps = phased["tokens_per_s"]
        best = max(STATIC, key=lambda n: tps[n])
        print(f"\nphased workload ({', '.join(phased['phases'])}): tokens/s "
              + ", ".join(f"{n} {v:.1f}" for n, v in tps.items())
              + f", oracle {phased['oracle']['tokens_per_s']:.1f}; " + "; ".join(
                  f"{k} / best static ({best}) = {tps[k] / tps[best]:.3f}x, {k} / oracle = "
                  f"{tps[k] / phased['oracle']['tokens_per_s']:.3f}x" for k in KINDS))  # fmt: skip
    n = "/".join(map(str, per_batch))
    print(f"\n{args.draft_kind} draft on {gpu}, {args.shape} pair; {n} requests × "
          f"{args.new_tokens} new tokens per cell; x = speedup over target-only (same "
          f"deployment); x eng = over the in-process engine's target-only; accept = accepted "
          f"drafts per round; JSON {out}\n")  # fmt: skip
    if stages := render_stages(cells):
        print(f"ms per batch round by stage\n{stages}\n")
    print(render(cells))


if __name__ == "__main__":
    main()
