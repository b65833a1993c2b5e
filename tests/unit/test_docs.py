"""The design of record stays true: ARCHITECTURE.md's message table names exactly the fields of
the round's dataclasses, and every file the docs name exists."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from specpair.runtime import round as round_messages

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["ARCHITECTURE.md", "README.md"]
PATH = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|proto|sh|yml|yaml|toml))`")


def message_rows() -> dict[str, str]:
    """ARCHITECTURE.md's message table: message name → its fields cell."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text.split("| message | fields | direction |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1]
    return rows


def top_level_names(cell: str) -> set[str]:
    """The backticked names of a cell outside parentheses (those inside explain a field)."""
    flat, depth = [], 0
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            flat.append(ch)
        depth -= ch == ")" and depth > 0
    return set(re.findall(r"`([a-z_]+)`", "".join(flat)))


def test_the_message_table_lists_every_field_of_each_round_message() -> None:
    rows = message_rows()
    assert set(rows) == {
        "DraftInput",
        "RoundRequest",
        "RoundResponse",
        "StageTimings",
        "RoundStats",
    }
    for name, cell in rows.items():
        fields = {f.name for f in dataclasses.fields(getattr(round_messages, name))}
        assert top_level_names(cell) == fields, name


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")  # a source tarball: the docs are checked in CI
    return out.stdout.split()


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_docs_name_exists(doc: str) -> None:
    """A path may be given whole or from a folder down (`gpu/verify_graphs.py`)."""
    files = tracked()
    named = set(PATH.findall((ROOT / doc).read_text()))
    missing = [p for p in named if not any(f == p or f.endswith("/" + p) for f in files)]
    assert not missing, f"{doc} names files that do not exist: {sorted(missing)}"
