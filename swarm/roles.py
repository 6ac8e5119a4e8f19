"""The two roles a peer (``swarm/node.py``) plays: a stage server (``StageRole``) or a trainer (``TrainerRole``).

A role gets its node's shared parts (``PeerParts``, ``swarm/parts.py``: configs, DHT records, P2P, the
outer-step plumbing) and owns what it builds on them: a stage server its rebalancing loop and one
``ServedStage`` (``swarm/served_stage.py``: ``StageServer``, replica sync, stage RPC service,
checkpoints) per stage it serves, a new one after each move; a trainer its ``Trainer``, router and
replica sync. ``holder`` is the replica it holds now (a fault schedule reads its step).

A starting stage server serves a live replica's state, else its own checkpoint (rollback), else,
if the swarm has trained, the stage rebuilt from its neighbours (CheckFree, ``swarm/recovery/rebuild.py``),
else the seeded weights. Every ``rebalance_every_s`` (± 20%) it reads the stages' throughput and
moves if ``plan_move`` names it, downloading (or rebuilding) the new stage's state while still serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership, pipeline_replicas
from swarm.dht.metrics import Meter
from swarm.dht.records import StageStatus, serving
from swarm.hardware import describe
from swarm.model.stages import EDGE_STAGE
from swarm.outer.replica import Holder
from swarm.outer.transfer import StageState, TransferError
from swarm.parts import PeerParts, every, publish_metrics, until_stopped
from swarm.pipeline.routing import Router
from swarm.pipeline.trainer import Batch, Trainer
from swarm.recovery.checkfree import NoRecoverySource
from swarm.recovery.rebalance import Snapshot, StageLoad, next_check_delay, plan_move
from swarm.recovery.rebuild import (
    PRIORITY_JOINER,
    PRIORITY_MOVER,
    Rebuilt,
    acquire_claim,
    empty_stages,
    load_stage_checkpoint,
    rebuild_stage,
    save_stage_checkpoint,
    swarm_has_trained,
)
from swarm.served_stage import ServedStage, provide_local_state

logger = logging.getLogger(__name__)
# (swarm config, this peer's id: what its data shard derives from) → (train batches, val batches); run off the event loop
DataFactory = Callable[[SwarmConfig, str], tuple[Iterator[Batch], Sequence[Batch]]]


def stage_loads(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> Snapshot:
    """The rebalancer's view of the DHT records: each middle stage's servers and their throughput (a full peer's record
    is none: it takes no pipeline traffic, so a stage it alone holds is a hole in every path)."""
    return {
        stage: [
            StageLoad(peer_id=peer.to_base58(), throughput=status.samples_per_s)
            for peer, status in serving(replicas.get(stage, {})).items()
        ]
        for stage in range(1, num_stages + 1)
    }


@dataclass(frozen=True)
class Move:
    """Rebalancing moves this server to ``stage``; ``state`` was downloaded (or ``rebuilt``) while it still served the old one
    (None: nobody held it yet)."""

    stage: int
    state: StageState | None
    rebuilt: Rebuilt | None = None


class StageRole:
    """A stage server: serves ``stage`` from its current state, moving when rebalancing says so, until ``parts.stop``."""

    def __init__(self, parts: PeerParts, stage: int) -> None:
        self.parts, self.stage = parts, stage
        self.holder: Holder | None = None  # the stage server of the stage served now
        self.recoveries = 0  # stages this peer rebuilt

    async def run(self) -> dict[str, Any]:
        """Serve until stopped; the final record ({} if stopped before serving)."""
        initial = await until_stopped(self._initial_state(), self.parts.stop)
        if initial is None:  # stopped while waiting for another peer's rebuild
            return {}
        state, rebuilt = initial
        while True:
            self.recoveries += rebuilt is not None
            outcome = await self._serve(ServedStage(self.parts, self.stage, state, rebuilt, self.recoveries))
            if not isinstance(outcome, Move):
                return outcome
            self.parts.on_log(
                {
                    "event": "move",
                    "from": self.stage,
                    "to": outcome.stage,
                    "downloaded": outcome.state is not None,
                    "rebuilt": outcome.rebuilt is not None,
                }
            )
            self.stage, state, rebuilt = outcome.stage, outcome.state, outcome.rebuilt

    async def _initial_state(self) -> tuple[StageState | None, Rebuilt | None]:
        """What a starting server serves: a live replica's state; else its own checkpoint (rollback); else, if the swarm has
        trained (the stage was lost), the stage rebuilt from its neighbours; else (a new swarm) None: the seeded weights."""
        cfg, config, stage = self.parts.cfg, self.parts.config, self.stage
        try:
            if (state := await self._download(stage)) is not None:
                return state, None
        except TransferError as e:  # the records still list replicas that just died
            logger.warning(f"stage {stage}: no listed replica delivered its state ({e}); taking the stage as lost")
        if config.stage_checkpoint and config.stage_checkpoint.exists():
            state = load_stage_checkpoint(config.stage_checkpoint, cfg, stage)
            self.parts.on_log(
                {
                    "event": "rollback",
                    "stage": stage,
                    "schedule_step": state.schedule_step,
                    "path": str(config.stage_checkpoint),
                }
            )
            return state, None
        while True:  # a joining peer: it rebuilds the stage unless another peer already claimed it
            if not swarm_has_trained(await self.parts.membership.all_replicas()):
                return None, None
            try:
                if (rebuilt := await self._claim_and_rebuild(stage, PRIORITY_JOINER)) is not None:
                    return rebuilt.state, rebuilt
            except NoRecoverySource as e:  # S = 1: no neighbour to rebuild from
                logger.warning(f"stage {stage} was lost and {e}; starting from the seeded weights")
                return None, None
            # someone else rebuilds it: take its state once it serves
            await asyncio.sleep(cfg.timeouts.announce_period_s)
            if (state := await self._download(stage)) is not None:
                return state, None

    async def _download(self, stage: int) -> StageState | None:
        """A live replica's state of ``stage`` (None: the stage has none listed), its download timed in the log."""
        started = time.perf_counter()
        state = await self.parts.outer_service.download(stage)
        if state is not None:
            self.parts.on_log(
                {
                    "event": "state_download",
                    "stage": stage,
                    "reason": "join",
                    "outer_round": state.round,
                    "download_s": time.perf_counter() - started,
                }
            )
        return state

    async def _claim_and_rebuild(self, stage: int, priority: int) -> Rebuilt | None:
        """Rebuild ``stage`` if this peer's claim stands; None if another peer's does or the rebuild failed (the claim is then
        withdrawn); ``NoRecoverySource`` if the stage has no neighbour to be rebuilt from."""
        timeouts, membership, outer_service = self.parts.cfg.timeouts, self.parts.membership, self.parts.outer_service
        # the claim outlives a slow rebuild (two state downloads) and the first announce of the rebuilt stage
        if not await acquire_claim(
            membership,
            stage,
            priority=priority,
            ttl_s=2 * timeouts.rpc_s + timeouts.record_ttl_s,
            settle_s=timeouts.announce_period_s,
        ):
            return None
        try:
            if await outer_service.replicas(stage):  # it came back while we claimed: nothing to rebuild
                raise TransferError("the stage has a live replica again")
            fetch = lambda peer, name, sink, max_bytes: outer_service.client.stream(
                peer, name, sink, timeout=timeouts.rpc_s, max_bytes=max_bytes
            )
            return await rebuild_stage(self.parts.cfg, stage, outer_service.replicas, fetch)
        except (TransferError, NoRecoverySource) as e:
            logger.warning(f"stage {stage}: not rebuilding it: {e}")
            with contextlib.suppress(Exception):
                await membership.withdraw_recovery(stage)
            if isinstance(e, NoRecoverySource):
                raise
            return None

    async def _serve(self, served: ServedStage) -> dict[str, Any] | Move:
        """Serve one stage until stopped (the final record) or a rebalancing move (returned)."""
        parts = self.parts
        self.holder = served.server
        await served.start()
        watched = [
            asyncio.create_task(parts.stop.wait())
        ]  # serving happens in the P2P handlers; this waits for the end or a move
        if parts.config.rebalance_every_s:
            watched.append(asyncio.create_task(self._next_move(parts.config.rebalance_every_s)))
        parts.ready()
        move = None
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            move = None if parts.stop.is_set() else watched[1].result()
        finally:
            for task in watched:
                task.cancel()
            await served.close(retire=move is not None)  # the new stage is announced as soon as it serves
        if move is not None:
            return move
        parts.on_log(served.record())
        return served.record()

    async def _next_move(self, period_s: float) -> Move:
        """Wait until rebalancing moves this server: its target stage, with that stage's state downloaded or rebuilt.

        Throughput is compared every ``period_s`` (± 20%); a stage with no replica is looked for every
        announce period, since every path skips it until someone fills it. A hole in a swarm that has
        trained is a lost stage: the mover claims and rebuilds it (``swarm/recovery/rebuild.py``).
        """
        membership, num_stages = self.parts.membership, self.parts.cfg.stages.num_stages
        me, rng = membership.peer_id.to_base58(), random.Random(f"rebalance/{membership.peer_id}")
        hole_check_s = min(period_s, self.parts.cfg.timeouts.announce_period_s)
        next_balance = time.monotonic() + next_check_delay(period_s, rng)
        while True:
            await asyncio.sleep(next_check_delay(hole_check_s, rng))
            try:
                replicas = await membership.all_replicas()
                holes = empty_stages(pipeline_replicas(replicas), num_stages)
                if not holes and time.monotonic() < next_balance:
                    continue
                next_balance = time.monotonic() + next_check_delay(period_s, rng)
                if (target := plan_move(stage_loads(replicas, num_stages), me)) is None:
                    continue
                # a stage only full peers hold was not lost: its state is downloaded from them, not rebuilt
                if target in holes and not replicas.get(target) and swarm_has_trained(replicas):
                    if (rebuilt := await self._claim_and_rebuild(target, PRIORITY_MOVER)) is not None:
                        return Move(target, rebuilt.state, rebuilt)
                    continue
                state = await self.parts.outer_service.download(target)
                # the download took a while: move only if that is still the plan
                if plan_move(stage_loads(await membership.all_replicas(), num_stages), me) == target:
                    return Move(target, state)
            except (ValueError, TransferError) as e:  # a server caught mid-move in two stages, or no state to be had
                logger.info(f"rebalancing: staying on stage {self.stage} for now: {e}")


