"""The one lifecycle of the replicas a role holds: start (download or seed), announce, outer sync, checkpoint, close;
what differs between roles (their records, their metrics' counts) comes in as callbacks.

    >>> life = ReplicaLifecycle(ctx, meter, checkpoint_stage=EDGE_STAGE)
    >>> state = await download_state(ctx, EDGE_STAGE)   # a live replica's state; None: the seeded weights
    >>> await life.hold({EDGE_STAGE: trainer}, {EDGE_STAGE: state} if state else {})
    >>> life.start(status=lambda stage: trainer.status()); ...; await life.checkpoint(); life.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from hivemind.p2p import PeerID

from swarm.dht.membership import Membership
from swarm.dht.metrics import Meter
from swarm.dht.records import PeerMetrics, StageStatus
from swarm.events import Metrics, StageCheckpoint, StateDownload, StateServed
from swarm.model.stages import EDGE_STAGE
from swarm.node.context import NodeContext, every
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import held_stage
from swarm.outer.state import StageState, stream_state
from swarm.outer.threads import Holder
from swarm.recovery.rebuild import save_stage_checkpoint
from swarm.rpc.blobs import BlobStream, TransferError

logger = logging.getLogger(__name__)


async def download_state(ctx: NodeContext, stage: int) -> StageState | None:
    """A live replica's state of ``stage``, its download timed in the log; None if no replica is listed or none delivers
    (the caller then starts from the seeded weights, its checkpoint or a rebuild, and catches up at the next round)."""
    started = time.perf_counter()
    try:
        state = await ctx.outer_service.download(stage)
    except TransferError as e:  # the records still list replicas that just died
        logger.warning(f"stage {stage}: no listed replica delivered its state ({e})")
        return None
    if state is not None:
        ctx.on_log(
            StateDownload(stage=stage, reason="join", outer_round=state.round, download_s=time.perf_counter() - started)
        )
    return state


def provide_local_state(ctx: NodeContext, syncs: Sequence[ReplicaSync]) -> None:
    """Serve ``local/<stage>`` of each replica held (a snapshot of its weights, streamed), instead of those served before;
    each blob served whole is logged with its hash, so a rebuild's inputs can be traced to their replica."""
    held = {sync.stage for sync in syncs}

    async def provide(name: str) -> BlobStream:
        if (stage := held_stage(name)) is None or stage not in held:
            raise LookupError(f"this peer holds stages {sorted(held)}, not {name!r}")
        return stream_state(
            await ctx.outer_service.local_state(stage),
            on_sent=lambda sha256: ctx.on_log(StateServed(stage=stage, sha256=sha256[:16])),
        )

    ctx.outer_service.servicer.provide("local", provide)


async def publish_metrics(ctx: NodeContext, metrics: PeerMetrics) -> None:
    """Publish the peer's metrics record to the DHT, then log it (a ``metrics`` event, the record under ``"metrics"``):
    its JSONL file holds each record the dashboard read, when it was published."""
    await ctx.membership.publish_metrics(metrics)
    ctx.on_log(Metrics(metrics=metrics.dict()))


