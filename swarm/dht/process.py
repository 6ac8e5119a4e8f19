"""``SwarmDHT``: hivemind's DHT process, with the identity key this peer signs its records with, dying with its peer.

Its node checks signatures and the peer id binding from its start; the process and its p2pd shut down when
the peer dies, even by SIGKILL (a parent-death signal, a ``getppid`` watchdog). Why: docs/architecture.md, dht/.

    >>> Membership(SwarmDHT(initial_peers=[...], host_maddrs=["/ip4/0.0.0.0/tcp/0"]))  # signs with dht.identity
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator

from swarm.dht.identity import (
    IdentityKey,
    OwnerBindingValidator,
    identity_file,
    identity_peer_id,
    load_identity_key,
)
from swarm.dht.reachability import use_static_relays

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_DEATH_SIGNAL = signal.SIGUSR2  # not SIGTERM: Linux also sends it when the thread that started the DHT ends
PARENT_CHECK_S = 0.5  # how often the watchdog looks at its parent without a signal
SHUTDOWN_GRACE_S = 5.0  # for the node's clean shutdown, then its children are killed
# a SIGTERM to the whole process group also reaches the peer, which then retires its records through this node
# and shuts it down itself: give it that long before leaving on our own
SIGTERM_GRACE_S = 10.0


class SwarmDHT(DHT):
    """A started hivemind DHT whose ``identity`` is the private key of its peer id; its process dies with its parent."""

    identity: IdentityKey

    def __init__(self, *, identity_path: str | None = None, check_if_identity_free: bool = True, **kwargs: Any) -> None:
        self._peer_pid = os.getpid()  # the DHT process's parent, for as long as the peer lives
        with identity_file(identity_path) as (path, fresh):
            self.identity = load_identity_key(path)
            super().__init__(
                start=True,
                identity_path=str(path),
                # from the first record on: one stored before these were added would be served unchecked later
                record_validators=[RSASignatureValidator(self.identity), OwnerBindingValidator()],
                # a fresh identity is nobody's: asking the swarm would only cost a second daemon's start
                check_if_identity_free=check_if_identity_free and not fresh,
                **kwargs,
            )
        if identity_peer_id(self.identity) != self.peer_id.to_base58():  # hivemind changed how it reads identities
            self.shutdown()
            raise RuntimeError(
                f"the libp2p daemon runs peer id {self.peer_id}, not the one of {identity_path or 'its key'}"
            )

    async def routing_health(self) -> RoutingHealth:
        """How many peers this node's routing table holds, and how many it skips for now (for a log that says why a
        record is not found)."""
        health: RoutingHealth = await self.run_coroutine(_routing_health, return_future=True)
        return health

    def run(self) -> None:
        """The DHT process: hivemind's loop, with a watchdog that ends it when the peer is gone or on SIGTERM."""
        wake, stop = threading.Event(), threading.Event()
        signal.set_wakeup_fd(-1)  # inherited from the peer's event loop: our signals must not reach the peer's

        def on_sigterm(*_: object) -> None:
            stop.set()
            wake.set()

        signal.signal(signal.SIGTERM, on_sigterm)
        signal.signal(PARENT_DEATH_SIGNAL, lambda *_: wake.set())
        set_parent_death_signal(PARENT_DEATH_SIGNAL)
        threading.Thread(target=self._watch, args=(wake, stop), name="dht-lifeline", daemon=True).start()
        if self.kwargs.get("trusted_relays"):  # behind NAT: its daemon takes a slot on a relay at once
            use_static_relays()
        super().run()

    def _watch(self, wake: threading.Event, stop: threading.Event) -> None:
        """Wait for the peer's death (checked on its signal, and every PARENT_CHECK_S) or SIGTERM_GRACE_S after a
        SIGTERM, then leave."""
        deadline = float("inf")
        while os.getppid() == self._peer_pid and time.monotonic() < deadline:
            wake.wait(PARENT_CHECK_S)
            wake.clear()
            if stop.is_set():
                deadline = min(deadline, time.monotonic() + SIGTERM_GRACE_S)
        with contextlib.suppress(OSError):  # the loop has gone already: the fallback below
            self._outer_pipe.send(("_shutdown", [], {}))  # DHT.shutdown's request, from inside: the node stops p2pd
        time.sleep(SHUTDOWN_GRACE_S)  # the process exits when run() returns, and this thread with it
        kill_children(os.getpid())  # still here: the shutdown hung
        os._exit(1)


@dataclass(frozen=True, kw_only=True)
class RoutingHealth:
    """What this peer's DHT node can reach: the peers in its routing table, and those it skips for now (hivemind skips
    a peer that missed a call for 5 s, doubling at each further miss)."""

    known: int
    skipped: int

    def __str__(self) -> str:
        return f"its DHT node knows {self.known} peers and skips {self.skipped} that missed a call"


async def _routing_health(dht: DHT, node: DHTNode) -> RoutingHealth:  # runs in the DHT process
    return RoutingHealth(
        known=len(node.protocol.routing_table.uid_to_peer_id), skipped=len(node.blacklist.banned_peers)
    )


def set_parent_death_signal(sig: signal.Signals) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    status: int = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return status == 0


def kill_children(pid: int) -> None:
    """SIGKILL every live child of ``pid`` (Linux: read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a process that exited while we looked
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # "pid (comm) state ppid …"
                os.kill(int(stat.parent.name), signal.SIGKILL)