class TrainerRole:
    """A trainer: stage 0 (data, embedding, loss), routing microbatches through the middle stages' replicas."""

    def __init__(self, parts: PeerParts, data: DataFactory) -> None:
        self.parts, self.data = parts, data
        self.holder: Holder | None = None  # the trainer, once built

    async def run(self) -> dict[str, Any]:
        """Train ``config.steps`` inner steps; the last record ({} if stopped first)."""
        self.parts.ready()
        return await until_stopped(self._train(), self.parts.stop) or {}

    async def _train(self) -> dict[str, Any]:
        cfg, config, membership, outer_service = (
            self.parts.cfg,
            self.parts.config,
            self.parts.membership,
            self.parts.outer_service,
        )
        router = Router(cfg.stages.num_stages, random.Random(f"{cfg.train.seed}/{membership.peer_id}"))
        meter = Meter(
            role="trainer", stage=EDGE_STAGE, state="joining", name=config.name, device=describe(self.parts.device)
        )
        # a trainer joining mid-run starts from the other trainers' stage 0
        try:
            state = await outer_service.download(EDGE_STAGE)
        except TransferError as e:  # trainers are listed but none delivers: train, and catch up at the next round
            logger.warning(f"stage 0: no listed trainer delivered its state ({e}); starting from the seeded weights")
            state = None
        trainer = Trainer(
            cfg,
            self.parts.client,
            router,
            options=config.trainer,
            start_step=state.schedule_step if state else 0,
            traffic=meter.traffic,
            device=self.parts.device,
        )
        self.holder = trainer
        sync = outer_service.sync(EDGE_STAGE, trainer, self.parts.on_log)
        provide_local_state(self.parts, sync)  # what `swarmloco export` takes stage 0 from
        if state is not None:
            await sync.adopt(state)
        # reading and tokenizing a corpus takes a while: the loop keeps serving stage 0 and the DHT meanwhile
        batches, val_batches = await asyncio.to_thread(self.data, cfg, membership.peer_id.to_base58())

        async def refresh() -> None:
            banned = 0
            for stage, replicas in (await membership.all_replicas()).items():
                if stage != EDGE_STAGE:
                    router.update_records(stage, replicas, task_size=cfg.train.microbatch_size)
                    banned += len(serving(replicas)) - len(router.balancers[stage].live_peers())
            status = trainer.status().copy(update=sync.status_fields())
            await membership.announce(EDGE_STAGE, status)
            await membership.publish_config()
            await publish_metrics(
                self.parts, meter.sample(status, tokens=trainer.tokens, bans=banned, dht_stores=membership.stores)
            )

        def log(record: dict[str, Any]) -> None:
            meter.observe(record)
            self.parts.on_log({**record, **sync.info()})

        refresher = asyncio.create_task(every(cfg.timeouts.announce_period_s, refresh))
        syncer = asyncio.create_task(sync.run())
        try:
            await wait_for_stages(router, cfg.stages.num_stages, config.wait_for_stages_s)
            await wait_for_replicas(membership, config.wait_for_replicas, config.wait_for_stages_s)
            meter.state = "training"
            last = await trainer.train(batches, steps=config.steps, val_batches=val_batches, on_log=log)
            if config.stage_checkpoint is not None:  # stage 0 outlives the trainer: what a local swarm exports
                await save_stage_checkpoint(config.stage_checkpoint, await sync.local_state())
                self.parts.on_log(
                    {"event": "stage_checkpoint", "stage": EDGE_STAGE, "path": str(config.stage_checkpoint)}
                )
            return last
        finally:
            refresher.cancel()
            syncer.cancel()
            trainer.shutdown()
            sync.close()


