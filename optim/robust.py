"""The outer aggregate's robust rules, over members' Δs of any part type (a dense tensor, a sparse one): centred
clipping for three or more, a pair's guard for two, and SparseLoCo's judgement of each member by the replica's own Δ.
``OuterOptimizer.apply`` (outer.py) runs them on the same payloads in the same order on every replica; the bounds they
give are in docs/architecture.md, "The outer aggregate's bound".

    >>> kept, factors = clip_to_centre(members, names, dense=to_dense, with_delta=replaced, radius_factor=2.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

Part = TypeVar("Part")
Members = list[tuple[int, dict[str, Part]]]  # (payload index, the member's Δ by parameter name)


def coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """(K, *shape) → (*shape): per coordinate, the middle value (the mean of the two middle ones for even K)."""
    ordered = stacked.sort(dim=0).values
    k = len(ordered)
    return ordered[k // 2] if k % 2 else (ordered[k // 2 - 1] + ordered[k // 2]) / 2


def clip_to_centre(
    members: Members[Part],
    names: Iterable[str],
    *,
    dense: Callable[[Part], torch.Tensor],
    with_delta: Callable[[Part, torch.Tensor], Part],
    radius_factor: float,
) -> tuple[Members[Part], dict[int, float]]:
    """Centred clipping (K ≥ 3): each member's Δ xᵢ is pulled to within τ of the coordinate-wise median m.

    τ = ``radius_factor`` (outer.py's ``CENTRE_RADIUS``) · median ‖xᵢ − m‖; a member further away becomes m + (τ / ‖xᵢ − m‖)(xᵢ − m), the others are
    used as they are (a clean round's aggregate is exactly the plain one). The bound, for f < K/2 Byzantine members
    sending anything finite (docs/architecture.md, "The outer aggregate's bound"): m lies, per coordinate, within
    the honest members' range, and τ ≤ radius_factor · max_honest ‖x_h − m‖, so DiLoCo's mean moves at most
    (f/K)(τ + ‖m − μ_H‖) from the honest members' mean μ_H, in any direction (a flip or a scaled flip of an honest Δ
    is clipped like any other far point). Returns the members, clipped, and each clipped one's factor by index.
    Two passes over the parameters, one at a time, so the extra memory is K dense copies of the largest parameter.
    """
    squared = [0.0] * len(members)
    for name in names:
        stacked = torch.stack([dense(member[name]) for _, member in members])  # (K, *shape)
        offsets = stacked - coordinate_median(stacked)
        for i, offset in enumerate(offsets):
            squared[i] += float(offset.double().square().sum())
    distances = [math.sqrt(s) for s in squared]
    radius = radius_factor * statistics.median(distances)
    factors = {i: radius / d for i, d in enumerate(distances) if d > radius}
    if not factors:
        return members, {}
    out = [(index, dict(member)) for index, member in members]
    for name in names:
        stacked = torch.stack([dense(member[name]) for _, member in members])
        centre = coordinate_median(stacked)
        for i, factor in factors.items():
            out[i][1][name] = with_delta(members[i][1][name], centre + factor * (stacked[i] - centre))
    return out, {members[i][0]: factor for i, factor in factors.items()}


def leave_out_opposed(
    members: Members[Part],
    own: int,
    names: Iterable[str],
    *,
    dense: Callable[[Part], torch.Tensor],
    evidence: Callable[[str, Part], torch.Tensor],
    below: float,
) -> tuple[Members[Part], dict[int, float]]:
    """Leave out each member whose Δ points against this replica's own (a cosine under ``below``, < 0), judged against its own
    evidence (``evidence``, ``OuterOptimizer._own_evidence``: for SparseLoCo its whole Δ, what it sent and what its error buffer holds back).
    A flip, or a scaled flip, of any honest Δ points against every honest replica's descent, so every honest
    replica leaves it out and they stay in agreement; an honest Δ points along it. Sparse Δs barely overlap, so a
    member is judged against the dense Δ, never against another sparse payload. ``below`` leaves room for Δs that
    share no direction at all (noise: cosines within a few 1/√n of 0), so they stay in, the same on every replica.
    Per parameter, one at a time."""
    mine = next((member for index, member in members if index == own), None)
    if mine is None:
        return members, {}
    dots, squares, own_square = [0.0] * len(members), [0.0] * len(members), 0.0
    for name in names:
        own_delta = evidence(name, mine[name]).double()
        own_square += float(own_delta.square().sum())
        for i, (_, member) in enumerate(members):
            delta = dense(member[name]).double()
            dots[i] += float((delta * own_delta).sum())
            squares[i] += float(delta.square().sum())
    cosines = [d / math.sqrt(sq * own_square) if sq > 0 and own_square > 0 else 0.0 for d, sq in zip(dots, squares)]
    opposed = {index: cos for (index, _), cos in zip(members, cosines) if index != own and cos < below}
    return [(index, member) for index, member in members if index not in opposed], opposed


def guard_pair(
    members: Members[Part],
    *,
    dense: Callable[[Part], torch.Tensor],
    with_delta: Callable[[Part, torch.Tensor], Part],
) -> tuple[Members[Part], dict[int, float]]:
    """A pair has no majority: neither member's Δ may point against the other's. If ⟨x, y⟩ < 0, each loses its
    part along the other (x ← x − (⟨x, y⟩/‖y‖²)·y) and what is left of it is clipped to the other's norm, the same
    on both members (a function of the pair's payloads alone, so the pair stays in agreement). The step, their
    mean, then keeps ⟨step, x⟩ = ½‖x‖²·sin²(x, y) of each one's progress, and adds at most ¾‖x‖ at right angles
    to it. Promise to a member a, whatever the other sends: never backwards (⟨step, a⟩ ≥ 0), and a Δ opposed to a
    moves the step at most ¾‖a‖ off its part along a. Not promised: progress against an exact opposite (a stall),
    and what a Δ not opposed to a adds at right angles to it, bounded only by ``_screen``'s norm rules. Returns
    the members and, for each changed one, the factor of the other's Δ taken off it."""
    (i, x), (j, y) = members
    dense_x = {name: dense(part) for name, part in x.items()}
    dense_y = {name: dense(part) for name, part in y.items()}
    dot = sum(float((dense_x[n].double() * dense_y[n].double()).sum()) for n in dense_x)
    xx = sum(float(t.double().square().sum()) for t in dense_x.values())
    yy = sum(float(t.double().square().sum()) for t in dense_y.values())
    if dot >= 0 or xx == 0 or yy == 0:
        return members, {}

    def without(
        member: dict[str, Part],
        own: dict[str, torch.Tensor],
        other: dict[str, torch.Tensor],
        sq: float,
        osq: float,
    ) -> dict[str, Part]:
        """``member`` (dense: ``own``) less its part along ``other`` (‖member‖² = sq, ‖other‖² = osq), no longer than
        ``other``."""
        along = dot / osq
        scale = min(1.0, math.sqrt(osq / max(sq - dot * along, 1e-300)))
        return {n: with_delta(part, scale * (own[n] - along * other[n])) for n, part in member.items()}

    return (
        [(i, without(x, dense_x, dense_y, xx, yy)), (j, without(y, dense_y, dense_x, yy, xx))],
        {i: -dot / yy, j: -dot / xx},
    )
