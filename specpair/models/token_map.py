"""A token map's file (`draft_vocab.py`; `serve draft --token-map`): `load_token_map` reads one,
and

    python -m specpair.models.token_map --tokenizer DIR --size N --out map.pt FILE...

writes one, the ids ranked by how often the target's tokenizer emits them over the files (ties
and unseen ids by id, up to the vocabulary of DIR's config.json, which may be padded past the
tokenizer's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from specpair.models.draft_vocab import coverage, frequency_map, token_counts
from specpair.models.loading import CheckpointError, load_tokenizer, read_args


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The ids of the map at `path`, ascending, int64 [N]; a clear error naming the file."""
    path = Path(path)
    try:
        if path.suffix == ".json":
            raw: object = json.loads(path.read_text())
        else:  # a pickle: weights_only refuses anything but tensors and plain containers
            raw = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such token map") from None
    except Exception as exc:  # a foreign file: name it, not a library's internals
        raise CheckpointError(
            f"{path}: not a token map (a 1-D list of token ids; {type(exc).__name__}: {exc})"
        ) from None
    if ids.dim() != 1 or len(ids) == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise CheckpointError(
            f"{path}: a token map is a non-empty 1-D list of integer ids, got {ids.dtype} "
            f"{tuple(ids.shape)}"
        )
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise CheckpointError(
            f"{path}: token id {int(ids.max()) if int(ids.min()) >= 0 else int(ids.min())} "
            f"outside the target's vocabulary [0, {vocab_size})"
        )
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        raise CheckpointError(f"{path}: a token id appears twice")
    return ids


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
    texts = (file.read_text(errors="replace") for file in args.files)
    counts = token_counts(
        (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts), vocab
    )
    try:
        ids = frequency_map(counts, args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(ids.tolist()))
    else:
        torch.save(ids, args.out)
    print(
        f"{args.out}: {len(ids)} ids covering {coverage(counts, ids):.2%} of "
        f"{int(counts.sum())} tokens"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
