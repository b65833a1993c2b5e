"""The design of record stays true: docs/round.md's message table names exactly the fields of
the round's dataclasses, every file, module and function the docs name exists, every number the
docs quote for a code constant is that constant's, no doc points outside the repository and every
link resolves, ARCHITECTURE.md stays an overview that links every topic file, README's headline
numbers are RESULTS.md's and `bench/results/` holds exactly what RESULTS.md cites."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import pytest

from controller.policies.goodput.config import GoodputConfig
from controller.policies.sglang import PolicyConfig
from specpair.config import ControllerConfig, TargetConfig
from specpair.runtime import round_messages
from specpair.runtime.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "bench/RESULTS.md"
TOPICS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
ROUND, MESSAGES, LAYOUT = "docs/round.md", "docs/wire.md", "docs/layout.md"
DOCS = ["ARCHITECTURE.md", "README.md", RESULTS, *TOPICS]
ARCHITECTURE_MAX_LINES = 320
PATH = re.compile(r"(?<![\w./-])([A-Za-z0-9_./-]+\.(?:py|proto|sh|yml|yaml|toml|md))(?![\w-])")
PACKAGES = ("specpair", "controller", "target_service", "draft_service", "bench", "training")
# `specpair.rpc.wire.tensor_into`, `controller.policies.request_tiers:RequestTiers`,
# `python -m bench.cpu tiers`
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
    """docs/wire.md's message table: message name → its fields cell."""
    return {row[0].strip("`"): row[1] for row in table(MESSAGES, "| message | fields |")}


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
    return any(
        f == path or f.endswith("/" + path) or f.startswith(path.rstrip("/") + "/")
        for f in tracked()
    )


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_docs_name_exists(doc: str) -> None:
    named = {p for span in code_spans(read(doc)) for p in PATH.findall(span)}
    missing = [p for p in named if not exists(p)]
    assert not missing, f"{doc} names files that do not exist: {sorted(missing)}"


def layout_entries() -> list[str]:
    """Every file and folder of docs/layout.md's tree, with its folders prefixed.

    A line's names come before its description (two spaces apart): `  wire.py   round
    messages` under `specpair/` is `specpair/rpc/wire.py`; a line that is one folder opens it for
    the lines indented below, and the `.py` files its description names (down to the next line
    of names) are that folder's: `target/   worker.py (…)`. A name with a folder in it
    (`tests/unit/test_layering.py`) is from the repository's root."""
    block = read(LAYOUT).split("```", 2)[1]
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
    assert not missing, f"{LAYOUT} names what does not exist: {missing}"


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
        unlisted = sorted(
            f
            for f in files
            if f.endswith(".py") and not f.endswith("__init__.py") and f not in entries
        )
        assert not unlisted, f"{LAYOUT} misses {unlisted}"


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
        for row in table(ROUND, header)
        for cell in row[1:]
        for span in code_spans(cell)
        for token in re.split(r"[:\s]+", span)
        if re.fullmatch(r"[A-Za-z_]\w*(?:\.\w+)?", token)
    }
    assert {"TargetWorker.verify", "Drafter.extend"} & names, "the table was not found"
    missing = sorted(names - defined_anywhere())
    assert not missing, f"{ROUND}'s stage table names what does not exist: {missing}"


LINKED = [*DOCS, "models/README.md"]


def links(doc: str) -> list[str]:
    """The relative targets of `doc`'s Markdown links, anchors cut (`[x](docs/gpu.md#a)`)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", read(doc))  # links, not E[tokens](s)
    return [
        t.split("#")[0]
        for t in targets
        if re.search(r"[./]", t) and not re.match(r"[a-z]+://|#|mailto:", t)
    ]


@pytest.mark.parametrize("doc", LINKED)
def test_no_doc_points_outside_the_repository(doc: str) -> None:
    if "/" not in doc:  # a root doc has no business with `../`; docs/ reaches the root by it
        assert "../" not in read(doc), f"{doc} names a path outside the repository"
    for target in links(doc):
        path = ((ROOT / doc).parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc}: {target} leaves the repository"


@pytest.mark.parametrize("doc", LINKED)
def test_every_relative_link_resolves_to_a_file(doc: str) -> None:
    broken = [t for t in links(doc) if not ((ROOT / doc).parent / t).exists()]
    assert not broken, f"{doc} links what does not exist: {broken}"


def test_architecture_is_an_overview_that_links_every_topic_file() -> None:
    lines = read("ARCHITECTURE.md").count("\n")
    assert lines <= ARCHITECTURE_MAX_LINES, (
        f"ARCHITECTURE.md is {lines} lines: move detail to docs/"
    )
    assert len(TOPICS) >= 8, TOPICS
    linked = {str(((ROOT / t).resolve()).relative_to(ROOT)) for t in links("ARCHITECTURE.md")}
    assert not set(TOPICS) - linked, f"ARCHITECTURE.md links none of {set(TOPICS) - linked}"


def headline(doc: str) -> str:
    """The first paragraph under RESULTS.md's Headline heading, whitespace collapsed."""
    section = read(doc).split("\n## Headline\n", 1)[1]
    return " ".join(section.strip().split("\n\n", 1)[0].split())


