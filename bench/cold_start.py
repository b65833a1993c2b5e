"""The operator's first minutes: `specpair up` on a machine whose kernel caches are empty, the
first requests sent the moment it says "all services up", then the same stack started again
with the caches kept.

1. `up` (its defaults: the draft LM, SGLang's rule) with `XDG_CACHE_HOME` on an empty folder,
   so flashinfer and Triton compile everything (`up` keeps both caches under it): seconds to
   its ready line;
2. at once, `--requests` held-out code prompts, greedy, one at a time through the SDK: tokens/s,
   mean accept length of the rounds with drafts, and how many rounds decoded plainly (a draft
   that is not ready times out its rounds: they decode without drafts);
3. the same prompts with the target alone (tier 0 pinned through the ops API: `up` builds it);
4. `up` again with the same caches: seconds to its ready line.

Goal (issue 53): the first requests speculate (mean accept > 2 at tier 3 and above) and run
≥ 1.5× the target alone; the second start takes at most half the first's time.

    python -m bench.cold_start [--draft-kind model] [--requests 12] [--new-tokens 128]
    python -m bench.cold_start --device cpu --shape shipped --requests 2 --new-tokens 8  # smoke
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import device_info, format_table, write_json
from bench.gpu_speedup import add_pair_args, bench_pair, make_workloads
from bench.up_client import pin_target_alone, running_up
from specpair.client import ControllerClient, SpecpairClient


@dataclass
class Pass:
    name: str
    tokens: int
    seconds: float
    rounds: int  # rounds over all requests
    plain_rounds: int  # decoded without drafts
    accept: float | None  # accepted drafts per round with drafts

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_pass(name: str, client: SpecpairClient, prompts: list[list[int]], new_tokens: int) -> Pass:
    tokens = rounds = plain = 0
    accepts: list[int] = []
    t0 = time.perf_counter()
    for ids in prompts:
        result = client.generate(ids, max_tokens=new_tokens, temperature=0.0)
        tokens += len(result.token_ids)
        accepts += [a for a in result.accept_lengths if a >= 0]
        rounds += len(result.accept_lengths)
        plain += sum(a < 0 for a in result.accept_lengths)
    seconds = time.perf_counter() - t0
    return Pass(
        name, tokens, seconds, rounds, plain, sum(accepts) / len(accepts) if accepts else None
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_args(parser)
    parser.set_defaults(draft_kind="model")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--caches",
        type=Path,
        help="the kernel caches' folder, empty or new "
        "(default: a temporary one); kept for later runs",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/out/cold_start.json"))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    info = device_info()
    print(f"device: {info}", flush=True)
    target, draft = bench_pair(args.shape, args.models_dir, args.draft_kind, args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = make_workloads(tokenizer, args.requests, [0.0])[0].ids
    kind = "eagle" if args.draft_kind.startswith("eagle") else "model"
    command = [
        *(sys.executable, "-m", "specpair.cli", "up", "--device", args.device),
        *("--target-model", str(target), "--draft-model", str(draft), "--draft-kind", kind),
    ]
    starts: list[float] = []
    passes: list[Pass] = []
    if args.caches is not None and args.caches.exists() and any(args.caches.iterdir()):
        parser.error(f"--caches {args.caches}: not empty, so the first start would not be cold")
    with tempfile.TemporaryDirectory(prefix="specpair-cold-") as temporary:
        caches = str(args.caches or temporary)
        # `up` keeps flashinfer's and Triton's caches under XDG_CACHE_HOME unless they are set
        env = {
            "XDG_CACHE_HOME": caches,
            "FLASHINFER_WORKSPACE_BASE": None,
            "TRITON_CACHE_DIR": None,
        }
        for start in ("first", "second"):
            t0 = time.perf_counter()
            log = args.out.with_name(f"{args.out.stem}_{start}.log")
            with running_up(command, log, env_changes=env) as up:
                starts.append(time.perf_counter() - t0)
                print(f"{start} start: {starts[-1]:.1f} s to ready", flush=True)
                if start == "second":
                    break
                client = SpecpairClient(up.target, timeout=600)
                passes.append(run_pass("first requests", client, prompts, args.new_tokens))
                pin_target_alone(ControllerClient(up.controller, token=up.token, timeout=30))
                passes.append(run_pass("target alone", client, prompts, args.new_tokens))
    alone = passes[-1]
    rows = [
        [
            p.name,
            f"{p.tokens_per_s:.1f}",
            f"{p.tokens_per_s / alone.tokens_per_s:.2f}",
            "-" if p.accept is None else f"{p.accept:.2f}",
            f"{p.plain_rounds}/{p.rounds}",
        ]
        for p in passes
    ]
    write_json(
        args.out,
        {
            "device": info,
            "date": time.strftime("%Y-%m-%d"),
            "command": command,
            "draft_kind": args.draft_kind,
            "shape": args.shape,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "starts_s": starts,
            "passes": [asdict(p) | {"tokens_per_s": p.tokens_per_s} for p in passes],
        },
    )
    print(f"\nwrote {args.out}\n")
    print(
        f"start to ready: first {starts[0]:.1f} s (empty caches), second {starts[1]:.1f} s "
        f"({starts[1] / starts[0]:.2f} of the first)"
    )
    print(format_table(["pass", "tok/s", "x alone", "accept", "plain rounds"], rows))


if __name__ == "__main__":
    main()
