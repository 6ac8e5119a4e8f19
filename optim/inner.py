"""Inner optimizer: AdamW with linear warmup and cosine decay, built from the swarm config, and the
screen a stage server runs on each microbatch's gradient before it counts.

>>> opt, sched = make_inner_optimizer(model.parameters(), InnerOptimConfig())
>>> loss.backward(); clip_and_step(opt, sched, cfg.grad_clip)   # skips the step if the norm is not finite
>>> verdict = screen.judge(norm, peer); verdict.refusal or (verdict.scale_(grads), screen.accept(verdict, peer))
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from optim.config import InnerOptimConfig

logger = logging.getLogger(__name__)

# a microbatch's gradient norm may exceed the median of the recent accepted ones by this factor: honest
# norms drift (lr warmup, loss decay) and vary between microbatches, and early in training, with a replica
# just killed and its microbatches rerouted, an honest one measured 144× and 150× the median of the 13
# accepted before it (tests/test_swarm_integration.py::test_killed_stage_server_does_not_stop_training);
# refusing honest data is a strike, so while the window fills only a gradient three orders of magnitude out is refused
MAX_GRAD_NORM_RATIO = 1000.0
# once a full window of norms is in, the refusal bound: honest norms measured at most 2.7× their median there (and
# 13× before, same test); an honest outlier between the clip bound and this one is clipped, not refused
SETTLED_GRAD_NORM_RATIO = 100.0
# the clip bound, median · e^(CLIP_SIGMAS·σ) of the log-norms (σ from their MAD), held within these ratios: a norm
# above it still counts, scaled down to it, with no strike (an honest spike loses only its excess; honest norms measured
# at most 13× the median early and 2.7× later). An inner step may be one microbatch: an outlier at 32× the median made
# Adam's steps its own (val +3.9% in scripts/bench_adversary.py's grad-570x-sybil), hence the low cap
CLIP_SIGMAS = 4.0
CLIP_MIN_RATIO, CLIP_MAX_RATIO = 4.0, 8.0
# a peer with fewer counted microbatches than PROBATION_MICROBATCHES and than half the stage's longest-serving peer's
# (less one) is on probation: its microbatches count at PROBATION_WEIGHT, clipped at √(clip ratio), stay out of the
# statistics, and all such together weigh at most PROBATION_SHARE of the recent ones (their weight falls as their share
# grows). A fresh identity starts below an established one, so discarding an identity buys nothing, and a flood of them
# is capped as a whole; the stage's first peer (and peers that start together) are not on probation: the step stays
# the simulator's
PROBATION_MICROBATCHES = 32
PROBATION_WEIGHT = 0.5
PROBATION_SHARE = 0.25
# peers whose standing the screen remembers (the longest-silent forgotten: on probation again)
MAX_SCREENED_PEERS = 4096
_MAD_TO_SIGMA = 1.4826  # MAD · this estimates a normal distribution's σ


def lr_factor(step: int, cfg: InnerOptimConfig) -> float:
    """Multiplier of cfg.lr at inner step ``step``: linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Schedule:
    """The lr multiplier of an optimizer that starts at inner step ``start_step`` of the swarm's schedule (LambdaLR's
    lambda), which logs a warning once when the steps pass the cosine's end: from there lr stays at its floor, which
    a run longer than ``total_steps`` probably did not mean."""

    def __init__(self, cfg: InnerOptimConfig, start_step: int) -> None:
        self.cfg, self.start_step, self.warned = cfg, start_step, False

    def __call__(self, step: int) -> float:
        # LambdaLR asks for the factor of the next step after each step: past the end once a step has been taken there
        step += self.start_step
        if step > self.cfg.total_steps and not self.warned:
            self.warned = True
            logger.warning(
                "the cosine schedule ended at step %d; lr stays at min_lr_ratio·lr = %.3g; set [inner] total_steps "
                "to the run's length",
                self.cfg.total_steps,
                self.cfg.min_lr_ratio * self.cfg.lr,
            )
        return lr_factor(step, self.cfg)


def make_inner_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: InnerOptimConfig, *, lr_scale: float = 1.0, start_step: int = 0
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on 1-D gains) and its schedule.

    ``lr_scale`` multiplies the peak lr (CheckFree's ×1.1 on a rebuilt stage); ``start_step``
    places a late joiner or rebuilt stage at the swarm's point of the schedule instead of
    warming up from scratch.
    """
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr * lr_scale, betas=(cfg.beta1, cfg.beta2), **fused_kwargs(params)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Schedule(cfg, start_step))
    return opt, sched


def fused_kwargs(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """An optimizer's ``fused=True`` where every parameter is on CUDA (one kernel for the whole step, instead of
    torch's default foreach kernels per group of tensors); nothing elsewhere (CPU: torch's default)."""
    devices = {p.device.type for p in params}
    return {"fused": True} if devices == {"cuda"} else {}


def clip_and_step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, grad_clip: float) -> float:
    """Clip (if enabled), step, advance the schedule, zero grads; returns the pre-clip grad norm.

    A non-finite norm skips the step and the schedule (the gradients are dropped, with a warning):
    clipping would turn an inf into NaN weights, which no later step repairs.
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = float(total)
    if math.isfinite(norm):
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, total)
        opt.step()
        sched.step()
    else:
        logger.warning("inner step skipped: the gradient norm is %s; the accumulated gradients are dropped", norm)
    opt.zero_grad(set_to_none=True)
    return norm


