"""Admission to private swarms: why a refused peer was refused.

A private swarm's DHT drops the requests of a peer without a valid certificate and says nothing
(hivemind's authorizer hook can only accept or drop), so every peer also serves an
``AdmissionGate``: a refused peer asks the initial peers why (``ask_gates``), and its ``JoinError``
(``swarm/dht/start.py``) quotes their answer (``explain_refusal``).

    >>> await AdmissionGate(creds.verifier).add_p2p_handlers(await dht.replicate_p2p(), namespace=GATE_NAMESPACE)
    >>> answers = await ask_gates(initial_peers, identity_path="peer.id", certificate=creds.certificate_bytes())
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgpack
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from swarm.rpc.auth import CertificateAuthorizer, CertificateVerifier
from swarm.rpc.defences import PeerLimits
from swarm.rpc.servicer import GuardedServicer, RequestError

GATE_NAMESPACE = "swarmloco"
PROBE_TIMEOUT_S = 10.0


class Credentials(Protocol):
    """What a peer of a private swarm runs with (``peer.credentials.PeerCredentials``)."""

    @property
    def identity(self) -> Path: ...
    @property
    def verifier(self) -> CertificateVerifier: ...

    def certificate_bytes(self) -> bytes: ...

    def revocations_bytes(self) -> bytes | None: ...

    def dht_authorizer(self) -> CertificateAuthorizer: ...


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
