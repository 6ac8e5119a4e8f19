"""How big a model and each of its stages are, and how much memory serving a stage takes, computed before anything is allocated.

Parameter counts are exact; ``StageFootprint`` is an upper bound of what a peer holds for one stage while it
trains (weights, gradients and AdamW; the outer step's state; activations; the process). What each part costs:
docs/architecture.md, model/.

    >>> print(StageFootprint.of(cfg, stage=1).describe())  # stage 1: 42.5M parameters, needs ≈ 2.64 GiB (…)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from optim.config import OuterOptimConfig
from swarm.model.stages import EDGE_STAGE, StagesConfig, split_layers
from swarm.model.transformer import ModelConfig

GIB = 1024**3
TRAINING_BYTES_PER_PARAMETER = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
STASH_BYTES_PER_PARAMETER = 4 * 2  # a middle stage's server: fp32 copies of its last 2 inner steps' weights
OUTER_BYTES_PER_PARAMETER = 8 + 12  # fp32 global weights + momentum or error buffer; in a round: snapshot, target, Δ
RUNTIME_BYTES = GIB // 2  # measured: a tiny-model peer's peak RSS is ~0.45 GB (docs/benchmarks.md, bench_scale)


class TrainShape(Protocol):
    """What the estimate reads of ``swarm.config.TrainConfig``."""

    @property
    def seq_len(self) -> int: ...
    @property
    def microbatch_size(self) -> int: ...
    @property
    def precision(self) -> str: ...


class SizedSwarm(Protocol):
    """What the estimate reads of a ``swarm.config.SwarmConfig`` (typed by its shape: the config imports model/)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def stages(self) -> StagesConfig: ...
    @property
    def train(self) -> TrainShape: ...
    @property
    def outer(self) -> OuterOptimConfig: ...


def block_parameters(cfg: ModelConfig) -> int:
    """One transformer block: two RMSNorm gains, fused qkv, attention out, SwiGLU gate_up and down."""
    d, ffn, k = cfg.d_model, cfg.ffn_hidden, cfg.subspace_rank
    out_rows = k if k else d  # subspace projections write k numbers, lifted by the fixed basis
    return 2 * d + 3 * d * d + out_rows * d + 2 * ffn * d + out_rows * ffn


def edge_parameters(cfg: ModelConfig) -> int:
    """Stage 0: the embedding (vocab × d, or vocab × k in subspace mode), the final norm and the LM head."""
    width = cfg.subspace_rank or cfg.d_model
    return cfg.vocab_size * width + cfg.d_model + cfg.vocab_size * cfg.d_model


def stage_parameters(cfg: ModelConfig, num_stages: int, stage: int) -> int:
    if stage == EDGE_STAGE:
        return edge_parameters(cfg)
    return len(split_layers(cfg.n_layers, num_stages)[stage - 1]) * block_parameters(cfg)


def model_parameters(cfg: ModelConfig) -> int:
    return edge_parameters(cfg) + cfg.n_layers * block_parameters(cfg)


def activation_bytes(cfg: SizedSwarm, stage: int) -> int:
    """Upper bound of one microbatch's saved activations on ``stage`` (×2: the next microbatch's forward beside it)."""
    m, b, t = cfg.model, cfg.train.microbatch_size, cfg.train.seq_len
    value_bytes = 2 if cfg.train.precision == "bf16" else 4
    # per block: norm inputs and outputs, q k v before and after RoPE, attention output, SwiGLU's gate, up and product
    per_block = b * t * (10 * m.d_model + 4 * m.ffn_hidden) * value_bytes + b * m.n_heads * t * t * 4
    if stage == EDGE_STAGE:  # the embedding output, and the fp32 logits with their softmax gradient
        return 2 * (b * t * m.d_model * 4 + 3 * b * t * m.vocab_size * 4)
    blocks = len(split_layers(m.n_layers, cfg.stages.num_stages)[stage - 1])
    return 2 * blocks * per_block


@dataclass(frozen=True)
class StageFootprint:
    what: str  # "stage 2", or "the whole model"
    parameters: int
    training_bytes: int  # weights, gradients, AdamW moments (and a middle stage's weight stash)
    outer_bytes: int
    activation_bytes: int
    runtime_bytes: int = RUNTIME_BYTES

    @classmethod
    def of(cls, cfg: SizedSwarm, stage: int) -> StageFootprint:
        params = stage_parameters(cfg.model, cfg.stages.num_stages, stage)
        outer = OUTER_BYTES_PER_PARAMETER * params if cfg.outer.method != "none" else 0
        per_parameter = TRAINING_BYTES_PER_PARAMETER + (STASH_BYTES_PER_PARAMETER if stage != EDGE_STAGE else 0)
        return cls(f"stage {stage}", params, per_parameter * params, outer, activation_bytes(cfg, stage))

    @classmethod
    def whole_model(cls, cfg: SizedSwarm, *, outer: bool = False) -> StageFootprint:
        """One process holding every stage: the stages summed, activations included; the outer step's state only with
        ``outer`` (a full peer, a replica of every stage; train-local has none)."""
        parts = [cls.of(cfg, stage) for stage in range(cfg.stages.num_stages + 1)]
        return cls(
            "the whole model",
            sum(p.parameters for p in parts),
            sum(p.training_bytes for p in parts),
            sum(p.outer_bytes for p in parts) if outer else 0,
            sum(p.activation_bytes for p in parts),
        )

    @property
    def total_bytes(self) -> int:
        return self.training_bytes + self.outer_bytes + self.activation_bytes + self.runtime_bytes

    def describe(self) -> str:
        return (
            f"{self.what}: {self.parameters / 1e6:.1f}M parameters, needs ≈ {self.total_bytes / GIB:.2f} GiB "
            f"(weights, gradients, AdamW {self.training_bytes / GIB:.2f} GiB; outer state {self.outer_bytes / GIB:.2f} GiB; "
            f"activations {self.activation_bytes / GIB:.2f} GiB; the process {self.runtime_bytes / GIB:.2f} GiB)"
        )


class StageDoesNotFit(ValueError):
    """This peer's device has less free memory than the stage needs; the message says both."""


def check_fits(footprint: StageFootprint, *, available: int, device: str) -> None:
    """Refuse a stage whose estimated footprint exceeds what ``device`` has free."""
    if footprint.total_bytes > available:
        raise StageDoesNotFit(
            f"{footprint.describe()}, but {device} has {available / GIB:.2f} GiB free: serve a smaller stage "
            "(more stages: stages.num_stages), a smaller model preset, or use a device with more memory"
        )