# A number as the docs write it: 2.98, 7x4x16, 0.92–1.18 (two), never part of a name (H100).
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)*(?:x\d+)*(?![\w])")


def readme_headline() -> str:
    return read("README.md").split("**Measured speed-up**", 1)[1].split("\n## ", 1)[0]


def test_readme_headline_is_a_table_of_results_md_numbers() -> None:
    sections = re.findall(r"^## (.+)$", read(RESULTS), flags=re.M)
    assert sections[0] == "Headline", "RESULTS.md opens with its headline"
    claim = headline(RESULTS)
    assert re.search(r"\d\.\d+×", claim), claim
    text = readme_headline()
    rows = table("README.md", "| device | model (draft, tier) | load | greedy |")
    assert len(rows) >= 4 and all(len(r) == 5 for r in rows), rows
    assert any("2.98×" in cell for row in rows for cell in row), "the headline figure is gone"
    prose = [line for line in text.strip().split("\n\n")[-1].splitlines() if line]
    assert len(prose) <= 3, "README's headline is the table and at most three lines"
    quoted = set(NUMBER.findall(text))
    assert quoted, text
    stated = set(NUMBER.findall(claim))
    assert quoted <= stated, (
        f"README's headline quotes what RESULTS.md's does not: {quoted - stated}"
    )


def test_the_number_pattern_reads_numbers_and_skips_names() -> None:
    found = NUMBER.findall("H100 at 2.98× (tree 7x4x16, 32 768 ids, 0.92–1.18×), Llama-3-8B")
    assert found == ["2.98", "7x4x16", "32", "768", "0.92", "1.18", "3"]


def constant(dotted: str) -> object:
    """`module.NAME`: imported, or, where the module needs what a CPU machine lacks (the GPU
    modules import triton), its top-level assignment read from the source."""
    module, name = dotted.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return ast.literal_eval(node.value)
        raise


def default(cls: type, name: str) -> object:
    """A config field's default, or a constructor argument's."""
    if dataclasses.is_dataclass(cls):
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return inspect.signature(cls).parameters[name].default


def keepalive(option: str) -> float:
    return dict(constant("specpair.rpc.serving.SERVER_OPTIONS"))[option] / 1000


def c(dotted: str) -> object:
    """A constant of the code, by its dotted name, short prefixes expanded."""
    for short, long in PREFIXES.items():
        if dotted.startswith(short):
            return constant(long + dotted[len(short) :])
    return constant(dotted)


