"""The capabilities table (`specpair/capabilities.py`) is what is served: every
combination of the mode axes either builds (target config, draft config and checkpoint, policy)
or is refused with the table's reason naming its field; and the places that used to refuse on
their own conditions now read the table."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from controller.policies.bands import PolicySpec
from controller.policies.request_tiers import RequestTiers
from specpair import capabilities as caps
from specpair.capabilities import (
    ACCEPTS,
    AXES,
    REFUSALS,
    Device,
    Draft,
    Modes,
    Policy,
    Tiers,
    UnsupportedModes,
    combinations,
    refusal,
)
from specpair.config import DraftConfig, DraftKind, ServerConfig, TargetConfig
from specpair.runtime import build
from specpair.runtime.target.accepting import ACCEPT_PATHS

ROOT = Path(__file__).resolve().parents[2]
SERVER = ServerConfig("127.0.0.1:0")
TREE = "4x4x16"
# What `eagle_layout` reads off a head's files, per draft kind (a draft LM: none).
LAYOUT = {Draft.MODEL: None, Draft.EAGLE: "specpair", Draft.EAGLE3: "eagle3"}


def deploy(m: Modes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Configures what `m` names, in a deployment's order: the target, the draft (its config,
    then its checkpoint), the policy."""
    trees = (TREE,) if m.tiers is Tiers.TREES else ()
    assert m.device is not None and m.draft is not None
    TargetConfig(
        SERVER,
        Path("target"),
        device=str(m.device),
        tree_shapes=trees,
        draft_address=None if m.draft is Draft.NONE else "127.0.0.1:50052",
        deterministic=bool(m.deterministic),
        tensor_parallel=2 if m.tensor_parallel else 1,
    )
    if m.draft is not Draft.NONE:
        draft = DraftConfig(
            SERVER,
            Path("head"),
            device=str(m.device),
            tree_shapes=trees,
            draft_kind=DraftKind.MODEL if m.draft is Draft.MODEL else DraftKind.EAGLE,
            target_path=Path("target") if m.target_model else None,
            token_map=Path("map.json") if m.token_map else None,
        )
        monkeypatch.setattr(build, "eagle_layout", lambda path: LAYOUT[m.draft])
        try:
            build.check_drafter(draft.model_path, draft.target_path, draft.token_map)
        except build.CheckpointError as exc:  # the checkpoint's line: its path, then the field
            found = refusal(m)
            assert found is not None and str(exc) == f"head: {found.message}", m
            raise UnsupportedModes(found) from None
    if m.policy is Policy.REQUEST:
        RequestTiers({"candidate_steps": [0, 1, 3], "tree_shapes": list(trees)}, 3)
    else:
        PolicySpec.from_mapping({"kind": str(m.policy), "tree_shapes": list(trees)})


def test_every_combination_is_served_or_refused_with_the_tables_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = served = 0
    first: set[int] = set()  # the rows that refused first, by index
    for m in combinations():
        expected = refusal(m)
        if expected is None:
            deploy(m, monkeypatch)
            served += 1
            continue
        with pytest.raises(UnsupportedModes) as raised:
            deploy(m, monkeypatch)
        assert raised.value.refusal is expected, m
        assert str(raised.value).startswith(f"{expected.field}: "), m
        refused += 1
        first.add(REFUSALS.index(expected))
    assert served + refused == 2 * 4 * 2 * 2 * 2 * 2 * 2 * 3  # every axis' every value
    # A walk that refused nothing, or everything, would prove nothing; a row that is never the
    # first to refuse is dead.
    assert served > 0 and refused > 0
    assert first == set(range(len(REFUSALS)))


