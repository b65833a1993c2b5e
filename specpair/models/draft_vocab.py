"""A draft vocabulary: the target ids a head may draft, and its token map file.

An EAGLE-3 head ships its own (`d2t`); an EAGLE-1/2 head may be given one: a frequency-ranked
token map (FR-Spec, SGLang's `--speculative-token-map`), whose LM head keeps only those rows of
the target's. A draft step then reads N × H of the head instead of V × H: Llama-3 with a 32 768-id
map reads 0.27 of its 1.05 GB in bf16.

Draft id i is target id `i + d2t[i]`, target ids ascending. Worked example: the map [0, 2, 5]
gives d2t = [0, 1, 3]. Lossless as any draft is: the verify does not change; greedy drafts the
best mapped id; a sampled draft's q is its warped distribution over the mapped ids, zero
elsewhere, so rejection sampling against the target's p stays exact (an id outside the map is
only ever the target's own draw).

A map file is what SGLang loads: `torch.save` of a 1-D tensor or list of ids (`.pt`), or a JSON
list. `python -m specpair.models.draft_vocab --tokenizer DIR --size N --out map.pt FILE...` ranks
the ids by how often the tokenizer emits them over the files (ties and unseen ids by id).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor


def target_ids(d2t: Tensor) -> Tensor:
    """Target id of each draft id [N]."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def on_target_vocab(draft: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """Logits over the draft ids [.., N] placed on the target vocabulary [.., V], -inf at ids
    the draft cannot name: argmax is the mapped draft argmax, and any warp of them is the
    draft's warped distribution, zero elsewhere."""
    out = draft.new_full((*draft.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, target_ids(d2t), draft)


def mapped_argmax(draft: Tensor, d2t: Tensor) -> Tensor:
    """`on_target_vocab(draft, ..).argmax(-1)` without the target-wide logits. The same token,
    ties included: target ids ascend with draft ids, so the first maximum in draft order is the
    first in target order."""
    ids = draft.argmax(-1)
    return ids + d2t[ids]


def frequency_map(counts: Tensor, size: int) -> Tensor:
    """The `size` most frequent ids of `counts` [V] (ties and unseen ids by id), ascending."""
    if not 1 <= size <= len(counts):
        raise ValueError(f"size must be in [1, {len(counts)}], got {size}")
    # A stable sort on -count keeps equal counts in id order.
    ranked = torch.sort(-counts.long(), stable=True).indices
    return ranked[:size].sort().values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specpair.models.draft_vocab",
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
    from specpair.models.loading import load_tokenizer, read_args

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
