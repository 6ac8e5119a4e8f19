"""The trainer role: stage 0 (data, embedding, loss), routing each microbatch through the middle stages' replicas.

>>> role = TrainerRole(ctx, data)      # swarm/node/node.py makes it for ``--role trainer``
>>> last = await role.run()            # ``steps`` inner steps (or until ctx.stop); the last progress record
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from swarm.dht.metrics import Meter
from swarm.dht.records import serving
from swarm.events import TrainerProgress
from swarm.hardware import describe
from swarm.model.stages import EDGE_STAGE
from swarm.node.context import DataFactory, NodeContext, until_stopped
from swarm.node.lifecycle import ReplicaLifecycle, download_state, wait_for_replicas
from swarm.pipeline.routing import Router
from swarm.pipeline.trainer import Trainer

logger = logging.getLogger(__name__)


class TrainerRole:
    """A trainer: stage 0's replica, driving microbatches through the pipeline until ``PeerConfig.steps``."""

    def __init__(self, ctx: NodeContext, data: DataFactory) -> None:
        self.ctx, self.data = ctx, data
        self.holder: Trainer | None = None  # the trainer, once built (a fault schedule reads its step)

    async def run(self) -> TrainerProgress | None:
        """Train ``steps`` inner steps; the last progress record (None if stopped first)."""
        self.ctx.ready()
        return await until_stopped(self._train(), self.ctx.stop)

    async def _train(self) -> TrainerProgress:
        ctx, cfg, config = self.ctx, self.ctx.swarm_config, self.ctx.peer_config
        router = Router(cfg.stages.num_stages, random.Random(f"{cfg.train.seed}/{ctx.membership.peer_id}"))
        meter = Meter(role="trainer", stage=EDGE_STAGE, state="joining", name=config.name, device=describe(ctx.device))
        life = ReplicaLifecycle(ctx, meter, checkpoint_stage=EDGE_STAGE)
        state = await download_state(
            ctx, EDGE_STAGE
        )  # a trainer joining mid-run starts from the other trainers' stage 0
        self.holder = trainer = Trainer(
            cfg,
            ctx.client,
            router,
            options=config.trainer,
            start_step=state.schedule_step if state else 0,
            traffic=meter.traffic,
            device=ctx.device,
            pace=ctx.pace,
        )
        (sync,) = await life.hold({EDGE_STAGE: trainer}, {EDGE_STAGE: state} if state else {})
        # reading and tokenizing a corpus takes a while: the loop keeps serving stage 0 and the DHT meanwhile
        batches, val_batches = await asyncio.to_thread(self.data, cfg, ctx.me)
        banned = 0

        async def refresh_router() -> None:
            nonlocal banned
            banned = 0
            for stage, replicas in (await ctx.membership.all_replicas()).items():
                if stage != EDGE_STAGE:
                    router.update_records(stage, replicas, task_size=cfg.train.microbatch_size)
                    banned += len(serving(replicas)) - len(router.balancers[stage].live_peers())

        def log(record: dict[str, Any]) -> None:  # Trainer.progress's line, with val_loss when evaluated
            progress = TrainerProgress.from_json({**record, **sync.info()})  # and the outer step's round and counters
            meter.observe(progress)
            ctx.on_log(progress)

        life.start(
            status=lambda stage: trainer.status(),
            usage=lambda: {"tokens": trainer.tokens, "bans": banned},
            refresh=refresh_router,
        )
        try:
            await wait_for_stages(
                router,
                cfg.stages.num_stages,
                config.wait_for_stages_s,
                refresh=refresh_router,
                health=ctx.membership.dht.routing_health,
            )
            await wait_for_replicas(ctx.membership, config.wait_for_replicas, config.wait_for_stages_s)
            meter.state = "training"
            last = await trainer.train(batches, steps=config.steps, val_batches=val_batches, on_log=log)
            await life.checkpoint()  # stage 0 outlives the trainer: what a local swarm exports
            return TrainerProgress.from_json({**last, **sync.info()})  # the record logged last
        finally:
            life.close()
            trainer.shutdown()


async def wait_for_stages(
    router: Router,
    num_stages: int,
    timeout_s: float,
    *,
    refresh: Callable[[], Awaitable[None]] | None = None,
    health: Callable[[], Awaitable[object]] | None = None,
    health_every_s: float = 20.0,
) -> None:
    """Start training once every middle stage has a replica (or train on with skips after ``timeout_s``).

    ``refresh`` (the router from the DHT) runs at each look, not once per announce period: a trainer that saw the
    last stage 5 s late then waited for the other trainer of ``wait_for_replicas``, which had trained its 20 steps and
    left meanwhile. Every ``health_every_s`` of waiting, ``health()`` is logged too (``SwarmDHT.routing_health``)."""
    started = time.monotonic()
    deadline, last_missing, next_health = started + timeout_s, None, started + health_every_s
    while True:
        if refresh is not None:
            try:
                await refresh()
            except Exception as e:  # a DHT read that failed: the next look reads again (as the periodic refresh does)
                logger.warning(f"reading the stage records failed: {type(e).__name__}: {e}")
        missing = sorted(set(range(1, num_stages + 1)) - set(router.live_stages()))
        if not missing or time.monotonic() >= deadline:
            break
        if missing != last_missing:
            logger.warning(f"waiting for servers of stages {missing}")
            last_missing = missing
        if health is not None and time.monotonic() >= next_health:
            next_health += health_every_s
            logger.warning(
                f"still waiting for servers of stages {missing} after {time.monotonic() - started:.0f}s: {await health()}"
            )
        await asyncio.sleep(0.5)
    if missing:
        logger.warning(f"no server for stages {missing} after {timeout_s:.0f}s: training skips them")
