"""Backward probes: a server's returned input gradient judged by its own forward (pure code; the calls are the trainer's).

A stage server's backward should return g = Jᵀu, where u is the gradient the trainer sent it and J the Jacobian of the
forward it ran. Whatever it returns, its own forward says how the stage's output moves along g: ⟨u, f(x + εg) −
f(x − εg)⟩ / 2ε ≈ ⟨u, Jg⟩ = ⟨Jᵀu, g⟩. So the trainer sends the same server two forwards, x ± εg (fresh microbatch
ids, not kept: ``train=False``), and asks of the microbatch that

    descent = ⟨u, y⁺ − y⁻⟩ / 2⟨g, ε·g⟩  ≥  ρ           (``ProbeRule.min_descent``, ρ = ¼; ε per token)

An honest server's descent is ~1 (up to the wire's rounding and second-order terms; measured 0.89-0.99 at 8 × 1024 ×
768 through int8 both ways, 0.91 at 6 layers, ≥ 0.5 on the tiny model over 100 probes). The bound, by construction,
for any g that passes: ⟨g_true, g⟩_ε ≥ ρ‖g‖²_ε (in the inner product weighted by the per-token steps ε), i.e.
‖g − g_true/2ρ‖_ε ≤ ‖g_true‖_ε/2ρ: never against the true gradient, at most 1/ρ times its norm. A sign flip has
descent −1, random gradients ~0, a ×5 scaled gradient ⅕. The probe is judged by the server's own forward, not by
other replicas: colluders cannot outvote it, and an honest replica that drifted (H steps apart, or alone ahead) passes
it as well as any.

On the weights the backward used (``TrainerOptions.probe_rate``, 2% of backwards once a server passed its first
two): a server that takes an inner step between the two (every backward, where its inner batch is one microbatch; or
another trainer's backward) would answer from moved weights, and one AdamW step of a seeded 6-layer stage at lr 1e-4
took an honest descent from 0.91 to 0.12 (−0.12 seen in a real swarm). So a forward reply says which weights it ran
on (``Reply.weights``), the probe's forwards ask for those (``Forward.on_epoch``/``on_step``), and the server runs
them on its stash (the weights before each of its last two inner steps) or refuses: an unanswered probe judges
nothing, and an unproven server's backward then goes to another replica. Other limits: a microbatch is judged as one
(flipping one sample of eight passes), and a server that recognises probe inputs (they name old weights, and lie near
an input it holds, offset along the gradient it returned) can fake its forward's answer at the cost of a
Jacobian-vector product, or refuse them (its backwards then land only where no other replica is left).

    >>> eps = probe_steps(x, g, ProbeRule().step); x_plus, x_minus = x + eps * g, x - eps * g  # two server forwards
    >>> descent(u, y_plus, y_minus, eps, g)  # honest ≈ 1, flipped ≈ −1
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

# Links whose codecs round far under a probe's step: int8 rounds ~1% of a token's norm, int4 ~16% (the 5% step drowns:
# an honest descent of 0.06 was seen), and a subspace frame is exact only for a subspace-constrained model's inputs.
PROBED_CODECS = frozenset({"fp32", "fp16", "bf16", "int8"})


@dataclass(frozen=True, kw_only=True)
class ProbeRule:
    """How often backwards are probed, how far the probe steps and what passes."""

    rate: float = 0.02  # of a proven server's backwards
    first_probes: int = 2  # every backward of a server is probed until it passed this many
    # the probe's step per token, relative to the token's input norm: far enough over the wire's int8 rounding (~1% of
    # a token's norm) that the difference is the forward's, near enough that second-order terms stay small
    step: float = 0.05
    # A probe whose two outputs differ in under this share of their values (as coded on the wire) did not resolve the
    # step: the reply's rounding swallowed it (an int8 output ~200× its input's norm, as a seeded stage's is) and it
    # judges nothing; the server's next probe steps 4× further, up to ``max_step``, where an unresolved one counts as
    # passed (no evidence against it, and its gradients need not wait for a probe again).
    min_resolved: float = 0.5
    max_step: float = 0.2  # at 0.4 an honest 6-layer stage's descent is 0.28 (second-order terms)
    # ρ: a microbatch's descent under it fails the probe. Honest: 0.89 (seeded) to 0.99 (trained) at 8 × 1024 × 768,
    # ≥ 0.51 over 102 probes of the tiny model, whose servers step every 4th backward
    min_descent: float = 0.25
    failures: int = 2  # failed probes of a server's last ``window`` that condemn it (a liar fails each one)
    window: int = 8

    def __post_init__(self) -> None:
        if (
            not 0.0 <= self.rate <= 1.0
            or not 0 < self.step <= self.max_step
            or not 0.0 <= self.min_resolved <= 1.0
            or not 0.0 < self.min_descent <= 1.0
            or not 1 <= self.failures <= self.window
        ):
            raise ValueError(
                f"probe rate and min_resolved in [0, 1], 0 < step ≤ max_step, min_descent in (0, 1], "
                f"1 ≤ failures ≤ window; got {self}"
            )


def probe_steps(x: torch.Tensor, g: torch.Tensor, step: float) -> torch.Tensor:
    """ε per token (B, T, 1): ‖ε_t g_t‖ = step · ‖x_t‖, so that every token's step is as far above the wire's
    per-token rounding (0 where g_t is 0: nothing to judge there)."""
    x_norm, g_norm = x.float().norm(dim=-1, keepdim=True), g.float().norm(dim=-1, keepdim=True)
    return torch.where(g_norm > 0, step * x_norm / g_norm.clamp_min(1e-30), torch.zeros_like(g_norm))


def resolved(y_plus: torch.Tensor, y_minus: torch.Tensor) -> float:
    """The share of values in which the two probe outputs differ (1 for any fp32 step, ~0 under the rounding)."""
    return float((y_plus != y_minus).float().mean())


def descent(u: torch.Tensor, y_plus: torch.Tensor, y_minus: torch.Tensor, eps: torch.Tensor, g: torch.Tensor) -> float:
    """⟨u, y⁺ − y⁻⟩ / 2⟨g, ε·g⟩ over the microbatch, in float64: the forward's own directional derivative along ε·g
    against what g claims it is; 1 for the true Jᵀu, −1 for its flip, ~0 for noise; NaN if g is 0."""
    along = (u.double() * (y_plus.double() - y_minus.double())).sum() / 2
    claimed = (eps.double() * g.double().square()).sum()
    return float(along / claimed) if claimed > 0 else math.nan


def passes(descent_: float, rule: ProbeRule) -> bool:
    """The microbatch's gradient descends at least ``min_descent`` (or is 0: nothing to judge)."""
    return math.isnan(descent_) or descent_ >= rule.min_descent


