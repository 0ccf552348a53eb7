"""The optimizer's one Pareto filter and the frontiers built on it, against brute force."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ken.models.cascade import Cascade
from ken.optimizer.gen_planner import GenCandidate, pareto
from ken.optimizer.pareto import pareto_front
from ken.optimizer.planner import pareto_plans

# small grids so that ties and exact duplicates are common
POINTS = st.lists(
    st.tuples(st.integers(0, 6).map(lambda a: a / 6), st.integers(0, 6).map(float)),
    max_size=30,
)


def brute_pareto(points: list[tuple[float, float]]) -> set[tuple[float, float]]:
    """Distinct (quality, cost) points that no other point dominates."""
    front = set()
    for a, c in points:
        dominated = any(
            (a2 >= a and c2 <= c) and (a2 > a or c2 < c) for a2, c2 in points
        )
        if not dominated:
            front.add((a, c))
    return front


def first_of_each(points: list[tuple[float, float]]) -> list[int]:
    """Index of the first occurrence of each point of the brute-force front."""
    front = brute_pareto(points)
    return [i for i, p in enumerate(points) if p in front and points.index(p) == i]


@settings(max_examples=200, deadline=None)
@given(POINTS)
def test_pareto_front_matches_brute_force(points: list[tuple[float, float]]) -> None:
    front = pareto_front(points)
    chosen = [points[i] for i in front]
    assert set(chosen) == brute_pareto(points)
    assert len(chosen) == len(set(chosen))  # one index per distinct point
    costs = [c for _, c in chosen]
    accs = [a for a, _ in chosen]
    assert all(a < b for a, b in itertools.pairwise(costs))
    assert all(a < b for a, b in itertools.pairwise(accs))
    # exact duplicates resolve to the first occurrence
    assert all(points.index(points[i]) == i for i in front)


def test_pareto_front_ties() -> None:
    # equal accuracy: keep the cheaper; equal cost: keep the more accurate
    assert pareto_front([(0.5, 2.0), (0.5, 1.0), (0.7, 1.0), (0.9, 3.0)]) == [2, 3]
    assert pareto_front([]) == []
    with pytest.raises(ValueError):
        pareto_front([(math.nan, 1.0)])


@settings(max_examples=100, deadline=None)
@given(POINTS)
def test_gear_plan_frontier_is_the_brute_force_front_by_p95(
        points: list[tuple[float, float]]) -> None:
    plans = [SimpleNamespace(predicted=SimpleNamespace(accuracy=a, p95_ms=c))
             for a, c in points]
    want = sorted(first_of_each(points), key=lambda i: points[i][1])
    assert [id(p) for p in pareto_plans(plans)] == [id(plans[i]) for i in want]


@settings(max_examples=100, deadline=None)
@given(POINTS)
def test_generation_candidates_are_the_brute_force_front_most_accurate_first(
        points: list[tuple[float, float]]) -> None:
    found = [GenCandidate(Cascade((f"m{i}",)), q, w) for i, (q, w) in enumerate(points)]
    want = sorted(first_of_each(points), key=lambda i: -points[i][0])
    assert pareto(found) == [found[i] for i in want]
