"""The import graph points one way: no cycle among the project's modules (counting imports
under TYPE_CHECKING and inside functions, which hide cycles rather than remove them), and
`runtime/`'s two sides and its GPU layer stay apart."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specpair", "draft_service", "target_service", "controller")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "proto" not in path.relative_to(ROOT).parts[:2]:
                found[_module(path)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module `path` imports, anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c`: c may be a module of a.b, else a name in a.b
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}

    # `from pkg import mod` names `pkg` too: an __init__ that imports nothing is no edge worth
    # following; one that re-exports (specpair/config/, specpair/client/) is a real edge
    def empty_init(d: str) -> bool:
        return modules[d].name == "__init__.py" and not _imports(modules[d], modules) - {d}

    return {m: {d for d in deps if not empty_init(d)} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as its modules in order, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_module_imports_itself_back() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]


def test_runtime_sides_and_gpu_layer_stay_apart() -> None:
    """target/ and draft/ never import each other; gpu/ imports neither (a graph stage is
    handed its eager fallback); the shared core imports no side."""
    graph = _graph()
    rt = "specpair.runtime."
    sides = {"target": rt + "target.", "draft": rt + "draft.", "gpu": rt + "gpu."}
    forbidden = {
        "target": (sides["draft"],),
        "draft": (sides["target"],),
        "gpu": (sides["target"], sides["draft"]),
    }
    both = (sides["target"], sides["draft"])
    wrong = []
    for m, deps in graph.items():
        for side, prefix in sides.items():
            if m.startswith(prefix):
                wrong += [f"{m} -> {d}" for d in deps if d.startswith(forbidden[side])]
        core = m.startswith(rt) and not any(m.startswith(p) for p in sides.values())
        if core and m not in (rt + "build", rt + "engine"):  # the assembly of both sides
            wrong += [f"{m} -> {d}" for d in deps if d.startswith(both)]
    assert not wrong, "\n".join(wrong)
