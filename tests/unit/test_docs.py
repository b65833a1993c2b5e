"""The design of record stays true: ARCHITECTURE.md's message table names exactly the fields of
the round's dataclasses, every file, module and function the docs name exists, no doc points
outside the repository, README's headline is RESULTS.md's and `bench/results/` holds exactly
what RESULTS.md cites."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import pytest

from specpair.runtime import round_messages

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "bench/RESULTS.md"
DOCS = ["ARCHITECTURE.md", "README.md", RESULTS]
PATH = re.compile(r"(?<![\w./-])([A-Za-z0-9_./-]+\.(?:py|proto|sh|yml|yaml|toml|md))(?![\w-])")
PACKAGES = ("specpair", "controller", "target_service", "draft_service", "bench", "training")
# `specpair.rpc.wire.tensor_into`, `controller.policies.request_tiers:RequestTiers`,
# `python -m bench.tiers`
MODULE = re.compile(rf"(?<![\w./])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?::(\w+))?")
RESULT_FILE = re.compile(r"([\w.-]+\.(?:json|json\.gz|png))$")


def read(doc: str) -> str:
    return (ROOT / doc).read_text()


def code_spans(text: str) -> list[str]:
    """Fenced blocks whole, then inline spans (which may wrap a line) in what is left."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    rest = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return blocks + re.findall(r"`([^`]+)`", rest)


def table(doc: str, header: str) -> list[list[str]]:
    """The rows of the table under `header` in `doc`, as lists of stripped cells."""
    body = read(doc).split(header, 1)[1].split("\n\n", 1)[0]
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()[2:]
    ]


def message_rows() -> dict[str, str]:
    """ARCHITECTURE.md's message table: message name → its fields cell."""
    return {row[0].strip("`"): row[1] for row in table("ARCHITECTURE.md", "| message | fields |")}


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


@cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")  # a source tarball: the docs are checked in CI
    return tuple(out.stdout.split())


def exists(path: str) -> bool:
    """A tracked file given whole or from a folder down (`gpu/verify_graphs.py`), or a folder."""
    return any(f == path or f.endswith("/" + path) or f.startswith(path.rstrip("/") + "/")
               for f in tracked())  # fmt: skip


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_docs_name_exists(doc: str) -> None:
    named = {p for span in code_spans(read(doc)) for p in PATH.findall(span)}
    missing = [p for p in named if not exists(p)]
    assert not missing, f"{doc} names files that do not exist: {sorted(missing)}"


def layout_entries() -> list[str]:
    """Every file and folder of ARCHITECTURE.md's Layout tree, with its folders prefixed.

    A line's names come before its description (two spaces apart): `  wire.py   round
    messages` under `specpair/` is `specpair/rpc/wire.py`; a line that is one folder opens it for
    the lines indented below, and the `.py` files its description names (down to the next line
    of names) are that folder's: `target/   worker.py (…)`. A name with a folder in it
    (`tests/unit/test_layering.py`) is from the repository's root."""
    block = read("ARCHITECTURE.md").split("## Layout", 1)[1].split("```", 2)[1]
    entries: list[str] = []
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders
    described = ""  # the folder whose description is being read
    for line in block.splitlines():
        chunks = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        names = chunks[0].split()
        if not names or not all(re.fullmatch(r"[\w./-]+(?:\.py|/)", n) for n in names):
            description = line  # a continuation line
        else:
            indent = len(line) - len(line.lstrip())
            while folders and folders[-1][0] >= indent:
                folders.pop()
            prefix = folders[-1][1] if folders else ""
            entries += [prefix + n for n in names]
            described = ""
            if len(names) == 1 and names[0].endswith("/"):
                folders.append((indent, prefix + names[0]))
                described = prefix + names[0]
            description = chunks[1] if len(chunks) > 1 else ""
        for name in re.findall(r"[\w/]+\.py\b", description):
            entries.append(name if "/" in name else described + name if described else name)
    return entries


def test_the_layout_tree_names_only_files_that_exist() -> None:
    entries = layout_entries()
    assert "specpair/rpc/wire.py" in entries and "controller/policies/request_tiers.py" in entries
    missing = [
        e
        for e in entries
        if not (e in tracked() or (e.endswith("/") and any(f.startswith(e) for f in tracked())))
    ]
    assert not missing, f"ARCHITECTURE.md's Layout names what does not exist: {missing}"


def test_every_module_of_the_services_and_the_runtime_is_in_the_layout_tree() -> None:
    """The other way round: a new module gets a line (folders the tree describes as a whole,
    `specpair/models/`, `specpair/client/`, are not listed file by file)."""
    entries = set(layout_entries())
    folders = ["controller/", "target_service/", "draft_service/", "specpair/"]
    folders += [
        e for e in entries if e.startswith(("specpair/runtime/", "controller/")) and e.endswith("/")
    ]
    for folder in folders:
        files = {f for f in tracked() if f.startswith(folder) and "/" not in f[len(folder) :]}
        unlisted = sorted(f for f in files if f.endswith(".py") and not f.endswith("__init__.py")
                          and f not in entries)  # fmt: skip
        assert not unlisted, f"ARCHITECTURE.md's Layout misses {unlisted}"


