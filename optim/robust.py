"""The outer aggregate's robust rules, over members' Δs of any part type (a dense tensor, a sparse one): centred
clipping for three or more (and, for SparseLoCo, a bound to the median member's norm), a pair's guard for two.
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


def bound_norms(
    members: Members[Part],
    names: Iterable[str],
    *,
    norm: Callable[[Part], float],
    scale: Callable[[Part, float], Part],
    limit: Callable[[list[float]], float],
) -> tuple[Members[Part], dict[int, float]]:
    """Per parameter, each member's part scaled down to at most ``limit`` of the members' norms of that parameter
    (the others as they are). Per parameter, so that nobody can pour a whole Δ's length into one small tensor (a
    norm's gain, say). A function of the payloads alone: every member computes the same. Returns the members and,
    for each scaled one, the smallest factor it got, by payload index."""
    out = [(index, dict(member)) for index, member in members]
    factors: dict[int, float] = {}
    for name in names:
        norms = [norm(member[name]) for _, member in members]
        bound = limit(norms)
        for (index, member), n in zip(out, norms):
            if n > bound > 0:
                member[name] = scale(member[name], bound / n)
                factors[index] = min(factors.get(index, 1.0), bound / n)
    return (out if factors else members), factors


def bound_to_median_norm(
    members: Members[Part],
    names: Iterable[str],
    *,
    norm: Callable[[Part], float],
    scale: Callable[[Part, float], Part],
) -> tuple[Members[Part], dict[int, float]]:
    """K ≥ 3: per parameter, each member's part scaled down to at most the median member's norm (``bound_norms``).

    With f < K/2 Byzantine members each median lies within the honest members' norms, so whatever a minority sends,
    each of its members adds to each parameter at most what one honest member does: the aggregate moves at most
    f · max_honest ‖x_h,p‖ from what the honest members alone give, per parameter p, in any direction. SparseLoCo
    needs it: its per-index mean counts a lone sender's value in full and its payloads barely overlap, so the centred
    clip's centre (the coordinate median) is ~0 and lets a Δ of twice the median norm through (measured: a −9× flip
    clipped to 2× there took the honest replicas' validation loss from 2.8 to 3.5 and 6.9; docs/benchmarks.md)."""
    return bound_norms(members, names, norm=norm, scale=scale, limit=statistics.median)


def bound_pair(
    members: Members[Part],
    names: Iterable[str],
    *,
    norm: Callable[[Part], float],
    scale: Callable[[Part, float], Part],
    ratio: float,
) -> tuple[Members[Part], dict[int, float]]:
    """K = 2: per parameter, the larger part scaled down to at most ``ratio`` × the smaller's norm (``bound_norms``).
    A pair has no majority, but neither member may push more than ``ratio`` × what the other moved, in any direction:
    a push at right angles (which ``guard_pair`` leaves) costs at most ``ratio``² of its length's harm at 1×."""
    return bound_norms(members, names, norm=norm, scale=scale, limit=lambda norms: ratio * min(norms))


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
