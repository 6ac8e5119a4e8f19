"""Checked pipeline work: sampled forward hops recomputed by another replica of the stage, and judged (pure code).

``HopChecker`` picks hops to check (``rate``; every one of a server's until it passed ``first_checks``; more for new
servers and suspects: a failed judgement, loss spikes on their paths) and judges. Two outputs within ``tolerance`` of
relative L2 error (the worst sample's) agree outright: the same computation on weights a few steps apart. Further
apart, no vote settles it (colluders outvote an honest server, and a server passing its input through is nearer
the true output than drifted honest replicas are to each other): each output goes on down the rest of the
microbatch's path to the trainer's head, and the loss it gives judges it (``by_loss``). An output fails if its loss
exceeds the other's by more than ``loss_margin`` and it does no better than skipping the stage (its input passed on
down the same path: ``no_better_than_skipping``): it does not land, and its server is suspect (every forward checked)
and, unless the failure was harmful, out of the trainer's routing 2 s (``HopAudit``). A failure ``harm_margin`` above
the skip's loss is harmful (worse than no work); ``failures`` harmful ones among its last ``history`` judgements make
the server **unfit** (``rest``): out of this trainer's routing until its outer round moves on (its weights synced with
the other replicas') or ``rest_s`` passes (doubling per rest). Unfit is no verdict: an honest replica behind the
others, or one that trained alone, gives harmful outputs too, and the loss cannot tell it from a liar. So whatever a
server returns, an output that lands gives a loss within ``loss_margin`` of another replica's on the same microbatch,
or better than skipping its stage, however many identities agree with it, and no honest server is ever condemned by
the loss. Verdicts (``condemn``, published to the stage's outer rounds) come only from work that contradicts itself:
a backward against the server's own forwards (probing.py). docs/architecture.md, pipeline/.

    >>> if checker.should_check(peer) and not checker.agree(y, y2): worse = checker.by_loss(loss_y, loss_y2)
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
    # is found out at its first forward, and none of its output lands (at 50% probation alone, 1-2 landed per run,
    # +3.5% val in bench_adversary's stage-garbler); an honest server costs one extra forward per trainer
    first_checks: int = 1
    probation_hops: int = 20  # a server's first forwards, checked at probation_rate
    probation_rate: float = 0.5  # off the microbatch's path once the first checks passed (``unproven``)
    # a suspect (a failed judgement, or loss spikes on its paths) has every forward checked, each landing once its
    # check passed: at 0.5, half a garbler's forwards landed unchecked between its first failure and its verdict
    suspect_rate: float = 1.0
    # relative L2 error within which two replicas' outputs agree outright. Honest replicas H steps apart measured
    # ≤ 0.82 (d_model 768, the first round from the start, at 5× the 125m preset's lr), garbled ones √2, a server
    # passing its input through 0.6 (tiny) to 1.0 (d 768) from the true output: none of these agree outright, and
    # the loss judges them
    tolerance: float = 0.25
    # outputs further apart than this are not both honest, whatever their losses: while the loss cannot tell which
    # (near chance, at the start), neither passes (``close_enough``). Honest drift measured ≤ 0.82; random √2
    far: float = 1.2
    # an output whose loss through the rest of the path exceeds the other replica's by more than this fraction fails.
    # Measured (tests/test_stage_checks.py's harness, tiny model, 200 steps, replicas never synced: the widest honest
    # drift): honest pairs median 1.7%, at most 5.2% in 53 judgements; random activations of the true norm +4-8% at
    # the start (a loss of ~5.5 is near chance either way), far more once trained
    loss_margin: float = 0.05
    # an output failing the above must also be no better than its stage skipped, by this fraction: a replica starved
    # of microbatches (tests/test_stage_checks.py: 14 of 60) measured 0.15% better than skipping its stage, and a
    # server passing its input through gives the skip's loss itself, give or take its codec's rounding
    skip_margin: float = 0.001
    # a failed output this far above the loss with its stage skipped is harmful: worse than no work. Only harmful
    # failures count towards unfitness: random activations measured +48% once the replicas had learned a little
    # (5.55 against 3.75), while honest replicas that never sync, in tests/test_stage_checks.py's harness (the tiny
    # model's stage barely beats skipping it), failed up to ~20% of their judgements at up to +5%, and were
    # condemned in 3 runs of 8 when every failure counted. A server passing its input through (the skip's loss
    # itself) fails but is never harmful: each failure takes it out of the routing 2 s (``HopAudit``), never unfit
    harm_margin: float = 0.1
    # harmful failures among a server's last ``history`` judgements by the loss that make it unfit. Harmful failures are
    # strong evidence (honest replicas' worst, starved and never synced, was +5% over the skip's loss), and unfit is no
    # verdict (a rest from this trainer's routing), so two suffice, among a long history: a server honest on its
    # training forwards but garbling those it cannot tell from validation fails only as another's checker, and each
    # failure makes it a suspect whose every forward is checked and passes (bench_adversary's stage-garbler: harmful
    # at mb39, mb62, mb117, passing in between). Among its last four it was never found unfit, while the val loss
    # taken through it read 1.3-1.45× clean
    failures: int = 2
    history: int = 16
    ban_s: float = 600.0  # a condemned server's first ban; doubles for each further verdict
    # an unfit server's first rest from this trainer's routing, unless its outer round moves on first; doubles per rest,
    # at most ``ban_s``. Back from it, the server is still suspect: its forwards land only once their checks passed
    rest_s: float = 30.0

    def __post_init__(self) -> None:
        rates = (self.rate, self.probation_rate, self.suspect_rate)
        if (
            not all(0.0 <= r <= 1.0 for r in rates)
            or min(self.probation_hops, self.first_checks) < 0
            or min(self.tolerance, self.ban_s, self.rest_s, self.loss_margin, self.skip_margin, self.harm_margin) <= 0
            or self.far < self.tolerance
            or not 1 <= self.failures <= self.history
        ):
            raise ValueError(
                f"check rates must be in [0, 1], tolerance, margins, ban_s and rest_s positive, 1 ≤ failures ≤ history,"
                f" got {self}"
            )


class HopChecker:
    """Which hops to check, the verdicts, the servers condemned (``condemned``: until when, by clock) and those unfit
    (``unfit``: until when, or until their outer round moves past the one they had)."""

    def __init__(
        self, rule: CheckRule, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rule, self._rng, self._clock = rule, rng or random.Random(), clock
        self.served: Counter[Hashable] = Counter()  # forwards seen per server
        self.passed: Counter[Hashable] = Counter()  # checks passed per server
        self.suspects: set[Hashable] = set()
        self.verdicts: Counter[Hashable] = Counter()  # times condemned
        self.condemned: dict[Hashable, float] = {}  # server → end of its ban
        self.rests: Counter[Hashable] = Counter()  # times found unfit
        self.unfit: dict[Hashable, tuple[float, int | None]] = {}  # server → (end of its rest, its outer round then)
        self._losses: deque[float] = deque(maxlen=SPIKE_HISTORY)
        self._on_path: Counter[Hashable] = Counter()  # microbatches whose loss was judged, per server on the path
        self._spikes: Counter[Hashable] = Counter()
        self._judged: dict[Hashable, deque[bool]] = {}  # per server, its last judgements: passed or not

    @property
    def off(self) -> bool:
        """Checking is off: no forward is checked, a validation forward neither."""
        rule = self.rule
        return rule.rate == rule.probation_rate == rule.suspect_rate == 0.0 and rule.first_checks == 0

    def should_check(self, peer: Hashable) -> bool:
        """One more forward served by ``peer``: whether to check it."""
        rule = self.rule
        if self.off:
            return False
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

    def close_enough(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Within ``far`` of each other: outputs two honest replicas could give."""
        return relative_error(a, b) <= self.rule.far

    def by_loss(self, loss_a: float, loss_b: float) -> int | None:
        """Two outputs' losses through the same rest of the path: 0 if ``a``'s exceeds ``b``'s by more than
        ``loss_margin``, 1 if ``b``'s exceeds ``a``'s, None if neither (both pass)."""
        margin = 1.0 + self.rule.loss_margin
        if loss_a > margin * loss_b:
            return 0
        if loss_b > margin * loss_a:
            return 1
        return None

    def no_better_than_skipping(self, loss: float, skip_loss: float) -> bool:
        """An output's loss against the loss with its stage skipped (its input passed on): True unless the output is
        better by more than ``skip_margin``. Only such an output can fail: one that does the stage's work, if less
        of it than the other replica's (a replica behind, or trained on less), is no attack, and a verdict on it
        would be false."""
        return loss > (1.0 - self.rule.skip_margin) * skip_loss

    def harmful(self, loss: float, skip_loss: float) -> bool:
        """A failed output's loss is over ``harm_margin`` above the loss with its stage skipped: worse than no work."""
        return loss > (1.0 + self.rule.harm_margin) * skip_loss

    def failed(self, peer: Hashable, *, harmful: bool) -> bool:
        """``peer``'s output failed a judgement: suspect (every forward checked); True if that makes ``failures``
        harmful failures among its last ``history`` judgements (then ``rest`` it)."""
        judged = self._judged.setdefault(peer, deque(maxlen=self.rule.history))
        judged.append(not harmful)
        self.suspects.add(peer)
        return judged.count(False) >= self.rule.failures

    def suspect(self, *peers: Hashable) -> None:
        self.suspects.update(peers)

    def clear(self, peer: Hashable, *, by_loss: bool = False) -> None:
        """A check ``peer`` passed: no longer suspect, and one check nearer to sampled checking (``first_checks``).
        ``by_loss``: judged by the loss, a judgement in its history; agreeing outright is none (two colluders agree)."""
        self.suspects.discard(peer)
        self.passed[peer] += 1
        if by_loss:
            self._judged.setdefault(peer, deque(maxlen=self.rule.history)).append(True)

    def condemn(self, peer: Hashable) -> float:
        """``peer``'s work contradicted itself (a backward against its own forwards): banned for ``ban_s``, doubled per
        earlier verdict. The ban's seconds."""
        self.verdicts[peer] += 1
        self._judged.pop(peer, None)  # a fresh record once its ban ends
        seconds = self.rule.ban_s * 2.0 ** (self.verdicts[peer] - 1)
        self.condemned[peer] = self._clock() + seconds
        self.suspects.discard(peer)
        return seconds

    def rest(self, peer: Hashable, outer_round: int | None) -> float:
        """``peer``'s outputs were worse than no work, as its weights stand at ``outer_round`` (None: unknown): out of
        the routing for ``rest_s``, doubled per earlier rest (at most ``ban_s``), or until its round moves on
        (``unfit_now``). It is suspect when it comes back. The rest's seconds."""
        self.rests[peer] += 1
        self.suspects.add(peer)
        self._judged.pop(peer, None)  # a fresh record when it comes back
        seconds = min(self.rule.rest_s * 2.0 ** (self.rests[peer] - 1), self.rule.ban_s)
        self.unfit[peer] = (self._clock() + seconds, outer_round)
        return seconds

    def unfit_now(self, outer_round: Callable[[Hashable], int | None] = lambda peer: None) -> set[Hashable]:
        """The servers resting now: their rest runs, and their outer round (``outer_round``, as their records say)
        has not moved past the one they had when found unfit."""
        now, resting = self._clock(), set()
        for peer, (until, then) in list(self.unfit.items()):
            current = outer_round(peer)
            if until <= now or (then is not None and current is not None and current > then):
                del self.unfit[peer]  # rested, or synced since: its next forwards are checked (it is still suspect)
            else:
                resting.add(peer)
        return resting

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
