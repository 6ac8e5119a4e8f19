"""The outer aggregate's bound: what f < K/2 members sending anything finite can move it, and what a pair promises.

Honest Δs here share a common direction plus each replica's own noise, as replicas that descend from the same
weights on different data do. The bound (docs/architecture.md, "The outer aggregate's bound"), in honest-only terms,
for DiLoCo's mean when no honest member is clipped: ‖step − μ_H‖ ≤ (f/K)·(2D + 3S), with μ_H the honest mean,
D = max_h ‖x_h − μ_H‖ and S = √Σ_h ‖x_h − μ_H‖² (the coordinate-wise median lies within S of μ_H).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optim.outer
from compress.codecs import get_codec
from compress.sparseloco import SparseLoCoCodec
from optim.outer import DiLoCo, OuterOptimizer, Screening, SparseLoCo

Named = dict[str, torch.Tensor]
SHAPES = {"w": (48, 64), "b": (200,)}


def honest_deltas(count: int, seed: int, *, noise: float = 0.5) -> list[Named]:
    g = torch.Generator().manual_seed(seed)
    common = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return [
        {n: 0.01 * (common[n] + noise * torch.randn(s, generator=g)) for n, s in SHAPES.items()} for _ in range(count)
    ]


def norm(t: Named) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in t.values()))


def dot(a: Named, b: Named) -> float:
    return sum(float((a[n].double() * b[n].double()).sum()) for n in a)


def plus(a: Named, b: Named, scale: float = 1.0) -> Named:
    return {n: a[n] + scale * b[n] for n in a}


def mean(ds: list[Named]) -> Named:
    return {n: torch.stack([d[n] for d in ds]).mean(0) for n in ds[0]}


def make(method: str, start: Named) -> OuterOptimizer:
    # lr 1 and no momentum: the step moves the weights by exactly the aggregate, which the test then reads
    if method == "diloco":
        return DiLoCo(start, lr=1.0, momentum=0.0, codec=get_codec("fp32"))
    return SparseLoCo(start, codec=SparseLoCoCodec(topk=64))


def applied_steps(method: str, group: list[Named], appliers: list[int]) -> list[Named]:
    """Every member sends its Δ; members ``appliers`` apply the round. Returns each one's step (old − new weights)."""
    return [step for step, _ in applied_rounds(method, group, appliers)]


def applied_rounds(method: str, group: list[Named], appliers: list[int]) -> list[tuple[Named, Screening]]:
    """``applied_steps`` with each applier's screening of the payloads."""
    g = torch.Generator().manual_seed(123)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    opts = [make(method, start) for _ in group]
    payloads = [opt.make_payload(plus(start, d, -1.0)) for opt, d in zip(opts, group)]
    steps = []
    for i in appliers:
        local = {n: t.clone() for n, t in start.items()}
        screening = opts[i].apply(payloads[::-1], local)  # another delivery order than the sending one
        steps.append(({n: start[n] - local[n] for n in start}, screening))
    return steps


def honest_bound(honest: list[Named], f: int) -> float:
    mu = mean(honest)
    spread = [norm(plus(x, mu, -1.0)) for x in honest]
    k = len(honest) + f
    return f / k * (2 * max(spread) + 3 * math.sqrt(sum(s * s for s in spread)))


