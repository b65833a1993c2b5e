"""Runtime states hold their workers' stages, built at start-up and counted by the builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair.runtime.build import StateBuilder, build_drafter, build_states, build_target
from specpair.runtime.draft.eager import EagerDraft, EagerExtend
from specpair.runtime.engine import GREEDY
from specpair.runtime.round_messages import DraftInput
from specpair.runtime.target.verify import EagerVerify
from specpair.runtime.target.worker import TargetSequence
from specpair.runtime.tree import EMPTY_TREE


def test_builder_builds_complete_eager_states_and_counts_them(ckpts: dict[str, Path]) -> None:
    worker = build_target(ckpts["target"], max_requests=2, max_len=64)
    drafter = build_drafter(ckpts["draft"], target_path=None, max_requests=2, max_len=64)
    builder = StateBuilder(worker, drafter)
    states = builder.build_all([3, 0, 1, 3])
    assert sorted(states) == [0, 1, 3] and builder.builds == 3 and builder.captures == 0
    for tier, state in states.items():
        assert isinstance(state.verify, EagerVerify) and state.verify.cache is worker.cache
        assert isinstance(state.extend, EagerExtend) and state.extend.cache is drafter.cache
        assert isinstance(state.draft, EagerDraft) and state.draft.tier == tier
        assert state.chain_parents == tuple(range(-1, tier))
    assert states[0].chain_parents == (-1,) and states[0].chain_mask.tolist() == [[True]]
    with pytest.raises(ValueError, match="tier"):
        builder.build(-1)


def test_a_state_serves_only_the_workers_it_was_built_for(ckpts: dict[str, Path]) -> None:
    worker = build_target(ckpts["target"], max_requests=2, max_len=64)
    other = build_target(ckpts["target"], max_requests=2, max_len=64)
    drafter = build_drafter(ckpts["draft"], target_path=None, max_requests=2, max_len=64)
    target_only = build_states([3], worker)[3]
    assert target_only.extend is None and target_only.draft is None
    item = DraftInput("r", (5, 6, 7), GREEDY)
    with pytest.raises(RuntimeError, match="without a drafter"):
        drafter.draft([item], target_only)
    seq = TargetSequence("r", [5, 6, 7], GREEDY, max_new_tokens=4)
    other.prefill([seq])
    with pytest.raises(RuntimeError, match="another target worker"):
        other.verify([seq], [EMPTY_TREE], target_only)
    assert len(other.verify([seq], [EMPTY_TREE], None)[0].new_tokens) == 1  # plain decoding
