"""Mean accept length per tier and draft kind, greedy and sampled, on held-out code and on prose.

    python -m bench.cpu acceptance [--models models] [--code-prompts 16] [--new-tokens 64]
                                   [--tiers 1 3 7 4x4x16 6x8x32] [--temperatures 0 0.7 1]
                                   [--token-map-sizes 2048 4096]

Runs the in-process engine on CPU with the shipped pair (`models/target` with `models/draft`, a
standalone LM, `models/eagle`, an EAGLE head on the target's last hidden state, and `models/eagle3`,
an EAGLE-3 head on three of its layers; `--drafts` picks). One `generate`
call per cell batches every prompt of a set; sampling seeds are fixed per prompt, so each cell
is reproducible and every tier and draft kind sees the same requests. The prompts are
`bench/prompts.py`'s.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from bench.common import cpu_run, format_table, shape_arg, write_json
from bench.prompts import PROSE_PROMPTS, Prompt, code_prompts, prose_prompts, read_py, stdlib_files
from specpair.config import FeatureDType
from specpair.models.draft_vocab import coverage, frequency_map, token_counts
from specpair.proto.v1 import common_pb2
from specpair.rpc.wire_tensor import feature_rows_from_proto, fp8_rows_into
from specpair.runtime.build import StateBuilder, build_drafter, build_target, feature_layers
from specpair.runtime.draft.drafter import Drafter
from specpair.runtime.engine import SpeculativeEngine
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.sampling import SamplingParams
from specpair.runtime.shape import TreeShape
from specpair.runtime.state import SpecRuntimeState
from specpair.runtime.target.worker import TargetWorker
from specpair.runtime.tree import CandidateTree
from training.corpus import is_heldout

EOT_ID = 0  # <|endoftext|>: bos, eos and pad of the shared tokenizer
TEMPERATURES = (0.0, 0.7, 1.0)
DRAFT_KINDS = ("draft", "eagle", "eagle3")  # folder names under --models

FOOTNOTE = """\
accept s=k: mean accepted draft tokens per round (bonus token excluded, at most k), over every
  request-round of the cell; a tree shape STEPSxTOPKxNODES (EAGLE-2: topk candidates a node,
  the topk best expanded each step, the best NODES kept) accepts at most STEPS.
  rounds: request-rounds per tier (one round of a batch of n requests counts n). tokens:
  generated tokens per tier (fewer than prompts x new tokens where a request stopped at
  <|endoftext|>).
