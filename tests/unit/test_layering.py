"""The import graph points one way: no cycle among the project's modules (counting imports
under TYPE_CHECKING and inside functions, which hide cycles rather than remove them); the
shared package imports no service and no service another; the runtime imports no config and
reaches its GPU layer only where it assembles the states; `runtime/`'s two sides and its GPU
layer stay apart; the controller's policies are pure and the controller never imports the SDK."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

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


SERVICES = ("target_service", "draft_service", "controller")


def _under(*prefixes: str) -> Callable[[str], bool]:
    """Whether a module is one of `prefixes` or inside one."""
    return lambda m: any(m == p or m.startswith(p + ".") for p in prefixes)


def _service(m: str) -> str | None:
    top = m.partition(".")[0]
    return top if top in SERVICES else None


@dataclass(frozen=True)
class Rule:
    """Modules that `source` accepts never import (directly, anywhere in the file) one that
    `banned(module, dependency)` names, except the edges of `allowed`, each with its reason."""

    name: str
    source: Callable[[str], bool]
    banned: Callable[[str, str], bool]
    allowed: dict[tuple[str, str], str] = field(default_factory=dict)

    def broken(self, graph: dict[str, set[str]]) -> list[str]:
        return [
            f"{m} -> {d}"
            for m in sorted(graph)
            if self.source(m)
            for d in sorted(graph[m])
            if self.banned(m, d) and (m, d) not in self.allowed
        ]


_gpu = _under("specpair.runtime.gpu")
# Where the runtime assembles a tier's states: the only core module that picks GPU stages.
ASSEMBLY = ("specpair.runtime.build",)
RULES = [
    Rule(
        # a service registers itself (`specpair.services` entry points): `specpair serve`
        # finds it by name
        "the shared package imports no service",
        _under("specpair"),
        lambda m, d: _service(d) is not None,
    ),
    Rule(
        "no service imports another",
        lambda m: _service(m) is not None,
        lambda m, d: _service(d) not in (None, _service(m)),
    ),
    Rule(
        # the runtime takes plain values; a service turns its config into them
        "the runtime imports no config",
        _under("specpair.runtime"),
        lambda m, d: _under("specpair.config")(d),
    ),
    Rule(
        # the core holds the protocols (`stages.py`); `build.py` hands it CUDA-graph stages
        "the core runtime reaches the GPU layer only in the assembly",
        lambda m: _under("specpair.runtime")(m) and not _gpu(m) and m not in ASSEMBLY,
        lambda m, d: _gpu(d),
        allowed={
            ("specpair.runtime.kv_cache", "specpair.runtime.gpu.attention"): (
                "the cache makes its own attention backends (`Backends`: SDPA on the CPU, "
                "flashinfer or Triton on a GPU), and `KVCache(...)` is built so in parallel/"
            ),
        },
    ),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_the_packages_import_one_way(rule: Rule) -> None:
    wrong = rule.broken(_graph())
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_allowed_exception_is_still_needed(rule: Rule) -> None:
    graph = _graph()
    stale = [f"{m} -> {d}" for m, d in rule.allowed if d not in graph.get(m, set())]
    assert not stale, "allowed, but no longer imported: " + ", ".join(stale)


BREAKING = {  # an edge each rule must refuse
    "the shared package imports no service": ("specpair.cli.main", "target_service.server"),
    "no service imports another": ("controller.service.server", "draft_service.rounds"),
    "the runtime imports no config": ("specpair.runtime.engine", "specpair.config.target"),
    "the core runtime reaches the GPU layer only in the assembly": (
        "specpair.runtime.target.worker",
        "specpair.runtime.gpu.prefill_graphs",
    ),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_refuses_an_edge_that_breaks_it(rule: Rule) -> None:
    m, d = BREAKING[rule.name]
    graph = {m: {d}, d: set(), "specpair.runtime.build": {"specpair.runtime.gpu.capture"}}
    assert rule.broken(graph) == [f"{m} -> {d}"]


def test_the_walker_sees_imports_in_functions_and_from_imports(tmp_path: Path) -> None:
    """The rules see what `_imports` finds: `from a import b` (b a module or a name), and
    imports inside functions and under TYPE_CHECKING."""
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from specpair.runtime import kv_cache\n"
        "if TYPE_CHECKING:\n"
        "    from specpair.config.target import TargetConfig\n"
        "def f():\n"
        "    from target_service.batching.scheduler import Scheduler\n"
        "    import specpair.runtime.gpu.attention\n"
    )
    found = _imports(module, _modules())
    assert {
        "specpair.runtime.kv_cache",
        "specpair.config.target",
        "target_service.batching.scheduler",
        "specpair.runtime.gpu.attention",
    } <= found


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
