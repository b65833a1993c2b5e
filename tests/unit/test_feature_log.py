"""The target's per-request feature rows: appends grow one buffer, reads are views."""

import torch

from specpair.runtime.target.features import FeatureLog


def test_rows_since_a_position_match_the_concatenated_history() -> None:
    log = FeatureLog()
    chunks = [torch.randn(n, 8) for n in (70, 1, 3, 130, 2)]  # crosses two regrowths
    for i, chunk in enumerate(chunks):
        log.append(chunk)
        history = torch.cat(chunks[: i + 1])
        assert log.length == len(history)
        for start in (-1, 0, len(history) - 3, len(history)):
            assert torch.equal(log.since(start), history[max(start, 0) :])


def test_a_read_is_a_view_and_keeps_the_dtype() -> None:
    log = FeatureLog()
    log.append(torch.ones(4, 2, dtype=torch.bfloat16))
    rows = log.since(2)
    assert rows.dtype == torch.bfloat16
    assert rows.untyped_storage().data_ptr() == log.since(0).untyped_storage().data_ptr()
