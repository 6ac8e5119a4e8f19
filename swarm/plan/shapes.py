"""What the throughput model needs from a swarm config: its frames' bytes from the real codecs, and each stage's
compute on a device known by one process's training rate, split by the stages' FLOPs.

    >>> codec_frames(SwarmConfig()).trainer_sent  # 528712: the default model's int8 frames, 4 × 128 × 128, 4 stages
    >>> reference_compute(cfg, tokens_per_s=REFERENCE_RATES["h200"]["125m"])  # cfg at 125m: each stage's seconds

Frames here are the codec's own size (``header_bytes`` + ``payload_bytes``, which ``tests/test_plan.py`` checks
against real encodes): zstd may shrink a real swarm's frames further (at 125m the embedding's int8 codes to 0.04, a
block's output to 0.6), so a prediction from them errs slow. ``swarm/plan/measure.py`` measures real frames instead.
"""

from __future__ import annotations

from compress.codecs import get_codec
from compress.wire import header_bytes
from swarm.config import SwarmConfig
from swarm.model.stages import split_layers
from swarm.model.transformer import ModelConfig, subspace_basis
from swarm.plan.model import RECOMPUTE_FACTOR, Compute, Frames

# One process training the whole preset (train-local, bf16, microbatches of 8 × 1024, 16 samples an inner step, the
# validation passes and the first window left out), tokens per second: docs/benchmarks.md, "The GPU check" (H200;
# the later run of the two, at the presets' own optimizer defaults; the earlier one measured 210,419 and 51,395).
REFERENCE_RATES: dict[str, dict[str, float]] = {
    "h200": {"125m": 192_675.0, "1b": 50_722.0},
}
REFERENCE_SHAPE = (8, 1024)  # (microbatch, seq_len) those rates were measured at


def frame_bytes(codec_name: str, shape: tuple[int, ...], model: ModelConfig, *, kind: str) -> int:
    """Bytes of one frame of ``codec_name`` holding a ``shape`` tensor, before zstd (as ``Codec.encode`` writes it
    when zstd does not pay)."""
    basis = table = None
    if codec_name.startswith("subspace"):
        if not model.subspace_rank:
            raise ValueError(f"codec {codec_name!r} needs a subspace-constrained model (model.subspace_rank)")
        basis, table = subspace_basis(model)
    codec = get_codec(codec_name, basis=basis, table=table, kind="activation" if kind == "activation" else "gradient")
    return header_bytes(len(shape)) + codec.payload_bytes(shape)


def codec_frames(cfg: SwarmConfig) -> Frames:
    """Every hop's frames at cfg's shapes in its codecs (a fixed codec each: "adaptive" chooses by link, unknown here)."""
    acts, grads = cfg.codecs.activations, cfg.codecs.gradients
    if "adaptive" in (acts, grads):
        raise ValueError("the adaptive codec chooses per link as it measures it: plan with the codec it would pick")
    shape = (cfg.train.microbatch_size, cfg.train.seq_len, cfg.model.d_model)
    return Frames.uniform(
        stages=cfg.stages.num_stages,
        activation=frame_bytes(acts, shape, cfg.model, kind="activation"),
        gradient=frame_bytes(grads, shape, cfg.model, kind="gradient"),
    )


def stage_flops_per_token(model: ModelConfig, num_stages: int, seq_len: int) -> list[float]:
    """Training FLOPs per token of stage 0 (the LM head; the embedding is a lookup) and stages 1..S: 6 per weight
    (forward 2, backward 4) and 12 · d · T per block for attention's scores and mixing (the MFU count of
    docs/benchmarks.md, "The GPU check")."""
    d, ffn = model.d_model, model.ffn_hidden
    block = 6 * (4 * d * d + 3 * d * ffn) + 12 * d * seq_len
    head = 6.0 * model.vocab_size * d
    return [head, *(float(len(layers) * block) for layers in split_layers(model.n_layers, num_stages))]


def reference_compute(cfg: SwarmConfig, *, tokens_per_s: float, keep_graphs: bool = True) -> Compute:
    """Each stage's compute on a device where one process trains cfg's whole model at ``tokens_per_s``: the same
    microbatch's time split by FLOPs, a server's × 4/3 where it recomputes its forward (``keep_graphs`` off). The
    codecs' own time is not in it (on a GPU they are a small part; measure them with ``swarm/plan/measure.py``)."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    flops = stage_flops_per_token(cfg.model, cfg.stages.num_stages, cfg.train.seq_len)
    microbatch_s = cfg.train.microbatch_size * cfg.train.seq_len / tokens_per_s
    share = [f / sum(flops) * microbatch_s for f in flops]
    factor = 1.0 if keep_graphs else RECOMPUTE_FACTOR
    return Compute(stages=tuple(factor * s for s in share[1:]), trainer=share[0])