def test_the_table_serves_and_refuses_what_the_modes_mean() -> None:
    gpu = Modes(device=Device.CUDA, deterministic=True, tiers=Tiers.CHAINS, tensor_parallel=False)
    assert refusal(gpu) is None  # the batch-invariant mode: one GPU, chains
    for changed, field in [
        (Modes(device=Device.CPU, deterministic=True), "deterministic"),
        (Modes(deterministic=True, tiers=Tiers.TREES), "tree_shapes"),
        (Modes(deterministic=True, tensor_parallel=True), "tensor_parallel"),
        (Modes(draft=Draft.EAGLE3, target_model=False), "target_path"),
        (Modes(draft=Draft.MODEL, token_map=True), "token_map"),
        (Modes(draft=Draft.EAGLE3, token_map=True, target_model=True), "token_map"),
        (Modes(policy=Policy.SGLANG, tiers=Tiers.TREES), "tree_shapes"),
        (Modes(policy=Policy.REQUEST, tiers=Tiers.TREES), "tree_shapes"),
    ]:
        found = refusal(changed)
        assert found is not None and found.field == field, changed
    # served: trees with the goodput kind, a token map on an EAGLE-1/2 head, the target alone
    assert refusal(Modes(policy=Policy.GOODPUT, tiers=Tiers.TREES)) is None
    assert refusal(Modes(draft=Draft.EAGLE, token_map=True, target_model=True)) is None
    assert refusal(Modes(draft=Draft.NONE, token_map=True, target_model=False)) is None
    # an axis the caller does not know never fires a row: the target cannot know the draft's
    assert refusal(Modes(token_map=True)) is None


def test_every_row_names_known_axes_and_a_field_of_a_config() -> None:
    fields = {
        *TargetConfig.__dataclass_fields__,
        *DraftConfig.__dataclass_fields__,
        "tree_shapes",  # the policies' key too
    }
    for row in REFUSALS:
        assert set(row.when) <= set(AXES) and row.when, row
        assert all(values <= set(AXES[a]) for a, values in row.when.items()), row
        assert row.field in fields, row


def _literals(path: Path) -> list[str]:
    """Every string constant of a module but its docstrings (f-strings' literal parts
    included): what a message may be built from."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def _imports_capabilities(path: Path) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.module == "specpair.capabilities"
        for n in ast.walk(ast.parse(path.read_text()))
    )


# The sites that carried a condition and a string of their own before the table.
SITES = (
    "specpair/config/target.py",
    "specpair/config/draft.py",
    "specpair/runtime/build.py",
    "controller/policies/bands.py",
    "controller/policies/request_tiers.py",
)


def test_the_old_refusal_sites_read_the_table_and_hold_no_reason_of_their_own() -> None:
    for site in SITES:
        assert _imports_capabilities(ROOT / site), f"{site} no longer reads the capabilities"
    assert not hasattr(importlib.import_module("controller.policies.sglang"), "refuse_tree_shapes")
    table = ROOT / "specpair/capabilities.py"
    # The reasons' openings, and the old sites' own phrasings of them.
    phrases = [row.reason[:40] for row in REFUSALS] + [
        "is a GPU mode",
        "serves chains only",
        "chooses among chains by accept length",
        "per-request tiers are chains",
        "needs the target checkpoint",
        "token map applies",
        "token_map applies",
        "target checkpoint path is required",
    ]
    copies = [
        f"{path.relative_to(ROOT)}: {phrase!r}"
        for package in ("specpair", "target_service", "draft_service", "controller")
        for path in (ROOT / package).rglob("*.py")
        if path != table and "proto" not in path.relative_to(ROOT).parts[:2]
        for text in _literals(path)
        for phrase in phrases
        if phrase in text
    ]
    assert not copies, "a refusal outside the table:\n" + "\n".join(copies)


def test_the_site_check_would_see_a_copy(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(f'raise ValueError(f"{{x}}: {REFUSALS[0].reason[:40]}")\n')
    assert any(REFUSALS[0].reason[:40] in text for text in _literals(module))
    assert not _imports_capabilities(module)


def test_accepts_list_every_accept_path_and_its_rule() -> None:
    from specpair.runtime import accept

    assert {p for a in ACCEPTS for p in a.paths} == set(ACCEPT_PATHS)
    assert all(hasattr(accept, a.rule) for a in ACCEPTS)
    assert caps.__doc__ is not None and all(axis in caps.__doc__ for axis in AXES)
