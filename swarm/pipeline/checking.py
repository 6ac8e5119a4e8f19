"""Checked pipeline work: sampled forward hops recomputed by another replica of the stage and compared (pure code).

``HopChecker`` picks hops to check (``rate``; every one of a server's until it passed ``first_checks``; more for new
servers and suspects: a disagreement, loss spikes on their paths) and judges: outputs agree within ``tolerance`` of
relative L2 error (the worst sample's). Honest replicas H steps apart differ by up to 0.6-0.8
(tests/test_stage_checks.py), random ones of the true norm by √2. A third replica referees a disagreement; the odd
one out is condemned. docs/architecture.md, pipeline/.

    >>> if checker.should_check(peer) and not checker.agree(y, y2): wrong = checker.referee(peer, y, other, y2, z)
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

SPIKE_HISTORY = 64  # losses the running median is taken over
SPIKE_MADS = 6.0  # a loss this many median absolute deviations above the median is a spike
MIN_SPIKES = 3  # spikes on a server's paths before they make it suspect


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst, over the leading (sample) dimension, of ‖a − b‖ / max(‖a‖, ‖b‖): 0 for equal outputs, ~√2 for
    independent ones of the same norm, at most 2. Per sample, so garbling one sample of a microbatch shows."""
    a, b = a.float().flatten(1), b.float().flatten(1)
    scale = torch.maximum(a.norm(dim=1), b.norm(dim=1)).clamp_min(1e-12)
    return float(((a - b).norm(dim=1) / scale).max())


@dataclass(frozen=True, kw_only=True)
class CheckRule:
    rate: float = 0.02  # of hops checked once a server is past probation
    # a server's forwards are all checked (and held back) until it passed this many checks: a garbler from the start
    # is condemned at its first forward, and none of its output lands (at 50% probation alone, 1-2 landed per run,
    # +3.5% val in bench_adversary's stage-garbler); an honest server costs one extra forward per trainer
    first_checks: int = 1
    probation_hops: int = 20  # a server's first forwards, checked at probation_rate
    probation_rate: float = 0.5  # off the microbatch's path once the first checks passed (``unproven``)
    suspect_rate: float = 0.5
    # relative L2 error within which two replicas agree: honest ones H steps apart measured ≤ 0.82 (d_model 768, the
    # first round from the start, at 5× the 125m preset's lr), garbled ones √2
    tolerance: float = 1.0
    ban_s: float = 600.0  # a condemned server's first ban; doubles for each further verdict

    def __post_init__(self) -> None:
        rates = (self.rate, self.probation_rate, self.suspect_rate)
        if (
            not all(0.0 <= r <= 1.0 for r in rates)
            or min(self.probation_hops, self.first_checks) < 0
            or min(self.tolerance, self.ban_s) <= 0
        ):
            raise ValueError(f"check rates must be in [0, 1], tolerance and ban_s positive, got {self}")


