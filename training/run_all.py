"""Run every training stage in order: corpus + tokenizer, target, draft, EAGLE head, probe.

    python -m training.run_all --out models                      # everything, one process
    python -m training.run_all --out models --stages tokenizer,target,draft
    python -m training.run_all --out models --stages eagle,probe  # reuses models/target

The corpus is read and encoded once per process and shared by the stages that run in it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from training import corpus as corpus_mod
from training.probe import probe
from training.train_eagle import CE_WEIGHT, INTERMEDIATE_SIZE, train_eagle
from training.train_lm import SEQ_LEN, train_lm

STAGES = ("tokenizer", "target", "draft", "eagle", "probe")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models"))
    p.add_argument("--plots", type=Path, default=Path("training/plots"))
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--max-bytes", type=int, default=200_000_000)
    p.add_argument("--target-seconds", type=float, default=230.0)
    p.add_argument("--draft-seconds", type=float, default=130.0)
    p.add_argument("--eagle-seconds", type=float, default=300.0)
    p.add_argument("--target-steps", type=int, default=None, help="overrides --target-seconds")
    p.add_argument("--draft-steps", type=int, default=None, help="overrides --draft-seconds")
    p.add_argument("--eagle-steps", type=int, default=None, help="overrides --eagle-seconds")
    p.add_argument("--lm-batch", type=int, default=64)
    p.add_argument("--eagle-batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--eagle-name", default="eagle", help="EAGLE head folder under --out")
    p.add_argument("--eagle-ce-weight", type=float, default=CE_WEIGHT)
    p.add_argument("--eagle-intermediate", type=int, default=INTERMEDIATE_SIZE)
    p.add_argument(
        "--finish-by",
        type=float,
        default=None,
        help="shrink the seconds budgets so that the run ends within this many seconds",
    )
    a = p.parse_args()
    stages = [s for s in a.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    t0 = time.time()
    corpus = corpus_mod.collect(a.max_bytes)
    dirs = {"target": a.out / "target", "draft": a.out / "draft", "eagle": a.out / a.eagle_name}
    if "tokenizer" in stages:
        tok = corpus_mod.train_tokenizer(corpus.train)
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
            corpus_mod.save_tokenizer(tok, d, SEQ_LEN)
    else:
        tok = corpus_mod.load_tokenizer(dirs["target"])
        if "eagle" in stages:  # a head trained alone still ships the target's tokenizer
            dirs["eagle"].mkdir(parents=True, exist_ok=True)
            corpus_mod.save_tokenizer(tok, dirs["eagle"], SEQ_LEN)
    train_ids = corpus_mod.encode(tok, corpus.train)
    heldout_ids = corpus_mod.encode(tok, corpus.heldout)
    print(f"data ready in {time.time() - t0:.0f}s")
    summary: dict[str, object] = {}
    for kind in ("target", "draft"):
        if kind in stages:
            steps = a.target_steps if kind == "target" else a.draft_steps
            seconds = a.target_seconds if kind == "target" else a.draft_seconds
            if a.finish_by is not None:
                # Reserve ~30 s per LM stage for evaluation and saving.
                later = a.draft_seconds + 30 if kind == "target" and "draft" in stages else 0
                seconds = min(seconds, a.finish_by - (time.time() - t0) - later - 30)
            summary[kind] = train_lm(
                kind,
                train_ids,
                heldout_ids,
                dirs[kind],
                a.plots,
                steps=steps,
                seconds=None if steps else seconds,
                batch=a.lm_batch,
                seq_len=a.seq_len,
            )
    if "eagle" in stages:
        summary["eagle"] = train_eagle(
            dirs["target"],
            train_ids,
            heldout_ids,
            dirs["eagle"],
            a.plots,
            steps=a.eagle_steps,
            seconds=None if a.eagle_steps else a.eagle_seconds,
            batch=a.eagle_batch,
            seq_len=a.seq_len,
            ce_weight=a.eagle_ce_weight,
            intermediate_size=a.eagle_intermediate,
        )
    if "probe" in stages:
        summary["probe"] = probe(a.out, heldout_ids, n_prompts=a.prompts, eagle_name=a.eagle_name)
    summary["corpus"] = {
        "train_files": len(corpus.train),
        "heldout_files": len(corpus.heldout),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
    }
    summary["wall_seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
