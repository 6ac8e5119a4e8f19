"""Private-swarm checks: certificates, revocation lists, the DHT authorizer, and real DHT peers on loopback."""

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.credentials import invite, load_credentials, load_identity_key, new_identity, peer_id_of_identity, revoke
from swarm.rpc.auth import (
    AccessDenied,
    Certificate,
    CertificateAuthorizer,
    CertificateVerifier,
    CredentialError,
    RevocationList,
    encode_public_key,
    format_time,
    peer_id_of_public_key,
)
from swarmtest.clock import FakeClock

SWARM = "demo-0123456789abcdef"
NOW = 1_700_000_000
AUTHORITY = Ed25519PrivateKey.generate()
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER_PEER = "QmZMxNdpMkewiVZLMRxaNxUeZpDUb34pWjZ1kZvsd16Zic"


def certificate(
    *,
    signer: Ed25519PrivateKey = AUTHORITY,
    claimed: Ed25519PrivateKey | None = None,
    swarm: str = SWARM,
    peer: str = PEER,
    issued: int = NOW,
    days: float = 1,
) -> bytes:
    """A certificate signed by ``signer``, naming ``claimed`` (default: the signer) as its authority."""
    cert = Certificate(
        authority=encode_public_key(signer.public_key()),
        swarm_id=swarm,
        peer_id=peer,
        issued_at=issued,
        expires_at=issued + int(days * 86400),
    )
    if claimed is None:
        return cert.sign(signer)
    fields = json.loads(cert.sign(signer))
    fields["authority"] = encode_public_key(claimed.public_key())  # the signature no longer fits
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def verifier(now: float = NOW + 60, revocations: bytes | None = None) -> CertificateVerifier:
    return CertificateVerifier(AUTHORITY.public_key(), SWARM, revocations=revocations, clock=lambda: now)


def denied(check: CertificateVerifier, peer: str, cert: bytes | None) -> AccessDenied:
    with pytest.raises(AccessDenied) as info:
        check.check(peer, cert)
    return info.value


def test_certificate_round_trip() -> None:
    data = certificate()
    cert = verifier().check(PEER, data)
    assert cert == Certificate.decode(data)
    assert (cert.swarm_id, cert.peer_id, cert.issued_at, cert.expires_at) == (SWARM, PEER, NOW, NOW + 86400)
    assert len(data) < 400


@pytest.mark.parametrize(
    ("cert", "peer", "reason", "says"),
    [
        (None, PEER, "missing", "presented no certificate"),
        (b"not json", PEER, "malformed", "not a swarmloco certificate"),
        (certificate(swarm="other-0123456789abcdef"), PEER, "wrong_swarm", "other-0123456789abcdef"),
        (certificate(), OTHER_PEER, "wrong_peer", f"issued to peer {PEER}"),
        (certificate(signer=Ed25519PrivateKey.generate()), PEER, "wrong_authority", "comes from authority"),
        (certificate(signer=Ed25519PrivateKey.generate(), claimed=AUTHORITY), PEER, "forged", "valid signature"),
        (certificate(issued=NOW - 2 * 86400), PEER, "expired", f"expired at {format_time(NOW - 86400)}"),
    ],
)
def test_refusals_say_why_and_what_to_do(cert: bytes | None, peer: str, reason: str, says: str) -> None:
    error = denied(verifier(), peer, cert)
    assert error.reason == reason
    assert says in str(error)
    assert "swarmloco swarm invite" in str(error)


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_any_altered_byte_is_refused(data: st.DataObject) -> None:
    signed = certificate()
    i = data.draw(st.integers(0, len(signed) - 1))
    byte = data.draw(st.integers(0, 255).filter(lambda b: b != signed[i]))
    altered = signed[:i] + bytes([byte]) + signed[i + 1 :]
    with pytest.raises(AccessDenied):
        verifier().check(PEER, altered)


def test_expiry_and_revocation_apply_to_cached_certificates() -> None:
    clock = FakeClock(NOW + 60.0)
    check = CertificateVerifier(AUTHORITY.public_key(), SWARM, clock=clock)
    data = certificate()
    check.check(PEER, data)
    clock.now = NOW + 86400
    assert denied(check, PEER, data).reason == "expired"
    clock.now = NOW + 60
    revocations = RevocationList(swarm_id=SWARM).revoke(PEER, NOW + 30)
    assert check.update_revocations(revocations.sign(AUTHORITY))
    error = denied(check, PEER, data)
    assert error.reason == "revoked" and format_time(NOW + 30) in str(error)
    renewed = certificate(issued=NOW + 31)  # a certificate issued after the revocation readmits the peer
    assert check.check(PEER, renewed).issued_at == NOW + 31


