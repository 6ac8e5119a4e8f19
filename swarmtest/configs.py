"""The configs the tests and benchmarks run: the tiny swarm, its outer-step and stage-RPC variants, the test corpus
and the convergence study's presets.

    cfg = tiny_config(stages=3, steps=400, model={"n_layers": 3}, outer={"method": "none"}, paths=None)
    cfg = outer_config("sparseloco", inner_steps=2, timeouts=TIMEOUTS)   # rounds from the first step
    cfg = rpc_config(stages=2, clip=0.0)   # stage RPC at RPC_BATCH × RPC_SEQ × RPC_WIDTH, fp32 on the wire
"""

from __future__ import annotations

import dataclasses
import functools
import sysconfig
from pathlib import Path

from compress.config import CodecConfig
from optim.config import InnerOptimConfig, OuterMethod, OuterOptimConfig
from swarm.config import ConfigValue, PathConfig, SwarmConfig, TimeoutConfig, TrainConfig
from swarm.model.stages import StagesConfig
from swarm.model.transformer import ModelConfig

DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "email")  # ~30 files of Python's own source: loads in a blink
BATCH, SEQ = 8, 64  # the tiny config's microbatch: 8 samples of 64 tokens
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
LOOPBACK_MADDRS = [LOOPBACK]  # a peer's host_maddrs on loopback

# The id of every public swarm on the default config: fields added since must leave it unchanged (it changed on
# purpose with the default microbatch of 4, 2026-11-24, and with the default warm start of 100 steps, 2026-11-26).
DEFAULT_SWARM_HASH = "695ed322fad08987"

# Test swarms meet every H from their first step: their runs are tens of steps, and most tests count rounds
# (the default warm start, 100 steps of a round after every step, is exercised by the main job and its own tests).
QUICK_OUTER = OuterOptimConfig(warm_start_steps=0)

# Swarms of nodes or processes that must see a dead peer's records go within seconds (announced every second, 4 s TTL)
FAST_TIMEOUTS = TimeoutConfig(rpc_s=5.0, matchmaking_s=2.0, announce_period_s=1.0, record_ttl_s=4.0)

# Outer rounds on the in-memory network (swarmtest.fakes.Hub): records read every 0.1 s, rounds in tenths of a second
MEMORY_ROUND_TIMEOUTS = TimeoutConfig(rpc_s=0.5, matchmaking_s=0.5, announce_period_s=0.1, record_ttl_s=1.0)

# Outer rounds between replicas on loopback (swarmtest.loopback): a round every 0.3 s or so at an inner step every 0.1 s
LOOPBACK_ROUND_TIMEOUTS = TimeoutConfig(rpc_s=2.0, matchmaking_s=1.0, announce_period_s=0.5, record_ttl_s=3.0)

# The convergence study's configs (scripts/bench_convergence.py, bench_full_peers.py), as dotted overrides: one
# microbatch of 16 per inner step (the swarm's default splits it in four, the same gradient in more calls: the simulator
# would take longer for the same numbers, and one-process would train on batches of 4); micro, small and medium differ
# only in width and depth (sequences of 64, 2 middle stages): the model-size curve
STUDY_STEP: dict[str, ConfigValue] = {"train.microbatch_size": 16, "train.inner_batch": 16}
STUDY_SEQ64: dict[str, ConfigValue] = {
    "model.max_seq_len": 64,
    "stages.num_stages": 2,
    "train.seq_len": 64,
} | STUDY_STEP
STUDY_PRESETS: dict[str, dict[str, ConfigValue]] = {
    "default": STUDY_STEP,
    "micro": {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2} | STUDY_SEQ64,
    "small": {"model.d_model": 64, "model.n_layers": 4} | STUDY_SEQ64,
    "medium": {"model.d_model": 128, "model.n_layers": 8} | STUDY_SEQ64,
}

RPC_BATCH, RPC_SEQ, RPC_WIDTH = 4, 16, 32  # rpc_config's microbatches and width: exact fp32 checks in milliseconds
FP32_BOUNDARIES = CodecConfig(activations="fp32", gradients="fp32")


def tiny_config(*, stages: int | None = None, steps: int | None = None, **sections: object) -> SwarmConfig:
    """The tiny swarm the tests run: d_model 64, 2 layers, 4 heads, one stage, microbatches of 8 × 64 tokens, 5 warm-up steps.

    ``stages`` (middle stages) and ``steps`` (the inner schedule's length) are the knobs most tests turn. Any other
    field of ``SwarmConfig`` is replaced by a value, or, given a dict, changed field by field; None keeps the default.
    """
    tiny = SwarmConfig(
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=SEQ),
        stages=StagesConfig(num_stages=1),
        train=TrainConfig(seq_len=SEQ, microbatch_size=BATCH, inner_batch=BATCH),
        inner=InnerOptimConfig(warmup_steps=5),
        outer=QUICK_OUTER,
    )
    changes = {
        name: dataclasses.replace(getattr(tiny, name), **value) if isinstance(value, dict) else value
        for name, value in sections.items()
        if value is not None
    }
    if stages is not None:
        changes["stages"] = dataclasses.replace(changes.get("stages", tiny.stages), num_stages=stages)
    if steps is not None:
        changes["inner"] = dataclasses.replace(changes.get("inner", tiny.inner), total_steps=steps)
    return dataclasses.replace(tiny, **changes)


def outer_config(
    method: OuterMethod = "diloco",
    *,
    inner_steps: int = 3,
    timeouts: TimeoutConfig | None = None,
    stages: int | None = None,
    steps: int | None = None,
    **outer: float,
) -> SwarmConfig:
    """The tiny swarm with an outer step every ``inner_steps`` from the first step, its pseudo-gradients on the wire
    in the method's own codec (SparseLoCo's, else fp32); ``outer``: more ``OuterOptimConfig`` fields (``diloco_lr``)."""
    return tiny_config(
        stages=stages,
        steps=steps,
        outer=OuterOptimConfig(warm_start_steps=0, method=method, inner_steps=inner_steps, **outer),
        codecs=CodecConfig(pseudo_gradients="sparseloco" if method == "sparseloco" else "fp32"),
        timeouts=timeouts,
    )


def rpc_config(
    *,
    stages: int = 2,
    steps: int = 8,
    codecs: CodecConfig = FP32_BOUNDARIES,
    clip: float = 1.0,
    paths: PathConfig | None = None,
) -> SwarmConfig:
    """The stage-RPC tests' swarm: two blocks a stage, width ``RPC_WIDTH``, microbatches of ``RPC_BATCH`` ×
    ``RPC_SEQ`` tokens, two a step, fp32 boundaries (a trainer's result can equal one process's)."""
    return tiny_config(
        stages=stages,
        steps=steps,
        model={"d_model": RPC_WIDTH, "n_layers": 2 * stages, "n_heads": 2, "max_seq_len": RPC_SEQ},
        train={"seq_len": RPC_SEQ, "microbatch_size": RPC_BATCH, "inner_batch": 2 * RPC_BATCH},
        inner={"warmup_steps": 2, "grad_clip": clip},
        codecs=codecs,
        paths=paths,
    )


# ``outer_config`` of replicas that sync on the in-memory network (ReplicaSync tests): they meet every 3 inner steps,
# their records read every 0.1 s, so rounds take tenths of a second
sync_config = functools.partial(outer_config, timeouts=MEMORY_ROUND_TIMEOUTS)
