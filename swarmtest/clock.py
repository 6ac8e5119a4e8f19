"""Time the tests control: a fake clock to hand to anything that takes ``clock=``, and an event loop on virtual time
(sleeps, windows and timeouts in it cost no wall time).

    clock = FakeClock(100.0); guard = PeerGuard(limits, clock); clock.advance(2.5)
    result, took_s = in_virtual_time(allgather_round(...))   # windows and timeouts cost no wall time
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class FakeClock:
    """A clock that moves only when the test moves it (``advance``, or ``now = ...``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _WarpSelector(selectors.DefaultSelector):
    """A selector that never blocks on a timeout: with nothing ready, the loop's clock jumps to its next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = time.monotonic()  # near the real clock: times a test computes before the loop starts stay comparable

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout is None:  # None: no timer at all, so nothing could ever wake the loop but I/O
            return ready or super().select(None)
        self.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: it moves only while every task waits, so sleeps, windows and timeouts cost no
    wall time and a loaded machine's scheduling delays move no arrival past a window (the rounds' timing is exact).
    For code with no threads and no real I/O: the in-memory hub's rounds."""

    def __init__(self) -> None:
        self._warp = _WarpSelector()
        super().__init__(self._warp)

    def time(self) -> float:
        return self._warp.now


def in_virtual_time(work: Awaitable[T]) -> tuple[T, float]:
    """Run ``work`` on a ``VirtualClockLoop``: its result and the virtual seconds it took."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        started = runner.get_loop().time()
        result = runner.run(work)
        return result, runner.get_loop().time() - started
