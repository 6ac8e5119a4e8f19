"""Shared fixtures."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from swarmtest.processes import reap


@pytest.fixture
def child_processes() -> Iterator[list[subprocess.Popen]]:
    """Append every process a test starts (in its own process group, as ``swarmtest.processes`` starts them all).

    Whatever the test's outcome, each one and everything it started (a ``swarmloco local``'s peers, every peer's
    DHT process and libp2p daemon) gets SIGTERM and then SIGKILL, so no peer outlives the test.
    """
    procs: list[subprocess.Popen] = []
    yield procs
    reap(procs)


@pytest.fixture(scope="module")
def module_child_processes() -> Iterator[list[subprocess.Popen]]:
    """``child_processes`` for a module-scoped fixture: stopped once the module's tests are done."""
    procs: list[subprocess.Popen] = []
    yield procs
    reap(procs)