async def wait_for_stages(router: Router, num_stages: int, timeout_s: float) -> None:
    """Start training once every middle stage has a replica (or train on with skips after ``timeout_s``)."""
    deadline, last_missing = time.monotonic() + timeout_s, None
    while (
        missing := sorted(set(range(1, num_stages + 1)) - set(router.live_stages()))
    ) and time.monotonic() < deadline:
        if missing != last_missing:
            logger.warning(f"waiting for servers of stages {missing}")
            last_missing = missing
        await asyncio.sleep(0.5)
    if missing:
        logger.warning(f"no server for stages {missing} after {timeout_s:.0f}s: training skips them")


async def wait_for_replicas(membership: Membership, count: int, timeout_s: float) -> None:
    """Start training once ``count`` replicas of stage 0 (trainers and full peers, this one included) are listed, or
    train on after ``timeout_s``.

    Replicas started together (``swarmloco local``) then meet from their first round: one that starts first would
    otherwise run its first rounds alone, and the first full peer of a swarm without a pipeline would train alone
    while the others start.
    """
    if count <= 0:  # not asked to wait: not even a look at the DHT
        return
    deadline, listed = time.monotonic() + timeout_s, 0
    while (listed := len(await membership.replicas(EDGE_STAGE))) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    if listed < count:
        logger.warning(f"{listed} of {count} replicas of stage 0 listed after {timeout_s:.0f}s: training on")
