"""When a replica takes part in an outer round: due, early (another opened it), or held back; and how long it waits.

Pure rules over a replica's ``SyncState`` and its stage's records; ``ReplicaSync.run`` polls them.

    >>> round_call(steps_taken(state, holder.inner_steps), horizon, held=hold_back(state, round_=7, now=now) is not None)
    'open'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from swarm.dht.records import StageStatus
from swarm.outer.group import RoundTiming
from swarm.outer.sync_state import SyncState

# open: this replica opens its round (or joins it); join: it joins if another has opened it; wait: too few steps
RoundCall = Literal["open", "join", "wait"]


def steps_taken(state: SyncState, inner_steps: int) -> int:
    """Inner steps since the last snapshot or download: this replica's share of its next round."""
    return inner_steps - state.synced_at


def round_call(taken: int, horizon: int, *, held: bool) -> RoundCall:
    """Whether a replica with ``taken`` of its ``horizon`` steps opens its round, joins one another opened (with H/2:
    the fastest sets the pace), or waits. A due round ``held`` back (``hold_back``) still joins one another opened.

    One with fewer than H/2 steps sits the round out and downloads its result: its small Δ would count as much as the
    others' in the mean."""
    if taken >= horizon and not held:
        return "open"
    return "join" if taken >= (horizon + 1) // 2 else "wait"


def hold_back(state: SyncState, *, round_: int, now: float) -> float | None:
    """Until when (monotonic) a replica at ``round_`` holds its due round back; None: it does not (any longer).

    After a round done alone while other replicas were listed (``alone_until``), the others were a round behind
    (finishing their last round, or late to this replica's): opening the next round at once would take this replica
    through it alone again, just before they arrive, round after round: two halves of the stage a round apart, each
    following no claim of the other (one behind; one lone). It waits until one of them reaches its round (its record;
    its declaration is ``window_open``'s to see), nobody is listed, or the bound passes; then it meets them at its
    round, or follows their claim there."""
    if state.alone_until is None:
        return None
    caught_up = any(status.outer_round >= round_ for status in state.others.values())
    if caught_up or not state.others or now >= state.alone_until:
        return None
    return state.alone_until


def hold_after_round(alone: bool, others: Mapping[str, StageStatus], *, now: float, wait_s: float) -> float | None:
    """The hold-back (``hold_back``) a round done leaves: ``wait_s`` from ``now`` after one done alone while
    ``others`` were listed, else none."""
    return now + wait_s if alone and others else None


def progress_wait_s(timing: RoundTiming, announce_period_s: float) -> float:
    """How long a replica waits for others to get past a round (``ReplicaSync.await_progress``) or reach its round
    (``hold_back``): a round's longest, and two announce periods for their records to show it."""
    return timing.max_round_s + 2 * announce_period_s


def progress_possible(others: Mapping[str, StageStatus], round_: int, *, leader: str | None) -> bool:
    """Whether, after its late or failed ``round_``, another replica may yet get past it: one is listed at that round
    or later, or the round's ``leader`` is listed at all (its record lags by up to an announce period: it has likely
    finished the round). Else the partner left, and nobody gets past the round without this replica."""
    return leader in others or any(status.outer_round >= round_ for status in others.values())