class ReplicaLifecycle:
    """The replicas one role holds (one stage each), from their start state to teardown.

    ``checkpoint_stage`` is the replica ``PeerConfig.stage_checkpoint`` holds (one file, one stage; None: no file).
    """

    def __init__(self, ctx: NodeContext, meter: Meter, *, checkpoint_stage: int | None = None) -> None:
        self.ctx, self.meter, self.checkpoint_stage = ctx, meter, checkpoint_stage
        self.syncs: list[ReplicaSync] = []  # in stage order
        self._tasks: list[asyncio.Task[None]] = []
        self._status: Callable[[int], StageStatus] | None = None
        self._usage: Callable[[], Mapping[str, Any]] = dict
        self._refresh: Callable[[], Awaitable[None]] | None = None
        self._on_announced: Callable[[], None] | None = None

    async def hold(self, holders: Mapping[int, Holder], states: Mapping[int, StageState]) -> list[ReplicaSync]:
        """Take part in the outer step of each holder (stage → holder), serve their local states, and adopt the start
        states given (the others keep their seeded or rebuilt weights)."""
        alongside = len(holders) > 1  # a full peer holds every stage at once
        self.syncs = [
            self.ctx.outer_service.sync(stage, holder, self.ctx.on_log, alongside=alongside)
            for stage, holder in sorted(holders.items())
        ]
        provide_local_state(self.ctx, self.syncs)
        for sync in self.syncs:
            if (state := states.get(sync.stage)) is not None:
                await sync.adopt(state)
        return self.syncs

    def start(
        self,
        *,
        status: Callable[[int], StageStatus],
        usage: Callable[[], Mapping[str, Any]] = dict,
        refresh: Callable[[], Awaitable[None]] | None = None,
        on_announced: Callable[[], None] | None = None,
        periodic_checkpoints: bool = False,
    ) -> None:
        """Start announcing (``status``: a stage's record before its outer fields; ``usage``: the metrics' role-specific
        counts; ``refresh`` runs before each announce, ``on_announced`` after), the outer rounds, and
        (``periodic_checkpoints``) the checkpoints every ``checkpoint_every`` inner steps."""
        self._status, self._usage, self._refresh, self._on_announced = status, usage, refresh, on_announced
        period_s = self.ctx.swarm_config.timeouts.announce_period_s
        self._tasks = [asyncio.create_task(every(period_s, self.announce))]
        self._tasks += [asyncio.create_task(sync.run()) for sync in self.syncs]
        if periodic_checkpoints and self.ctx.peer_config.checkpoint_every:
            self._tasks.append(asyncio.create_task(self._checkpoints()))

    async def announce(self) -> None:
        """Announce each replica's record, re-publish the swarm config, and publish this peer's metrics."""
        assert self._status is not None, "start() first"
        membership = self.ctx.membership
        if self._refresh is not None:
            await self._refresh()
        statuses = {sync.stage: self._status(sync.stage).copy(update=sync.status_fields()) for sync in self.syncs}
        # The first stage last: a peer that sees a full peer's stage-0 record (``wait_for_replicas``) then finds it listed
        # on every stage, so no first round of a later stage finds nobody listed and closes its window at once.
        for stage in reversed(statuses):
            await membership.announce(stage, statuses[stage])
        await membership.publish_config()
        first = statuses[self.syncs[0].stage]
        await publish_metrics(self.ctx, self.meter.sample(first, **self._usage(), dht_stores=membership.stores))
        if self._on_announced is not None:
            self._on_announced()

    async def checkpoint(self) -> None:
        """Write ``checkpoint_stage``'s local weights to ``PeerConfig.stage_checkpoint`` (if both are set) and log it."""
        path = self.ctx.peer_config.stage_checkpoint
        sync = next((s for s in self.syncs if s.stage == self.checkpoint_stage), None)
        if path is None or sync is None:
            return
        await save_stage_checkpoint(path, await self.ctx.outer_service.local_state(sync.stage))
        self.ctx.on_log(StageCheckpoint(stage=sync.stage, inner_steps=sync.holder.inner_steps, path=str(path)))

    async def _checkpoints(self) -> None:
        """A checkpoint every ``checkpoint_every`` inner steps of ``checkpoint_stage`` (the rollback baseline)."""
        sync = next(s for s in self.syncs if s.stage == self.checkpoint_stage)
        every_steps, written = self.ctx.peer_config.checkpoint_every, sync.holder.inner_steps
        while True:
            await asyncio.sleep(self.ctx.swarm_config.timeouts.announce_period_s)
            if sync.holder.inner_steps >= written + every_steps:
                written = sync.holder.inner_steps
                await self.checkpoint()

    def close(self) -> None:
        """Stop announcing, the outer rounds and the checkpoints; close the replicas' outer steps."""
        for task in self._tasks:
            task.cancel()
        for sync in self.syncs:
            sync.close()


async def wait_for_replicas(membership: Membership, count: int, timeout_s: float) -> None:
    """Start training once ``count`` replicas of stage 0 (trainers and full peers, this one included) are listed, or
    train on after ``timeout_s``.

    Replicas started together (``swarmloco local``) then meet from their first round: one that starts first would
    otherwise run its first rounds alone, and the first full peer of a swarm without a pipeline would train alone
    while the others start.
    """
    if count <= 0:  # not asked to wait: not even a look at the DHT
        return
    # every replica listed at any look counts, not only those listed at once: a short run's other trainer may train
    # and leave between two looks (a trainer then waited out the whole timeout for it)
    deadline, seen, said = time.monotonic() + timeout_s, set[PeerID](), False
    while len(seen := seen | set(await membership.replicas(EDGE_STAGE))) < count and time.monotonic() < deadline:
        if not said:
            logger.info(
                f"waiting for {count} replicas of stage 0 (trainers and full peers) to start together: {len(seen)} seen"
            )
            said = True
        await asyncio.sleep(0.5)
    if len(seen) < count:
        logger.warning(f"{len(seen)} of {count} replicas of stage 0 seen after {timeout_s:.0f}s: training on")
