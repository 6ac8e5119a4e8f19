"""One copy of a holder's weights per version, shared by the downloads that ask for it while any of them holds it.

A ``local/<stage>`` download (and ``state/<stage>`` without an outer step) is a snapshot of the weights taken on the
holder's compute thread, between its inner steps and requests: one copy per request, and an identity asking again and
again held that thread (issue 42). ``SharedSnapshot.get`` copies once per version (``version()``, read when the copy
is asked for, and every ``invalidate``) and hands that copy to every request of the same version: those that ask
while it is being taken, and those that ask while a download still holds it. It keeps only weak references: once the
last download of a copy ends the copy is freed, so an idle holder keeps no second copy of its weights.

    >>> snapshot = SharedSnapshot(functools.partial(snapshot_weights, holder), lambda: holder.inner_steps)
    >>> params = await snapshot.get()  # a dict of its own; the tensors are the shared copy (read them, never write)
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Hashable

import torch

Weights = dict[str, torch.Tensor]


class SharedSnapshot:
    """``take()`` (a copy of the weights, on the compute thread) once per version, shared while it is held."""

    def __init__(self, take: Callable[[], Awaitable[Weights]], version: Callable[[], Hashable]) -> None:
        self.take, self.version = take, version
        self.copies = 0  # copies taken
        self._epoch = 0  # ``invalidate`` calls: a change of the weights ``version`` does not see
        self._held: tuple[Hashable, dict[str, weakref.ref[torch.Tensor]]] | None = None
        self._taking: tuple[Hashable, asyncio.Future[Weights]] | None = None

    def invalidate(self) -> None:
        """The weights changed (a download adopted, a round installed): the next ``get`` copies them again."""
        self._epoch += 1

    async def get(self) -> Weights:
        """The weights as of this call or later: the copy of this version if one is alive or on its way, else a new one."""
        key = (self._epoch, self.version())
        if self._held is not None and self._held[0] == key:
            alive = {name: ref() for name, ref in self._held[1].items()}
            if all(t is not None for t in alive.values()):
                return {name: t for name, t in alive.items() if t is not None}
        if self._taking is None or self._taking[0] != key:
            self._taking = (key, asyncio.ensure_future(self._copy(key)))
        return dict(await asyncio.shield(self._taking[1]))  # a waiter that gives up leaves the copy to the others

    async def _copy(self, key: Hashable) -> Weights:
        try:
            weights = await self.take()
        finally:
            if self._taking is not None and self._taking[0] == key:
                self._taking = None
        self.copies += 1
        self._held = (key, {name: weakref.ref(t) for name, t in weights.items()})
        return weights
