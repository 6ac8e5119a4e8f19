"""Inner optimizer: AdamW with linear warmup and cosine decay, built from the swarm config.

>>> opt, sched = make_inner_optimizer(model.parameters(), InnerOptimConfig())
>>> loss.backward(); clip_and_step(opt, sched, cfg.grad_clip)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from optim.config import InnerOptimConfig


def lr_factor(step: int, cfg: InnerOptimConfig) -> float:
    """Multiplier of cfg.lr at inner step ``step``: linear warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(start_step + step, cfg))
    return opt, sched


def clip_and_step(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, grad_clip: float) -> float:
    """Clip (if enabled), step, advance the schedule, zero grads; returns the pre-clip grad norm."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)
