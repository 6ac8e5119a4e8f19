"""Swarm credentials on disk: the authority's keys, peer identities, invitations and revocations.

Whoever creates a private swarm holds ``authority.key`` (Ed25519, mode 0600) and signs a
certificate for each peer id it admits. A peer's id is fixed by its identity file (hivemind's
libp2p RSA key, ``--identity``), so a peer makes its identity first and sends the printed id to
the authority; the certificate file it gets back is its ``--credentials``. Certificates and
revocation lists are public; only the two private keys are secret. Formats and checks live in
``swarm/rpc/auth.py``; this module reads and writes the files.

    $ swarmloco swarm create --name demo --private --out demo/     # swarm.toml, authority.key, authority.pub
    $ swarmloco swarm identity --out peer.id                        # prints the peer id
    $ swarmloco swarm invite --authority demo/authority.key --config demo/swarm.toml --peer-id Qm… -o peer.cert
    $ swarmloco swarm revoke --authority demo/authority.key --config demo/swarm.toml --peer-id Qm…

    >>> creds = load_credentials(Path("peer.id"), Path("peer.cert"), cfg.swarm_id)
    >>> dht = DHT(identity_path="peer.id", authorizer=creds.dht_authorizer(), start=True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P

from swarm.config import SwarmConfig
from swarm.config_toml import save_config
from swarm.dht.identity import identity_peer_id, load_identity_key
from swarm.rpc.auth import (
    Certificate,
    CertificateAuthorizer,
    CertificateVerifier,
    CredentialError,
    RevocationList,
    decode_public_key,
    encode_public_key,
)

AUTHORITY_KEY, AUTHORITY_PUB, CONFIG_FILE, REVOCATIONS = (
    "authority.key",
    "authority.pub",
    "swarm.toml",
    "revocations.json",
)
DAY_S = 86_400
# a certificate counts whole seconds: under a minute it is void before its peer has started; 100 years is forever
MIN_DAYS, MAX_DAYS = 60 / DAY_S, 36_525.0


def create_swarm(name: str, out: Path, *, private: bool, base: SwarmConfig | None = None) -> SwarmConfig:
    """Write ``out/swarm.toml`` (``base``, default the built-in config, named ``name``) and, for a private swarm, a new
    authority key pair beside it, named in the config (so the swarm id is this authority's: another private swarm of
    the same name gets another id)."""
    targets = [out / CONFIG_FILE] + ([out / AUTHORITY_KEY, out / AUTHORITY_PUB] if private else [])
    for path in targets:
        if path.exists():
            raise CredentialError(
                f"{path} already exists; choose another --out (an overwritten authority key is a lost swarm)"
            )
    key = Ed25519PrivateKey.generate() if private else None
    cfg = dataclasses.replace(
        base or SwarmConfig(), name=name, authority=encode_public_key(key.public_key()) if key else ""
    )
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / CONFIG_FILE)
    if key is not None:
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_new(out / AUTHORITY_KEY, pem, mode=0o600)
        _write_new(out / AUTHORITY_PUB, f"{cfg.authority}\n".encode(), mode=0o644)
    return cfg


def load_authority(path: Path) -> Ed25519PrivateKey:
    data = _read(path)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise CredentialError(
            f"{path} is readable by others (mode {mode:o}); anyone who reads it can admit peers. Run `chmod 600 {path}`"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as e:
        raise CredentialError(f"{path} is not a private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise CredentialError(f"{path} holds a {type(key).__name__}, not a swarm authority (Ed25519) key")
    return key


def invite(
    authority: Path, swarm_id: str, peer_id: str, *, days: float, out: Path, clock: Callable[[], float] = time.time
) -> Certificate:
    """Sign a certificate admitting ``peer_id`` to the swarm for ``days`` and write it to ``out``."""
    if not MIN_DAYS <= days <= MAX_DAYS:  # NaN too
        raise CredentialError(
            f"--days must be between {MIN_DAYS:.5f} (one minute) and {MAX_DAYS:g} (100 years), got {days:g}"
        )
    key = load_authority(authority)
    now = int(clock())
    cert = Certificate(
        authority=encode_public_key(key.public_key()),
        swarm_id=swarm_id,
        peer_id=check_peer_id(peer_id),
        issued_at=now,
        expires_at=now + round(days * DAY_S),
    )
    _replace(out, cert.sign(key) + b"\n")  # overwriting renews: a running peer re-reads it when the old one expires
    return cert


def revoke(
    authority: Path, swarm_id: str, peer_id: str, *, revocations: Path, clock: Callable[[], float] = time.time
) -> RevocationList:
    """Add ``peer_id`` to the signed revocation list (created if absent): its certificates issued until now are void."""
    key = load_authority(authority)
    current = RevocationList(swarm_id=swarm_id)
    if revocations.exists():
        with _about(revocations):
            current = RevocationList.verify(_read(revocations), key.public_key(), swarm_id)
    updated = current.revoke(check_peer_id(peer_id), int(clock()))
    _replace(revocations, updated.sign(key) + b"\n")
    return updated


def new_identity(path: Path) -> str:
    """Create a libp2p identity file the way hivemind does (RSA, mode 0400); returns its peer id."""
    if path.exists():
        raise CredentialError(
            f"{path} already exists; refusing to overwrite an identity (its peer id may hold certificates)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    P2P.generate_identity(str(path))
    return peer_id_of_identity(path)


def peer_id_of_identity(path: Path) -> str:
    return identity_peer_id(load_identity_key(path))


def check_peer_id(peer_id: str) -> str:
    try:
        multihash.decode(base58.b58decode(peer_id))
    except ValueError:
        raise CredentialError(
            f"{peer_id!r} is not a libp2p peer id (base58, as `swarmloco swarm identity` prints)"
        ) from None
    return peer_id


@dataclass(frozen=True)
class PeerCredentials:
    """What a peer of a private swarm runs with: its identity, its certificate, and the verifier for everyone else's."""

    identity: Path
    certificate: Path
    verifier: CertificateVerifier
    revocations: Path | None = None  # the signed revocation list it was started with, re-read while it runs

    def certificate_bytes(self) -> bytes:
        """Read the file (a renewal may have replaced it): at start and when the certificate expires, not per request."""
        return _read(self.certificate).strip()

    def revocations_bytes(self) -> bytes | None:
        """The revocation list file as it is now (an authority's newer list may have replaced it), if there is one."""
        return _read(self.revocations).strip() if self.revocations is not None else None

    def dht_authorizer(self) -> CertificateAuthorizer:
        return CertificateAuthorizer(load_identity_key(self.identity), self.certificate_bytes, self.verifier)


