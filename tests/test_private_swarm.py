"""Private swarms end to end on loopback: stage RPCs, the blob service and the DHT admit only peers with
a valid certificate, and a refused or failed join explains itself (``swarm/rpc/admission.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P

import swarm.pipeline.protocol as protocol
from compress.codecs import get_codec
from peer.credentials import (
    PeerCredentials,
    create_swarm,
    invite,
    load_credentials,
    new_identity,
    peer_id_of_identity,
    revoke,
)
from swarm.dht.start import JoinError, explain_daemon_error, start_dht
from swarm.events import Revocations
from swarm.node.config import PeerConfig
from swarm.pipeline.protocol import Backward, Forward, RemoteError, RequestError, StageClient, StageServicer
from swarm.rpc.admission import GATE_NAMESPACE, AdmissionGate, ask_gates, explain_refusal
from swarm.rpc.auth import CertificateVerifier
from swarm.rpc.blobs import BlobClient, BlobServicer, TransferError
from swarmtest.configs import FAST_TIMEOUTS, tiny_config
from swarmtest.fakes import EchoBackend
from swarmtest.node import BackgroundNode

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FP32 = get_codec("fp32")
DAY_S = 86_400


@dataclass
class Shown:
    """Credentials showing a fixed certificate: what a client with a bad one sends."""

    verifier: CertificateVerifier
    certificate: bytes

    def certificate_bytes(self) -> bytes:
        return self.certificate


@pytest.fixture(scope="module")
def swarm_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A private swarm: certificates for ``server``, ``member`` and ``revoked`` (then revoked), a stale one for
    ``member``, one ``member`` extended by hand, and a certificate of another authority for the same swarm."""
    root = tmp_path_factory.mktemp("private")
    swarm_id = create_swarm("demo", root / "swarm", private=True).swarm_id
    create_swarm("demo", root / "rogue", private=True)  # another authority, signing certificates for our swarm id
    for name in ("server", "member", "revoked", "thief", "outsider"):
        peer = new_identity(root / f"{name}.id")
        if name in ("server", "member", "revoked"):
            invite(root / "swarm" / "authority.key", swarm_id, peer, days=1, out=root / f"{name}.cert")
    member = peer_id_of_identity(root / "member.id")
    invite(
        root / "swarm" / "authority.key",
        swarm_id,
        member,
        days=1,
        out=root / "expired.cert",
        clock=lambda: time.time() - 2 * DAY_S,
    )
    invite(
        root / "rogue" / "authority.key",
        swarm_id,
        peer_id_of_identity(root / "outsider.id"),
        days=1,
        out=root / "outsider.cert",
    )
    fields = json.loads((root / "member.cert").read_bytes())
    fields["expires"] += 365 * DAY_S  # a member extending its own certificate: the signature no longer fits
    (root / "forged.cert").write_text(json.dumps(fields, sort_keys=True, separators=(",", ":")))
    revoke(
        root / "swarm" / "authority.key",
        swarm_id,
        peer_id_of_identity(root / "revoked.id"),
        revocations=root / "swarm" / "revocations.json",
    )
    return root, swarm_id


def credentials(root: Path, swarm_id: str, name: str, cert: str | None = None, **kwargs) -> PeerCredentials:
    return load_credentials(root / f"{name}.id", root / f"{cert or name}.cert", swarm_id, **kwargs)


@pytest.fixture  # one per test: a DHT's replicated P2P belongs to the event loop of the test that made it
def server(swarm_dir: tuple[Path, str]) -> Iterator[tuple[DHT, PeerCredentials]]:
    """The swarm's one peer: a DHT that admits certified peers only (its RPC handlers are added per test)."""
    root, swarm_id = swarm_dir
    creds = credentials(root, swarm_id, "server", revocations=root / "swarm" / "revocations.json")
    dht = DHT(
        start=True, identity_path=str(root / "server.id"), authorizer=creds.dht_authorizer(), host_maddrs=LOOPBACK
    )
    yield dht, creds
    dht.shutdown()


