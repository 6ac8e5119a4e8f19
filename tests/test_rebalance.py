"""SWARM rebalancing: one peer moves, towards the bottleneck, never emptying a stage (pure, deterministic)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.recovery.rebalance import (
    Snapshot,
    StageLoad,
    bottleneck,
    choose_stage_for_newcomer,
    next_check_delay,
    plan_move,
    stage_totals,
)


def snap(*stages: dict[str, float]) -> dict[int, list[StageLoad]]:
    """``snap({"a": 10}, {})`` → stage 1 served by a at 10 samples/s, stage 2 empty."""
    return {
        i: [StageLoad(peer_id=p, throughput=t) for p, t in loads.items()] for i, loads in enumerate(stages, start=1)
    }


def plans(snapshot: Snapshot, margin: float = 0.1) -> dict[str, int]:
    """The move every peer of the snapshot plans, for the peers that plan one."""
    peers = [load.peer_id for loads in snapshot.values() for load in loads]
    return {peer: stage for peer in peers if (stage := plan_move(snapshot, peer, margin=margin)) is not None}


def apply_move(snapshot: Snapshot, peer: str, stage: int) -> dict[int, list[StageLoad]]:
    """The snapshot after ``peer`` moved to ``stage``, keeping its throughput (plan_move's assumption)."""
    load = next(load for loads in snapshot.values() for load in loads if load.peer_id == peer)
    moved = {s: [x for x in loads if x.peer_id != peer] for s, loads in snapshot.items()}
    moved[stage].append(load)
    return moved


snapshots = st.integers(2, 5).flatmap(
    lambda num_stages: st.lists(
        st.tuples(st.integers(1, num_stages), st.sampled_from([0.0, 1.0, 2.5, 5.0, 10.0, 40.0])), max_size=12
    ).map(
        lambda peers: {
            s: [StageLoad(peer_id=f"p{i:02d}", throughput=t) for i, (ps, t) in enumerate(peers) if ps == s]
            for s in range(1, num_stages + 1)
        }
    )
)


# ---- bottleneck and newcomers -----------------------------------------------------------------------


def test_bottleneck_is_the_least_total_throughput_and_an_empty_stage_is_worst():
    assert bottleneck(snap({"a": 5, "b": 5}, {"c": 3}, {"d": 8})) == 2
    assert bottleneck(snap({"a": 0.0}, {}, {"d": 8})) == 2  # empty beats a zero-throughput stage
    assert bottleneck(snap({"a": 4}, {"b": 4}, {"c": 4})) == 1  # ties: lowest index
    assert choose_stage_for_newcomer(snap({"a": 5}, {"b": 1, "c": 1}, {"d": 8})) == 2


def test_snapshot_must_cover_stages_1_to_s_and_list_each_peer_once():
    with pytest.raises(ValueError, match="stages 1..S"):
        stage_totals({1: [], 3: []})
    with pytest.raises(ValueError, match="more than once.*'a'"):
        stage_totals(snap({"a": 1}, {"b": 1}) | {3: [StageLoad(peer_id="a", throughput=2)]})
    with pytest.raises(ValueError, match="finite"):
        StageLoad(peer_id="a", throughput=float("nan"))


# ---- plan_move ----------------------------------------------------------------------------------------


def test_exactly_the_least_loaded_member_of_the_richest_stage_moves_to_the_bottleneck():
    snapshot = snap({"a": 10, "b": 10, "c": 12}, {"d": 6, "e": 6}, {"f": 4})
    assert plans(snapshot) == {"a": 3}  # a and b tie at 10: the smallest peer id moves, b stays


def test_no_move_when_balanced_within_the_margin():
    snapshot = snap({"a": 10, "b": 1}, {"c": 10})  # moving b gives min(10, 11) = 10: no gain at all
    assert plans(snapshot) == {}
    close = snap({"a": 20, "b": 0.5}, {"c": 10})  # moving b lifts the min 10 → 10.5: below 1.1·10
    assert plans(close) == {} and plans(close, margin=0.0) == {"b": 2}
    assert plans(snap({"a": 10, "b": 4}, {"c": 10}, {"d": 10}), margin=0.1) == {}  # 10 → 10
    assert plans(snap({"a": 10, "b": 10}, {"c": 8}), margin=0.1) == {"a": 2}  # 8 → 10 ≥ 8.8
    assert plans(snap({"a": 10, "b": 10}, {"c": 8}), margin=0.5) == {}  # but not ≥ 12


def test_an_empty_stage_attracts_a_move_even_from_a_stage_other_than_the_fastest():
    # stage 1 is fastest but has a single replica; stage 2 can spare one
    assert plans(snap({"a": 100}, {"b": 3, "c": 2}, {})) == {"c": 3}
    assert plans(snap({"a": 0.0, "b": 0.0}, {})) == {"a": 2}  # even with nothing measured yet


def test_a_peer_outside_the_snapshot_stays():
    assert plan_move(snap({"a": 10, "b": 10}, {}), "zz") is None


def test_margin_must_be_non_negative():
    with pytest.raises(ValueError, match="margin"):
        plan_move(snap({"a": 1}), "a", margin=-0.1)


@settings(deadline=None, max_examples=300)
@given(snapshots, st.sampled_from([0.0, 0.1, 0.5]))
def test_at_most_one_peer_moves_it_never_empties_a_stage_and_the_bottleneck_does_not_drop(snapshot, margin):
    moves = plans(snapshot, margin)
    assert len(moves) <= 1  # no stampede
    for peer, stage in moves.items():
        old_stage = next(s for s, loads in snapshot.items() if any(x.peer_id == peer for x in loads))
        assert len(snapshot[old_stage]) >= 2 and stage != old_stage
        after = apply_move(snapshot, peer, stage)
        assert all(after[s] for s in snapshot if snapshot[s])  # no stage emptied
        assert min(stage_totals(after).values()) >= min(stage_totals(snapshot).values())


@settings(deadline=None, max_examples=100)
@given(snapshots)
def test_repeated_rebalancing_settles_and_fills_every_stage_when_there_are_enough_peers(snapshot):
    for _ in range(50):
        moves = plans(snapshot)
        if not moves:
            break
        snapshot = apply_move(snapshot, *moves.popitem())
    assert not plans(snapshot)  # settled (each move fills a stage or lifts the minimum: no cycles)
    if sum(map(len, snapshot.values())) >= len(snapshot):
        assert all(snapshot.values())


# ---- jittered period ----------------------------------------------------------------------------------


def test_next_check_delay_is_jittered_around_the_period_and_seeded():
    delays = [next_check_delay(60.0, random.Random(seed)) for seed in range(200)]
    assert all(48.0 <= d <= 72.0 for d in delays) and len(set(delays)) == 200
    assert next_check_delay(60.0, random.Random(7)) == next_check_delay(60.0, random.Random(7))
    assert next_check_delay(60.0, random.Random(7), jitter=0.0) == 60.0
    with pytest.raises(ValueError, match="jitter"):
        next_check_delay(60.0, random.Random(0), jitter=1.0)
    with pytest.raises(ValueError, match="period_s"):
        next_check_delay(0.0, random.Random(0))
