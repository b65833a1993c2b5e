"""CPU tokens/s of target-only vs speculative decoding (tiers 1, 3, 7), with a per-stage split.

    python -m bench.cpu engine [--batch 4] [--target models/target --draft models/draft]

Without checkpoints it generates a target big enough that its forward dominates on CPU and a
small unrelated draft. Every speculative output is checked against target-only's, token for token.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers.utils import logging as hf_logging

from bench.common import Stats, add_output_args, cpu_run, format_table, write_json
from specpair.models.loading import is_eagle_checkpoint, read_args
from specpair.models.tiny import make_tiny_llama
from specpair.runtime.build import build_drafter, build_states, build_target
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.engine import SpeculativeEngine, StageTimes
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetWorker

VOCAB = 8192
FOOTNOTE = """\
tok/s: generated tokens / wall time of generate() (target and draft prefill included), median of
  {repeats} runs after one warm-up, interleaved across configurations; speed-up: tok/s divided by
  target-only tok/s from the same run. min-max: the spread of the timed runs (a wide one means
  other processes were competing for the cores).
accept: mean accepted draft tokens per round, bonus excluded (at most s). ms: median time per
  round spent drafting / verifying / in accept bookkeeping, then each as % of the round.
lossless: every run (warm-up included) produced exactly target-only's tokens.
(a) identical draft: it costs as much per token as the target, so it cannot beat target-only on
  compute; it accepts all s drafts every round, the most the accept bookkeeping ever handles,
  so its accept ms is the upper bound on that overhead.