def certificate_of(root: Path, name: str) -> bytes:
    return (root / f"{name}.cert").read_bytes().strip()


@pytest.mark.timeout(90)
def test_stage_rpcs_serve_certified_peers_only(
    swarm_dir: tuple[Path, str], server: tuple[DHT, PeerCredentials], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, swarm_id = swarm_dir
    dht, server_creds = server
    verifier = server_creds.verifier
    x = torch.randn(2, 4, 8)

    async def scenario() -> None:
        host = await dht.replicate_p2p()
        servicer = StageServicer(EchoBackend(), stage=1, max_request_bytes=1 << 20, verifier=verifier)
        await servicer.add_p2p_handlers(host, namespace=swarm_id)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        clients = {
            name: await P2P.create(initial_peers=maddrs, identity_path=str(root / f"{name}.id"), host_maddrs=LOOPBACK)
            for name in ("member", "revoked", "thief")
        }
        try:
            member = StageClient(
                clients["member"], namespace=swarm_id, credentials=credentials(root, swarm_id, "member")
            )
            y = await member.forward(dht.peer_id, Forward(mb="a", stage=1, prev_stage=0, x=FP32.encode(x)), timeout=10)
            assert torch.equal(FP32.decode(y), x)
            assert await member.backward(dht.peer_id, Backward(mb="a", stage=1, grad=y), timeout=10) == y
            assert (await member.info(dht.peer_id, timeout=10))["stage"] == 1
            with monkeypatch.context() as patch:
                patch.setattr(
                    protocol, "MAX_UNARY_PAYLOAD_SIZE", 256
                )  # the certificate travels in streamed requests too
                assert (
                    await member.forward(
                        dht.peer_id, Forward(mb="s", stage=1, prev_stage=0, x=FP32.encode(x)), timeout=10
                    )
                    == y
                )

            refused = {  # (client, the certificate it shows) → what the server says
                ("member", None): "presented no certificate",
                ("member", "expired"): "expired at",
                ("member", "forged"): "does not carry a valid signature",
                ("thief", "member"): "was issued to peer",
                ("revoked", "revoked"): "revoked peer",
            }
            for (name, cert), says in refused.items():
                shown = Shown(verifier, certificate_of(root, cert)) if cert else None
                client = StageClient(clients[name], namespace=swarm_id, credentials=shown)
                for call in (
                    client.forward(dht.peer_id, Forward(mb="b", stage=1, prev_stage=0, x=FP32.encode(x)), timeout=10),
                    client.info(dht.peer_id, timeout=10),
                ):
                    with pytest.raises(RemoteError) as denied:
                        await call
                    assert denied.value.code == RequestError.DENIED and says in denied.value.message, (
                        name,
                        cert,
                        denied.value,
                    )
                    assert "swarmloco swarm invite" in denied.value.message
            assert servicer.guard.banned_for(clients["thief"].peer_id) == 0.0  # being refused is not misbehaving
        finally:
            await servicer.remove_p2p_handlers(host, namespace=swarm_id)
            for p2p in clients.values():
                await p2p.shutdown()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_blobs_are_served_to_certified_peers_only(
    swarm_dir: tuple[Path, str], server: tuple[DHT, PeerCredentials]
) -> None:
    root, swarm_id = swarm_dir
    dht, server_creds = server

    async def scenario() -> None:
        host = await dht.replicate_p2p()
        servicer = BlobServicer(verifier=server_creds.verifier)

        async def provide(name: str) -> bytes:
            return b"state of " + name.encode()

        servicer.provide("state", provide)
        await servicer.add_p2p_handlers(host, namespace=swarm_id)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        clients = {
            name: await P2P.create(initial_peers=maddrs, identity_path=str(root / f"{name}.id"), host_maddrs=LOOPBACK)
            for name in ("member", "thief")
        }
        try:

            def fetch(name: str, certificate: bytes | None) -> Awaitable[bytes]:
                client = BlobClient(clients[name], namespace=swarm_id, certificate=lambda: certificate)
                return client.fetch(dht.peer_id, "state/1", timeout=10, max_bytes=1 << 10)

            assert await fetch("member", certificate_of(root, "member")) == b"state of state/1"
            for name, certificate, says in [
                ("member", None, "presented no certificate"),
                ("thief", certificate_of(root, "member"), "was issued to peer"),
            ]:
                with pytest.raises(TransferError, match=f"refused: denied: .*{says}"):
                    await fetch(name, certificate)
            assert servicer.guard.banned_for(clients["thief"].peer_id) == 0.0  # being refused is not misbehaving
        finally:
            await servicer.remove_p2p_handlers(host, namespace=swarm_id)
            for p2p in clients.values():
                await p2p.shutdown()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_refused_joins_say_why(swarm_dir: tuple[Path, str], server: tuple[DHT, PeerCredentials]) -> None:
    """A peer the DHT refuses gets the reason from the initial peer's gate; a certified one joins."""
    root, swarm_id = swarm_dir
    dht, server_creds = server
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    cases = {  # identity, credentials → the reason quoted in the JoinError
        "no certificate": ("thief", None, "presented no certificate, and this swarm is private"),
        "revoked": (
            "revoked",
            credentials(root, swarm_id, "revoked"),
            "revoked peer",
        ),  # it has not seen the revocation
        "another authority": ("outsider", credentials(root, swarm_id, "outsider"), "comes from authority"),
    }

    async def scenario() -> None:
        await AdmissionGate(server_creds.verifier).add_p2p_handlers(await dht.replicate_p2p(), namespace=GATE_NAMESPACE)
        for case, (name, creds, says) in cases.items():
            with pytest.raises(JoinError) as refused:
                await start_dht(
                    initial_peers=maddrs,
                    host_maddrs=LOOPBACK,
                    identity_path=str(root / f"{name}.id"),
                    credentials=creds,
                )
            message = str(refused.value)
            assert message.startswith(f"the swarm at {maddrs[0]} refused this peer: ") and says in message, (
                case,
                message,
            )
        member = await start_dht(
            initial_peers=maddrs,
            host_maddrs=LOOPBACK,
            identity_path=str(root / "member.id"),
            credentials=credentials(root, swarm_id, "member"),
        )
        try:
            assert member.store("joined", "yes", time.time() + 60) and dht.get("joined", latest=True).value == "yes"
        finally:
            member.shutdown()

    asyncio.run(scenario())


def revocation_events(node: BackgroundNode, sequence: int) -> list[Revocations]:
    return [event for event in node.events(Revocations) if event.sequence == sequence]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_running_peers_follow_a_revocation_published_in_the_dht(tmp_path: Path) -> None:
    """Peer a was started with a revocation list file, b with none; the authority then revokes c and the new list
    replaces a's file: a reads it, republishes it in the DHT, and b (never given it) refuses c at its gate and DHT."""
    authority = create_swarm("live", tmp_path / "swarm", private=True).authority
    cfg = dataclasses.replace(tiny_config(stages=1, timeouts=FAST_TIMEOUTS), name="live", authority=authority)
    key, listing = tmp_path / "swarm" / "authority.key", tmp_path / "revocations.json"
    ids = {name: new_identity(tmp_path / f"{name}.id") for name in ("a", "b", "c", "gone")}
    for name in ("a", "b", "c"):
        invite(key, cfg.swarm_id, ids[name], days=1, out=tmp_path / f"{name}.cert")
    revoke(key, cfg.swarm_id, ids["gone"], revocations=listing)  # list #1, which a starts with

    def peer(name: str, join: list[str], **kwargs) -> PeerConfig:
        creds = credentials(tmp_path, cfg.swarm_id, name, **kwargs)
        return PeerConfig(
            role="stage",
            stage=1,
            name=name,
            initial_peers=join,
            host_maddrs=LOOPBACK,
            identity=tmp_path / f"{name}.id",
            credentials=creds,
        )

    def c_at_gate(node: BackgroundNode) -> dict:
        gate = ask_gates(node.maddrs, identity_path=str(tmp_path / "c.id"), certificate=certificate_of(tmp_path, "c"))
        (answer,) = asyncio.run(gate)
        return answer

    with BackgroundNode(peer("a", [], revocations=listing), cfg) as a:
        with BackgroundNode(peer("b", a.maddrs), cfg) as b:
            b.wait("list #1 from the DHT", lambda: revocation_events(b, 1), 30)
            assert c_at_gate(b)["admitted"]

            revoke(key, cfg.swarm_id, ids["c"], revocations=listing)  # list #2 replaces a's file while a runs
            (read,) = a.wait("a to read list #2 from its file", lambda: revocation_events(a, 2), 30)
            (spread,) = b.wait("b to learn list #2 from the DHT", lambda: revocation_events(b, 2), 30)
            assert (read.source, spread.source, spread.revoked) == ("file", "dht", 2)
            answer = c_at_gate(b)
            assert not answer["admitted"] and answer["reason"] == "revoked", answer
            with pytest.raises(JoinError, match="revoked peer"):  # b's DHT process refuses c too
                asyncio.run(
                    start_dht(
                        initial_peers=b.maddrs,
                        host_maddrs=LOOPBACK,
                        identity_path=str(tmp_path / "c.id"),
                        credentials=credentials(tmp_path, cfg.swarm_id, "c"),
                    )
                )


# ---- the explanations themselves (pure) ----

PEERS = ["/ip4/10.0.0.1/tcp/4000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]


@pytest.mark.parametrize(
    ("answers", "credentials", "says"),
    [
        (
            [{"admitted": False, "private": True, "message": "the certificate of peer Qm… expired"}],
            True,
            "refused this peer: the certificate",
        ),
        ([{"admitted": True, "private": False}], True, "is public, but this peer runs with --credentials"),
        ([{"admitted": True, "private": True}], True, "check this machine's clock"),
        ([], False, "does not answer this peer's DHT requests"),
    ],
)
def test_refusals_are_explained_from_the_gates_answers(answers: list, credentials: bool, says: str) -> None:
    message = explain_refusal(PEERS, answers, credentials=credentials, identity=True)
    assert message.startswith(f"the swarm at {PEERS[0]}") and says in message


@pytest.mark.parametrize(
    ("error", "says"),
    [  # what hivemind 1.1.12 raises, verbatim but for addresses
        (
            "Identity from `a.id` is already taken by another peer",
            "the identity a.id is in use by another running peer",
        ),
        (
            "Daemon failed to start: 2026/11/22 01:18:20 failed to connect to bootstrap peers",
            "could not reach any initial peer (tried /ip4/10.0.0.1",
        ),
        (
            "Daemon failed to start: 2026/11/22 01:18:21 failed to listen on any addresses: [listen tcp4 1.2.3.4:0: bind: cannot assign "
            "requested address]",
            "cannot listen on --host-maddrs /ip4/1.2.3.4/tcp/0 (failed to listen on any addresses",
        ),
        ("Daemon failed to start in 15.0 seconds", "the libp2p daemon (p2pd, shipped with hivemind) failed to start"),
    ],
)
def test_daemon_errors_are_explained(error: str, says: str) -> None:
    message = explain_daemon_error(error, initial_peers=PEERS, host_maddrs=["/ip4/1.2.3.4/tcp/0"], identity_path="a.id")
    assert says in message and "2026/11/22" not in message


def test_peer_addresses_are_checked_before_starting_anything() -> None:
    for bad in ("garbage", "/ip4/127.0.0.1/tcp/4000", "/ip4/127.0.0.1/tcp/4000/p2p/xyz"):
        with pytest.raises(JoinError, match="is not a peer address"):
            asyncio.run(start_dht(initial_peers=[bad], host_maddrs=LOOPBACK))