PREFIXES = {
    "sampling.": "specpair.runtime.sampling.",
    "gpu.": "specpair.runtime.gpu.",
    "deadline.": "target_service.drafts.draft_deadline.",
    "watchdog.": "specpair.parallel.watchdog.",
    "addresses.": "specpair.config.addresses.",
}
TARGET, SGLANG, GOODPUT = TargetConfig, PolicyConfig, GoodputConfig
PING, PING_TIMEOUT = "grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms"
DEADLINE_NAMES = ("MULTIPLE", "PERCENTILE", "WINDOW", "MIN_ROUNDS", "MAX_BENCH_S", "HEALTHY_ROUNDS")
# (doc, what it says, each quoted number a group; the values in the code). A pattern is matched
# against the doc with its whitespace collapsed; a change on either side fails the test.
QUOTED: list[tuple[str, str, tuple[object, ...]]] = [
    (
        "ARCHITECTURE.md",
        r"its (\d+) likeliest tokens \(`DRAFT_SUPPORT`",
        (c("sampling.DRAFT_SUPPORT"),),
    ),
    (
        "ARCHITECTURE.md",
        r"row's (\d+) likeliest tokens \(`CANDIDATES`",
        (c("sampling.CANDIDATES"),),
    ),
    (
        "ARCHITECTURE.md",
        r"default candidates are `\[([\d, ]+)\]` \(`candidate_steps`",
        (c("specpair.config.model_service.CANDIDATE_STEPS"),),
    ),
    (
        "ARCHITECTURE.md",
        r"drafts \(α ([\d.]+)\), a decision every (\d+) counted batches after a warm-up of "
        r"(\d+), moving up or down the candidate list `\[([\d, ]+)\]`",
        (
            *tuple(default(SGLANG, f) for f in ("ema_alpha", "update_interval", "warmup_batches")),
            default(SGLANG, "candidate_steps"),
        ),
    ),
    (
        "ARCHITECTURE.md",
        r"at most (\d+) query rows per KV head, `MAX_ROWS`",
        (c("gpu.tree_attention.MAX_ROWS"),),
    ),
    (
        "ARCHITECTURE.md",
        r"at most (\d+) nodes \(`MAX_TREE_NODES`",
        (c("specpair.runtime.shape.MAX_TREE_NODES"),),
    ),
    (
        "ARCHITECTURE.md",
        r"(\d+)× the (\d+)th percentile of its last (\d+) answers, at least "
        r"`--draft-deadline-floor` \((\d+) s\), at most `--draft-timeout` \((\d+) s\)",
        (
            c("deadline.MULTIPLE"),
            c("deadline.PERCENTILE") * 100,
            c("deadline.WINDOW"),
            default(TARGET, "draft_deadline_floor_s"),
            default(TARGET, "draft_timeout_s"),
        ),
    ),
    (
        "ARCHITECTURE.md",
        r"\(floor (\d+) s, a first call (\d+) s",
        (c("watchdog.DEFAULT_FLOOR_S"), c("watchdog.FIRST_CALL_S")),
    ),
    (
        "ARCHITECTURE.md",
        r"\(half its slots, (\d+) streams\)",
        (c("draft_service.server.MAX_HOST_STREAMS"),),
    ),
    (
        "docs/sampling.md",
        r"row's (\d+) likeliest tokens \(`CANDIDATES`",
        (c("sampling.CANDIDATES"),),
    ),
    (
        "docs/sampling.md",
        r"in two levels past (\d+) tokens \(a slice of (\d+) by mass",
        (2 * c("sampling.DRAW_SLICE"), c("sampling.DRAW_SLICE")),
    ),
    (
        "docs/sampling.md",
        r"to its (\d+) likeliest tokens \(`DRAFT_SUPPORT`",
        (c("sampling.DRAFT_SUPPORT"),),
    ),
    (
        "docs/sampling.md",
        r"one per\s+bucket up to (\d+)",
        (c("gpu.verify_graphs.VOCABULARY_ACCEPT_BATCH"),),
    ),
    ("docs/wire.md", r"what this draft sends, K = (\d+)", (c("sampling.DRAFT_SUPPORT"),)),
    (
        "docs/wire.md",
        r"cut to (\d+) characters at the wire",
        (c("specpair.logging.MAX_DETAILS_CHARS"),),
    ),
    (
        "docs/wire.md",
        r"a ping every (\d+) s, (\d+) s to answer",
        (keepalive(PING), keepalive(PING_TIMEOUT)),
    ),
    (
        "docs/wire.md",
        r"(\d+) MiB message limits \(`MESSAGE_LIMIT`",
        (c("specpair.rpc.channels.MESSAGE_LIMIT") / 2**20,),
    ),
    (
        "docs/wire.md",
        r"node's (\d+) likeliest tokens \(`DRAFT_SUPPORT`",
        (c("sampling.DRAFT_SUPPORT"),),
    ),
    ("docs/round.md", r"each row's (\d+) candidates", (c("sampling.CANDIDATES"),)),
    (
        "docs/round.md",
        r"for at most (\d+) µs a running request \(at least (\d+) ms",
        (
            c("specpair.rpc.serving.SETTLE_PER_REQUEST_S") * 1e6,
            c("specpair.rpc.serving.SETTLE_BUDGET_S") * 1e3,
        ),
    ),
    (
        "docs/services.md",
        r"\| target \| `([\d.:]+)` .*?\| draft \| `([\d.:]+)` .*?\| controller \| `([\d.:]+)`",
        tuple(c(f"addresses.DEFAULT_{n}_ADDRESS") for n in ("TARGET", "DRAFT", "CONTROLLER")),
    ),
    ("docs/services.md", r"page size \((\d+) positions", (default(KVCache, "page_size"),)),
    (
        "docs/services.md",
        r"\(`MAX_TREE_NODES`, (\d+) nodes",
        (c("specpair.runtime.shape.MAX_TREE_NODES"),),
    ),
    (
        "docs/services.md",
        r"\(`DRAFT_SUPPORT`, (\d+) tokens\) and the warp's candidates \(`CANDIDATES`, (\d+)\)",
        (c("sampling.DRAFT_SUPPORT"), c("sampling.CANDIDATES")),
    ),
    (
        "docs/services.md",
        r"a `WatchRounds` queue \((\d+) rounds",
        (c("target_service.batching.round_feed.QUEUE_ROUNDS"),),
    ),
    (
        "docs/services.md",
        r"`MULTIPLE` (\d+), `PERCENTILE` ([\d.]+), `WINDOW` (\d+), `MIN_ROUNDS` (\d+), "
        r"`MAX_BENCH_S` (\d+), `HEALTHY_ROUNDS` (\d+)",
        tuple(c(f"deadline.{n}") for n in DEADLINE_NAMES),
    ),
    (
        "docs/services.md",
        r"\(`MAX_HOST_STREAMS`, (\d+),",
        (c("draft_service.server.MAX_HOST_STREAMS"),),
    ),
    (
        "docs/services.md",
        r"omitted `max_tokens` is (\d+) on every door\), except the OpenAI door's own "
        r"`temperature` (\d+\.\d+)",
        (
            c("target_service.request_path.validation.DEFAULT_MAX_TOKENS"),
            c("target_service.http_door.openai_request.DEFAULT_TEMPERATURE"),
        ),
    ),
    (
        "docs/services.md",
        r"every child \(SIGTERM, (\d+) s, then SIGKILL",
        (c("specpair.cli.group.STOP_GRACE_S"),),
    ),
    (
        "docs/security.md",
        r"the same (\d+) MiB message limits",
        (c("specpair.rpc.channels.MESSAGE_LIMIT") / 2**20,),
    ),
    (
        "docs/security.md",
        r"at most (\d+) Round streams \(`MAX_HOST_STREAMS`",
        (c("draft_service.server.MAX_HOST_STREAMS"),),
    ),
    (
        "docs/security.md",
        r"a whole queue \((\d+) rounds\)",
        (c("target_service.batching.round_feed.QUEUE_ROUNDS"),),
    ),
    (
        "docs/security.md",
        r"JSON over (\d+) kB parses on a worker thread",
        (c("target_service.http_door.http_guards.PARSE_INLINE_BYTES") / 1024,),
    ),
    (
        "docs/failure.md",
        r"\(target: ([\d.]+) → ([\d.]+) s; controller: ([\d.]+) → ([\d.]+) s\)",
        (
            default(TARGET, "reconnect_min_s"),
            default(TARGET, "reconnect_max_s"),
            c("controller.service.target_link.FIRST_BACKOFF_S"),
            default(ControllerConfig, "reconnect_s"),
        ),
    ),
    (
        "docs/failure.md",
        r"(\d+)× the (\d+)th percentile of the replica's last (\d+) answer times",
        (c("deadline.MULTIPLE"), c("deadline.PERCENTILE") * 100, c("deadline.WINDOW")),
    ),
    (
        "docs/failure.md",
        r"`--draft-deadline-floor` \((\d+) s\) nor over `--draft-timeout` \((\d+) s\), which "
        r"alone applies before (\d+) rounds are measured",
        (
            default(TARGET, "draft_deadline_floor_s"),
            default(TARGET, "draft_timeout_s"),
            c("deadline.MIN_ROUNDS"),
        ),
    ),
    (
        "docs/failure.md",
        r"doubling to (\d+) s; (\d+) rounds in time clear the strikes",
        (c("deadline.MAX_BENCH_S"), c("deadline.HEALTHY_ROUNDS")),
    ),
    (
        "docs/failure.md",
        r"ping every (\d+) s, (\d+) s timeout",
        (keepalive(PING), keepalive(PING_TIMEOUT)),
    ),
    ("docs/kv-cache.md", r"\(default (\d+) positions\)", (default(KVCache, "page_size"),)),
    (
        "docs/draft-pool.md",
        r"`--draft-resolve-interval` \((\d+) s\)",
        (default(TARGET, "draft_resolve_s"),),
    ),
    ("docs/gpu.md", r"at most (\d+) rows \(`GEMV_MAX_ROWS`\)", (c("gpu.fused.GEMV_MAX_ROWS"),)),
    (
        "docs/gpu.md",
        r"Triton split-K GEMV up to (\d+) rows, cuBLAS above \| the Triton kernel at every row "
        r"count: the GEMV's (\d+)-row tiles up to (\d+), (\d+) × (\d+) above \(`INVARIANT_TILE`",
        (c("gpu.fused.GEMV_MAX_ROWS"),) * 3 + tuple(c("gpu.fused.INVARIANT_TILE")[:2]),
    ),
    (
        "docs/gpu.md",
        r"chunks of (\d+) fixed key positions",
        (c("gpu.tree_attention.INVARIANT_CHUNK"),),
    ),
    (
        "docs/gpu.md",
        r"buckets of 1–(\d+) prompts × (\d+), (\d+) or (\d+) tokens up to (\d+) rows",
        (
            c("gpu.prefill_graphs.MOST_PROMPTS"),
            *c("gpu.prefill_graphs.TOKENS"),
            c("gpu.prefill_graphs.MOST_ROWS"),
        ),
    ),
    ("docs/gpu.md", r"MAX_ROWS (\d+) query rows per KV head", (c("gpu.tree_attention.MAX_ROWS"),)),
    (
        "docs/tensor-parallel.md",
        r"max\(`rank_timeout_floor_s` = (\d+) s, (\d+) × p(\d+) of those × its tokens\) is a "
        r"hang \(a kind's first call, nothing measured yet, gets (\d+) s",
        (
            default(TARGET, "rank_timeout_floor_s"),
            c("watchdog.FACTOR"),
            99,
            c("watchdog.FIRST_CALL_S"),
        ),
    ),
    (
        "docs/policies.md",
        r"an EMA of accepted drafts \(α ([\d.]+), starting at tier − 1\), a decision every "
        r"(\d+) counted batches after (\d+),",
        tuple(default(SGLANG, f) for f in ("ema_alpha", "update_interval", "warmup_batches")),
    ),
    (
        "docs/policies.md",
        r"ours is \[([\d, ]+)\] at every batch size",
        (default(SGLANG, "candidate_steps"),),
    ),
    ("docs/policies.md", r"`probe_budget` \((\d+) %\)", (default(GOODPUT, "probe_budget") * 100,)),
    ("docs/policies.md", r"spans ~(\d+) request-rounds", (default(GOODPUT, "acceptance_window"),)),
    (
        "docs/policies.md",
        r"for at least one interval and (\d+) request-rounds",
        (c("controller.policies.goodput.probe.REMEASURE_REQUEST_ROUNDS"),),
    ),
]


