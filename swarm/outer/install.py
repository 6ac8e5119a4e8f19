"""How a replica installs an outer round's result or a downloaded state, and where that leaves its ``SyncState``.

The bookkeeping (``after_round_done``, ``after_round_missed``, ``lone_leader_is_late``) is pure; ``apply_round`` runs
a result through the outer optimizer on its thread, and the weights' arithmetic (``move_by``, ``keep_own_delta``,
``copy_into``, ``load_outer``) runs there or on the holder's compute thread. ``ReplicaSync.step`` and
``ReplicaSync.adopt`` call them in turn.

    >>> result = lone_leader_is_late(result, key, me)
    >>> state = after_round_done(state, result, me=me, entered=entered, inner_steps=40, hold_until=None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from optim.outer import OuterOptimizer, Screening
from swarm.dht.records import StageStatus
from swarm.outer.group import RoundKey, RoundResult
from swarm.outer.state import StageState, weights_hash
from swarm.outer.sync_state import SyncState
from swarm.outer.threads import OuterThread
from swarm.outer.trust import distance


def lone_leader(result: RoundResult, me: str) -> str | None:
    """The other replica whose payload alone made up the round's set, if so: it led the round alone."""
    return result.contributors[0] if len(result.contributors) == 1 and result.contributors != (me,) else None


def lone_leader_is_late(result: RoundResult, key: RoundKey, me: str) -> RoundResult:
    """A round done whose set is another replica's alone, as late: that leader kept its own weights (``apply_alone``),
    which applying its Δ here would not reproduce (rounding, or SparseLoCo's top-k of a dense move), and the two would
    stay apart for good, each in the other's last group. Its state does reproduce them: catch up by download."""
    if result.outcome == "done" and lone_leader(result, me) is not None:
        return dataclasses.replace(
            result, outcome="late", reason=f"the leader of {key} was alone in its set; its state is downloaded"
        )
    return result


def done_alone(result: RoundResult, me: str) -> bool:
    """Whether this replica's payload alone made up the round's set: its snapshot becomes the global weights."""
    return result.contributors == (me,)


def entered_with(others: Mapping[str, StageStatus], round_: int, global_hash: str) -> set[str]:
    """The other replicas whose records show them entering ``round_`` from the same global weights as this one."""
    return {peer for peer, s in others.items() if (s.outer_round, s.global_hash) == (round_, global_hash)}


def after_round_done(
    state: SyncState,
    result: RoundResult,
    *,
    me: str,
    entered: Collection[str],
    inner_steps: int,
    hold_until: float | None,
) -> SyncState:
    """``state`` after round ``result`` (done) is installed at ``inner_steps``: its contributors are the last group,
    those of them that ``entered`` it from this replica's global weights its same entry, and ``hold_until`` the
    hold-back it leaves (``pacing.hold_after_round``)."""
    return dataclasses.replace(
        state,
        synced_at=inner_steps,
        last_group=result.contributors,
        same_entry=tuple(p for p in result.contributors if p in entered or p == me),
        alone_until=hold_until,
    )


def after_round_missed(state: SyncState, *, progressed: bool, inner_steps: int) -> SyncState:
    """``state`` after a late or failed round: if no replica got past it (``progressed`` False), it is tried again after
    another H steps from ``inner_steps``; if one did, its state was adopted, which set ``synced_at`` already."""
    return state if progressed else dataclasses.replace(state, synced_at=inner_steps)


@dataclass(frozen=True)
class Applied:
    """A round's result as the outer optimizer took it: its ``Screening`` of the payloads (None alone), and the weights
    the local ones move to (``target``: the new global weights, plus this replica's Δ where the set lacked it; None
    alone: the local weights stay as they are)."""

    screening: Screening | None
    target: dict[str, torch.Tensor] | None


async def apply_round(
    outer: OuterOptimizer[Any],
    thread: OuterThread,
    state: SyncState,
    payloads: tuple[bytes, ...] | None,
    snapshot: dict[str, torch.Tensor],
    *,
    keep_own: bool = False,
) -> Applied:
    """Apply a round's result to ``outer`` on its ``thread`` (``payloads`` None: this replica's alone, its snapshot
    becomes global), and set ``state``'s global hash and move as soon as they are known. ``keep_own``: this replica's
    Δ is not in the set (it arrived after the leader's window closed): its local weights keep that progress for its
    next round to send."""
    if payloads is None:
        # nothing to agree on: the local weights, and the progress since the snapshot, stay as they are
        state.moved = await thread.run(distance, snapshot, outer.global_params)
        await thread.change(outer.apply_alone, snapshot)
        state.global_hash = await thread.run(weights_hash, outer.global_params)
        return Applied(screening=None, target=None)
    target = {name: torch.empty_like(t) for name, t in snapshot.items()}
    old_global = {name: g.clone() for name, g in outer.global_params.items()} if keep_own else None
    own = await thread.run(distance, snapshot, outer.global_params)  # with the move below: ≥ the global's move
    screening: Screening = await thread.change(outer.apply, list(payloads), target)  # target ← new global weights
    state.global_hash = await thread.run(weights_hash, outer.global_params)
    state.moved = own + await thread.run(distance, outer.global_params, snapshot)
    if old_global is not None:
        keep_own_delta(target, snapshot, old_global)
    return Applied(screening=screening, target=target)


def load_outer(outer: OuterOptimizer[Any], state: StageState) -> None:
    """Load a downloaded state into the outer optimizer: its global weights, round and buffers, under this replica's
    own hyper-parameters (never the sender's)."""
    groups = outer.optimizer.state_dict()["param_groups"]
    slots = state.optimizer["state"] if state.optimizer else {}
    optimizer = {"state": slots, "param_groups": groups}
    outer.load_state_dict({"round": state.round, "params": state.params, "optimizer": optimizer})


@torch.no_grad()
def copy_into(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """θ ← values: a downloaded state replaces the local weights."""
    for name, p in params.items():
        p.copy_(values[name])


@torch.no_grad()
def move_by(
    params: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
) -> None:
    """θ ← θ + (target − snapshot): to the new global weights, keeping the progress made since the snapshot."""
    for name, p in params.items():
        p.add_(target[name] - snapshot[name])


@torch.no_grad()
def keep_own_delta(
    target: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], old_global: Mapping[str, torch.Tensor]
) -> None:
    """target ← target + (snapshot − old global): this replica's Δ, which the group did not receive (it arrived after
    the leader's window closed), stays in its local weights for its next round to send."""
    for name, t in target.items():
        t.add_(snapshot[name] - old_global[name])
