"""Inner and outer optimizer hyper-parameters (part of the swarm config).

>>> OuterOptimConfig(method="diloco", inner_steps=20).method  # 'diloco'
>>> OuterOptimConfig(method="adam")  # ConfigError: config field 'method': unknown value 'adam'; choose from none, diloco, sparseloco, noloco
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from compress.codecs import PseudoGradientCodecName
from compress.config import check_choices, check_non_negative, check_positive, cli
from compress.errors import ConfigError

OuterMethod = Literal["none", "diloco", "sparseloco", "noloco"]  # none: replicas never sync
OUTER_METHODS: tuple[OuterMethod, ...] = get_args(OuterMethod)
# SparseLoCo sends its own codec (top-k with error feedback), and no other method can send it
OWN_PSEUDO_GRADIENT_CODEC: dict[OuterMethod, PseudoGradientCodecName] = {"sparseloco": "sparseloco"}


def pseudo_gradient_codec_problem(method: OuterMethod, codec: str) -> str | None:
    """Why outer method ``method`` cannot send pseudo-gradients with ``codec``; None if it can (method "none" sends none).

    >>> pseudo_gradient_codec_problem("diloco", "sparseloco")  # "'sparseloco' does not fit outer.method='diloco'"
    """
    if method == "none" or (codec == "sparseloco") == (method == "sparseloco"):
        return None
    return f"{codec!r} does not fit outer.method={method!r}"


def fitting_pseudo_gradient_codec(method: OuterMethod, codec: PseudoGradientCodecName) -> PseudoGradientCodecName:
    """The codec ``method`` sends where ``codec`` was asked for: SparseLoCo's own, or "fp32" for another method that was
    given SparseLoCo's; else ``codec`` itself."""
    if method in OWN_PSEUDO_GRADIENT_CODEC:
        return OWN_PSEUDO_GRADIENT_CODEC[method]
    if method != "none" and codec in OWN_PSEUDO_GRADIENT_CODEC.values():
        return "fp32"
    return codec


