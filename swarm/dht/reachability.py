"""How others reach this peer: directly (public), through a relay, or not at all but for the calls it makes (client).

``choose_reachability`` picks the mode (``auto``: public unless nothing suggests others can dial the peer) and
gives its DHT/P2P options; ``use_static_relays`` makes p2pd take the initial peers as static relays, and
``wait_for_circuit`` waits for the relayed address. The modes and the WAN lab's findings: docs/architecture.md, dht/.

    >>> choose_reachability("auto", initial_peers=peers, host_maddrs=hosts, announce_maddrs=[]).dht_options(peers)
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hivemind.dht import DHT
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

ReachabilityMode = Literal["auto", "public", "relay", "client"]
REACHABILITY_MODES: tuple[str, ...] = get_args(ReachabilityMode)
AnyAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Reachability:
    """The mode this peer runs in (never ``auto``) and why it was chosen, for the one line a peer prints at start."""

    mode: Literal["public", "relay", "client"]
    reason: str

    @property
    def behind_nat(self) -> bool:
        return self.mode != "public"

    def dht_options(self, initial_peers: Sequence[str]) -> dict[str, Any]:
        """hivemind DHT / P2P keywords for this mode."""
        if not self.behind_nat:
            return {"force_reachability": "public"}  # so p2pd's relay service runs for the peers behind NAT
        return {
            "client_mode": True,
            "use_auto_relay": True,
            "force_reachability": "private",  # reserve a relay slot now, not once AutoNAT has made up its mind
            "trusted_relays": list(initial_peers),
        }

    def describe(self) -> str:
        what = {
            "public": "others dial this peer directly; it is a full DHT node and a relay for peers behind NAT",
            "relay": "a DHT client, reached through a relay (the initial peers)",
            "client": "a trainer and DHT client: it calls the stage servers; its outer-round payloads go out through a relay",
        }[self.mode]
        return f"reachability: {self.mode} ({self.reason}): {what}"


def use_static_relays() -> None:
    """Make the p2pd daemons this process starts reserve a slot on their trusted relays at once.

    hivemind 1.1.12 passes ``-trustedRelays`` but not ``-relayDiscovery=0``, so p2pd feeds autorelay from a peer
    source (the trusted relays, then DHT peers) that reserves nothing until it has 4 candidates or 3 minutes have
    passed; with discovery off the trusted relays become go-libp2p's static relays, reserved as soon as they are
    connected (measured in the WAN lab: a circuit address within a second instead of none in 4 minutes). hivemind has
    no option for it, so its daemon command line gains the flag wherever trusted relays are given. Idempotent; called
    in the DHT process, the one that starts this peer's daemon (``swarm/dht/process.py``).
    """
    make_args = P2P._make_process_args
    if getattr(make_args, "static_relays", False):
        return

    def with_static_relays(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("trustedRelays"):
            kwargs.setdefault("relayDiscovery", False)
        command_line: list[str] = make_args(*args, **kwargs)
        return command_line

    with_static_relays.static_relays = True  # type: ignore[attr-defined]  # marks the patch, so it is applied once
    P2P._make_process_args = staticmethod(with_static_relays)


RELAY_WAIT_S = 15.0  # a static relay slot is reserved within a second of joining (WAN lab); beyond this, say so
CIRCUIT = "/p2p-circuit"


def visible_maddrs(dht: DHT, *, latest: bool = False) -> list[str]:
    """The addresses p2pd announces for this peer; [] where it announces none (hivemind raises then): a peer behind
    NAT has none of its own until its first relay slot is reserved."""
    try:
        return [str(maddr) for maddr in dht.get_visible_maddrs(latest=latest)]
    except ValueError:
        return []


async def wait_for_circuit(dht: DHT, timeout_s: float = RELAY_WAIT_S, poll_s: float = 0.25) -> list[str]:
    """This peer's relayed addresses (``…/p2p/<relay>/p2p-circuit/p2p/<itself>``) once p2pd announces one; [] if
    none within ``timeout_s`` (no initial peer was a public relay, or none let it reserve a slot)."""
    deadline = time.monotonic() + timeout_s
    while True:
        maddrs = await asyncio.to_thread(visible_maddrs, dht, latest=True)
        circuits = [m for m in maddrs if CIRCUIT in m]
        if circuits or time.monotonic() >= deadline:
            return circuits
        await asyncio.sleep(poll_s)


def choose_reachability(
    mode: ReachabilityMode,
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    local_addresses: Sequence[str] | None = None,
) -> Reachability:
    """The mode to run in and why. ``auto`` picks ``relay`` only when nothing says others can dial this peer: no
    --announce-maddrs, it joins a swarm, listens on no public address, and no initial peer shares a network with it
    (an initial peer with a public address, or a private one outside this machine's networks)."""
    if mode not in REACHABILITY_MODES:
        raise ValueError(f"--reachability must be one of {', '.join(REACHABILITY_MODES)}, got {mode!r}")
    if mode != "auto":
        return Reachability(mode, "as asked with --reachability")
    if announce_maddrs:
        return Reachability("public", "--announce-maddrs given")
    if not initial_peers:
        return Reachability("public", "this peer creates the swarm: the others join through its address")
    own = _listen_addresses(host_maddrs, local_addresses)
    if any(address.is_global for address in own):
        return Reachability("public", f"listening on the public address {next(a for a in own if a.is_global)}")
    networks = [ipaddress.ip_network(f"{address}/24", strict=False) for address in own if address.version == 4]
    for peer in _peer_addresses(initial_peers):
        if peer.is_loopback or any(peer in network for network in networks):
            return Reachability("public", f"initial peer {peer} is on this peer's network")
    listened = ", ".join(map(str, own)) or "no IP address"
    return Reachability(
        "relay",
        f"no --announce-maddrs, listening only on private addresses ({listened}), initial peers on another network",
    )


def _listen_addresses(host_maddrs: Sequence[str], local_addresses: Sequence[str] | None) -> list[AnyAddress]:
    """The IP addresses this peer listens on: those in ``host_maddrs``, this machine's own for 0.0.0.0 / ::."""
    found: list[AnyAddress] = []
    for maddr in host_maddrs:
        address = _ip_of(maddr)
        if address is not None and address.is_unspecified:
            found += [ipaddress.ip_address(a) for a in (local_addresses or machine_addresses())]
        elif address is not None:
            found.append(address)
    return found


def _peer_addresses(maddrs: Sequence[str]) -> list[AnyAddress]:
    return [address for address in map(_ip_of, maddrs) if address is not None]


def _ip_of(maddr: str) -> AnyAddress | None:
    """The /ip4 or /ip6 address of a multiaddr; None for /dns… or one that does not parse (checked elsewhere)."""
    try:
        parsed = Multiaddr(maddr)
        for protocol in ("ip4", "ip6"):
            if protocol in parsed:
                return ipaddress.ip_address(parsed[protocol])
    except (ValueError, LookupError):
        pass
    return None


def machine_addresses() -> list[str]:
    """This machine's IPv4 addresses as its resolver sees them, and the one it would leave by towards a public address
    (a UDP "connect" sends nothing); loopback where there is nothing else."""
    addresses: set[str] = set()
    try:
        addresses |= {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent, only a route looked up
        addresses.add(probe.getsockname()[0])
    except OSError:  # no route out (e.g. an isolated namespace)
        pass
    finally:
        probe.close()
    return sorted(addresses) or ["127.0.0.1"]
