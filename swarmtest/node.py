"""A swarm ``Node`` run in this process, on its own event loop in a background thread: start it, wait until ready, stop it.

For tests that want a peer's objects at hand (its records as they are logged, its ``Node``) rather than a separate
process; tests of whole swarms spawn processes (``swarmtest.processes``).

    with BackgroundNode(PeerConfig(role="stage", stage=1, host_maddrs=LOOPBACK_MADDRS), cfg) as server:   # ready: serving
        with BackgroundNode(PeerConfig(role="trainer", initial_peers=server.maddrs, ...), data=batches) as trainer:
            last = trainer.result(timeout=120)
    # leaving the block stops the node (records retired, DHT down) and re-raises what its run raised
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from swarm.config import SwarmConfig
from swarm.events import E, Event, Progress, of_kind
from swarm.node.config import PeerConfig
from swarm.node.context import DataFactory
from swarm.node.node import Node

T = TypeVar("T")


class BackgroundNode:
    """One ``Node`` on a daemon thread; ``records`` are its log records in order, ``maddrs`` where to join it."""

    def __init__(
        self,
        config: PeerConfig,
        cfg: SwarmConfig | None = None,
        *,
        data: DataFactory | None = None,
        on_fault: Literal["kill", "crash"] = "crash",
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.config, self.cfg, self.data, self.on_fault, self.ready_timeout_s = (
            config,
            cfg,
            data,
            on_fault,
            ready_timeout_s,
        )
        self.records: list[Event] = []  # as logged (unstamped)
        self.maddrs: list[str] = []
        self.node: Node | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the node's, while it runs
        self._thread = threading.Thread(target=self._main, name=f"node-{config.name or config.role}", daemon=True)
        self._ready, self._done = threading.Event(), threading.Event()
        self._result: Progress | None = None  # the node's last progress record (None: stopped before one)
        self._error: BaseException | None = None

    def start(self) -> BackgroundNode:
        """Start the node and wait until its role takes calls; raises what the node raised if it ended first."""
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            if self._done.is_set():
                self.result(timeout=0)  # raises the node's error, if any
                raise RuntimeError(f"{self.config.name or self.config.role} ended before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.config.name or self.config.role} not ready within {self.ready_timeout_s:.0f}s"
                )
        return self

    def stop(self, timeout: float = 60.0) -> Progress | None:
        """Stop the node (if it still runs) and wait for it to leave; its last progress record."""
        loop, node = self._loop, self.node
        if loop is not None and node is not None and not self._done.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the node ended by itself
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(node.stop()))
        return self.result(timeout)

    def result(self, timeout: float) -> Progress | None:
        """Wait for ``run`` to end by itself (a trainer's last step, a fault); its last progress record (None: stopped
        before one), or what it raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.config.name or self.config.role} still running after {timeout:.0f}s")
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def call(self, fn: Callable[[Node], Awaitable[T]], timeout: float = 30.0) -> T:
        """``await fn(node)`` on the node's own loop, e.g. ``call(lambda node: node.membership.replicas(1))``."""
        assert self._loop is not None and self.node is not None, "the node is not running"
        node = self.node
        return asyncio.run_coroutine_threadsafe(_awaited(fn(node)), self._loop).result(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def events(self, kind: type[E]) -> list[E]:
        """The events of ``kind`` logged so far: ``events(Serving)``, ``events(Progress)`` (the progress records)."""
        return of_kind(list(self.records), kind)

    def wait(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        """Poll ``check`` until it returns something true; TimeoutError (with the last records) if it does not in time."""
        deadline = time.monotonic() + timeout
        while not (found := check()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f}s; last records: {self.records[-5:]}")
            time.sleep(0.05)
        return found

    def __enter__(self) -> BackgroundNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.run(self._run())  # which also cancels what the node's libraries leave running

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()

        def on_ready(maddrs: list[str]) -> None:
            self.maddrs = maddrs
            self._ready.set()

        try:
            self.node = Node(
                self.config,
                self.cfg,
                data=self.data,
                on_log=self.records.append,
                on_ready=on_ready,
                on_fault=self.on_fault,
            )
            self._result = await self.node.run()
        except BaseException as e:  # handed to the test thread by result()
            self._error = e
        finally:
            self._done.set()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable
