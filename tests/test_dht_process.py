"""The DHT process and its libp2p daemon die with their peer: a SIGKILLed ``swarmloco run`` leaves no process behind,
and a SIGTERM stops the DHT process (and its daemon) cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from swarm.dht.process import SIGTERM_GRACE_S, SwarmDHT
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
    peer = swarm.spawn("stage1-a", "--role", "stage", "--stage", "1")  # waits until it prints its address
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