greedy = target: every greedy cell's output equals target-only greedy decoding, token for token.
T > 0: speculative sampling (drafts accepted by rejection sampling against the target's
  distribution at that temperature); one fixed seed per prompt, the same in every cell."""


@dataclass(frozen=True, slots=True)
class Cell:
    prompts: str  # "code" | "prose"
    draft: str  # one of DRAFT_KINDS
    temperature: float
    tier: str  # the shape: "7" (a chain), "4x4x16" (a tree)
    mean_accept: float
    rounds: int  # request-rounds: one batch round of n running requests counts n
    tokens: int
    seconds: float
    matches_target: bool | None  # greedy output == target-only greedy output; None when sampled
    accept_by_prompt: tuple[float | None, ...]  # per request, prompt order; None: no rounds


def token_maps(
    tokenizer: PreTrainedTokenizerBase, sizes: Sequence[int], out: Path
) -> dict[int, Path]:
    """A frequency-ranked token map per size (`draft_vocab.frequency_map`) under `out`, its ids
    counted over the stdlib files training read (never a held-out one)."""
    if not sizes:
        return {}
    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    texts = (read_py(path) for name, path in files.items() if not is_heldout(name))
    encoded = (tokenizer.encode(t, add_special_tokens=False) for t in texts if t is not None)
    counts = token_counts(encoded, len(tokenizer))
    out.mkdir(parents=True, exist_ok=True)
    maps = {}
    for n in sizes:
        maps[n] = out / f"token_map_{n}.pt"
        ids = frequency_map(counts, n)
        torch.save(ids, maps[n])
        print(f"token map {n}: {coverage(counts, ids):.2%} of the counted tokens")
    return maps


def sampling_for(prompts: Sequence[Prompt], temperature: float, seed: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=seed + i) for i in range(len(prompts))]


def generate(
    target: TargetWorker,
    drafter: Drafter | None,
    state: SpecRuntimeState | None,
    prompts: Sequence[Prompt],
    sampling: list[SamplingParams],
    new_tokens: int,
    draft_window: int = 0,
) -> tuple[list[list[int]], list[list[int]]]:
    """(output tokens per request, accept lengths of each request's rounds)."""
    engine = SpeculativeEngine(target, drafter)
    results = engine.generate(
        [p.ids for p in prompts],
        max_new_tokens=new_tokens,
        state=state,
        sampling=sampling,
        stop_token_ids=frozenset({EOT_ID}),
        draft_window=draft_window,
    )
    return [r.token_ids for r in results], [r.accept_lengths for r in results]


DraftCall = Callable[[Sequence[DraftInput], SpecRuntimeState], list[CandidateTree]]


def through_float8(draft: DraftCall) -> DraftCall:
    """`draft` reading its inputs' features as the draft service would from a target with
    `--feature-dtype float8`: encoded by `wire_tensor.fp8_rows_into`, decoded by the service's
    decoder."""

    def drafted(inputs: Sequence[DraftInput], state: SpecRuntimeState) -> list[CandidateTree]:
        sent = []
        for item in inputs:
            if item.features is not None:
                msg = common_pb2.Tensor()
                fp8_rows_into(msg, item.features)
                item = replace(item, features=feature_rows_from_proto(msg, "features"))
            sent.append(item)
        return draft(sent, state)

    return drafted


def render(cells: Sequence[Cell], tiers: Sequence[str]) -> str:
    groups: dict[tuple[str, str, float], dict[str, Cell]] = {}
    for c in cells:
        groups.setdefault((c.prompts, c.draft, c.temperature), {})[c.tier] = c
    headers = ["prompts", "draft", "T", *(f"accept s={t}" for t in tiers)]
    headers += ["rounds", "tokens", "greedy = target"]
    rows = []
    for (prompts, draft, temperature), by_tier in groups.items():
        row = [by_tier[t] for t in tiers]
        checks = {c.matches_target for c in row}
        rows.append(
            [
                prompts,
                draft,
                "greedy" if temperature == 0 else f"{temperature:g}",
                *(f"{c.mean_accept:.2f}" for c in row),
                "/".join(str(c.rounds) for c in row),
                "/".join(str(c.tokens) for c in row),
                "-" if checks == {None} else ("yes" if checks == {True} else "NO"),
            ]
        )
    return format_table(headers, rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu acceptance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", type=Path, default=Path("models"), help="target + drafts")
    parser.add_argument("--drafts", nargs="+", choices=DRAFT_KINDS, default=list(DRAFT_KINDS))
    parser.add_argument("--code-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[96, 128], metavar="N")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--tiers",
        type=shape_arg,
        nargs="+",
        default=[TreeShape(s) for s in (1, 3, 7)],
        help="shapes: STEPS (a chain) or STEPSxTOPKxNUM_DRAFT_TOKENS (a tree)",
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    parser.add_argument(
        "--feature-dtype",
        choices=list(FeatureDType),
        default=FeatureDType.AUTO,
        help="EAGLE features as the target would send them (float8: through the wire's e4m3 "
        "per-row encoding and back, as `serve target --feature-dtype float8`)",
    )
    parser.add_argument(
        "--token-map-sizes",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also the EAGLE head over each size's frequency-ranked token map (`eagle/N`), its "
        "ids counted over the training-named stdlib files",
    )
    parser.add_argument(
        "--draft-window",
        type=int,
        default=0,
        metavar="N",
        help="each drafter starts at a prompt's last N tokens (`serve target --draft-window`; "
        "default: %(default)s, the whole prompt)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0, help="first sampling seed (one per prompt)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/acceptance.json"))
    args = parser.parse_args(argv)
    lo, hi = args.prompt_tokens
    if args.code_prompts < 1 or args.new_tokens < 1 or not 1 <= lo <= hi:
        parser.error("--code-prompts and --new-tokens must be >= 1, --prompt-tokens LO <= HI")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = cpu_run(args.threads)
    hf_logging.set_verbosity_error()  # whole files are encoded; only windows reach the model
    target_path = args.models / "target"
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompt_sets = {
        "code": code_prompts(tokenizer, args.code_prompts, *args.prompt_tokens),
        "prose": prose_prompts(tokenizer),
    }
    stdlib = sysconfig.get_paths()["stdlib"]
    print(
        f"code prompts: {args.code_prompts} windows of {args.prompt_tokens[0]}-"
        f"{args.prompt_tokens[1]} tokens from files of {stdlib} whose names stdlib/<path> were "
        "held out of training (training.corpus.is_heldout):"
    )
    for p in prompt_sets["code"]:
        print(f"  {p.source} ({len(p.ids)} tokens)")
    print(f"prose prompts: {len(PROSE_PROMPTS)} English sentences (bench/prompts.py)")

    batch = max(len(p) for p in prompt_sets.values())
    longest = max(len(p.ids) for ps in prompt_sets.values() for p in ps)
    room = max(max(s.num_draft_tokens, s.draft_rows) for s in args.tiers)
    sizes = dict(max_requests=batch, max_len=longest + args.new_tokens + room + 1)
    # An EAGLE head drafts from the target's last hidden states, an EAGLE-3 head from three of
    # its layers: one target per kind of features.
    maps = token_maps(tokenizer, args.token_map_sizes, args.out.parent)
    drafts = {kind: (kind, None) for kind in args.drafts} | {
        f"eagle/{n}": ("eagle", path) for n, path in maps.items()
    }
    layers = {k: feature_layers(args.models / kind, target_path) for k, (kind, _) in drafts.items()}
    targets = {
        f: build_target(target_path, keep_features=True, feature_layers=f, **sizes)
        for f in {(), *layers.values()}
    }
    drafters = {
        k: build_drafter(args.models / kind, target_path=target_path, token_map=m, **sizes)
        for k, (kind, m) in drafts.items()
    }
    if args.feature_dtype == FeatureDType.FLOAT8:
        for drafter in drafters.values():
            drafter.draft = through_float8(drafter.draft)  # type: ignore[method-assign,assignment]
    states = {}
    for kind, d in drafters.items():
        builder = StateBuilder(targets[layers[kind]], d)
        states[kind] = {str(shape): builder.build(shape) for shape in args.tiers}

    cells: list[Cell] = []
    start = time.perf_counter()
    for set_name, prompts in prompt_sets.items():
        greedy = sampling_for(prompts, 0.0, args.seed)
        reference, _ = generate(targets[()], None, None, prompts, greedy, args.new_tokens)
        for kind, drafter in drafters.items():
            for temperature in args.temperatures:
                sampling = sampling_for(prompts, temperature, args.seed)
                for tier, state in states[kind].items():
                    t0 = time.perf_counter()
                    outputs, per_request = generate(
                        targets[layers[kind]],
                        drafter,
                        state,
                        prompts,
                        sampling,
                        args.new_tokens,
                        args.draft_window,
                    )
                    accepts = [a for request in per_request for a in request]
                    cell = Cell(
                        prompts=set_name,
                        draft=kind,
                        temperature=temperature,
                        tier=tier,
                        mean_accept=sum(accepts) / len(accepts),
                        rounds=len(accepts),
                        tokens=sum(map(len, outputs)),
                        seconds=time.perf_counter() - t0,
                        matches_target=outputs == reference if temperature == 0 else None,
                        accept_by_prompt=tuple(sum(a) / len(a) if a else None for a in per_request),
                    )
                    cells.append(cell)
                    print(
                        f"  {set_name:5} {kind:6} T={temperature:g} s={tier}: accept "
                        f"{cell.mean_accept:.2f}, {cell.rounds} rounds, {cell.tokens} tokens, "
                        f"{cell.seconds:.1f}s"
                    )
    print(f"{len(cells)} cells in {time.perf_counter() - start:.0f}s")

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["tiers"] = [str(s) for s in args.tiers]
    write_json(
        args.out,
        {
            "device": device,
            "settings": settings,
            "stdlib": stdlib,
            "prompts": {
                name: [{"source": p.source, "tokens": len(p.ids), "text": p.text} for p in ps]
                for name, ps in prompt_sets.items()
            },
            "cells": cells,
        },
    )
    print(f"wrote {args.out}\n")
    print(FOOTNOTE)
    print()
    print(render(cells, [str(s) for s in args.tiers]))
