"""Inner and outer optimizer hyper-parameters (part of the swarm config)."""

from __future__ import annotations

from dataclasses import dataclass

OUTER_METHODS = ("none", "diloco", "sparseloco")


def _positive(obj: object, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"config field '{name}': must be positive, got {getattr(obj, name)}")


@dataclass(kw_only=True)
class InnerOptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio · lr``."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    warmup_steps: int = 30
    total_steps: int = 1000  # length of the cosine schedule in inner steps
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm per stage; 0 disables

    def __post_init__(self) -> None:
        _positive(self, "lr", "total_steps")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"config field '{name}': must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"config field 'min_lr_ratio': must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("config fields 'warmup_steps', 'weight_decay', 'grad_clip' must be non-negative")


@dataclass(kw_only=True)
class OuterOptimConfig:
    """How replicas of a stage agree every ``inner_steps`` (H) inner steps."""

    method: str = "sparseloco"  # none | diloco | sparseloco
    inner_steps: int = 50  # H
    diloco_lr: float = 0.7
    diloco_momentum: float = 0.9  # Nesterov
    sparseloco_lr: float = 1.0  # plain SGD on the aggregated sparse pseudo-gradient

    def __post_init__(self) -> None:
        if self.method not in OUTER_METHODS:
            raise ValueError(f"config field 'method': unknown outer method {self.method!r}; choose from {', '.join(OUTER_METHODS)}")
        _positive(self, "inner_steps", "diloco_lr", "sparseloco_lr")
        if not 0.0 <= self.diloco_momentum < 1.0:
            raise ValueError(f"config field 'diloco_momentum': must be in [0, 1), got {self.diloco_momentum}")
