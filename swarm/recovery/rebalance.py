"""SWARM rebalancing: which stage a server should move to so that the slowest stage speeds up (pure code).

Every server applies ``plan_move``'s deterministic rule to (nearly) the same snapshot of per-stage throughput,
so at most one of them moves per period, and only when the move lifts the bottleneck by a margin. Why it
works: docs/architecture.md, recovery/.

    >>> plan_move({1: [StageLoad(peer_id="a", throughput=40.0)], 2: [...]}, "a")  # the stage "a" moves to, or None
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StageLoad:
    """One stage server's published load."""

    peer_id: str
    throughput: float  # samples/s EMA

    def __post_init__(self) -> None:
        if not (math.isfinite(self.throughput) and self.throughput >= 0):
            raise ValueError(f"throughput of {self.peer_id!r} must be finite and non-negative, got {self.throughput}")


Snapshot = Mapping[int, Sequence[StageLoad]]  # middle stage 1..S → its servers (an empty list if none)


def stage_totals(snapshot: Snapshot) -> dict[int, float]:
    """Total samples/s per stage, after checking the snapshot covers stages 1..S and lists each peer once."""
    stages = sorted(snapshot)
    if stages != list(range(1, len(stages) + 1)):
        raise ValueError(
            f"snapshot must have exactly the stages 1..S (an empty list for a stage nobody serves), got {stages}"
        )
    counts = Counter(load.peer_id for loads in snapshot.values() for load in loads)
    repeated = sorted(peer for peer, n in counts.items() if n > 1)
    if repeated:  # a peer caught mid-move: the caller keeps only its freshest record
        raise ValueError(f"peers listed more than once in the snapshot: {repeated}")
    return {stage: sum(load.throughput for load in loads) for stage, loads in snapshot.items()}


def bottleneck(snapshot: Snapshot) -> int:
    """The stage with the least total throughput; an empty stage is the worst; ties go to the lowest index."""
    totals = stage_totals(snapshot)
    return min(totals, key=lambda stage: (len(snapshot[stage]) > 0, totals[stage], stage))


def choose_stage_for_newcomer(snapshot: Snapshot) -> int:
    """The stage a joining server (``--role auto``) takes: the bottleneck, where throughput is scarcest.

    No hysteresis here: a newcomer adds throughput wherever it goes, so it simply goes where it helps most.
    """
    return bottleneck(snapshot)


def plan_move(snapshot: Snapshot, me: str, *, margin: float = 0.1) -> int | None:
    """The stage ``me`` should move to, or None to stay.

    Only one peer of the snapshot gets a stage back: the least-loaded member (least throughput,
    then smallest peer id) of the donor stage, the stage with the highest total among those with at
    least two replicas — a stage with one replica has nothing to spare, however fast it is. The
    move must fill an empty bottleneck stage, or raise the minimum stage total to at least
    ``(1 + margin)`` times what it was. A peer that is not in the snapshot stays.
    """
    if margin < 0:
        raise ValueError(f"margin must be non-negative, got {margin}")
    totals = stage_totals(snapshot)
    target = bottleneck(snapshot)
    donors = [stage for stage, loads in snapshot.items() if len(loads) >= 2 and stage != target]
    if not donors:
        return None
    donor = max(donors, key=lambda stage: (totals[stage], -stage))  # ties: the lowest index, as everyone computes
    mover = min(snapshot[donor], key=lambda load: (load.throughput, load.peer_id))
    if mover.peer_id != me:
        return None
    if not snapshot[target]:
        return target  # a stage with no replica is a hole in every path: filling it beats any throughput
    after = dict(totals)
    after[donor] -= mover.throughput
    after[target] += mover.throughput
    old_min, new_min = totals[target], min(after.values())
    return target if new_min > old_min and new_min >= (1 + margin) * old_min else None


def next_check_delay(period_s: float, rng: random.Random, jitter: float = 0.2) -> float:
    """Seconds until the next rebalancing check: ``period_s`` ± ``jitter``·``period_s``, uniform.

    The jitter keeps servers that started together from all reading the DHT at the same instant.
    """
    if not period_s > 0:
        raise ValueError(f"period_s must be positive, got {period_s}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    return period_s * (1 + rng.uniform(-jitter, jitter))