ATTACKS = {
    "flip x9": lambda own, honest: {n: -9.0 * t for n, t in own.items()},
    "flip x1": lambda own, honest: {n: -1.0 * t for n, t in own.items()},
    "orthogonal x9": lambda own, honest: {n: 9.0 * torch.roll(t, 1, dims=-1) for n, t in own.items()},
    "shift inside the spread": lambda own, honest: plus(
        mean(honest), plus(min(honest, key=lambda x: dot(x, mean(honest))), mean(honest), -1.0), 3.0
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize(("k", "f"), [(3, 1), (5, 2), (7, 3)])
def test_a_minority_moves_the_diloco_step_at_most_the_bound_and_honest_members_agree(
    attack: str, k: int, f: int
) -> None:
    honest = honest_deltas(k - f, seed=k)
    attackers = [ATTACKS[attack](honest[i % len(honest)], honest) for i in range(f)]  # colluders where f > 1
    group = [*attackers, *honest]
    steps = applied_steps("diloco", group, appliers=list(range(f, k)))
    mu = mean(honest)
    assert norm(plus(steps[0], mu, -1.0)) <= honest_bound(honest, f) * (1 + 1e-5)
    assert all(torch.equal(s[n], steps[0][n]) for s in steps[1:] for n in s)  # every honest member applied the same
    assert dot(steps[0], mu) > 0  # never backwards
    # the plain mean breaks the bound for the flips: the test can fail
    if attack == "flip x9":
        assert norm(plus(mean(group), mu, -1.0)) > honest_bound(honest, f)


@settings(deadline=None, max_examples=20)
@given(seed=st.integers(0, 10_000), k=st.sampled_from([3, 4, 5, 6]), noise=st.sampled_from([0.2, 0.5, 1.0]))
def test_a_clean_round_is_the_plain_mean(seed: int, k: int, noise: float) -> None:
    honest = honest_deltas(k, seed=seed, noise=noise)
    ((step, screening),) = applied_rounds("diloco", honest, appliers=[0])
    assert not screening.clipped and not screening.dropped
    torch.testing.assert_close(step, mean(honest), rtol=1e-5, atol=1e-6)  # (the weights are ~1: fp32 rounding)


def test_sparseloco_colluders_cannot_turn_the_step_against_the_honest_members(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = honest_deltas(3, seed=4)
    attackers = [{n: -9.0 * t for n, t in honest[0].items()}] * 2  # two identical flips among five
    steps = applied_steps("sparseloco", [*attackers, *honest], appliers=[2, 3, 4])
    (clean,) = applied_steps("sparseloco", honest, appliers=[0])
    assert all(torch.equal(s[n], steps[0][n]) for s in steps[1:] for n in s)
    # SparseLoCo averages each index over its senders, so a member weighs up to 1, not 1/K, where few others sent;
    # bounded to the median member's norm, each flip is one honest-sized Δ backwards. A quarter of the honest
    # progress or more stays ...
    assert dot(steps[0], mean(honest)) > 0.25 * dot(clean, mean(honest))
    # ... where the plain aggregate goes backwards
    monkeypatch.setattr(optim.outer, "CENTRE_RADIUS", math.inf)
    monkeypatch.setattr(SparseLoCo, "bounded_by_median", False)
    (undefended,) = applied_steps("sparseloco", [*attackers, *honest], appliers=[2])
    assert dot(undefended, mean(honest)) < 0


def sent_norms(group: list[Named]) -> list[dict[str, float]]:
    """Each member's payload as the others decode it (top-k, 2 bits): its norm per parameter."""
    g = torch.Generator().manual_seed(123)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out = []
    for d in group:
        opt = make("sparseloco", start)
        member = opt._decode_member(opt.make_payload(plus(start, d, -1.0)))
        out.append({n: float(part.values.double().norm()) for n, part in member.items()})
    return out


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize(("k", "f"), [(3, 1), (5, 2), (7, 3)])
def test_a_minority_adds_to_each_sparseloco_parameter_at_most_f_honest_payloads_and_honest_members_agree(
    attack: str, k: int, f: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound (docs/architecture.md, "The outer aggregate's bound"): per parameter p, every member is scaled to at
    most the median member's norm, so a minority moves the step at most f·max_h ‖x̂_h,p‖ from the honest members' own
    per-index mean, plus the honest values it dilutes where it sent the same index (≤ ‖clean_p‖)."""
    honest = honest_deltas(k - f, seed=7 + k)
    attackers = [ATTACKS[attack](honest[i % len(honest)], honest) for i in range(f)]
    group = [*attackers, *honest]
    steps = applied_steps("sparseloco", group, appliers=list(range(f, k)))
    (clean,) = applied_steps("sparseloco", honest, appliers=[0])
    assert all(torch.equal(s[n], steps[0][n]) for s in steps[1:] for n in s)  # every honest member applied the same
    largest = {n: max(sent[n] for sent in sent_norms(honest)) for n in SHAPES}

    def off_bound(step: Named) -> bool:
        return all(
            float((step[n] - clean[n]).double().norm()) <= (f * largest[n] + float(clean[n].double().norm())) * 1.0001
            for n in SHAPES
        )

    assert off_bound(steps[0])
    assert dot(steps[0], mean(honest)) > 0  # never backwards
    if attack == "flip x9":  # the bound is what holds it: without it the flips break it
        monkeypatch.setattr(optim.outer, "CENTRE_RADIUS", math.inf)
        monkeypatch.setattr(SparseLoCo, "bounded_by_median", False)
        assert not off_bound(applied_steps("sparseloco", group, appliers=[f])[0])


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 10_000), k=st.sampled_from([3, 4, 5]), noise=st.sampled_from([0.5, 1.0, 2.0]))
def test_a_clean_sparseloco_round_strikes_nobody_and_keeps_most_of_the_plain_step(
    seed: int, k: int, noise: float
) -> None:
    honest = honest_deltas(k, seed=seed, noise=noise)
    rounds = applied_rounds("sparseloco", honest, appliers=[0, k - 1])
    for _, screening in rounds:
        assert not screening.dropped and not screening.clipped and screening.used == k  # no offence counted
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SparseLoCo, "bounded_by_median", False)
        (plain,) = applied_steps("sparseloco", honest, appliers=[0])
    # honest members above the median lose some of their length, never the direction
    assert dot(rounds[0][0], mean(honest)) >= 0.7 * dot(plain, mean(honest))


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
@pytest.mark.parametrize("scale", [-9.0, -1.0])
def test_in_a_pair_a_flip_of_the_attackers_own_delta_keeps_the_honest_progress_and_adds_little(
    method: str, scale: float
) -> None:
    own, attackers_own = honest_deltas(2, seed=7, noise=1.0)  # the attacker flips its own Δ, like the honest one
    flip = {n: scale * t for n, t in attackers_own.items()}
    step_honest, step_attacker = applied_steps(method, [own, flip], appliers=[0, 1])
    assert all(torch.equal(step_honest[n], step_attacker[n]) for n in step_honest)  # the pair stays in agreement
    cos = dot(own, flip) / (norm(own) * norm(flip))
    if method == "diloco":
        assert dot(step_honest, own) == pytest.approx(0.5 * dot(own, own) * (1 - cos**2), rel=1e-4)
        # at right angles to a: ½ of a's own remainder (|cos·sin|·‖a‖) and of the flip's, no longer than a: ≤ ¾‖a‖
        off = norm(plus(step_honest, own, -0.5 * (1 - cos**2)))
        assert off <= 0.5 * (1 + abs(cos) * math.sqrt(1 - cos**2)) * norm(own) * (1 + 1e-4) <= 0.75 * norm(own)
    assert dot(step_honest, own) > 0  # SparseLoCo: the honest progress is what its top-k payload carries


@pytest.mark.parametrize("cosine", [-0.9, -0.45, -0.05])
def test_an_opposed_pair_keeps_agreeing_and_neither_member_goes_backwards(cosine: float) -> None:
    a, noise = honest_deltas(2, seed=11, noise=1.0)
    # b: cosine to a as asked, the rest at right angles to a
    ortho = plus(noise, a, -dot(noise, a) / dot(a, a))
    b = plus(
        {n: cosine * t / norm(a) for n, t in a.items()},
        {n: math.sqrt(1 - cosine**2) * t / norm(ortho) for n, t in ortho.items()},
    )
    b = {n: 2.0 * norm(a) * t for n, t in b.items()}
    step_a, step_b = applied_steps("diloco", [a, b], appliers=[0, 1])
    assert all(torch.equal(step_a[n], step_b[n]) for n in step_a)
    assert dot(step_a, a) == pytest.approx(0.5 * dot(a, a) * (1 - cosine**2), rel=1e-3)  # ½‖a‖²·sin²
    assert dot(step_b, b) >= 0


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_in_a_pair_a_push_at_right_angles_moves_each_parameter_at_most_the_bound(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pg-orthogonal-pair: 9× the attacker's Δ rolled by one coordinate passes the guard (not opposed) and the ×10 norm
    screen, and cost a pair 5-9%. Per parameter neither member moves more than PAIR_BOUND_RATIO × the other."""
    own, attackers_own = honest_deltas(2, seed=7, noise=1.0)
    rolled = {n: torch.roll(t, 1, dims=-1) for n, t in attackers_own.items()}
    # at right angles to own, and a little along it: not opposed, so the guard leaves it whole
    across = plus(rolled, own, -dot(rolled, own) / dot(own, own))
    push = plus({n: 9.0 * norm(own) / norm(across) * t for n, t in across.items()}, own, 0.01)
    steps = applied_steps(method, [own, push], appliers=[0, 1])
    assert all(torch.equal(steps[0][n], steps[1][n]) for n in steps[0])  # the pair stays in agreement
    sent = sent_norms([own]) if method == "sparseloco" else [{n: float(t.double().norm()) for n, t in own.items()}]

    # DiLoCo's step, a mean of two, holds at most (1 + ratio)/2 × the honest part; SparseLoCo's per-index mean, where
    # the two sent other indices, each in full: 1 + ratio
    most = (1 + optim.outer.PAIR_BOUND_RATIO) / (2 if method == "diloco" else 1)

    def within(step: Named) -> bool:
        return all(float(step[n].double().norm()) <= most * sent[0][n] * 1.0001 for n in step)

    assert within(steps[0]) and dot(steps[0], own) > 0
    # the bound holds it alone (top-k payloads' few shared indices can make the guard act too) ...
    monkeypatch.setattr(OuterOptimizer, "_guard_pair", lambda self, members: (members, {}))
    assert within(applied_steps(method, [own, push], appliers=[0])[0])
    # ... and without it the push breaks it
    monkeypatch.setattr(optim.outer, "PAIR_BOUND_RATIO", math.inf)
    assert not within(applied_steps(method, [own, push], appliers=[0])[0])