def load_credentials(
    identity: Path,
    certificate: Path,
    swarm_id: str,
    *,
    revocations: Path | None = None,
    clock: Callable[[], float] = time.time,
) -> PeerCredentials:
    """Read a peer's credentials and check its own certificate: AccessDenied says what to fix before joining."""
    data = _read(certificate)
    with _about(certificate):
        cert = Certificate.decode(data)  # names the authority to trust; checked below
    signed_list = _read(revocations) if revocations else None
    with _about(revocations):
        verifier = CertificateVerifier(
            decode_public_key(cert.authority), swarm_id, revocations=signed_list, clock=clock
        )
    verifier.check(peer_id_of_identity(identity), data)
    return PeerCredentials(identity=identity, certificate=certificate, verifier=verifier, revocations=revocations)


@contextlib.contextmanager
def _about(path: Path | None) -> Iterator[None]:
    """Name the file in a CredentialError raised while reading it."""
    try:
        yield
    except CredentialError as e:
        raise CredentialError(f"{path}: {e}") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CredentialError(f"{path} does not exist") from None


def _write_new(path: Path, data: bytes, *, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise CredentialError(f"{path} already exists; refusing to overwrite it") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # exact, whatever the umask
        f.write(data)


def _replace(path: Path, data: bytes) -> None:
    """Write atomically: a reader (a running peer) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
