"""Peers on loopback for the outer step: each its own hivemind DHT node and libp2p daemon, its real ``Membership``;
a ``LoopbackReplica`` adds its ``OuterService`` and ``ReplicaSync`` on stage 1, training a ``RandomStepHolder``.

    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)
    a = await LoopbackReplica.start("a", cfg, [], seed=1)
    b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
    async with stopping(a, b):
        await wait_for("a round of a and b", lambda: a.rounds(contributors=2), 90, lambda: a.events[-5:])
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership
from swarm.dht.process import SwarmDHT
from swarm.dht.records import StageStatus
from swarm.events import Event, OuterRound, of_kind
from swarm.model.stages import build_stage
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import OuterService
from swarmtest.configs import LOOPBACK
from swarmtest.fakes import RandomStepHolder

STAGE = 1
STEP_EVERY_S = 0.1  # one inner step of every replica: a round every 0.3 s or so


def seeded_weights(cfg: SwarmConfig) -> dict[str, torch.Tensor]:
    """Stage 1's seeded weights, as every replica starts."""
    return {
        name: p.detach().clone() for name, p in build_stage(cfg.model, cfg.stages.num_stages, STAGE).named_parameters()
    }


async def loopback_dht(initial_peers: list[str]) -> SwarmDHT:
    return await asyncio.to_thread(SwarmDHT, initial_peers=initial_peers or None, host_maddrs=[LOOPBACK])


@dataclasses.dataclass
class Peer:
    """A DHT node joined to the swarm, its P2P and membership; ``tasks`` run until ``stop``."""

    name: str
    dht: DHT
    membership: Membership
    p2p: P2P
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)
    stopped: bool = False

    @property
    def id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    @classmethod
    async def join(cls, name: str, cfg: SwarmConfig, initial_peers: list[str]) -> Peer:
        dht = await loopback_dht(initial_peers)
        membership = Membership(dht)
        await membership.join(cfg, create=not initial_peers)
        return cls(name, dht, membership, await dht.replicate_p2p())

    def every(self, period_s: float, action: Callable[[], Any]) -> asyncio.Task:
        """Run ``action`` (sync or async) every ``period_s`` seconds until the peer stops (or the task is cancelled)."""

        async def loop() -> None:
            while True:
                if asyncio.iscoroutine(result := action()):
                    await result
                await asyncio.sleep(period_s)

        self.tasks.append(asyncio.create_task(loop()))
        return self.tasks[-1]

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.to_thread(self.dht.shutdown)


@dataclasses.dataclass
class LoopbackReplica:
    """An honest replica of stage 1: it downloads the stage's state when it joins, trains (one inner step every
    ``step_every_s``), takes part in rounds and announces its record; ``events`` are its sync's events, ``joined_from``
    the outer round of the state it downloaded on joining (None: it started the stage)."""

    peer: Peer
    holder: Any  # a ``Holder`` with a ``train()``: RandomStepHolder.stage unless ``start`` is given another
    sync: ReplicaSync
    events: list[Event]
    joined_from: int | None = None
    training: asyncio.Task | None = None  # its inner steps; cancelled: no more rounds once the one under way is done

    @classmethod
    async def start(
        cls,
        name: str,
        cfg: SwarmConfig,
        initial_peers: list[str],
        *,
        seed: int,
        make_holder: Callable[[SwarmConfig, int], Any] = RandomStepHolder.stage,
        step_every_s: float = STEP_EVERY_S,
    ) -> LoopbackReplica:
        """Join (the first replica: create) the swarm and start; ``make_holder(cfg, seed)`` makes what it trains."""
        peer = await Peer.join(name, cfg, initial_peers)
        service = OuterService(cfg, peer.membership, peer.p2p)
        await service.servicer.add_p2p_handlers(peer.p2p, namespace=cfg.swarm_id)
        state = await service.download(STAGE)
        events: list[Event] = []
        holder = make_holder(cfg, seed)
        sync = service.sync(STAGE, holder, events.append)
        if state is not None:
            await sync.adopt(state)
        replica = cls(peer, holder, sync, events, joined_from=state.round if state is not None else None)
        peer.every(cfg.timeouts.announce_period_s, replica.announce)
        replica.training = peer.every(step_every_s, holder.train)
        peer.tasks.append(asyncio.create_task(sync.run()))
        return replica

    async def announce(self) -> None:
        status = StageStatus(inner_steps=self.holder.inner_steps, **self.sync.status_fields())
        await self.peer.membership.announce(STAGE, status)

    def rounds(self, *, contributors: int = 1) -> list[OuterRound]:
        return [e for e in of_kind(self.events, OuterRound) if e.outcome == "done" and e.contributors >= contributors]

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.holder.module.named_parameters()}

    async def stop(self) -> None:
        await self.peer.stop()
        self.sync.close()


def largest_norm_ratio(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest factor by which a tensor's norm differs from the reference's, either way (inf if not finite)."""
    ratios = [float(weights[n].norm() / reference[n].norm()) for n in reference]
    return max(max(r, 1 / r) if math.isfinite(r) and r > 0 else math.inf for r in ratios)


async def wait_for(what: str, check: Callable[[], bool], timeout: float, explain: Callable[[], Any] = str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s: {explain()}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def stopping(*peers: LoopbackReplica | Peer) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await asyncio.gather(*(p.stop() for p in peers), return_exceptions=True)