@cache
def definitions(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module → for a class, the names defined in its body."""
    out: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for m in node.body:
                if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef):
                    members.add(m.name)
                elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                    members.add(m.target.id)
                elif isinstance(m, ast.Assign):
                    members |= {t.id for t in m.targets if isinstance(t, ast.Name)}
            out[node.name] = members
        elif isinstance(node, ast.Assign):
            out |= {t.id: set() for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0]: set() for a in node.names}
    return out


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def entry_point_groups() -> set[str]:
    project = tomllib.loads(read("pyproject.toml"))["project"]
    return set(project.get("entry-points", {}))


def unresolved(dotted: str, attr: str) -> str | None:
    """Why `dotted` (`pkg.module.Name.member`, or `pkg.module:Name`) names nothing, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(parts[:i])
        if path is not None:
            break
    else:
        return "no such module"
    rest = parts[i:] + ([attr] if attr else [])
    if not rest:
        return None
    names = definitions(path)
    if rest[0] not in names:
        return f"{rest[0]} is not defined in {path.relative_to(ROOT)}"
    if len(rest) > 1 and names[rest[0]] and rest[1] not in names[rest[0]]:
        return f"{rest[0]} has no {rest[1]}"
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_and_name_the_docs_name_exists(doc: str) -> None:
    groups = entry_point_groups()  # `specpair.services` is one, not a module
    wrong = {
        f"{dotted}{':' + attr if attr else ''}": why
        for span in code_spans(read(doc))
        for dotted, attr in MODULE.findall(span)
        if dotted not in groups and not PATH.fullmatch(dotted) and (why := unresolved(dotted, attr))
    }
    assert not wrong, f"{doc} names modules or names that do not exist: {wrong}"


@cache
def defined_anywhere() -> set[str]:
    """`name` and `Class.member` for every top-level definition of the four packages."""
    out: set[str] = set()
    for package in ("specpair", "target_service", "draft_service", "controller"):
        for path in (ROOT / package).rglob("*.py"):
            if "proto" in path.relative_to(ROOT).parts[:2]:
                continue  # generated stubs
            for name, members in definitions(path).items():
                out |= {name, *(f"{name}.{m}" for m in members)}
    return out


@pytest.mark.parametrize("header", ["| stage | file | function |", "| stage | who | in → out |"])
def test_the_stage_tables_name_functions_that_exist(header: str) -> None:
    names = {
        token
        for row in table("ARCHITECTURE.md", header)
        for cell in row[1:]
        for span in code_spans(cell)
        for token in re.split(r"[:\s]+", span)
        if re.fullmatch(r"[A-Za-z_]\w*(?:\.\w+)?", token)
    }
    assert {"TargetWorker.verify", "Drafter.extend"} & names, "the table was not found"
    missing = sorted(names - defined_anywhere())
    assert not missing, f"ARCHITECTURE.md's stage table names what does not exist: {missing}"


@pytest.mark.parametrize("doc", ["ARCHITECTURE.md", "README.md", RESULTS, "models/README.md"])
def test_no_doc_points_outside_the_repository(doc: str) -> None:
    text = read(doc)
    assert "../" not in text, f"{doc} names a path outside the repository"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # links, not E[tokens](s)
        if re.search(r"[./]", target) and not re.match(r"[a-z]+://|#|mailto:", target):
            path = (ROOT / doc).parent / target.split("#")[0]
            assert path.resolve().is_relative_to(ROOT) and path.exists(), f"{doc}: {target}"


def headline(doc: str) -> str:
    """The first paragraph under RESULTS.md's Headline heading, whitespace collapsed."""
    section = read(doc).split("\n## Headline\n", 1)[1]
    return " ".join(section.strip().split("\n\n", 1)[0].split())


def test_readme_states_the_headline_of_results_word_for_word() -> None:
    sections = re.findall(r"^## (.+)$", read(RESULTS), flags=re.M)
    assert sections[0] == "Headline", "RESULTS.md opens with its headline"
    claim = headline(RESULTS)
    assert re.search(r"\d\.\d+×", claim), claim
    readme = " ".join(read("README.md").split())
    assert claim in readme, "README's headline differs from RESULTS.md's"


def test_bench_results_holds_exactly_what_results_md_cites() -> None:
    cited = {
        m.group(1)
        for span in code_spans(read(RESULTS))
        if (m := RESULT_FILE.search(span.split("/")[-1]))
    }
    stored = {Path(f).name for f in tracked() if f.startswith("bench/results/")}
    assert not cited - stored, f"RESULTS.md cites files bench/results/ lacks: {cited - stored}"
    assert not stored - cited, f"bench/results/ holds files no table cites: {stored - cited}"
