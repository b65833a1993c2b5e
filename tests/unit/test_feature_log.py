"""The target's per-request feature rows: appends keep the rows they are given, the usual read
is a view of the last of them, older ones fold into one buffer, and `trim` lets go of rows."""

import gc
import weakref

import pytest
import torch

from specpair.runtime.target.features import FOLD_AT, FeatureLog


def test_rows_since_a_position_match_the_concatenated_history() -> None:
    log = FeatureLog()
    sizes = [70, 1, 3, 130, 2, *([5] * (2 * FOLD_AT)), 1]  # folds twice, the buffer regrows
    chunks = [torch.randn(n, 8) for n in sizes]
    for i, chunk in enumerate(chunks):
        log.append(chunk)
        history = torch.cat(chunks[: i + 1])
        assert log.length == len(history)
        for start in (-1, 0, 69, 71, len(history) - 7, len(history) - 3, len(history)):
            assert torch.equal(log.since(start), history[max(start, 0) :])


def test_an_append_copies_nothing_and_the_usual_round_reads_a_view_of_it() -> None:
    log = FeatureLog()
    prompt, verified = torch.ones(4, 2, dtype=torch.bfloat16), torch.zeros(3, 2)
    log.append(prompt)
    assert log.since(2).dtype == torch.bfloat16
    assert log.since(3).data_ptr() == prompt[3:].data_ptr()  # the row before the first output
    log.append(verified.bfloat16())
    rows = log.since(4)  # what the next round sends: the rows the verify appended
    assert rows.untyped_storage().data_ptr() == log.since(5).untyped_storage().data_ptr()
    assert torch.equal(log.since(3), torch.cat([prompt[3:], verified.bfloat16()]))


def test_folding_lets_go_of_the_read_backs_the_rows_came_in() -> None:
    """A verify's read-back holds every request's rows; a log keeps its views only for its last
    FOLD_AT rounds, then copies them, so the batch's read can be freed."""
    log = FeatureLog()
    batch = torch.randn(64, 8)  # one round's read, 64 requests' rows
    read = weakref.ref(batch)
    log.append(batch[:5])
    del batch
    gc.collect()
    assert read() is not None  # the view holds it
    for _ in range(FOLD_AT):
        log.append(torch.randn(5, 8))
    gc.collect()
    assert read() is None
    assert log.since(0).shape == (5 + 5 * FOLD_AT, 8)


def test_trimmed_rows_are_refused_by_position_and_the_rest_still_read() -> None:
    log = FeatureLog()
    chunks = [torch.randn(n, 4) for n in (10, 3, 3, 3)]
    for chunk in chunks:
        log.append(chunk)
    history = torch.cat(chunks)
    log.trim(12)  # only whole chunks go: the prompt's 10 rows
    assert log.first == 10
    with pytest.raises(ValueError, match="position 9"):
        log.since(9)
    assert torch.equal(log.since(10), history[10:])
    log.trim(100)  # the last chunk stays
    assert log.first == 16 and torch.equal(log.since(16), history[16:])
    for _ in range(FOLD_AT + 1):  # into the buffer, then past it
        log.append(torch.randn(2, 4))
    start = log.first
    log.trim(start + 1)  # the buffer is not all before it: kept
    assert log.first == start
    log.trim(log.length)
    assert log.first == log.length - 2
