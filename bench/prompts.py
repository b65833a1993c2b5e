"""The held-out prompts every bench draws from: code windows of this Python's standard library
that the training corpus held out, and English prose written here.

Code prompts are windows of this interpreter's standard-library files whose corpus names
(`stdlib/<relative path>`) `training.corpus.is_heldout` holds out: the rule the training corpus
split by, on names alone, so no model trained on them. Windows whose lines mostly occur in
training-named files (boilerplate, vendored copies) are skipped.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from training.corpus import MAX_FILE_BYTES, is_heldout

# Same folders the training corpus skipped: packaging trees are not the standard library.
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# Held out by name, trained as text: setuptools vendors distutils as `setuptools/_distutils`,
# which training read from site-packages (on the GPU machine 4 of the 5 long lines of our
# distutils window occur in training files).
_VENDORED = ("stdlib/distutils/",)

# English prose, no code. Each ends mid-sentence so the continuation is plain text, not a
# newline (a prompt that ends in whitespace splits it where training text never does).
PROSE_PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as"
    " his father had taught him, and when he reached the lamp room he",
    "Most people who visit the city in autumn come for the markets, which fill the narrow"
    " streets with the smell of roasted chestnuts and the sound of",
    "After three weeks of rain the river had risen above its banks, and the farmers along the"
    " valley began moving their animals to higher ground before",
    "When the committee finally published its report, the conclusions surprised almost"
    " everyone: the project had cost twice as much as planned, yet",
    "She opened the letter slowly, recognising her grandmother's careful handwriting on the"
    " envelope, and read the first line twice because it said that",
    "A good teacher does not simply hand out answers; instead, she asks the kind of questions"
    " that lead her students to",
    "The history of the bicycle begins in the early nineteenth century, when inventors in"
    " Germany and France experimented with wooden frames that riders pushed along",
    "Every spring the small village holds a festival in honour of the first harvest, and"
    " families travel from distant towns to share food, music and",
)


@dataclass(frozen=True, slots=True)
class Prompt:
    source: str  # corpus name of the file ("stdlib/json/__init__.py") or "prose/<i>"
    text: str
    ids: list[int]


def stdlib_files(stdlib: Path) -> dict[str, Path]:
    """This stdlib's `.py` files by corpus name ("stdlib/<relative path>"), sorted."""
    found = {}
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if not _SKIP_DIRS.intersection(relative.parts):
            found[f"stdlib/{relative.as_posix()}"] = path
    return found


def read_py(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8") if path.stat().st_size <= MAX_FILE_BYTES else None
    except (OSError, UnicodeDecodeError):
        return None


def long_lines(text: str) -> set[str]:
    """Stripped lines of 20+ characters: short ones (`return x`, `)`) are everywhere."""
    return {line.strip() for line in text.splitlines() if len(line.strip()) >= 20}


def code_window(
    ids: Sequence[int], decode: Callable[[list[int]], str], lo: int, hi: int, at: float
) -> list[int] | None:
    """`lo`..`hi` tokens from about fraction `at` of a file: from a line's first token to mid-line.

    The window opens right after a token holding a newline, and ends, as late as it can, on a
    token whose text ends in a non-space character with the same line going on after it.
    None when the file has no such window.
    """
    if len(ids) < hi + 2:
        return None
    start = min(int(len(ids) * at), len(ids) - hi - 1)
    while start > 0 and "\n" not in decode([ids[start - 1]]):
        start -= 1
    for end in range(start + hi, start + lo - 1, -1):
        last, after = decode([ids[end - 1]]), decode([ids[end]])
        if last[-1:].strip() and "\n" not in after:
            return list(ids[start:end])
    return None


def code_prompts(tokenizer: PreTrainedTokenizerBase, count: int, lo: int, hi: int) -> list[Prompt]:
    """`count` windows from held-out stdlib files, spread evenly over their sorted names."""

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    files = stdlib_files(Path(sysconfig.get_paths()["stdlib"]))
    # A held-out name can still carry trained text: the encodings/ codecs are one boilerplate
    # with a different codec name, so a window mostly made of lines of a training file is out.
    trained: set[str] = set()
    for name, path in files.items():
        if not is_heldout(name):
            trained |= long_lines(read_py(path) or "")
    eligible = []
    for name, path in files.items():
        text = read_py(path)
        if not is_heldout(name) or name.startswith(_VENDORED) or text is None:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        window = code_window(ids, decode, lo, hi, at=0.3)
        if window is None:
            continue
        lines = long_lines(decode(window))
        if len(lines & trained) * 2 <= len(lines):
            eligible.append(Prompt(name, decode(window), window))
    if len(eligible) < count:
        raise SystemExit(f"only {len(eligible)} held-out stdlib files give a prompt, need {count}")
    return [eligible[i * len(eligible) // count] for i in range(count)]


def prose_prompts(tokenizer: PreTrainedTokenizerBase) -> list[Prompt]:
    return [
        Prompt(f"prose/{i}", text, tokenizer.encode(text, add_special_tokens=False))
        for i, text in enumerate(PROSE_PROMPTS)
    ]
