"""Writes a frequency-ranked token map (`draft_vocab.py`) for `serve draft --token-map`:

    python -m specpair.models.token_map --tokenizer DIR --size N --out map.pt FILE...

ranks the ids by how often the target's tokenizer emits them over the files (ties and unseen ids
by id, up to the vocabulary of DIR's config.json, which may be padded past the tokenizer's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from specpair.models.draft_vocab import frequency_map
from specpair.models.loading import load_tokenizer, read_args


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpair.models.token_map",
        description="Write a frequency-ranked token map for --token-map (an EAGLE-1/2 head).",
    )
    parser.add_argument("files", nargs="+", type=Path, help="text files to count tokens over")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        help="the target's directory (its tokenizer and config.json)",
    )
    parser.add_argument("--size", type=int, required=True, help="ids in the map")
    parser.add_argument("--out", type=Path, required=True, help="the map (.pt, or .json)")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        parser.error(f"{args.tokenizer}: no tokenizer.json")
    tokenizer.model_max_length = 1 << 62  # whole files are counted, never fed to a model
    # The model's vocabulary, which may be padded past the tokenizer's (Llama-3: 128 256 ids).
    vocab = len(tokenizer)
    if (args.tokenizer / "config.json").is_file():
        vocab = max(vocab, read_args(args.tokenizer).vocab_size)
    counts = torch.zeros(vocab, dtype=torch.long)
    for file in args.files:
        ids = tokenizer(file.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(counts))
    try:
        ids = frequency_map(counts, args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(ids.tolist()))
    else:
        torch.save(ids, args.out)
    seen = counts[ids].sum() / max(int(counts.sum()), 1)
    print(f"{args.out}: {len(ids)} ids covering {float(seen):.2%} of {int(counts.sum())} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