def _check_unit_interval(section: object, name: str, *, closed: bool) -> None:
    value = getattr(section, name)
    if not (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
        raise ConfigError(name, f"must be in [0, 1{']' if closed else ')'}, got {value}")


@dataclass(kw_only=True)
class InnerOptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio · lr``."""

    # peak learning rate, reached after warmup_steps. A config that names a model preset and leaves it out gets the
    # preset's, from published recipes of comparable models: tiny 3e-3 (tuned on it here); 20m 1e-3 (Pythia-70M);
    # 125m 6e-4 (GPT-3 Small 125M, Pythia-160M); 350m 3e-4 (GPT-3 Medium 350M, Pythia-410M); 1b 2e-4 (GPT-3 XL 1.3B,
    # Pythia-1.4B; TinyLlama 1.1B trains at 4e-4 on 2M-token batches)
    lr: float = field(default=3e-3, metadata=cli("Inner AdamW's peak learning rate (default: the preset's)."))
    beta1: float = 0.9  # AdamW β1
    beta2: float = 0.95  # AdamW β2; GPT-3, Pythia and TinyLlama use 0.95 at every size
    weight_decay: float = 0.1  # AdamW's decoupled weight decay (GPT-3 and TinyLlama: 0.1)
    # inner steps of linear warmup to lr. A preset's default: tiny 30 (tuned here), 20m 50, 125m 100, 350m 150, 1b 200:
    # the recipes' warm-ups (GPT-3: 375M tokens; Pythia: 1% of the run; TinyLlama: 2,000 steps) outlast a whole run
    # of a swarm's small inner batches, so these grow from tiny's with the model
    warmup_steps: int = field(
        default=30,
        metadata=cli("Inner steps of linear warm-up to the peak lr (default: the preset's).", flag="--warmup", min=0),
    )
    # length of the cosine schedule in inner steps. `swarmloco local` and `train-local` make it their --steps unless
    # the config sets it (written commented out at its default, so a file `config show` printed leaves it to the run);
    # a peer whose inner steps pass it warns, and trains on at min_lr_ratio · lr
    total_steps: int = 1000
    min_lr_ratio: float = 0.1  # the cosine decays to min_lr_ratio · lr (GPT-3, Pythia and TinyLlama: 10% of the peak)
    grad_clip: float = 1.0  # max global grad norm per stage; 0 disables (1.0 in GPT-3, Pythia and TinyLlama)

    def __post_init__(self) -> None:
        check_positive(self, "lr", "total_steps")
        _check_unit_interval(self, "beta1", closed=False)
        _check_unit_interval(self, "beta2", closed=False)
        _check_unit_interval(self, "min_lr_ratio", closed=True)
        check_non_negative(self, "warmup_steps", "weight_decay", "grad_clip")


@dataclass(kw_only=True)
class OuterOptimConfig:
    """How replicas of a stage agree every ``inner_steps`` (H) inner steps."""

    # the outer step: none (replicas never sync), DiLoCo, SparseLoCo or NoLoCo
    method: OuterMethod = field(
        default="sparseloco",
        metadata=cli(
            "The outer step: none (replicas never sync), DiLoCo, SparseLoCo or NoLoCo.", flag="--outer-method"
        ),
    )
    # H. 10: SparseLoCo's pseudo-gradients stay >1000× below per-step fp32 gradients at K = 2, and the
    # gap to data-parallel training roughly halves against H = 20 (docs/benchmarks.md, "Convergence")
    inner_steps: int = field(
        default=10,
        metadata=cli("H: inner steps between outer steps.", flag="--inner-steps", aliases=("-H",), min=1),
    )
    # A plain average (lr 1, no momentum) reaches a 9-12% lower loss than DiLoCo's Nesterov 0.7/0.9 at these model
    # sizes and horizons (docs/benchmarks.md); the paper's values are for 150M+ models and H = 500.
    diloco_lr: float = 1.0
    diloco_momentum: float = 0.0  # Nesterov when > 0
    sparseloco_lr: float = 1.0  # SGD on the aggregated sparse pseudo-gradient
    sparseloco_momentum: float = 0.0  # Nesterov; 0: plain SGD (the SparseLoCo paper's α = 1 step)
    noloco_lr: float = 0.7  # NoLoCo: heavy-ball SGD on mean(Δ) plus the pull towards the partner's weights
    noloco_momentum: float = 0.5  # NoLoCo: the heavy-ball momentum
    # a warm start: replicas meet after every inner step for their first ``warm_start_steps`` steps, then every H.
    # 100: on the default model at 8M tokens (K = 2, 3 seeds) SparseLoCo H10 goes from 3.0% to 1.2% above data-parallel
    # training, every seed lower and the spread 7× smaller, for 1.45× the pseudo-gradient bytes of such a run (still
    # 1,184× below fp32 gradients); the early rounds are where replicas' small batches cost most (docs/benchmarks.md)
    warm_start_steps: int = field(
        default=100,
        metadata=cli(
            "Warm start: replicas meet after every inner step for this many steps, then every H.",
            flag="--warm-start",
            min=0,
        ),
    )

    def __post_init__(self) -> None:
        check_choices(self)
        check_positive(self, "inner_steps", "diloco_lr", "sparseloco_lr", "noloco_lr")
        check_non_negative(self, "warm_start_steps")
        for momentum in ("diloco_momentum", "sparseloco_momentum", "noloco_momentum"):
            _check_unit_interval(self, momentum, closed=False)

    def horizon(self, synced_at: int) -> int:
        """Inner steps until the next round, for a replica whose last round was after its ``synced_at``-th step.

        >>> OuterOptimConfig(inner_steps=10, warm_start_steps=3).horizon(2), OuterOptimConfig(inner_steps=10).horizon(2)  # (1, 10)
        """
        return 1 if synced_at < self.warm_start_steps else self.inner_steps