class BackwardProbes:
    """Which backwards to probe (every one of a server's until it passed ``first_probes``, and while a failure is in
    its window; else ``rate``), and each server's last ``window`` outcomes; ``record`` says when a server has failed
    ``failures`` of them and is to be condemned."""

    def __init__(self, rule: ProbeRule, rng: random.Random | None = None) -> None:
        self.rule, self._rng = rule, rng or random.Random()
        self.passed: Counter[Hashable] = Counter()
        self.failed: Counter[Hashable] = Counter()  # in all
        self._recent: dict[Hashable, deque[bool]] = {}  # outcomes (True: failed), newest last
        self._steps: dict[Hashable, float] = {}  # a server's probe step, grown past steps its replies did not resolve

    def step(self, peer: Hashable) -> float:
        return self._steps.get(peer, self.rule.step)

    def unresolved(self, peer: Hashable) -> None:
        """A probe of ``peer`` did not resolve its step: the next one steps 4× further; at ``max_step`` it counts as
        passed (nothing is known against it)."""
        if self.step(peer) >= self.rule.max_step:
            self.passed[peer] += 1
        self._steps[peer] = min(self.rule.max_step, 4 * self.step(peer))

    def should_probe(self, peer: Hashable) -> bool:
        if self.rule.rate == 0.0 and self.rule.first_probes == 0:
            return False  # probing off
        return self._rng.random() < (1.0 if self.unproven(peer) else self.rule.rate)

    def unproven(self, peer: Hashable) -> bool:
        """``peer`` is yet to pass ``first_probes``, or failed one in its window: its gradients land once probed."""
        return self.passed[peer] < self.rule.first_probes or any(self._recent.get(peer, ()))

    def record(self, peer: Hashable, descent_: float) -> bool:
        """A probe of ``peer``'s backward came back; True if ``rule.failures`` of its last ``rule.window`` failed."""
        failed = not passes(descent_, self.rule)
        self.failed[peer] += failed
        self.passed[peer] += not failed
        recent = self._recent.setdefault(peer, deque(maxlen=self.rule.window))
        recent.append(failed)
        if sum(recent) >= self.rule.failures:
            recent.clear()  # judged: a later verdict needs fresh failures
            return True
        return False
