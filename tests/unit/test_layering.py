"""The import graph points one way: no cycle among the project's modules (counting imports
under TYPE_CHECKING and inside functions, which hide cycles rather than remove them), and
`runtime/`'s two sides and its GPU layer stay apart; the controller's policies are pure and the
controller never imports the SDK."""

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


def _raw_imports(path: Path) -> set[str]:
    """Every module name `path` imports, the project's or not (`grpc`, `specpair.proto.v1`)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _reaches(start: str, graph: dict[str, set[str]]) -> set[str]:
    """`start` and every project module it imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, set())
    return seen


def _forbidden_reached(prefix: str, banned: tuple[str, ...]) -> list[str]:
    """`module -> import` for every import under `banned` that a module under `prefix` makes or
    reaches through the project's modules."""
    modules, graph = _modules(), _graph()
    wrong = []
    for m in sorted(m for m in modules if m == prefix or m.startswith(prefix + ".")):
        for reached in sorted(_reaches(m, graph)):
            raw = _raw_imports(modules[reached])
            hits = sorted(i for i in raw if any(i == b or i.startswith(b + ".") for b in banned))
            wrong += [f"{m} (through {reached}) -> {h}" for h in hits]
    return wrong


def test_the_policies_are_pure() -> None:
    """controller/policies/ imports no grpc, no protos, no service and no SDK, even through
    the modules it does import: a policy is unit-tested and replayed without a process."""
    banned = ("grpc", "specpair.proto", "controller.service", "specpair.client")
    wrong = _forbidden_reached("controller.policies", banned)
    assert not wrong, "\n".join(wrong)


def test_the_controller_never_imports_the_sdk() -> None:
    """What the controller and the SDK both speak (a target's state) is in specpair/, so that
    neither imports the other."""
    wrong = _forbidden_reached("controller", ("specpair.client",))
    assert not wrong, "\n".join(wrong)


def test_the_purity_check_sees_an_import_made_through_another_module(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}
    assert _reaches("a", graph) == {"a", "b", "c"}
    module = tmp_path / "m.py"
    module.write_text("import grpc\nfrom specpair.proto.v1 import target_pb2\n")
    assert {"grpc", "specpair.proto.v1", "specpair.proto.v1.target_pb2"} <= _raw_imports(module)
