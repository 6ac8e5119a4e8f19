"""What a role (``swarm/roles.py``) gets of the node that runs it (``PeerParts``), and the two coroutine helpers roles share.

>>> result = await until_stopped(trainer.train(batches, steps=100), parts.stop)   # None: stopped first
>>> announcer = asyncio.create_task(every(cfg.timeouts.announce_period_s, announce))
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership
from swarm.dht.records import PeerMetrics
from swarm.outer.service import OuterService
from swarm.peer_config import PeerConfig
from swarm.pipeline.protocol import StageClient

logger = logging.getLogger(__name__)
T = TypeVar("T")
LogFn = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class PeerParts:
    """What a role uses of the node that runs it."""

    cfg: SwarmConfig
    config: PeerConfig
    membership: Membership
    p2p: P2P
    client: StageClient
    outer_service: OuterService
    on_log: LogFn
    ready: Callable[[], None]  # the role takes calls now (the node tells its caller once)
    stop: asyncio.Event
    device: torch.device  # where this peer computes (``PeerConfig.device`` resolved)


async def publish_metrics(parts: PeerParts, metrics: PeerMetrics) -> None:
    """Publish the peer's metrics record to the DHT, then log it (a ``metrics`` event, the record under ``"metrics"``):
    its JSONL file holds each record the dashboard read, when it was published."""
    await parts.membership.publish_metrics(metrics)
    parts.on_log({"event": "metrics", "metrics": metrics.dict()})


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
