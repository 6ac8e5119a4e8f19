"""Inner optimizer: AdamW with linear warmup and cosine decay, built from the swarm config, and the
screen a stage server runs on each microbatch's gradient before it counts.

>>> opt, sched = make_inner_optimizer(model.parameters(), InnerOptimConfig())
>>> loss.backward(); clip_and_step(opt, sched, cfg.grad_clip)   # skips the step if the norm is not finite
>>> screen = GradNormScreen(); screen.refusal(norm) or screen.accept(norm)
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable

import torch

from optim.config import InnerOptimConfig

logger = logging.getLogger(__name__)

# a microbatch's gradient norm may exceed the median of the recent accepted ones by this factor: honest
# norms drift (lr warmup, loss decay) and vary between microbatches, and early in training, with a replica
# just killed and its microbatches rerouted, an honest one measured 144× and 150× the median of the 13
# accepted before it (tests/test_swarm_integration.py::test_killed_stage_server_does_not_stop_training);
# refusing honest data is a strike, so only a gradient three orders of magnitude out is refused
MAX_GRAD_NORM_RATIO = 1000.0


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
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr * lr_scale, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Schedule(cfg, start_step))
    return opt, sched


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


class GradNormScreen:
    """Refuses a gradient whose norm is not finite, or far above the recent accepted ones.

    The reference is the median of the last ``window`` accepted norms, so a minority of outsized
    gradients cannot move it; until ``warmup`` norms are in only finiteness is checked.
    """

    def __init__(self, *, ratio: float = MAX_GRAD_NORM_RATIO, window: int = 64, warmup: int = 8) -> None:
        if ratio <= 1 or window < 1 or not 1 <= warmup <= window:
            raise ValueError(f"need ratio > 1 and 1 ≤ warmup ≤ window, got {ratio}, {warmup}, {window}")
        self.ratio, self.warmup = ratio, warmup
        self.recent: deque[float] = deque(maxlen=window)  # accepted norms, oldest first

    @property
    def limit(self) -> float:
        """The largest norm accepted now."""
        if len(self.recent) < self.warmup:
            return math.inf
        return self.ratio * statistics.median(self.recent)

    def refusal(self, norm: float) -> str | None:
        """Why a gradient of this norm is refused, or None if it is accepted."""
        if not math.isfinite(norm):
            return f"gradient norm is {norm}"
        if norm > self.limit:
            return (
                f"gradient norm {norm:.3g} is over {self.ratio:g}× the median {self.limit / self.ratio:.3g} "
                f"of the last {len(self.recent)} accepted"
            )
        return None

    def accept(self, norm: float) -> None:
        self.recent.append(norm)