class HopChecker:
    """Which hops to check, the verdicts, and the servers condemned (``condemned``: until when, by clock)."""

    def __init__(
        self, rule: CheckRule, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rule, self._rng, self._clock = rule, rng or random.Random(), clock
        self.served: Counter[Hashable] = Counter()  # forwards seen per server
        self.passed: Counter[Hashable] = Counter()  # checks passed per server
        self.suspects: set[Hashable] = set()
        self.verdicts: Counter[Hashable] = Counter()  # times condemned
        self.condemned: dict[Hashable, float] = {}  # server → end of its ban
        self._losses: deque[float] = deque(maxlen=SPIKE_HISTORY)
        self._on_path: Counter[Hashable] = Counter()  # microbatches whose loss was judged, per server on the path
        self._spikes: Counter[Hashable] = Counter()

    def should_check(self, peer: Hashable) -> bool:
        """One more forward served by ``peer``: whether to check it."""
        rule = self.rule
        if rule.rate == rule.probation_rate == rule.suspect_rate == 0.0 and rule.first_checks == 0:
            return False  # checking off
        self.served[peer] += 1
        if self.passed[peer] < rule.first_checks:
            rate = 1.0
        elif peer in self.suspects:
            rate = rule.suspect_rate
        elif self.served[peer] <= rule.probation_hops:
            rate = rule.probation_rate
        else:
            rate = rule.rate
        return self._rng.random() < rate

    def unproven(self, peer: Hashable) -> bool:
        """``peer`` is yet to pass ``first_checks``, or suspect: a checked forward of it should land only once the
        check passed, since most of a garbler's damage is done before its first verdict. (Holding back every probation
        check as well cost a short run 16% of its tokens/s: the microbatch waits for a second forward.)"""
        return peer in self.suspects or self.passed[peer] < self.rule.first_checks

    def agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return relative_error(a, b) <= self.rule.tolerance

    def referee(
        self, primary: Hashable, y: torch.Tensor, other: Hashable, y_other: torch.Tensor, z: torch.Tensor
    ) -> Hashable | None:
        """Two servers disagreed, a third computed ``z``: the one it contradicts (the other agreeing), or None if it
        agrees with neither or both (then all stay suspect)."""
        with_primary, with_other = self.agree(y, z), self.agree(y_other, z)
        if with_other and not with_primary:
            return primary
        if with_primary and not with_other:
            return other
        return None

    def tie_break(self, a: Hashable, b: Hashable) -> Hashable | None:
        """Two servers disagreed and no third could referee: the one whose paths spike (``observe_loss``), if only
        one of them does."""
        spiky = [peer for peer in (a, b) if self._spikes[peer] >= MIN_SPIKES and self._over_represented(peer)]
        return spiky[0] if len(spiky) == 1 else None

    def suspect(self, *peers: Hashable) -> None:
        self.suspects.update(peers)

    def clear(self, peer: Hashable) -> None:
        """A check ``peer`` passed: no longer suspect, and one check nearer to sampled checking (``first_checks``)."""
        self.suspects.discard(peer)
        self.passed[peer] += 1

    def condemn(self, peer: Hashable) -> float:
        """``peer`` computed a wrong output: banned for ``ban_s``, doubled per earlier verdict. The ban's seconds."""
        self.verdicts[peer] += 1
        seconds = self.rule.ban_s * 2.0 ** (self.verdicts[peer] - 1)
        self.condemned[peer] = self._clock() + seconds
        self.suspects.discard(peer)
        return seconds

    def is_condemned(self, peer: Hashable) -> bool:
        until = self.condemned.get(peer)
        return until is not None and until > self._clock()

    def condemned_now(self) -> set[Hashable]:
        now = self._clock()
        return {peer for peer, until in self.condemned.items() if until > now}

    def observe_loss(self, loss: float, path: Iterable[Hashable]) -> bool:
        """A training microbatch's loss over the servers of its path; True if a spike (far above the running median):
        a server over-represented in spikes becomes suspect, so its hops are checked more."""
        path = list(path)
        spike = False
        if len(self._losses) >= SPIKE_HISTORY // 4:
            median = statistics.median(self._losses)
            mad = statistics.median(abs(x - median) for x in self._losses)
            spike = loss > median + SPIKE_MADS * max(mad, 0.01 * abs(median))
        if not spike:
            self._losses.append(loss)  # spikes stay out: a garbler's losses must not raise the median
        for peer in path:
            self._on_path[peer] += 1
            self._spikes[peer] += spike
            if spike and self._spikes[peer] >= MIN_SPIKES and self._over_represented(peer):
                self.suspects.add(peer)
        return spike

    def _over_represented(self, peer: Hashable) -> bool:
        """Half of ``peer``'s paths spiked, and at least twice the share of the other servers' paths."""
        others_spikes = sum(self._spikes.values()) - self._spikes[peer]
        others_paths = sum(self._on_path.values()) - self._on_path[peer]
        own = self._spikes[peer] / self._on_path[peer]
        return own >= 0.5 and own >= 2 * others_spikes / max(others_paths, 1)