@dataclass(frozen=True)
class Verdict:
    """What the screen made of one microbatch's gradient: refused (why), or counted with its gradients scaled by
    ``weight`` (the clip factor times the probation weight); ``counted`` is its norm after clipping."""

    refusal: str | None = None
    weight: float = 1.0
    clipped: bool = False
    counted: float = 0.0
    probation: bool = False  # its sender was on probation: its norm stays out of the statistics

    def scale_(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Scale the microbatch's gradients in place by ``weight``."""
        if self.weight != 1.0:
            for grad in grads:
                if grad is not None:
                    grad.mul_(self.weight)


@dataclass
class Standing:
    """One peer's record at a stage's screen: microbatches counted, of them clipped, and refused."""

    accepted: int = 0
    clipped: int = 0
    refused: int = 0


class GradNormScreen:
    """Judges each microbatch's gradient norm against the stage's own recent accepted norms, whoever sent them.

    A non-finite norm, or one over MAX_GRAD_NORM_RATIO × the median of the last ``window`` (SETTLED_GRAD_NORM_RATIO
    once the window is full), is refused (the sender struck); one over the clip bound (module constants) counts
    scaled down to it. The statistics are the stage's, so a new identity meets the same bounds, and while it is on
    probation (module constants) its microbatches count less, clipped tighter, and stay out of the statistics (fresh
    identities cannot move the median, however many microbatches they send). Until ``warmup`` norms are in the clip
    ratio is CLIP_MAX_RATIO; the stage's first norm has no reference but finiteness.
    """

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 8,
        probation: int = PROBATION_MICROBATCHES,
        probation_weight: float = PROBATION_WEIGHT,
        max_peers: int = MAX_SCREENED_PEERS,
    ) -> None:
        if window < 1 or not 1 <= warmup <= window or probation < 0 or not 0 < probation_weight <= 1 or max_peers < 1:
            raise ValueError(
                f"need 1 ≤ warmup ≤ window, probation ≥ 0, 0 < probation_weight ≤ 1, max_peers ≥ 1; got {warmup}, "
                f"{window}, {probation}, {probation_weight}, {max_peers}"
            )
        self.warmup, self.max_peers = warmup, max_peers
        self.probation, self.probation_weight = probation, probation_weight
        self.recent: deque[float] = deque(maxlen=window)  # counted (clipped) norms, oldest first
        self.peers: OrderedDict[Hashable, Standing] = OrderedDict()  # the most recently seen last
        self.most_accepted = 0  # by one peer: the stage's longest-serving peer's count (never lowered)
        self.from_probation: deque[bool] = deque(maxlen=window)  # of the recent accepted microbatches, oldest first

    def bounds(self) -> tuple[float, float, float]:
        """(median of the recent counted norms, clip ratio, refusal ratio); a median of 0 when there is none."""
        positive = [n for n in self.recent if n > 0]
        if not positive:
            return 0.0, math.inf, math.inf
        median = statistics.median(positive)
        refusal = SETTLED_GRAD_NORM_RATIO if len(self.recent) == self.recent.maxlen else MAX_GRAD_NORM_RATIO
        if len(positive) < self.warmup:
            return median, CLIP_MAX_RATIO, refusal
        logs = [math.log(n / median) for n in positive]
        sigma = _MAD_TO_SIGMA * statistics.median(abs(x) for x in logs)
        return median, min(CLIP_MAX_RATIO, max(CLIP_MIN_RATIO, math.exp(CLIP_SIGMAS * sigma))), refusal

    def on_probation(self, peer: Hashable) -> bool:
        """Whether the peer's microbatches count less: it is new (or forgotten) next to a longer-serving peer."""
        standing = self.peers.get(peer)
        accepted = 0 if standing is None else standing.accepted
        return accepted < self.probation and 2 * accepted + 2 <= self.most_accepted  # (+2: peers a step apart)

    def judge(self, norm: float, peer: Hashable) -> Verdict:
        """The verdict on a gradient of norm ``norm`` from ``peer``; a refusal is counted against the peer here."""
        median, clip_ratio, refusal_ratio = self.bounds()
        refusal = None
        if not math.isfinite(norm):
            refusal = f"gradient norm is {norm}"
        elif median > 0 and norm > refusal_ratio * median:
            refusal = (
                f"gradient norm {norm:.3g} is over {refusal_ratio:g}× the median {median:.3g} of the stage's last "
                f"{len(self.recent)} accepted"
            )
        if refusal is not None:
            self._standing(peer).refused += 1
            return Verdict(refusal=refusal)
        probation = self.on_probation(peer)
        limit = median * (math.sqrt(clip_ratio) if probation else clip_ratio) if median > 0 else math.inf
        clip = limit / norm if norm > limit else 1.0
        weight = clip * (self.probation_weight * self._probation_share_factor() if probation else 1.0)
        return Verdict(weight=weight, clipped=clip < 1.0, counted=norm * clip, probation=probation)

    def accept(self, verdict: Verdict, peer: Hashable) -> None:
        """Count a judged gradient that went into the stage's accumulated gradients."""
        if not verdict.probation:
            self.recent.append(verdict.counted)
        self.from_probation.append(verdict.probation)
        standing = self._standing(peer)
        standing.accepted += 1
        standing.clipped += verdict.clipped
        self.most_accepted = max(self.most_accepted, standing.accepted)

    def _probation_share_factor(self) -> float:
        """1, or less where peers on probation sent over PROBATION_SHARE of the recent accepted microbatches."""
        share = sum(self.from_probation) / len(self.from_probation) if self.from_probation else 0.0
        return min(1.0, PROBATION_SHARE / share) if share > 0 else 1.0

    def _standing(self, peer: Hashable) -> Standing:
        standing = self.peers.get(peer)
        if standing is None:
            standing = self.peers[peer] = Standing()
            if len(self.peers) > self.max_peers:
                self.peers.popitem(last=False)
        self.peers.move_to_end(peer)
        return standing
