"""Shared fixtures."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from peer.launch import stop_processes


@pytest.fixture
def child_processes() -> Iterator[list[subprocess.Popen]]:
    """Append every process a test starts (in its own process group, as ``peer.launch.spawn_peer`` does).

    Whatever the test's outcome, each group gets SIGTERM and then SIGKILL, so no peer (nor its
    DHT process or libp2p daemon) outlives the test.
    """
    procs: list[subprocess.Popen] = []
    yield procs
    stop_processes(procs, grace_s=5.0)
