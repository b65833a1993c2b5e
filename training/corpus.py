"""Python-source corpus: collect files, split off held-out files, train the BPE tokenizer, encode.

The corpus is this interpreter's standard library plus the `.py` files of its site-packages, so it
is reproducible on any machine with the same Python environment (`models/README.md` names the one
the shipped pair was trained on).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
VOCAB_SIZE = 8192
HELDOUT_PERCENT = 2
MAX_FILE_BYTES = 1_000_000  # larger .py files are mostly generated tables, not code
# Packaging trees inside the stdlib folder are not the standard library.
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass(frozen=True)
class Corpus:
    """File texts in a fixed order; `heldout` files never enter training or the tokenizer."""

    train: list[str]
    heldout: list[str]
    train_names: list[str]
    heldout_names: list[str]


def _hash(text: str) -> int:
    return int(hashlib.md5(text.encode()).hexdigest(), 16)


def is_heldout(name: str) -> bool:
    """Whether corpus file `name` (e.g. "stdlib/json/__init__.py") is held out of training.

    A rule on the name alone, so benchmarks on another machine can pick prompts no model saw.
    """
    return _hash("heldout:" + name) % 100 < HELDOUT_PERCENT


def _list_py(root: Path, prefix: str, skip: set[str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found[f"{prefix}/{path.relative_to(root).as_posix()}"] = path
    return found


def collect(max_bytes: int = 200_000_000) -> Corpus:
    """Read stdlib + purelib `.py` files in a hash order until `max_bytes`, dedup by content."""
    paths = sysconfig.get_paths()
    files = _list_py(Path(paths["stdlib"]), "stdlib", _SKIP_DIRS)
    files.update(_list_py(Path(paths["purelib"]), "purelib", {"__pycache__"}))
    # Hash order, not alphabetical, so that a byte cap samples every package a little.
    names = sorted(files, key=lambda n: (_hash("order:" + n), n))
    seen: set[str] = set()
    corpus = Corpus([], [], [], [])
    total = 0
    for name in names:
        path = files[name]
        try:
            size = path.stat().st_size
            if not 0 < size <= MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.sha1(text.encode()).hexdigest()
        if digest in seen:  # vendored copies would leak held-out text into training
            continue
        seen.add(digest)
        if is_heldout(name):
            corpus.heldout.append(text)
            corpus.heldout_names.append(name)
        else:
            corpus.train.append(text)
            corpus.train_names.append(name)
        total += len(text.encode())
        if total >= max_bytes:
            break
    print(
        f"corpus: {len(corpus.train)} train files, {len(corpus.heldout)} held-out files, "
        f"{total / 1e6:.1f} MB (stdlib {paths['stdlib']}, purelib {paths['purelib']})"
    )
    return corpus


def train_tokenizer(texts: list[str], sample_bytes: int = 60_000_000) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on an evenly spread file sample."""
    total = sum(len(t) for t in texts)
    stride = max(1, round(total / sample_bytes))
    sample = texts[::stride]
    t0 = time.time()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOT],  # id 0: bos, eos and pad
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer)
    took = time.time() - t0
    print(f"tokenizer: vocab {tok.get_vocab_size()} from {len(sample)} files in {took:.1f}s")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json so `AutoTokenizer.from_pretrained` loads it."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(str(out_dir))
    # Compact JSON: 230 KB instead of 550 KB per copy, which the 25 MB budget of models/ needs.
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")


def load_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def encode(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: each file followed by EOT. uint16 because the vocab is 8192."""
    t0 = time.time()
    eot = tok.token_to_id(EOT)
    parts: list[np.ndarray] = []
    chunk = 2048
    for i in range(0, len(texts), chunk):
        for enc in tok.encode_batch(texts[i : i + chunk], add_special_tokens=False):
            parts.append(np.asarray([*enc.ids, eot], dtype=np.uint16))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    print(f"encoded {len(texts)} files -> {len(ids) / 1e6:.2f}M tokens in {time.time() - t0:.1f}s")
    return ids
