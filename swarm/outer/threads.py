"""The two threads on which the outer step touches a replica's weights: the holder's compute thread (``Holder.exclusive``,
``snapshot_weights``), briefly, between inner steps and requests; and its own (``OuterThread``), where the outer
optimizer runs and the outer state changes.

    >>> snapshot = await snapshot_weights(holder); thread = OuterThread(stage)
    >>> payload = await thread.run(outer.make_payload, snapshot); await thread.change(outer.apply_alone, snapshot)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from swarm.model.step import WeightChange

T = TypeVar("T")


class Holder(Protocol):
    """What the outer step needs of a trainer (stage 0) or a stage server."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def inner_steps(self) -> int:
        """Inner steps taken by this process."""

    @property
    def start_step(self) -> int:
        """Where this process started on the lr schedule."""

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the compute thread: no inner step or request runs at the same time. ``change``: how ``fn``
        changes the weights (``swarm/model/step.py``): work begun before a move keeps its gradients, work begun
        before a replacement does not (a trainer drops them; a stage server leaves out the parameter gradients of
        forwards served before it)."""


async def snapshot_weights(holder: Holder) -> dict[str, torch.Tensor]:
    """A copy of the holder's weights, taken on its compute thread: no inner step or request tears it."""
    return await holder.exclusive(lambda: {name: p.detach().clone() for name, p in holder.module.named_parameters()})


class OuterThread:
    """The outer optimizer's own thread, and how often the outer state (global weights, optimizer, round) changed on
    it (``changes``: the version a served stream of that state holds to, ``StateChanged``)."""

    def __init__(self, stage: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"outer{stage}")
        self.changes = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the outer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def change(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the outer thread, as a change of the outer state: a stream of the old one stops."""

        def changing() -> T:
            self.changes += 1
            return fn(*args)

        return await self.run(changing)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