def test_revocation_lists_must_be_signed_for_this_swarm_and_newer() -> None:
    one = RevocationList(swarm_id=SWARM).revoke(PEER, NOW)
    two = one.revoke(OTHER_PEER, NOW)
    check = verifier(revocations=two.sign(AUTHORITY))
    assert not check.update_revocations(one.sign(AUTHORITY)), "an older list must not undo a revocation"
    assert check.revocations == two
    with pytest.raises(CredentialError, match="not signed by this swarm's authority"):
        check.update_revocations(two.revoke("QmX", NOW).sign(Ed25519PrivateKey.generate()))
    tampered = json.loads(two.sign(AUTHORITY))
    del tampered["revoked"][PEER]  # an attacker un-revoking a peer, keeping the signature
    with pytest.raises(CredentialError):
        check.update_revocations(json.dumps(tampered, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(CredentialError, match="is for swarm"):
        check.update_revocations(RevocationList(swarm_id="other-1", sequence=9).sign(AUTHORITY))
    assert check.revocations == two


def test_peer_id_of_public_key_matches_hivemind(tmp_path: Path) -> None:
    path = tmp_path / "peer.id"
    peer_id = new_identity(path)
    assert peer_id == PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id == peer_id_of_public_key(load_identity_key(path).get_public_key().to_bytes())
    with pytest.raises(ValueError):
        peer_id_of_public_key(b"ssh-ed25519 AAAA")


# ---- the DHT authorizer, without the network ----


def authorizer(
    key: RSAPrivateKey, *, swarm: str = SWARM, issued: int | None = None, clock: float | None = None
) -> CertificateAuthorizer:
    now = time.time() if clock is None else clock
    peer = peer_id_of_public_key(key.get_public_key().to_bytes())
    cert = certificate(swarm=swarm, peer=peer, issued=int(now) - 60 if issued is None else issued)
    check = CertificateVerifier(AUTHORITY.public_key(), swarm, clock=lambda: now)
    return CertificateAuthorizer(key, lambda: cert, check)


@pytest.fixture(scope="module")
def rsa_keys() -> list[RSAPrivateKey]:
    return [RSAPrivateKey() for _ in range(3)]


def test_authorizer_signs_and_validates_requests(rsa_keys: list[RSAPrivateKey]) -> None:
    client, server = authorizer(rsa_keys[0]), authorizer(rsa_keys[1])

    async def exchange() -> tuple[bool, bool, bool]:
        request = dht_pb2.PingRequest()
        await client.sign_request(request, None)
        accepted = await server.validate_request(request)
        replay_accepted = await server.validate_request(request)  # the same nonce again
        response = dht_pb2.PingResponse()
        await server.sign_response(response, request)
        return accepted, replay_accepted, await client.validate_response(response, request)

    assert asyncio.run(exchange()) == (True, False, True)


def test_authorizer_refuses_stolen_and_bad_tokens(rsa_keys: list[RSAPrivateKey]) -> None:
    honest, thief, server = (authorizer(key) for key in rsa_keys)
    token = asyncio.run(honest.get_token())
    assert server.is_token_valid(token)
    stolen = type(token)()
    stolen.CopyFrom(token)
    stolen.public_key = thief.local_public_key.to_bytes()  # honest's certificate, thief's signing key
    assert not server.is_token_valid(stolen)
    stolen.public_key = b"garbage"
    assert not server.is_token_valid(stolen)


def test_authorizer_checks_its_own_certificate_and_picks_up_a_renewal(rsa_keys: list[RSAPrivateKey]) -> None:
    with pytest.raises(AccessDenied, match="expired"):
        authorizer(rsa_keys[0], issued=int(time.time()) - 3 * 86400)
    clock = FakeClock(time.time())
    peer = peer_id_of_public_key(rsa_keys[0].get_public_key().to_bytes())
    current = [certificate(peer=peer, issued=int(clock.now) - 60)]
    auth = CertificateAuthorizer(
        rsa_keys[0], lambda: current[0], CertificateVerifier(AUTHORITY.public_key(), SWARM, clock=clock)
    )
    first = asyncio.run(auth.get_token())
    clock.advance(86400)  # the first certificate has expired; the authority issued a new one meanwhile
    current[0] = certificate(peer=peer, issued=int(clock.now) - 60)
    assert auth.does_token_need_refreshing(first)
    request = dht_pb2.PingRequest()
    asyncio.run(auth.sign_request(request, None))
    assert request.auth.client_access_token.signature == current[0]


# ---- real hivemind DHT peers on loopback ----


def start_member_dht(
    identity: Path, authorizer: CertificateAuthorizer | None, initial_peers: list | None = None, **kwargs
) -> DHT:
    return DHT(
        initial_peers=initial_peers,
        start=True,
        identity_path=str(identity),
        authorizer=authorizer,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        check_if_identity_free=False,
        wait_timeout=2,
        **kwargs,
    )


@pytest.fixture(scope="module")
def swarm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """AUTHORITY's key file, five identities, and a revocation list naming ``revoked``."""
    root = tmp_path_factory.mktemp("swarm")
    pem = AUTHORITY.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (root / "authority.key").write_bytes(pem)
    (root / "authority.key").chmod(0o600)
    for name in ("a", "b", "newcomer", "intruder", "revoked"):
        new_identity(root / f"{name}.id")
    revoke(
        root / "authority.key", SWARM, peer_id_of_identity(root / "revoked.id"), revocations=root / "revocations.json"
    )
    return root


@pytest.fixture(scope="module")
def members(swarm_dir: Path) -> Iterator[tuple[DHT, DHT]]:
    """Two DHT peers with valid certificates; the second bootstraps from the first (and would fail if refused)."""
    peers: list[DHT] = []
    try:
        for name in ("a", "b"):
            identity, cert = swarm_dir / f"{name}.id", swarm_dir / f"{name}.cert"
            invite(swarm_dir / "authority.key", SWARM, peer_id_of_identity(identity), days=1, out=cert)
            creds = load_credentials(identity, cert, SWARM, revocations=swarm_dir / "revocations.json")
            peers.append(
                start_member_dht(
                    identity, creds.dht_authorizer(), [str(m) for p in peers for m in p.get_visible_maddrs()]
                )
            )
        yield peers[0], peers[1]
    finally:
        for dht in peers:
            dht.shutdown()


Found = ValueWithExpiration | None


@pytest.mark.timeout(60)
def test_certified_dht_peers_store_and_get(members: tuple[DHT, DHT], swarm_dir: Path) -> None:
    a, b = members
    assert str(a.peer_id) == peer_id_of_identity(swarm_dir / "a.id")
    assert a.store("from-a", "hello", get_dht_time() + 60)
    assert b.get("from-a", latest=True).value == "hello"
    assert b.store("from-b", "hi", get_dht_time() + 60)
    assert a.get("from-b", latest=True).value == "hi"


def join_newcomer(
    members: tuple[DHT, DHT], identity: Path, auth: CertificateAuthorizer | None
) -> tuple[Found, Found, Found]:
    """Start a peer at ``members``, let it store a key; what it reads of the members' key, and what they read of its key."""
    a, b = members
    assert a.store("members-only", "secret", get_dht_time() + 60)
    key = f"newcomer-{uuid.uuid4().hex}"
    newcomer = start_member_dht(
        identity, auth, [str(m) for m in a.get_visible_maddrs()], ensure_bootstrap_success=False
    )
    try:
        newcomer.store(key, str(identity), get_dht_time() + 60)
        return newcomer.get("members-only", latest=True), a.get(key, latest=True), b.get(key, latest=True)
    finally:
        newcomer.shutdown()


@pytest.mark.timeout(60)
def test_dht_admits_a_certified_newcomer(members: tuple[DHT, DHT], swarm_dir: Path) -> None:
    """The control for the refusals below: the same join, with a valid certificate, works."""
    theirs, at_a, at_b = join_newcomer(
        members, swarm_dir / "newcomer.id", authorizer(load_identity_key(swarm_dir / "newcomer.id"))
    )
    assert theirs.value == "secret"
    assert at_a.value == at_b.value == str(swarm_dir / "newcomer.id")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("intruder", ["no certificate", "expired", "other swarm", "revoked"])
def test_dht_refuses_peers_without_a_valid_certificate(
    members: tuple[DHT, DHT], swarm_dir: Path, intruder: str
) -> None:
    identity = swarm_dir / ("revoked.id" if intruder == "revoked" else "intruder.id")
    # every intruder believes its own certificate is fine (its clock, swarm or revocations differ): the members must refuse it
    auth = None
    if intruder != "no certificate":
        issued = int(time.time()) - (
            10 * 86400 if intruder == "expired" else 3600
        )  # "revoked": issued before the revocation
        swarm = "other-0123456789abcdef" if intruder == "other swarm" else SWARM
        auth = authorizer(load_identity_key(identity), swarm=swarm, issued=issued, clock=issued + 60)
    assert join_newcomer(members, identity, auth) == (None, None, None)
    assert members[1].get("members-only", latest=True).value == "secret"  # the members still work
