"""A step travels to the followers as bytes (`lockstep.encode`): every host tensor of it comes
back with its dtype, shape and values, contiguous or not, and writable (a follower's loads and
plans read them as its own)."""

from __future__ import annotations

import torch

from specpair.parallel.lockstep import (
    Apply,
    Commit,
    GraphLoad,
    GraphPlan,
    Replay,
    Step,
    decode,
    encode,
)
from specpair.runtime.layout import BatchLayout


def test_a_step_comes_back_whole() -> None:
    layout = BatchLayout.causal([3, 5], [200, 17], [8, 2])  # a bool mask [2, 8, 8], long rows
    rows = torch.arange(24).view(4, 6).t()  # not contiguous
    plan = Step((Commit(3, 190, (0, 1, 2)), GraphPlan(17, 0, layout)), Apply())
    load = Step(
        (
            GraphLoad(17, "tokens", rows),
            GraphLoad(17, "rows", (torch.tensor([0.5, -1.25]), torch.zeros((), dtype=torch.int32))),
        ),
        Replay(17),
    )
    got_plan, got_load = decode(encode(plan)), decode(encode(load))
    assert got_plan.op == Apply() and got_plan.changes[0] == Commit(3, 190, (0, 1, 2))
    sent, back = plan.changes[1].layout, got_plan.changes[1].layout  # type: ignore[union-attr]
    for name in ("slots", "starts", "new_mask"):
        a, b = getattr(sent, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    tokens, pair = got_load.changes[0].src, got_load.changes[1].src  # type: ignore[union-attr]
    assert torch.equal(tokens, rows) and tokens.shape == (6, 4)
    assert torch.equal(pair[0], torch.tensor([0.5, -1.25])) and pair[1].dtype == torch.int32
    assert pair[1].shape == () and got_load.op == Replay(17)
    tokens += 1  # writable: no warning, no error
