"""One round's answers from several draft replicas, merged into one RoundResponse: trees
and refusals united, each stage's time the slowest replica's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from specpair.runtime.round_messages import RoundResponse, StageTimings
from specpair.runtime.tree import CandidateTree


def merge(
    round_id: int, answers: Sequence[tuple[str, RoundResponse | None]]
) -> RoundResponse | None:
    """The replicas' answers, (address, its answer or None when none came), as one; None when
    none came. The round is an error only when every replica's is."""
    answered = [(address, r) for address, r in answers if r is not None]
    if not answered:
        return None
    trees: dict[str, CandidateTree] = {}
    malformed: dict[str, str] = {}
    refused: dict[str, str] = {}
    errors = []
    for address, r in answered:
        if r.error:  # that replica dropped its inputs: no tree, so each is sent whole again
            errors.append(f"{address}: {r.error}")
            continue
        trees |= r.trees
        malformed |= r.malformed
        refused |= r.refused
    error = "; ".join(errors) if len(errors) == len(answers) else ""
    timings = slowest([r.timings for _, r in answered])
    return RoundResponse(round_id, trees, timings, error, malformed, refused)


def slowest(timings: Sequence[StageTimings]) -> StageTimings:
    """A round waits for its slowest replica: each stage's time, the largest of the replicas'."""
    names = [f.name for f in fields(StageTimings)]
    return StageTimings(**{name: max(getattr(t, name) for t in timings) for name in names})