def as_number(text: str) -> object:
    if text.startswith(("1", "0", "2", "3", "4", "5", "6", "7", "8", "9")) and ":" not in text:
        if "," in text:
            return tuple(int(x) for x in text.split(","))
        return float(text)
    return text


def same(quoted: object, value: object) -> bool:
    if isinstance(value, tuple | list) and not isinstance(quoted, tuple):
        return False
    if isinstance(quoted, tuple):
        return tuple(quoted) == tuple(value)  # type: ignore[arg-type]
    if isinstance(quoted, float):
        return isinstance(value, int | float) and abs(quoted - value) < 1e-9 * max(1, abs(value))
    return quoted == value


@pytest.mark.parametrize(("doc", "pattern", "values"), QUOTED, ids=lambda x: str(x)[:40])
def test_the_docs_quote_the_code_constants(
    doc: str, pattern: str, values: tuple[object, ...]
) -> None:
    text = " ".join(read(doc).split())
    match = re.search(pattern, text)
    assert match, f"{doc} no longer says {pattern!r}: keep the claim or its check"
    quoted = tuple(as_number(g.replace(" ", "")) for g in match.groups())
    wrong = [(q, v) for q, v in zip(quoted, values, strict=True) if not same(q, v)]
    assert not wrong, f"{doc} quotes (doc, code) {wrong} for {pattern!r}"


def test_every_topic_file_has_a_checked_constant_or_none_to_check() -> None:
    """The constants check is not vacuous: it reads most topic files and ARCHITECTURE.md."""
    checked = {doc for doc, _, _ in QUOTED}
    assert "ARCHITECTURE.md" in checked and len(checked & set(TOPICS)) >= 10, checked


def test_bench_results_holds_exactly_what_results_md_cites() -> None:
    cited = {
        m.group(1)
        for span in code_spans(read(RESULTS))
        if (m := RESULT_FILE.search(span.split("/")[-1]))
    }
    stored = {Path(f).name for f in tracked() if f.startswith("bench/results/")}
    assert not cited - stored, f"RESULTS.md cites files bench/results/ lacks: {cited - stored}"
    assert not stored - cited, f"bench/results/ holds files no table cites: {stored - cited}"
