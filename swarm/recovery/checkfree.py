"""CheckFree / CheckFree+ recovery: rebuild a middle stage whose every replica is gone from its neighbours.

Pure code: ``recovery_source`` plans which neighbours to take (a gradient-norm-weighted merge of both for an
interior stage, a copy of the swap partner for an end stage), ``apply_recovery`` builds the weights from a
``fetch_state`` callable. The network side is ``rebuild.py``; the math and block alignment:
docs/architecture.md, recovery/.

    >>> state = apply_recovery(recovery_source(2, num_stages=4, swaps_enabled=True), fetch_state, num_blocks=3)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from optim.config import InnerOptimConfig
from optim.inner import make_inner_optimizer

GRAD_NORM_EPS = 1e-4  # keeps the weights positive when a neighbour's gradient norm is 0
RECOVERY_LR_SCALE = 1.1  # CheckFree: the rebuilt stage catches up with a slightly larger step

StateDict = Mapping[str, Tensor]
FetchState = Callable[[int], tuple[StateDict, float]]  # stage → (its state dict, its last gradient norm)

_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


class NoRecoverySource(ValueError):
    """The stage has no neighbouring middle stage to be rebuilt from."""


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    stage: int
    sources: tuple[int, ...]  # (i−1, i+1) to merge, or the one stage to copy
    kind: Literal["merge", "copy-swap-partner", "copy-neighbour"]


def recovery_source(stage: int, num_stages: int, *, swaps_enabled: bool) -> RecoveryPlan:
    """Where middle stage ``stage`` of 1..``num_stages`` is rebuilt from (see the module docstring)."""
    if stage == 0:
        raise ValueError("stage 0 (the trainers' edge stage) is on every trainer and is never rebuilt from neighbours")
    if not 1 <= stage <= num_stages:
        raise ValueError(f"stage must be a middle stage in [1, {num_stages}], got {stage}")
    if num_stages == 1:
        raise NoRecoverySource(
            "stage 1 is the only middle stage and has no neighbour to be rebuilt from: "
            "restore it from a live replica's state or re-initialise it"
        )
    if 1 < stage < num_stages:
        return RecoveryPlan(stage=stage, sources=(stage - 1, stage + 1), kind="merge")
    partner = 2 if stage == 1 else num_stages - 1
    return RecoveryPlan(
        stage=stage, sources=(partner,), kind="copy-swap-partner" if swaps_enabled else "copy-neighbour"
    )


def checkfree_merge(
    prev: StateDict, next_: StateDict, grad_norm_prev: float, grad_norm_next: float, *, num_blocks: int
) -> dict[str, Tensor]:
    """W_i = (a·W_{i+1} + b·W_{i−1}) / (a + b), a = ‖g_{i+1}‖ + 1e-4, b = ‖g_{i−1}‖ + 1e-4, for ``num_blocks`` blocks."""
    for name, norm in (("grad_norm_prev", grad_norm_prev), ("grad_norm_next", grad_norm_next)):
        if not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"{name} must be finite and non-negative, got {norm}")
    return _weighted_blocks(
        [(next_, grad_norm_next + GRAD_NORM_EPS), (prev, grad_norm_prev + GRAD_NORM_EPS)], num_blocks
    )


def apply_recovery(plan: RecoveryPlan, fetch_state: FetchState, *, num_blocks: int) -> dict[str, Tensor]:
    """The rebuilt stage's state dict (``num_blocks`` blocks, local keys), from the sources ``fetch_state`` returns."""
    if plan.kind == "merge":
        (prev, norm_prev), (next_, norm_next) = (fetch_state(s) for s in plan.sources)
        return checkfree_merge(prev, next_, norm_prev, norm_next, num_blocks=num_blocks)
    state, _ = fetch_state(plan.sources[0])
    return _weighted_blocks([(state, 1.0)], num_blocks)


def make_recovery_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: InnerOptimConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The rebuilt stage's fresh inner optimizer (no moments carried over), peak lr × ``RECOVERY_LR_SCALE``."""
    return make_inner_optimizer(params, cfg, lr_scale=RECOVERY_LR_SCALE)


def _blocks(state: StateDict) -> list[dict[str, Tensor]]:
    """A middle stage's state dict split by block: ``out[j][name] = state[f"blocks.{j}.{name}"]``."""
    blocks: dict[int, dict[str, Tensor]] = {}
    for key, value in state.items():
        match = _BLOCK_KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{key!r} is not a middle-stage key (expected 'blocks.<j>.<name>')")
        blocks.setdefault(int(match[1]), {})[match[2]] = value
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        raise ValueError(f"a middle stage needs blocks 0..n-1, got block indices {sorted(blocks)}")
    return [blocks[j] for j in range(len(blocks))]


def _weighted_blocks(sources: list[tuple[StateDict, float]], num_blocks: int) -> dict[str, Tensor]:
    """Σ_k w_k·W_k / Σ_k w_k per tensor, block j of the result from block min(j, n_k − 1) of source k."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
    aligned = [(_blocks(state), weight) for state, weight in sources]
    total = sum(weight for _, weight in sources)
    out: dict[str, Tensor] = {}
    for j in range(num_blocks):
        picks = [(blocks[min(j, len(blocks) - 1)], weight) for blocks, weight in aligned]
        names = picks[0][0].keys()
        if any(block.keys() != names for block, _ in picks):
            raise ValueError(f"block {j}: the sources have different tensors: {[sorted(block) for block, _ in picks]}")
        for name in names:
            shapes = [tuple(block[name].shape) for block, _ in picks]
            if len(set(shapes)) > 1:
                raise ValueError(f"blocks.{j}.{name}: the sources' shapes differ: {shapes}")
            # one tensor at a time; a tensor start (not 0) gives the sum a tensor's type, and the same values
            zero = torch.zeros((), dtype=torch.float64)
            merged = sum((weight * block[name].double() for block, weight in picks), zero) / total
            out[f"blocks.{j}.{name}"] = merged.to(picks[0][0][name].dtype)  # a new tensor, never a source's
    return out
