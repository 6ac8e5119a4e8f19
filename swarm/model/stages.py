"""How the model is cut into pipeline stages, and how a stage gets its seeded initial weights.

Stage 0 (``EdgeStage``: embedding, final norm, LM head) lives on every trainer; stages 1..S (``MiddleStage``) are
contiguous, balanced groups of blocks that stage servers serve. ``build_stage`` draws only its own stage's weights
(``seeded_init``, seeded by each parameter's name in the whole model): every replica starts identical, and equal to its
part of ``Transformer(cfg)``. ``stage_shapes`` and ``seeded_norms`` describe a stage without drawing it.

    >>> stage = build_stage(ModelConfig(n_layers=8), num_stages=4, stage=2)  # blocks 2-3: h (B, T, d) → stage(h)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, overload

import torch
from torch import nn

from swarm.cli_fields import cli
from swarm.errors import ConfigError
from swarm.model.transformer import ModelConfig, Transformer, init_std, seeded_init

EDGE_STAGE: Final = 0


@dataclass(kw_only=True)
class StagesConfig:
    # middle stages S; stage 0 (the edge) is extra
    num_stages: int = field(
        default=4, metadata=cli("Middle stages S (stage 0, the edge, is extra).", flag="--stages", min=1)
    )

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError("num_stages", f"must be at least 1, got {self.num_stages}")


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Balanced contiguous block ranges for stages 1..S (earlier stages take the remainder)."""
    if not 1 <= num_stages <= n_layers:
        raise ConfigError("stages.num_stages", f"must be in [1, n_layers={n_layers}], got {num_stages}")
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        size = base + (s < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class EdgeStage(nn.Module):
    """Stage 0: embedding in front of the pipeline, final norm + LM head behind it."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # alias so nn.Module tooling works
        h: torch.Tensor = self.embed(tokens)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(h))  # (B, T, d) → (B, T, vocab)
        return logits


class MiddleStage(nn.Module):
    """Stage i ≥ 1: blocks ``layers`` of the model. Its state dict uses local block indices."""

    rope_cos: torch.Tensor  # buffers
    rope_sin: torch.Tensor

    def __init__(self, model: Transformer, layers: range) -> None:
        super().__init__()
        self.cfg, self.layers = model.cfg, layers
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:  # h: (B, T, d) → (B, T, d)
            h = block(h, self.rope_cos, self.rope_sin)
        return h


@overload
def build_stage(cfg: ModelConfig, num_stages: int, stage: Literal[0]) -> EdgeStage: ...
@overload
def build_stage(cfg: ModelConfig, num_stages: int, stage: int) -> EdgeStage | MiddleStage: ...
def build_stage(cfg: ModelConfig, num_stages: int, stage: int) -> EdgeStage | MiddleStage:
    """The seeded initial weights of one stage (identical on every peer, and to the same part of ``Transformer(cfg)``).

    Only this stage's weights are drawn (``seeded_init``, which seeds each by its name in the full model); the other
    blocks are allocated uninitialised, never touched, and dropped with the model.
    """
    if not 0 <= stage <= num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}], got {stage}")
    model = Transformer(cfg, init=False)
    module = (
        EdgeStage(model)
        if stage == EDGE_STAGE
        else MiddleStage(model, split_layers(cfg.n_layers, num_stages)[stage - 1])
    )
    seeded_init(cfg, to_model_state(cfg, num_stages, stage, dict(module.named_parameters())))
    return module


def stage_template(cfg: ModelConfig, num_stages: int, stage: int) -> dict[str, nn.Parameter]:
    """A stage's parameters by name, as built: the names, order and shapes a downloaded state is checked against, and
    the seeded weights a state on one peer's word is compared with (``swarm/outer/claims.py``)."""
    return dict(build_stage(cfg, num_stages, stage).named_parameters())


def stage_shapes(cfg: ModelConfig, num_stages: int, stage: int) -> dict[str, nn.Parameter]:
    """``stage_template`` without its values: the same names, order and shapes, on the meta device (no memory, no
    time): what a download decodes into (``OuterService.download``, ``swarmloco export``)."""
    if not 0 <= stage <= num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}], got {stage}")
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    module = (
        EdgeStage(model)
        if stage == EDGE_STAGE
        else MiddleStage(model, split_layers(cfg.n_layers, num_stages)[stage - 1])
    )
    return dict(module.named_parameters())


def seeded_norms(cfg: ModelConfig, num_stages: int, stage: int) -> dict[str, float]:
    """The norm of each of a stage's seeded parameters, known without drawing them: √n for the norm gains (ones), and
    ``init_std``·√n for a matrix of n values drawn from N(0, ``init_std``²) (the drawn norm is within a few 1/√n of
    that: under 1% for every tensor of the tiny model up). What a state on one peer's word is held to, within ×100."""
    local = stage_shapes(cfg, num_stages, stage)
    full_names = to_model_state(cfg, num_stages, stage, local)  # the same order: blocks.{j} → blocks.{first + j}
    return {
        name: math.sqrt(p.numel()) * (1.0 if p.ndim == 1 else init_std(cfg, full))
        for (name, p), full in zip(local.items(), full_names, strict=True)
    }


def split_model(model: Transformer, num_stages: int) -> list[EdgeStage | MiddleStage]:
    """All stages of one model, sharing its parameters: [edge, stage 1, ..., stage S]."""
    return [EdgeStage(model), *middle_stages(model, num_stages)]


def middle_stages(model: Transformer, num_stages: int) -> list[MiddleStage]:
    """Stages 1..S of one model, sharing its parameters."""
    return [MiddleStage(model, r) for r in split_layers(model.cfg.n_layers, num_stages)]


def run_path(edge: EdgeStage, middles: dict[int, MiddleStage], path: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """Logits for ``tokens`` through the middle stages in ``path`` order (a skip/swap path)."""
    h = edge.embed(tokens)
    for stage in path:
        h = middles[stage](h)
    return edge.head(h)


def to_model_state(
    cfg: ModelConfig, num_stages: int, stage: int, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename a stage's state-dict keys to the full model's (``blocks.j`` → ``blocks.{first+j}``)."""
    if stage == EDGE_STAGE:
        return dict(state)
    first = split_layers(cfg.n_layers, num_stages)[stage - 1].start
    out = {}
    for key, value in state.items():
        _, j, rest = key.split(".", 2)  # "blocks.{j}.{rest}"
        out[f"blocks.{first + int(j)}.{rest}"] = value
    return out


def assemble_model(cfg: ModelConfig, num_stages: int, stage_states: dict[int, dict[str, torch.Tensor]]) -> Transformer:
    """A full model from the state dicts of stages 0..S (e.g. downloaded from a swarm)."""
    missing = set(range(num_stages + 1)) - set(stage_states)
    if missing:
        raise ValueError(f"cannot assemble the model: no state for stages {sorted(missing)}")
    full: dict[str, torch.Tensor] = {}
    for stage, state in stage_states.items():
        full.update(to_model_state(cfg, num_stages, stage, state))
    model = Transformer(cfg, init=False)  # every weight is loaded below: nothing to draw
    model.load_state_dict(full, strict=True)
    return model
