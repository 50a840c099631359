"""Rendezvous placement of shards and repair plans."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from coordinator_free.placement import (
    Placement,
    hrw_score,
    place,
    rank,
    repair_plan,
    tolerated_losses,
)
from hypothesis import given, settings
from hypothesis import strategies as st

orgs = st.lists(st.sampled_from([f"org{i}" for i in range(12)]), min_size=1, unique=True)


def test_hrw_score_is_a_fixed_function() -> None:
    assert hrw_score("a/state/1#0", "b") == hrw_score("a/state/1#0", "b")
    assert hrw_score("a/state/1#0", "b") != hrw_score("a/state/1#0", "c")
    assert rank("k", ["b", "a", "c", "a"]) == sorted(
        {"a", "b", "c"}, key=lambda c: -hrw_score("k", c)
    )


@settings(max_examples=80, deadline=None)
@given(members=orgs, n=st.integers(1, 8))
def test_place_spreads_evenly_and_is_deterministic(members: list[str], n: int) -> None:
    placement = place("o/state/3", n, members)
    assert placement == place("o/state/3", n, list(reversed(members)))
    loads = Counter(placement.holders)
    assert set(loads) <= set(members)
    assert max(loads.values()) - min(loads.values()) <= 1
    if len(members) >= n:
        assert len(set(placement.holders)) == n


@settings(max_examples=80, deadline=None)
@given(
    members=st.lists(
        st.sampled_from([f"org{i}" for i in range(14)]), min_size=8, max_size=14, unique=True
    ),
    k=st.integers(1, 4),
    m=st.integers(0, 3),
    lost=st.integers(0, 3),
)
def test_after_repair_any_m_losses_are_survivable(
    members: list[str], k: int, m: int, lost: int
) -> None:
    placement = place("o/state/1", k + m, members)
    gone = set(placement.holders[:lost])
    live = [x for x in members if x not in gone]
    plan = repair_plan(placement, live)
    # Only shards of lost holders move, each to a live member holding nothing yet.
    assert set(plan.moves) == {i for i, h in enumerate(placement.holders) if h in gone}
    assert set(plan.after.holders) <= set(live)
    loads = Counter(plan.after.holders)
    assert max(loads.values()) - min(loads.values()) <= 1 or len(live) > k + m
    if len(live) < k + m:
        return
    assert len(set(plan.after.holders)) == k + m
    assert plan.after.tolerated_losses(k) == m
    for failed in itertools.combinations(set(plan.after.holders), m):
        assert sum(1 for h in plan.after.holders if h not in failed) >= k


def test_repair_keeps_live_holders_and_is_empty_when_nothing_failed() -> None:
    placement = place("o/state/1", 5, [f"p{i}" for i in range(8)])
    plan = repair_plan(placement, [f"p{i}" for i in range(8)])
    assert plan.empty and plan.after == placement


def test_repair_spreads_after_a_join() -> None:
    crowded = Placement("o/state/1", ("a", "b", "a", "b", "c"))
    assert crowded.tolerated_losses(3) == 1
    plan = repair_plan(crowded, ["a", "b", "c", "d", "e"])
    assert len(set(plan.after.holders)) == 5
    assert len(plan.moves) == 2
    assert plan.after.tolerated_losses(3) == 2
    for index, (old, new) in plan.moves.items():
        assert crowded.holders[index] == old and plan.after.holders[index] == new


def test_repair_with_fewer_live_members_than_shards() -> None:
    placement = place("o/state/1", 6, [f"p{i}" for i in range(6)])
    plan = repair_plan(placement, ["p0", "p1", "p2"])
    assert set(plan.after.holders) == {"p0", "p1", "p2"}
    assert Counter(plan.after.holders).most_common(1)[0][1] == 2
    assert plan.after.tolerated_losses(4) == 1


@pytest.mark.parametrize(
    ("holders", "k", "expected"),
    [
        (("a", "b", "c", "d", "e", "f"), 4, 2),
        (("a", "a", "b", "c", "d", "e"), 4, 1),
        (("a", "a", "a", "b", "c", "d"), 4, 0),
        (("a", "", "b", "c", "d", "e"), 4, 1),
        (("a", "", "", "", "", ""), 4, -1),
        (("a", "b", "c", "d"), 4, 0),
    ],
)
def test_tolerated_losses(holders: tuple[str, ...], k: int, expected: int) -> None:
    assert tolerated_losses(holders, k) == expected


def test_place_needs_candidates() -> None:
    with pytest.raises(ValueError):
        place("x", 3, [])
    with pytest.raises(ValueError):
        place("x", 0, ["a"])
    plan = repair_plan(Placement("x", ("a", "b")), [])
    assert plan.empty


def test_minimal_disruption_when_a_member_joins() -> None:
    """A new member takes only the shards it now wins; nothing else moves."""
    members = [f"p{i}" for i in range(10)]
    placement = place("o/state/9", 6, members)
    plan = repair_plan(placement, [*members, "p10"])
    assert plan.empty  # everyone live, nobody doubly loaded: nothing to do
    assert shards_moved(placement, place("o/state/9", 6, [*members, "p10"])) <= 6


def shards_moved(a: Placement, b: Placement) -> int:
    return sum(1 for x, y in zip(a.holders, b.holders, strict=True) if x != y)
