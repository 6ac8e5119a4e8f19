"""Starting this peer's DHT node, with errors that say what to do.

``start_dht`` turns hivemind's failed joins into a ``JoinError`` naming the cause and the fix (a private swarm's
refusal is explained by the initial peers' admission gates); ``watch_swarm`` is a client-mode look at a swarm.

    >>> dht = await start_dht(initial_peers=["/ip4/…/tcp/31337/p2p/12D3…"], host_maddrs=["/ip4/0.0.0.0/tcp/0"])
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership
from swarm.dht.process import SwarmDHT
from swarm.dht.reachability import Reachability
from swarm.rpc.admission import Credentials, ask_gates, explain_refusal

BOOTSTRAP_FAILED = "DHTNode bootstrap failed"  # hivemind's RuntimeError when no initial peer answers the DHT
_DAEMON_LOG_TIME = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")  # p2pd prefixes its messages with a timestamp


class JoinError(RuntimeError):
    """This peer could not start or join the swarm; the message says why and what to do."""


async def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    credentials: Credentials | None = None,
    client_mode: bool = False,
    reachability: Reachability | None = None,
) -> SwarmDHT:
    """A running DHT node in the swarm at ``initial_peers`` (none: a new swarm), or a JoinError that says what to do.

    Without ``identity_path`` the node runs a fresh identity (a new peer id at every start). ``reachability`` sets the
    libp2p options of a peer behind NAT (``swarm/dht/reachability.py``); None: hivemind's defaults."""
    for maddr in initial_peers:
        check_peer_address(maddr)
    options = reachability.dht_options(initial_peers) if reachability is not None else {}
    options["client_mode"] = client_mode or options.get("client_mode", False)
    try:
        return SwarmDHT(
            initial_peers=list(initial_peers) or None,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity_path,
            authorizer=credentials.dht_authorizer() if credentials is not None else None,
            **options,
        )
    except P2PDaemonError as e:
        raise JoinError(
            explain_daemon_error(
                str(e), initial_peers=initial_peers, host_maddrs=host_maddrs, identity_path=identity_path
            )
        ) from None
    except RuntimeError as e:
        if BOOTSTRAP_FAILED not in str(e):
            raise
    certificate = credentials.certificate_bytes() if credentials is not None else None
    answers = await ask_gates(initial_peers, identity_path=identity_path, certificate=certificate)
    raise JoinError(
        explain_refusal(initial_peers, answers, credentials=credentials is not None, identity=identity_path is not None)
    )


def check_peer_address(maddr: str) -> None:
    """JoinError unless ``maddr`` is a multiaddr ending in the peer's id, as peers print theirs."""
    try:
        PeerID.from_base58(Multiaddr(maddr)["p2p"])
    except (ValueError, LookupError):  # multiaddr's parse errors and "no /p2p/ part"
        raise JoinError(
            f"--initial-peers {maddr!r} is not a peer address: expected /ip4/<host>/tcp/<port>/p2p/<peer id>, "
            f"as a running peer prints it ('join with --initial-peers …')"
        ) from None


def explain_daemon_error(
    error: str, *, initial_peers: Sequence[str], host_maddrs: Sequence[str], identity_path: str | None
) -> str:
    """What a P2PDaemonError from starting hivemind's libp2p daemon means for the user."""
    detail = _DAEMON_LOG_TIME.sub("", error.removeprefix("Daemon failed to start: ")).strip()
    if "already taken by another peer" in error:
        return (
            f"the identity {identity_path} is in use by another running peer: each peer needs its own identity file. "
            f"Stop the other peer, or create a new identity (`swarmloco swarm identity --out new.id`; in a private "
            f"swarm its authority must invite the new peer id)"
        )
    if "failed to connect to bootstrap peers" in error:
        return (
            f"could not reach any initial peer (tried {', '.join(initial_peers)}): check that the address is current "
            f"(a peer prints it when it starts; its /p2p/ id changes at every start unless it runs with --identity), "
            f"that its TCP port is open to this machine (firewall, port forwarding), and that a peer behind NAT runs "
            f"with --announce-maddrs /ip4/<its public ip>/tcp/<port> and --host-maddrs on that same port (a forwarded "
            f"port), or with --reachability relay to be reached through a relay"
        )
    if "failed to listen" in error:
        return (
            f"cannot listen on --host-maddrs {' '.join(host_maddrs)} ({detail}): use an address of this machine "
            f"(/ip4/0.0.0.0/tcp/<port> listens on all of them) and a free port (tcp/0 picks one)"
        )
    if "failed to parse" in error:
        return f"an address given to libp2p is not a multiaddr ({detail}); e.g. /ip4/203.0.113.7/tcp/31337"
    return (
        f"the libp2p daemon (p2pd, shipped with hivemind) failed to start: {detail}. Check --host-maddrs and "
        f"--announce-maddrs; if it says the binary is missing or incompatible, reinstall hivemind"
    )


@asynccontextmanager
async def watch_swarm(
    initial_peers: Sequence[str],
    cfg: SwarmConfig | None,
    *,
    name: str,
    identity_path: str | None = None,
    credentials: Credentials | None = None,
) -> AsyncIterator[Membership]:
    """A client-mode DHT node joined to the swarm (its config fetched, or ``cfg`` checked against it), shut down on exit:
    how ``swarmloco status``, ``export`` and the dashboard look at a swarm without taking part."""
    dht = await start_dht(
        initial_peers=initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=identity_path,
        credentials=credentials,
        client_mode=True,
    )
    try:
        membership = Membership(dht)
        await membership.join(cfg, create=False, name=name)
        yield membership  # its .dht is the node
    finally:
        dht.shutdown()