(b) smaller draft: the real trade-off, draft cost plus a wider verify per round against the
  tokens accepted (an unrelated random draft accepts ~0, so it can only lose)."""


@dataclass(frozen=True, slots=True)
class Config:
    label: str  # "target-only", "(a) identical", "(b) unrelated"
    drafter: Drafter | None
    state: SpecRuntimeState | None


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    outputs: list[list[int]]
    accept_lengths: list[int]
    times: StageTimes


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    tier: int | None
    tokens_per_s: Stats
    speedup: float
    mean_accept: float | None
    rounds: int
    draft_ms: Stats  # per round
    verify_ms: Stats
    accept_ms: Stats
    lossless: bool


def make_models(directory: Path, seed: int) -> tuple[Path, Path]:
    """A target whose forward dominates on CPU and a small draft with unrelated weights."""
    hf_logging.disable_progress_bar()
    target = make_tiny_llama(
        directory / "target",
        seed=seed,
        vocab_size=VOCAB,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1408,
        tokenizer=False,
    )
    draft = make_tiny_llama(
        directory / "draft",
        seed=seed + 1,
        vocab_size=VOCAB,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=352,
        tokenizer=False,
    )
    return target, draft


def make_prompts(batch: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, lengths cycling 16, 24, 32, 40 so the batch is ragged; id 0 is avoided."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(16 + 8 * (i % 4))] for i in range(batch)]


def run_once(
    target: TargetWorker, config: Config, prompts: list[list[int]], new_tokens: int
) -> Run:
    engine = SpeculativeEngine(target, config.drafter)
    start = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=new_tokens, state=config.state)
    seconds = time.perf_counter() - start
    return Run(
        seconds,
        [r.token_ids for r in results],
        [a for r in results for a in r.accept_lengths],
        engine.times,
    )


def measure(
    target: TargetWorker,
    configs: Sequence[Config],
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
) -> list[Row]:
    """One warm-up per config, then `repeats` passes over all configs.

    Interleaving the passes spreads load from other processes over every configuration alike,
    so the speed-ups stay comparable on a shared machine. `configs[0]` is the target-only
    reference that every output is compared with.
    """
    warmups = [run_once(target, c, prompts, new_tokens) for c in configs]
    runs: list[list[Run]] = [[] for _ in configs]
    for i in range(repeats):
        print(f"  pass {i + 1}/{repeats}")
        for config, done in zip(configs, runs, strict=True):
            done.append(run_once(target, config, prompts, new_tokens))
    reference = warmups[0].outputs
    tokens = sum(len(o) for o in reference)
    baseline = Stats.of([tokens / r.seconds for r in runs[0]]).median
    return [
        summarize(config, [warmup, *done], tokens, baseline, reference)
        for config, warmup, done in zip(configs, warmups, runs, strict=True)
    ]


def summarize(
    config: Config, runs: list[Run], tokens: int, baseline: float, reference: list[list[int]]
) -> Row:
    """`runs[0]` is the warm-up: checked for losslessness, left out of the timings."""
    timed = runs[1:]

    def per_round_ms(stage: str) -> Stats:
        return Stats.of([getattr(r.times, stage) / r.times.rounds * 1e3 for r in timed])

    tokens_per_s = Stats.of([tokens / r.seconds for r in timed])
    accepts = timed[0].accept_lengths
    return Row(
        label=config.label,
        tier=None if config.state is None else config.state.tier,
        tokens_per_s=tokens_per_s,
        speedup=tokens_per_s.median / baseline,
        mean_accept=sum(accepts) / len(accepts) if accepts else None,
        rounds=timed[0].times.rounds,
        draft_ms=per_round_ms("draft"),
        verify_ms=per_round_ms("verify"),
        accept_ms=per_round_ms("accept"),
        lossless=all(r.outputs == reference for r in runs),
    )


def render(rows: Sequence[Row]) -> str:
    headers = ["config", "s", "tok/s", "min-max", "speed-up", "accept", "rounds"]
    headers += ["draft ms", "verify ms", "accept ms", "draft %", "verify %", "accept %"]
    headers += ["lossless"]
    table = []
    for r in rows:
        stages = [r.draft_ms.median, r.verify_ms.median, r.accept_ms.median]
        total = sum(stages)
        table.append(
            [
                r.label,
                "-" if r.tier is None else str(r.tier),
                f"{r.tokens_per_s.median:.1f}",
                f"{r.tokens_per_s.min:.0f}-{r.tokens_per_s.max:.0f}",
                f"{r.speedup:.2f}x",
                "-" if r.mean_accept is None else f"{r.mean_accept:.2f}",
                str(r.rounds),
                *(f"{ms:.2f}" for ms in stages),
                *(f"{100 * ms / total:.1f}" for ms in stages),
                "yes" if r.lossless else "NO",
            ]
        )
    return format_table(headers, table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu engine",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--target", type=Path, help="target checkpoint (default: generated)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (default: generated)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tiers", type=int, nargs="+", default=[1, 3, 7])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser, "bench/out/engine_cpu.json")
    args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    if args.batch < 1 or args.new_tokens < 1 or args.repeats < 1:
        parser.error("--batch, --new-tokens and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = cpu_run(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        if args.target is None:
            target_path, draft_path = make_models(Path(tmp), args.seed)
            draft_label = "(b) unrelated"
        else:
            target_path, draft_path = args.target, args.draft
            draft_label = f"(b) {draft_path.name}"
        models = {
            "target": asdict(read_args(target_path)),
            "draft": asdict(read_args(draft_path, allow_eagle=True)),
        }
        print(f"target: {target_path}  draft: {draft_path}")
        prompts = make_prompts(args.batch, models["target"]["vocab_size"], args.seed)
        sizes = dict(
            max_requests=args.batch,
            max_len=max(map(len, prompts)) + args.new_tokens + max(args.tiers) + 1,
        )
        target = build_target(target_path, keep_features=is_eagle_checkpoint(draft_path), **sizes)
        identical = build_drafter(target_path, target_path=None, **sizes)
        draft = build_drafter(draft_path, target_path=target_path, **sizes)

        configs = [Config("target-only", None, None)]
        for label, drafter in (("(a) identical", identical), (draft_label, draft)):
            states = build_states(args.tiers, target, drafter)
            configs += [Config(label, drafter, state) for state in states.values()]
        print(f"{len(configs)} configurations, batch {args.batch}, {args.new_tokens} new tokens")
        rows = measure(target, configs, prompts, args.new_tokens, args.repeats)

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_json(
        args.out,
        {
            "device": device,
            "settings": settings,
            "models": models,
            "prompts": prompts,
            "rows": rows,
        },
    )
    print(f"wrote {args.out}\n")
    print(render(rows))
    print(FOOTNOTE.format(repeats=args.repeats))
