"""The full-peer role (``FullRole``): the whole model in one process, trained on its own data, one more replica of
every stage; with ``--serve`` it also serves stages 1..S to trainers on the weights it trains.

docs/architecture.md ("Full peers") says why it announces ``serves=False`` and never laps a round.

    >>> role = FullRole(ctx, data)        # swarm/node/node.py makes it for ``--role full``
    >>> last = await role.run()           # ``steps`` inner steps of stage 0 (or until ctx.stop)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from swarm.config import SwarmConfig
from swarm.dht.metrics import Meter
from swarm.dht.records import StageStatus
from swarm.events import FullProgress, ServesStages
from swarm.events.progress import training_fields
from swarm.hardware import compute_precision, describe
from swarm.model.compiling import compile_stage
from swarm.model.stages import EDGE_STAGE, EdgeStage, MiddleStage, middle_stages
from swarm.model.step import Batch, InnerStep, WeightChange, no_wire, run_microbatch
from swarm.model.transformer import Transformer
from swarm.node.context import DataFactory, NodeContext, until_stopped
from swarm.node.lifecycle import ReplicaLifecycle, download_state, wait_for_replicas
from swarm.node.roles.served import stage_servicer
from swarm.outer.replica import ReplicaSync
from swarm.pipeline.boundary import full_replica_link
from swarm.pipeline.protocol import StageServicer
from swarm.pipeline.server import StageCompute, StageServer
from swarm.sim.centralized import evaluate

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FullModel:
    """The whole model as stages 0..S of one ``Transformer``, each with its inner step; all torch work on one thread."""

    def __init__(self, cfg: SwarmConfig, *, start_steps: Sequence[int], device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.model = Transformer(cfg.model).to(device)  # seeded: its stages start as every other replica's
        self.edge = EdgeStage(self.model)
        self.middles = middle_stages(self.model, cfg.stages.num_stages)  # stage i is middles[i - 1]
        self.stages: list[EdgeStage | MiddleStage] = [self.edge, *self.middles]
        self.inners = [
            InnerStep(stage.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch, start_step=start)
            for stage, start in zip(self.stages, start_steps, strict=True)
        ]
        self.start_steps = list(start_steps)  # where each stage's lr schedule began (a joiner's: the swarm's point)
        self.tokens = 0  # trained on since the peer started
        # its boundaries stay in memory, unless the swarm compresses every replica's (``codecs.full_boundaries``)
        self.link = full_replica_link(cfg, device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="full")

    def compute(self, stage: int) -> StageCompute:
        """Middle stage ``stage`` as a ``StageServer`` serves it: these weights and inner step, on this compute thread."""
        return StageCompute(self.middles[stage - 1], self.inners[stage], self._executor)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread: after or before a whole microbatch, never within one."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def train_microbatch(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One microbatch through every stage in order, and each stage's inner step when due; its loss."""
        loss = await self.run(self._train, inputs, targets)
        self.tokens += inputs.numel()
        return loss

    async def evaluate(self, batches: Sequence[Batch]) -> float:
        """Mean validation loss of the whole model (the plain path 1..S)."""

        def run() -> float:
            self.model.eval()
            try:
                return evaluate(self.model, batches, device=self.device, precision=self.cfg.train.precision)
            finally:
                self.model.train()

        return await self.run(run)

    def _train(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        with compute_precision(self.device, self.cfg.train.precision):
            loss = run_microbatch(
                self.edge,
                self.middles,
                (inputs.to(self.device), targets.to(self.device)),
                inner_batch=self.cfg.train.inner_batch,
                send=self.link.send if self.link else no_wire,
            )
        for inner in self.inners:  # stages hold disjoint parameters: each clips and steps its own
            inner.add(inputs.shape[0])
        return loss

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class StageHolder:
    """One stage of a ``FullModel`` as its ``ReplicaSync`` holds it (``swarm.outer.replica.Holder``)."""

    def __init__(self, full: FullModel, stage: int) -> None:
        self.full, self.stage = full, stage
        self.module = full.stages[stage]
        self.inner = full.inners[stage]
        self.start_step = full.start_steps[stage]
        self.server: StageServer | None = None  # with --serve, stages 1..S: the server computing on this stage

    @property
    def inner_steps(self) -> int:
        return self.inner.steps

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the compute thread, between microbatches and requests, changing the weights as ``change`` says:
        after a replacement the gradients this stage holds for its next inner step are dropped (as a trainer drops
        its own), and forwards served before get no parameter gradient at their backward (as a stage server's); after
        a move both keep theirs."""

        def run() -> T:
            result = fn() if self.server is None else self.server.change_weights(fn, change)
            if change == "replaced":
                self.inner.drop()
            return result

        return await self.full.run(run)

    def status(self, *, queue: int = 0) -> StageStatus:
        """Its record: a server's (``queue``: requests held) where it serves the stage, else one routing skips."""
        if self.server is not None:
            return self.server.status(queue=queue)
        return StageStatus(inner_steps=self.inner.steps, grad_norm=float(self.inner.grad_norm), serves=False)


class FullRole:
    """A full peer: trains every stage locally and takes part in every stage's outer rounds, until ``steps``."""

    def __init__(self, ctx: NodeContext, data: DataFactory) -> None:
        self.ctx, self.data = ctx, data
        self.holder: StageHolder | None = None  # stage 0's (a fault schedule reads its step)
        self.stage = EDGE_STAGE

    async def run(self) -> FullProgress | None:
        """Train ``steps`` inner steps of stage 0; the last progress record (None if stopped first)."""
        self.ctx.ready()
        return await until_stopped(self._train(), self.ctx.stop)

    async def _train(self) -> FullProgress | None:
        ctx, cfg, config = self.ctx, self.ctx.swarm_config, self.ctx.peer_config
        meter = Meter(role="full", stage=EDGE_STAGE, state="joining", name=config.name, device=describe(ctx.device))
        life = ReplicaLifecycle(ctx, meter, checkpoint_stage=EDGE_STAGE)
        stages = range(cfg.stages.num_stages + 1)
        states = {stage: state for stage in stages if (state := await download_state(ctx, stage)) is not None}
        full = FullModel(
            cfg, start_steps=[states[s].schedule_step if s in states else 0 for s in stages], device=ctx.device
        )
        compile_stage(full.model, config.compile, ctx.device)  # in place, by block: what it serves too (--serve)
        holders = [StageHolder(full, stage) for stage in stages]
        self.holder = holders[EDGE_STAGE]
        syncs = await life.hold(dict(enumerate(holders)), states)
        batches, val_batches = await asyncio.to_thread(self.data, cfg, ctx.me)
        servicer = await self._serve(full, holders, meter) if config.serve else None
        life.start(
            status=lambda stage: holders[stage].status(queue=servicer.pending if servicer else 0),
            usage=lambda: {"tokens": full.tokens},
        )
        try:
            await wait_for_replicas(ctx.membership, config.wait_for_replicas, config.wait_for_stages_s)
            meter.state = "training"
            last = await self._loop(full, holders, syncs, batches, val_batches, meter)
            await life.checkpoint()  # as a trainer does: stage 0 outlives the peer
            return last
        finally:
            life.close()
            if servicer is not None:
                await servicer.remove_p2p_handlers(ctx.p2p, namespace=cfg.swarm_id)
            full.shutdown()

    async def _serve(self, full: FullModel, holders: list[StageHolder], meter: Meter) -> StageServicer:
        """Take requests for stages 1..S on the stages it trains (``--serve``); announced as a server from then on."""
        ctx = self.ctx
        for holder in holders[EDGE_STAGE + 1 :]:
            holder.server = StageServer(
                ctx.swarm_config,
                holder.stage,
                start_step=holder.start_step,
                device=ctx.device,
                keep_graph_mb=ctx.peer_config.keep_graph_mb,
                compute=full.compute(holder.stage),
            )
        servers = {holder.stage: holder.server for holder in holders if holder.server is not None}
        servicer = stage_servicer(ctx, servers, meter.traffic)
        await servicer.add_p2p_handlers(ctx.p2p, namespace=ctx.swarm_config.swarm_id)
        ctx.on_log(ServesStages(stages=tuple(sorted(servers))))
        return servicer

    async def _loop(
        self,
        full: FullModel,
        holders: list[StageHolder],
        syncs: list[ReplicaSync],
        batches: Iterator[Batch],
        val_batches: Sequence[Batch],
        meter: Meter,
    ) -> FullProgress | None:
        """Microbatches until ``config.steps`` inner steps of stage 0, holding still while a stage's round is due; the
        last record (None if it had no step left to take)."""
        config, edge = self.ctx.peer_config, full.inners[EDGE_STAGE]
        options, started, losses = config.trainer, time.perf_counter(), []
        record: FullProgress | None = None
        logged = edge.steps
        while edge.steps < config.steps:
            while any(sync.due for sync in syncs):  # a round to meet first: never lap the pipelines
                await asyncio.sleep(sync_poll_s(syncs))
            losses.append(await full.train_microbatch(*next(batches)))
            if edge.steps >= min(logged + options.log_every, config.steps):
                logged = edge.steps
                record = progress(full, syncs, started, losses, holders)
                if val_batches and (
                    edge.steps >= config.steps or (options.eval_every and logged % options.eval_every == 0)
                ):
                    record = dataclasses.replace(record, val_loss=await full.evaluate(val_batches))
                meter.observe(record)
                self.ctx.on_log(record)
                losses = []
        return record


def sync_poll_s(syncs: Sequence[ReplicaSync]) -> float:
    return min(sync.poll_s for sync in syncs)


def progress(
    full: FullModel,
    syncs: Sequence[ReplicaSync],
    started: float,
    losses: list[float],
    holders: Sequence[StageHolder],
) -> FullProgress:
    """A full peer's progress record: a trainer's fields that apply, its outer counters summed over its stages, and
    (``--serve``) the microbatches it served per stage (backwards done) with each stage's inner steps."""
    served = {
        str(h.stage): {"backward": h.server.counters["backward"], "inner_steps": h.inner.steps}
        for h in holders
        if h.server is not None
    }
    elapsed, edge = time.perf_counter() - started, full.inners[EDGE_STAGE]
    counters: Counter[str] = Counter()
    for sync in syncs:
        counters.update(sync.counters)
    return FullProgress(
        **training_fields(
            step=edge.steps, tokens=full.tokens, elapsed_s=elapsed, losses=losses, lr=edge.lr, grad_norm=edge.grad_norm
        ),
        outer_rounds={str(sync.stage): sync.round for sync in syncs},
        served=served or None,
        counters=dict(counters),
    )
