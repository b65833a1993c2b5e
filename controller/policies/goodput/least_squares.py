"""Least-squares lines through a few (x, y) points: the goodput cost model's verify time by the
tokens a request verifies."""

from __future__ import annotations


def line_at(points: dict[int, float], x: int) -> float:
    """Least-squares line through `points` at x; flat with one point, 0 with none.

    {1: 10, 3: 14} at 7 → 22 (slope 2).
    """
    if not points:
        return 0.0
    if x in points:
        return points[x]
    if len(points) == 1:
        return next(iter(points.values()))
    n = len(points)
    mx, my = sum(points) / n, sum(points.values()) / n
    return my + slope(points) * (x - mx)


def slope(points: dict[int, float]) -> float:
    """The least-squares slope through `points`; 0 below two points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(points) / n, sum(points.values()) / n
    sxx = sum((p - mx) ** 2 for p in points)
    return sum((p - mx) * (v - my) for p, v in points.items()) / sxx
