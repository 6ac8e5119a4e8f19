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
from swarm.model.reference import REFERENCE_RATES, REFERENCE_SHAPE, reference_seconds, stage_flops_per_token
from swarm.model.transformer import ModelConfig, subspace_basis
from swarm.plan.model import RECOMPUTE_FACTOR, Compute, Frames

__all__ = [
    "REFERENCE_RATES",
    "REFERENCE_SHAPE",
    "codec_frames",
    "frame_bytes",
    "reference_compute",
    "stage_flops_per_token",
]


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


def reference_compute(cfg: SwarmConfig, *, tokens_per_s: float, keep_graphs: bool = True) -> Compute:
    """Each stage's compute on a device where one process trains cfg's whole model at ``tokens_per_s``: the same
    microbatch's time split by FLOPs, a server's × 4/3 where it recomputes its forward (``keep_graphs`` off). The
    codecs' own time is not in it (on a GPU they are a small part; measure them with ``swarm/plan/measure.py``)."""
    train = cfg.train
    share = reference_seconds(
        cfg.model,
        num_stages=cfg.stages.num_stages,
        seq_len=train.seq_len,
        microbatch=train.microbatch_size,
        tokens_per_s=tokens_per_s,
    )
    factor = 1.0 if keep_graphs else RECOMPUTE_FACTOR
    return Compute(stages=tuple(factor * s for s in share[1:]), trainer=share[0])
