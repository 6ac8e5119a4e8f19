"""What a role gets of the node that runs it (``NodeContext``), and the two coroutine helpers roles share.

>>> result = await until_stopped(trainer.train(batches, steps=100), ctx.stop)   # None: stopped first
>>> announcer = asyncio.create_task(every(ctx.swarm_config.timeouts.announce_period_s, announce))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from hivemind.p2p import P2P

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership
from swarm.events import EventSink
from swarm.model.step import Batch
from swarm.node.config import PeerConfig
from swarm.outer.service import OuterService
from swarm.pipeline.pacing import Pace
from swarm.pipeline.protocol import StageClient

logger = logging.getLogger(__name__)
T = TypeVar("T")
# (swarm config, this peer's id: what its data shard derives from) → (train batches, val batches); run off the event loop
DataFactory = Callable[[SwarmConfig, str], tuple[Iterator[Batch], Sequence[Batch]]]


@dataclass(frozen=True, kw_only=True)
class NodeContext:
    """What a role uses of the node that runs it: the two config trees, the DHT records, P2P and its services."""

    swarm_config: SwarmConfig  # the swarm's, shared and hashed
    peer_config: PeerConfig  # this peer's own
    membership: Membership
    p2p: P2P
    client: StageClient
    outer_service: OuterService
    on_log: EventSink
    ready: Callable[[], None]  # the role takes calls now (the node tells its caller once)
    stop: asyncio.Event
    device: torch.device  # where this peer computes (``PeerConfig.device`` resolved)
    pace: Pace | None = None  # ``--pace-as``: a benchmark's paced peer (swarm/pipeline/pacing.py)

    @property
    def me(self) -> str:
        """This peer's id, base58."""
        return str(self.membership.peer_id.to_base58())


async def until_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """The result of ``work``, or None if ``stop`` comes first (``work`` is then cancelled)."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stopped):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


async def every(period_s: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Call ``fn`` now and then every ``period_s``, logging (not raising) its failures."""
    while True:
        try:
            await fn()
        except Exception as e:
            logger.warning(f"periodic task failed: {type(e).__name__}: {e}")
        await asyncio.sleep(period_s)
