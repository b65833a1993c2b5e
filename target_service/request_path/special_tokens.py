"""The special tokens a checkpoint asks for: the ids that end a generation, and a BOS first.

Both are read as `transformers` reads them, so greedy output over the services equals
`model.generate(**tokenizer(prompt, return_tensors="pt"))` on the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specpair.models.loading import CheckpointError


def _config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _ids(file: Path, value: Any) -> frozenset[int]:
    # eos_token_id: null, 2, or (Llama-3.1) [128001, 128008, 128009]
    values = value if isinstance(value, list) else [value]
    if not all(v is None or (isinstance(v, int) and v >= 0) for v in values):
        raise CheckpointError(f"{file}: eos_token_id {value!r} is not a token id or a list of them")
    return frozenset(v for v in values if v is not None)


def eos_ids(path: Path, tokenizer: Any) -> frozenset[int]:
    """generation_config.json's eos_token_id (config.json's where it has none), with the
    tokenizer's eos: any of them ends a generation."""
    file = path / "generation_config.json"
    if "eos_token_id" not in _config(file):
        file = path / "config.json"
    ids = _ids(file, _config(file).get("eos_token_id"))
    eos = None if tokenizer is None else tokenizer.eos_token_id
    return ids | ({int(eos)} if eos is not None else set())


def prompt_bos(path: Path, tokenizer: Any) -> int | None:
    """The BOS id to put before a text prompt, or None.

    tokenizer_config.json's `add_bos_token` decides where present (Llama-2, Mistral); else
    whether the tokenizer's own special-token step prepends it (Llama-3's post-processor).
    """
    if tokenizer is None or tokenizer.bos_token_id is None:
        return None
    bos = int(tokenizer.bos_token_id)
    add = _config(path / "tokenizer_config.json").get("add_bos_token")
    if add is None:
        special = tokenizer.encode("a", add_special_tokens=True)
        bare = tokenizer.encode("a", add_special_tokens=False)
        add = special[:1] == [bos] and bare[:1] != [bos]
    return bos if add else None
