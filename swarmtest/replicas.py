"""Replicas of one stage in outer rounds on the in-memory ``Hub``: each a real ``ReplicaSync`` over a
``RandomStepHolder``, their DHT records their syncs' live status, their state downloads straight from each other.

    group = ReplicaGroup(outer_config(timeouts=FAST), ["a", "b", "c"])
    asyncio.run(group.run({"a": 0.03, "b": 0.05}, until=lambda: len(group.rounds()) >= 6, timeout=60))
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

import pytest

from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.events import Event, OuterRound, Stamp, of_kind
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import ServedState
from swarm.rpc.blobs import Sink, TransferError, feed
from swarmtest.fakes import Hub, MemoryNet, RandomStepHolder

STAGE = 1


class ReplicaGroup:
    """Replicas of stage 1 on one hub; their DHT records are their syncs' live status. ``events``: every replica's
    events, each stamped with its name (``event.stamp.peer``) and the time."""

    def __init__(self, cfg: SwarmConfig, names: list[str], hub: Hub | None = None) -> None:
        self.hub, self.events = hub or Hub(), list[Event]()
        self.syncs: dict[str, ReplicaSync] = {}
        self._served: dict[str, ServedState] = {}
        for name in names:
            self.hub.join(name)
            self.syncs[name] = ReplicaSync(
                cfg,
                STAGE,
                RandomStepHolder.small(seed=sum(map(ord, name))),
                net=MemoryNet(self.hub, name),
                board=self.hub.boards[name],
                replicas=functools.partial(self.others, name),
                fetch=self.fetch_state,
                on_log=lambda event, name=name: self.events.append(event.stamped(Stamp(time=time.time(), peer=name))),
                clock=time.monotonic,
            )

    async def others(self, me: str) -> dict[str, StageStatus]:
        return {
            name: StageStatus(**s.status_fields())
            for name, s in self.syncs.items()
            if name != me and name not in self.hub.dead
        }

    async def fetch_state(self, peer: str, name: str, sink: Sink) -> str:
        if peer in self.hub.dead:
            raise TransferError(f"{peer} is gone")
        return await feed(await self.serving(peer).export_state(name), sink)

    def serving(self, name: str) -> ServedState:
        """The state replica ``name`` serves: one ``ServedState`` per sync (``syncs`` may be replaced), made when first
        asked for."""
        sync = self.syncs[name]
        if name not in self._served or self._served[name].sync is not sync:
            self._served[name] = ServedState(sync)
        return self._served[name]

    def rounds(self, name: str | None = None) -> list[OuterRound]:
        """The rounds done: of replica ``name``, or of every replica."""
        return [e for e in of_kind(self.events if name is None else self.of(name), OuterRound) if e.outcome == "done"]

    def of(self, name: str) -> list[Event]:
        """The events of replica ``name``."""
        return [e for e in self.events if e.stamp is not None and e.stamp.peer == name]

    async def run(self, step_every: dict[str, float], until: Callable[[], bool], timeout: float) -> None:
        """Train each replica at its own pace (one step per ``step_every[name]`` s) with its sync running, until ``until()``."""

        async def trainer(name: str, period: float) -> None:
            while True:
                await asyncio.sleep(period)  # the pace of this replica's inner steps
                self.syncs[name].holder.train()

        async def reached() -> None:
            while not until():
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(s.run()) for s in self.syncs.values()]
        tasks += [asyncio.create_task(trainer(name, period)) for name, period in step_every.items()]
        try:
            await asyncio.wait_for(reached(), timeout)
        except TimeoutError:
            pytest.fail(f"not reached within {timeout}s; events: {self.events}")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
