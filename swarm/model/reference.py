"""Reference devices: a device's measured one-process training rate, and a microbatch's time on it split by the
stages' FLOPs. What ``swarmloco plan`` projects with (``swarm/plan/shapes.py``) and what a paced peer waits
(``swarm/pipeline/pacing.py``, ``--pace-as``).

    >>> reference_seconds(cfg.model, num_stages=2, seq_len=1024, microbatch=8, tokens_per_s=192_675.0)
    [0.00016, 0.0212, 0.0212]  # stage 0 (the trainer's head), stages 1 and 2: forward + backward, seconds
"""

from __future__ import annotations

from swarm.model.stages import split_layers
from swarm.model.transformer import ModelConfig

# One process training the whole preset (train-local, bf16, microbatches of 8 × 1024, 16 samples an inner step, the
# validation passes and the first window left out), tokens per second: docs/benchmarks.md, "The GPU check" (H200;
# the later run of the two, at the presets' own optimizer defaults; the earlier one measured 210,419 and 51,395).
REFERENCE_RATES: dict[str, dict[str, float]] = {
    "h200": {"125m": 192_675.0, "1b": 50_722.0},
}
REFERENCE_SHAPE = (8, 1024)  # (microbatch, seq_len) those rates were measured at
FORWARD_SHARE = 1 / 3  # of a stage's training FLOPs: forward 2 per weight, backward 4


def stage_flops_per_token(model: ModelConfig, num_stages: int, seq_len: int) -> list[float]:
    """Training FLOPs per token of stage 0 (the LM head; the embedding is a lookup) and stages 1..S: 6 per weight
    (forward 2, backward 4) and 12 · d · T per block for attention's scores and mixing (the MFU count of
    docs/benchmarks.md, "The GPU check")."""
    d, ffn = model.d_model, model.ffn_hidden
    block = 6 * (4 * d * d + 3 * d * ffn) + 12 * d * seq_len
    head = 6.0 * model.vocab_size * d
    return [head, *(float(len(layers) * block) for layers in split_layers(model.n_layers, num_stages))]


def reference_seconds(
    model: ModelConfig, *, num_stages: int, seq_len: int, microbatch: int, tokens_per_s: float
) -> list[float]:
    """Seconds of forward + backward per microbatch of stage 0 (the trainer's head) and of stages 1..S on a device where
    one process trains the whole model at ``tokens_per_s``: the microbatch's time split by FLOPs."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    flops = stage_flops_per_token(model, num_stages, seq_len)
    microbatch_s = microbatch * seq_len / tokens_per_s
    return [f / sum(flops) * microbatch_s for f in flops]


def rate_spec_problem(spec: str) -> str | None:
    """Why ``spec`` names no reference rate (a device of ``REFERENCE_RATES``, or tokens/s as a positive number)."""
    if spec.lower() in REFERENCE_RATES:
        return None
    try:
        if float(spec) > 0:
            return None
    except ValueError:
        pass
    return (
        f"a reference device ({', '.join(REFERENCE_RATES)}) or one process's tokens/s (a positive number), got {spec!r}"
    )


def reference_rate(spec: str, preset: str) -> float:
    """One process's tokens/s on the model ``preset``: a device's measured rate (``REFERENCE_RATES``), or ``spec`` as
    a number."""
    if (problem := rate_spec_problem(spec)) is not None:
        raise ValueError(problem)
    device = spec.lower()
    if device not in REFERENCE_RATES:
        return float(spec)
    if preset not in REFERENCE_RATES[device]:
        known = ", ".join(REFERENCE_RATES[device])
        raise ValueError(
            f"{device}'s rate is measured for the presets {known}, not {preset!r}: give one process's tokens/s instead"
        )
    return REFERENCE_RATES[device][preset]
