"""The stage-server role: serves one middle stage, moving when rebalancing says so, rebuilding a lost stage (CheckFree).

A starting server serves a live replica's state, else its own checkpoint (rollback), else, if the swarm has trained,
the stage rebuilt from its neighbours, else the seeded weights (docs/architecture.md, "Roles").

    >>> role = StageRole(ctx, stage=1)     # swarm/node/node.py makes it for ``--role stage``
    >>> last = await role.run()            # serves until ctx.stop; the last record
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass

from swarm.dht.membership import pipeline_replicas
from swarm.events import Move, Rollback, StageProgress
from swarm.node.context import NodeContext, until_stopped
from swarm.node.lifecycle import download_state
from swarm.node.placement import stage_loads
from swarm.node.roles.served import ServedStage
from swarm.outer.state import StageState
from swarm.outer.threads import Holder
from swarm.recovery.checkfree import NoRecoverySource
from swarm.recovery.rebalance import next_check_delay, plan_move
from swarm.recovery.rebuild import (
    PRIORITY_JOINER,
    PRIORITY_MOVER,
    Rebuilt,
    acquire_claim,
    empty_stages,
    load_stage_checkpoint,
    rebuild_stage,
    swarm_has_trained,
)
from swarm.rpc.blobs import TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedMove:
    """Rebalancing moves this server to ``stage``; ``state`` was downloaded (or ``rebuilt``) while it still served the old one
    (None: nobody held it yet)."""

    stage: int
    state: StageState | None
    rebuilt: Rebuilt | None = None


class StageRole:
    """A stage server: serves ``stage`` from its current state, moving when rebalancing says so, until ``ctx.stop``."""

    def __init__(self, ctx: NodeContext, stage: int) -> None:
        self.ctx, self.stage = ctx, stage
        self.holder: Holder | None = None  # the stage server of the stage served now
        self.recoveries = 0  # stages this peer rebuilt

    async def run(self) -> StageProgress | None:
        """Serve until stopped; the final record (None if stopped before serving)."""
        initial = await until_stopped(self._initial_state(), self.ctx.stop)
        if initial is None:  # stopped while waiting for another peer's rebuild
            return None
        state, rebuilt = initial
        while True:
            self.recoveries += rebuilt is not None
            outcome = await self._serve(ServedStage(self.ctx, self.stage, state, rebuilt, self.recoveries))
            if not isinstance(outcome, PlannedMove):
                return outcome
            moved = Move(
                from_stage=self.stage,
                to_stage=outcome.stage,
                downloaded=outcome.state is not None,
                rebuilt=outcome.rebuilt is not None,
            )
            self.ctx.on_log(moved)
            self.stage, state, rebuilt = outcome.stage, outcome.state, outcome.rebuilt

    async def _initial_state(self) -> tuple[StageState | None, Rebuilt | None]:
        """What a starting server serves: a live replica's state; else its own checkpoint (rollback); else, if the swarm has
        trained (the stage was lost), the stage rebuilt from its neighbours; else (a new swarm) None: the seeded weights."""
        cfg, config, stage = self.ctx.swarm_config, self.ctx.peer_config, self.stage
        if (state := await download_state(self.ctx, stage)) is not None:
            return state, None
        if config.stage_checkpoint and config.stage_checkpoint.exists():
            state = load_stage_checkpoint(config.stage_checkpoint, cfg, stage)
            self.ctx.on_log(Rollback(stage=stage, schedule_step=state.schedule_step, path=str(config.stage_checkpoint)))
            return state, None
        while True:  # a joining peer: it rebuilds the stage unless another peer already claimed it
            if not swarm_has_trained(await self.ctx.membership.all_replicas()):
                return None, None
            try:
                if (rebuilt := await self._claim_and_rebuild(stage, PRIORITY_JOINER)) is not None:
                    return rebuilt.state, rebuilt
            except NoRecoverySource as e:  # S = 1: no neighbour to rebuild from
                logger.warning(f"stage {stage} was lost and {e}; starting from the seeded weights")
                return None, None
            # someone else rebuilds it: take its state once it serves
            await asyncio.sleep(cfg.timeouts.announce_period_s)
            if (state := await download_state(self.ctx, stage)) is not None:
                return state, None

    async def _claim_and_rebuild(self, stage: int, priority: int) -> Rebuilt | None:
        """Rebuild ``stage`` if this peer's claim stands; None if another peer's does or the rebuild failed (the claim is then
        withdrawn); ``NoRecoverySource`` if the stage has no neighbour to be rebuilt from."""
        timeouts, membership, outer_service = (
            self.ctx.swarm_config.timeouts,
            self.ctx.membership,
            self.ctx.outer_service,
        )
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
            return await rebuild_stage(self.ctx.swarm_config, stage, outer_service.replicas, fetch)
        except (TransferError, NoRecoverySource) as e:
            logger.warning(f"stage {stage}: not rebuilding it: {e}")
            with contextlib.suppress(Exception):
                await membership.withdraw_recovery(stage)
            if isinstance(e, NoRecoverySource):
                raise
            return None

    async def _serve(self, served: ServedStage) -> StageProgress | PlannedMove:
        """Serve one stage until stopped (the final record) or a rebalancing move (returned)."""
        ctx = self.ctx
        self.holder = served.server
        await served.start()
        # serving happens in the P2P handlers; this waits for the end or a move
        stopped = asyncio.create_task(ctx.stop.wait())
        period_s = ctx.peer_config.rebalance_every_s
        moving = asyncio.create_task(self._next_move(period_s)) if period_s else None
        ctx.ready()
        move = None
        try:
            await asyncio.wait([stopped] + ([moving] if moving else []), return_when=asyncio.FIRST_COMPLETED)
            move = None if ctx.stop.is_set() or moving is None else moving.result()
        finally:
            for task in (stopped, moving):
                if task is not None:
                    task.cancel()
            await served.close(retire=move is not None)  # the new stage is announced as soon as it serves
        if move is not None:
            return move
        record = served.record()
        ctx.on_log(record)
        return record

    async def _next_move(self, period_s: float) -> PlannedMove:
        """Wait until rebalancing moves this server: its target stage, with that stage's state downloaded or rebuilt.

        Throughput is compared every ``period_s`` (± 20%); a stage with no replica is looked for every
        announce period, since every path skips it until someone fills it. A hole in a swarm that has
        trained is a lost stage: the mover claims and rebuilds it (``swarm/recovery/rebuild.py``).
        """
        membership, num_stages = self.ctx.membership, self.ctx.swarm_config.stages.num_stages
        me, rng = membership.peer_id.to_base58(), random.Random(f"rebalance/{membership.peer_id}")
        hole_check_s = min(period_s, self.ctx.swarm_config.timeouts.announce_period_s)
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
                        return PlannedMove(target, rebuilt.state, rebuilt)
                    continue
                state = await self.ctx.outer_service.download(target)
                # the download took a while: move only if that is still the plan
                if plan_move(stage_loads(await membership.all_replicas(), num_stages), me) == target:
                    return PlannedMove(target, state)
            except (ValueError, TransferError) as e:  # a server caught mid-move in two stages, or no state to be had
                logger.info(f"rebalancing: staying on stage {self.stage} for now: {e}")
