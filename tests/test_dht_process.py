"""The DHT process and its libp2p daemon die with their peer: a SIGKILLed ``swarmloco run`` leaves no process behind,
and a SIGTERM stops the DHT process (and its daemon) cleanly. A trainer that waits long for a stage logs what its DHT
node reaches."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from swarm.dht.process import SIGTERM_GRACE_S, SwarmDHT
from swarm.node.config import PeerConfig
from swarmtest.configs import LOOPBACK, tiny_config
from swarmtest.processes import Swarm, descendants, wait_until

ORPHAN_WAIT_S = 20.0  # the DHT process notices within a second; its clean shutdown takes a few


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead: it waits only for a reaper that may never come)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_a_sigkilled_peer_leaves_no_dht_process_or_daemon_behind(tmp_path: Path, child_processes: list) -> None:
    swarm = Swarm(tmp_path, tiny_config(stages=1), child_processes)
    peer = swarm.spawn("stage1-a", PeerConfig(role="stage", stage=1))  # waits until it prints its address
    below = descendants(peer.pid)
    assert any("p2pd" in command(pid) for pid in below) and len(below) >= 2, [command(pid) for pid in below]

    os.kill(peer.pid, signal.SIGKILL)  # the peer alone, as the OOM killer would: not its process group
    peer.wait(timeout=10)
    wait_until(
        "the peer's DHT process and libp2p daemon to exit",
        lambda: not any(alive(pid) for pid in below),
        ORPHAN_WAIT_S,
        explain=lambda: "\n".join(f"{pid}: {command(pid)}" for pid in below if alive(pid)),
    )


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_sigterm_stops_the_dht_process_and_its_daemon() -> None:
    dht = SwarmDHT(host_maddrs=[LOOPBACK])
    below = [dht.pid, *descendants(dht.pid)]
    try:
        assert any("p2pd" in command(pid) for pid in below)
        os.kill(dht.pid, signal.SIGTERM)  # its parent (this test) does not stop it: it leaves after the grace period
        dht.join(SIGTERM_GRACE_S + ORPHAN_WAIT_S)
        assert dht.exitcode == 0, "the DHT process did not shut down on SIGTERM"
        wait_until("the libp2p daemon to exit", lambda: not any(alive(pid) for pid in below), ORPHAN_WAIT_S)
    finally:
        for pid in filter(alive, below):  # whatever the outcome, nothing outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
def test_the_routing_health_probe_counts_the_peers_a_node_knows_and_those_it_skips() -> None:
    first = SwarmDHT(host_maddrs=[LOOPBACK])
    second = SwarmDHT(initial_peers=[str(m) for m in first.get_visible_maddrs()], host_maddrs=[LOOPBACK])
    try:
        health = lambda: asyncio.run(first.routing_health())
        wait_until("the first node to know the second", lambda: health().known == 1, 30)
        second.shutdown()
        first.get("anything", latest=True)  # asks the second, which misses the call
        missed = wait_until("the first node to skip the second", lambda: (h := health()).skipped == 1 and h, 30)
        assert str(missed) == "its DHT node knows 0 peers and skips 1 that missed a call"
    finally:
        first.shutdown()
        second.shutdown()
