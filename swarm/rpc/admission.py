"""Joining a swarm: the DHT start-up, admission to private swarms, and errors that say what to do.

hivemind reports a failed join in terms of its machinery ("Daemon failed to start: … failed to
connect to bootstrap peers", "DHTNode bootstrap failed: none of the initial_peers responded to a
ping"); ``start_dht`` turns each into a ``JoinError`` naming the cause and the fix. A private
swarm's DHT drops the requests of a peer without a valid certificate and says nothing (hivemind's
authorizer hook can only accept or drop), so every peer also serves an ``AdmissionGate``: a
refused peer asks the initial peers why, and its error quotes their answer.

    >>> dht = await start_dht(initial_peers=["/ip4/…/tcp/31337/p2p/12D3…"], identity_path="peer.id", credentials=creds)
    >>> await AdmissionGate(creds.verifier).add_p2p_handlers(await dht.replicate_p2p(), namespace=GATE_NAMESPACE)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm.rpc.auth import CertificateAuthorizer, CertificateVerifier
from swarm.rpc.defences import PeerLimits
from swarm.rpc.servicer import GuardedServicer, RequestError

GATE_NAMESPACE = "swarmloco"
BOOTSTRAP_FAILED = "DHTNode bootstrap failed"  # hivemind's RuntimeError when no initial peer answers the DHT
PROBE_TIMEOUT_S = 10.0
_DAEMON_LOG_TIME = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")  # p2pd prefixes its messages with a timestamp


class Credentials(Protocol):
    """What a peer of a private swarm runs with (``peer.credentials.PeerCredentials``)."""

    identity: Path
    verifier: CertificateVerifier

    def certificate_bytes(self) -> bytes: ...

    def dht_authorizer(self) -> CertificateAuthorizer: ...


class JoinError(RuntimeError):
    """This peer could not start or join the swarm; the message says why and what to do."""


class AdmissionGate(GuardedServicer):
    """Tells anyone whether this peer admits them, and why not: the answer a refused DHT join lacks.

    The request is the asker's certificate (empty for none); libp2p authenticated the asker's peer
    id, so the answer is exactly what this peer's DHT decides. A public peer admits everyone. A
    refusal is no misbehaviour (the gate exists for refused peers), but askers are rate-limited.
    """

    def __init__(self, verifier: CertificateVerifier | None, *, limits: PeerLimits | None = None) -> None:
        super().__init__(label="admission gate", verifier=verifier, limits=limits)

    async def rpc_admit(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            self.screen(context.remote_id)
        except RequestError as e:
            return runtime_pb2.ExpertResponse(metadata=self.refuse(e, context.remote_id))
        answer: dict[str, Any] = {"admitted": True, "private": self.verifier is not None}
        if (denied := self.access_denied(context.remote_id, request.metadata or None)) is not None:
            answer.update(admitted=False, reason=denied.reason, message=str(denied))
        return runtime_pb2.ExpertResponse(metadata=msgpack.packb(answer))


async def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    credentials: Credentials | None = None,
    client_mode: bool = False,
) -> DHT:
    """A running DHT node in the swarm at ``initial_peers`` (none: a new swarm), or a JoinError that says what to do."""
    for maddr in initial_peers:
        check_peer_address(maddr)
    try:
        return DHT(
            initial_peers=list(initial_peers) or None,
            start=True,
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity_path,
            client_mode=client_mode,
            check_if_identity_free=identity_path is not None,  # hivemind checks only when joining
            authorizer=credentials.dht_authorizer() if credentials is not None else None,
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
            f"with --announce-maddrs /ip4/<its public ip>/tcp/<port> and --host-maddrs on that same port"
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


async def ask_gates(
    initial_peers: Sequence[str],
    *,
    identity_path: str | None,
    certificate: bytes | None,
    timeout: float = PROBE_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """The AdmissionGate answers of the initial peers to this identity and certificate (those that answered)."""
    try:
        p2p = await P2P.create(
            initial_peers=list(initial_peers),
            identity_path=identity_path,
            check_if_identity_free=False,
            dht_mode="client",
            no_listen=True,
        )
    except P2PDaemonError:
        return []
    try:

        async def ask(maddr: str) -> dict[str, Any] | None:
            stub = AdmissionGate.get_stub(p2p, PeerID.from_base58(Multiaddr(maddr)["p2p"]), namespace=GATE_NAMESPACE)
            try:
                reply = await stub.rpc_admit(runtime_pb2.ExpertRequest(metadata=certificate or b""), timeout=timeout)
                answer = msgpack.unpackb(reply.metadata, raw=False)
            except Exception:  # an unreachable peer, or one without a gate (an older swarmloco)
                return None
            return answer if isinstance(answer, dict) and isinstance(answer.get("admitted"), bool) else None

        return [answer for answer in await asyncio.gather(*map(ask, initial_peers)) if answer is not None]
    finally:
        await p2p.shutdown()


def explain_refusal(
    initial_peers: Sequence[str], answers: list[dict[str, Any]], *, credentials: bool, identity: bool
) -> str:
    """Why the DHT at ``initial_peers`` did not answer this peer, from their gates' ``answers``."""
    swarm = f"the swarm at {' '.join(initial_peers)}"
    for answer in answers:
        if not answer["admitted"]:
            unstable = (
                ""
                if identity
                else (
                    " (run with --identity FILE: without it this peer gets a new id at every "
                    "start, which no certificate can name)"
                )
            )
            return f"{swarm} refused this peer: {answer.get('message', 'no reason given')}{unstable}"
    if answers and credentials and not any(answer.get("private") for answer in answers):
        return (
            f"{swarm} is public, but this peer runs with --credentials and so rejects its peers' replies, which carry "
            f"no certificate: join it without --credentials"
        )
    if answers:
        return (
            f"{swarm} accepts this peer's certificate but dropped its DHT requests: check this machine's clock "
            f"(hivemind refuses requests more than a minute off)"
        )
    return (
        f"{swarm} does not answer this peer's DHT requests: a private swarm drops peers without a valid certificate for "
        f"it (--credentials, --identity), a public one drops peers that come with --credentials, and peers of another "
        f"swarmloco version may not answer at all"
    )
