"""The throughput model's inputs measured on this machine: a real ``Trainer`` drives real ``StageServer``s in this
process, one microbatch at a time (no network, nothing overlapping), and every call's frames and its server's time
are recorded.

    >>> m = measure(SwarmConfig(), random_batches(SwarmConfig()), steps=3)  # 1 warm-up inner step, then 3 timed
    >>> m.compute.stages, m.frames.out  # seconds per microbatch per stage; each stage's output frame, bytes

A stage's compute is its server's time per call (decoding the request, forward or backward, encoding the reply: what
it does for a real trainer, less the RPC), summed over the microbatch's forward and backward; the trainer's is the
rest of the microbatch's wall time (embedding, head and loss, its frames' codecs). Each is the median over inner
steps of their mean per microbatch, so an inner step's optimizer is in it. Frames are those really sent (zstd where
it paid), averaged over the timed microbatches.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from swarm.config import SwarmConfig
from swarm.node.config import PeerConfig
from swarm.pipeline.pacing import Pace
from swarm.pipeline.protocol import Backward, Forward, Reply
from swarm.pipeline.routing import Peer, Router
from swarm.pipeline.server import StageServer
from swarm.pipeline.trainer import Trainer
from swarm.plan.model import Compute, Frames

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each


@dataclass(frozen=True, kw_only=True)
class Measured:
    """``compute`` and ``frames`` as measured; ``step_s``: each timed inner step's wall time (whole pipeline, serial)."""

    compute: Compute
    frames: Frames
    step_s: tuple[float, ...]


class RecordingStages:
    """``StageCalls`` straight into one ``StageServer`` per middle stage, recording each call's frames and server time."""

    def __init__(self, cfg: SwarmConfig, *, keep_graph_mb: int | None = None, pace: Pace | None = None) -> None:
        self.servers = {
            s: StageServer(cfg, s, keep_graph_mb=keep_graph_mb, pace=pace) for s in range(1, cfg.stages.num_stages + 1)
        }
        self.router = Router(cfg.stages.num_stages, random.Random(0))
        for stage in self.servers:
            self.router.update(stage, [f"stage{stage}"])
        self.server_s: defaultdict[int, float] = defaultdict(float)  # per stage, since ``reset``
        self.bytes: defaultdict[str, list[int]] = defaultdict(list)  # "into1", "out1", "grad_into1", "grad_out1", …

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes:
        reply = await self.servers[request.stage].forward("trainer", request)
        if request.train:
            self._record(request.stage, reply, into=len(request.x), out=len(reply))
        return reply

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes:
        reply = await self.servers[request.stage].backward("trainer", request)
        self._record(request.stage, reply, grad_into=len(request.grad), grad_out=len(reply))
        return reply

    def _record(self, stage: int, reply: Reply, **sizes: int) -> None:
        self.server_s[stage] += reply.server_s or 0.0
        for kind, n in sizes.items():
            self.bytes[f"{kind}{stage}"].append(n)

    def reset(self) -> None:
        self.server_s.clear()
        self.bytes.clear()

    def shutdown(self) -> None:
        for server in self.servers.values():
            server.shutdown()


def measure(
    cfg: SwarmConfig,
    batches: Iterator[Batch],
    *,
    steps: int = 3,
    warmup_steps: int = 1,
    threads: int | None = 1,
    keep_graph_mb: int | None = None,
    pace: Pace | None = None,
) -> Measured:
    """Time ``steps`` inner steps (after ``warmup_steps``) of cfg's pipeline in this process with ``threads`` torch
    threads (1: as each peer of ``swarmloco local`` and the WAN lab runs; None: torch's default). ``pace``: every
    peer paced (swarm/pipeline/pacing.py): what is left beyond the reference device's time is this machine's cost."""
    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"steps must be ≥ 1 and warmup_steps ≥ 0, got {steps}, {warmup_steps}")
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    net = RecordingStages(cfg, keep_graph_mb=keep_graph_mb, pace=pace)
    options = replace(PeerConfig().trainer, in_flight=1, check_rate=0.0)  # one at a time, no checking recompute
    trainer = Trainer(cfg, net, net.router, options=options, pace=pace)
    per_step = cfg.train.inner_batch // cfg.train.microbatch_size
    num_stages = cfg.stages.num_stages
    stage_s: list[list[float]] = [[] for _ in range(num_stages)]
    trainer_s: list[float] = []
    step_s: list[float] = []
    frames: defaultdict[str, list[int]] = defaultdict(list)

    async def run() -> None:
        for step in range(warmup_steps + steps):
            net.reset()
            started = time.perf_counter()
            for _ in range(per_step):
                if await trainer.train_microbatch(*next(batches)) is None:
                    raise RuntimeError("a microbatch failed in the in-process pipeline")
            wall = time.perf_counter() - started
            if step < warmup_steps:
                continue
            step_s.append(wall)
            for s in range(num_stages):
                stage_s[s].append(net.server_s[s + 1] / per_step)
            trainer_s.append((wall - sum(net.server_s.values())) / per_step)
            for key, sizes in net.bytes.items():
                frames[key] += sizes

    try:
        asyncio.run(run())
    finally:
        trainer.shutdown()
        net.shutdown()
        torch.set_num_threads(threads_before)
    return summarised(stage_s, trainer_s, step_s, frames)


def summarised(
    stage_s: list[list[float]], trainer_s: list[float], step_s: list[float], frames: Mapping[str, list[int]]
) -> Measured:
    """The measurement from what each timed inner step recorded: per stage and for the trainer, the median over steps
    of the seconds per microbatch; each frame (``RecordingStages.bytes``' keys), its mean size in bytes."""

    def mean(key: str) -> int:
        return round(statistics.mean(frames[key]))

    stages = range(1, len(stage_s) + 1)
    return Measured(
        compute=Compute(stages=tuple(statistics.median(s) for s in stage_s), trainer=statistics.median(trainer_s)),
        frames=Frames(
            into=tuple(mean(f"into{s}") for s in stages),
            out=tuple(mean(f"out{s}") for s in stages),
            grad_into=tuple(mean(f"grad_into{s}") for s in stages),
            grad_out=tuple(mean(f"grad_out{s}") for s in stages),
        ),
        step_s=tuple(step_s),
    )


def random_batches(cfg: SwarmConfig, seed: int = 0) -> Iterator[Batch]:
    """Microbatches of uniformly random token ids at cfg's shapes (a corpus's frames compress differently)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.microbatch_size, cfg.train.seq_len + 1), generator=g)
        yield x[:, :-1], x[:, 1:]
