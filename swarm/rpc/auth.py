"""Private swarms: membership certificates, revocation lists, and the checks that enforce them.

A ``Certificate`` ("peer P may take part in swarm S until time T") and a ``RevocationList`` are signed by the
swarm's authority (an offline Ed25519 key); ``CertificateVerifier`` checks one against the peer libp2p
authenticated (every RPC) and ``CertificateAuthorizer`` in the DHT. Format and reasons: docs/architecture.md, rpc/.

    >>> CertificateVerifier(authority_public_key, cfg.swarm_id).check(context.remote_id, certificate)  # or AccessDenied
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import multihash
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1  # of certificates and revocation lists; bumped on any incompatible change
CERTIFICATE_FIELD = "cert"  # key of the certificate bytes in an RPC request's metadata
MAX_DOCUMENT_BYTES = 1 << 20  # a certificate is ~310 bytes; a revocation list grows ~60 bytes per peer
INVITE_HINT = "ask the swarm's authority for a new certificate (`swarmloco swarm invite --peer-id {peer}`) and pass it with --credentials"

Reason = Literal["missing", "malformed", "wrong_swarm", "wrong_peer", "wrong_authority", "forged", "expired", "revoked"]


class CredentialError(ValueError):
    """A key, certificate or revocation list that cannot be used (malformed, forged, misplaced)."""


class AccessDenied(PermissionError):
    """A peer may not take part in this swarm; ``reason`` says why, the message says what to do."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode_public_key(key: Ed25519PublicKey) -> str:
    """The 32 raw key bytes in base64: how certificates and ``authority.pub`` name an authority."""
    return base64.b64encode(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def decode_public_key(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text.strip(), validate=True))
    except ValueError as e:
        raise CredentialError(f"not an Ed25519 public key (base64 of 32 bytes): {text[:60]!r}") from e


@functools.lru_cache(maxsize=4096)
def peer_id_of_public_key(public_key: bytes) -> str:
    """libp2p peer id (base58) of a hivemind ``RSAPublicKey.to_bytes()``: sha256 multihash of its protobuf."""
    try:
        key = serialization.load_ssh_public_key(public_key)
    except UnsupportedAlgorithm as e:
        raise ValueError(str(e)) from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError(f"expected an RSA public key, got {type(key).__name__}")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    peer_id: str = PeerID(multihash.encode(hashlib.sha256(encoded).digest(), "sha2-256")).to_base58()
    return peer_id


def format_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class _Signed:
    """A decoded signed document: its fields, and the signature over their canonical form."""

    fields: dict[str, Any]
    signature: bytes

    @staticmethod
    def seal(kind: str, fields: dict[str, Any], key: Ed25519PrivateKey) -> bytes:
        fields = {**fields, "kind": kind, "v": FORMAT_VERSION}
        return _canonical({**fields, "sig": base64.b64encode(key.sign(_canonical(fields))).decode()})

    @classmethod
    def open(cls, data: bytes, kind: str) -> _Signed:
        """Parse without verifying; ValueError names what is wrong."""
        data = data.strip()  # the newline of a file, or one an editor added
        if len(data) > MAX_DOCUMENT_BYTES:
            raise ValueError(f"{len(data)} bytes, more than any {kind} has")
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(fields, dict) or fields.get("kind") != kind:
            raise ValueError(f"not a {kind}")
        if fields.get("v") != FORMAT_VERSION:
            raise ValueError(
                f"{kind} format v{fields.get('v')}, this swarmloco reads v{FORMAT_VERSION}: upgrade the older side"
            )
        signature = fields.pop("sig", None)
        if not isinstance(signature, str):
            raise ValueError("no signature")
        if _canonical({**fields, "sig": signature}) != data:  # one encoding per document: any altered byte is refused
            raise ValueError("not in canonical form (altered?)")
        return cls(fields, base64.b64decode(signature, validate=True))

    def signed_by(self, key: Ed25519PublicKey) -> bool:
        try:
            key.verify(self.signature, _canonical(self.fields))
            return True
        except InvalidSignature:
            return False

    def get(self, name: str, kind: type) -> Any:
        value = self.fields.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"field {name!r} must be {kind.__name__}, got {value!r}")
        return value


@dataclass(frozen=True, kw_only=True)
class Certificate:
    authority: str  # the issuer's public key (encode_public_key): a peer's copy tells it whom to trust
    swarm_id: str  # SwarmConfig.swarm_id
    peer_id: str  # libp2p peer id, base58 (PeerID.to_base58())
    issued_at: int  # unix seconds; a revocation voids certificates issued up to its time
    expires_at: int  # unix seconds

    KIND = "certificate"

    def __post_init__(self) -> None:
        if self.expires_at <= self.issued_at:
            raise CredentialError(f"certificate expires ({self.expires_at}) before it is issued ({self.issued_at})")

    def sign(self, authority: Ed25519PrivateKey) -> bytes:
        if encode_public_key(authority.public_key()) != self.authority:
            raise CredentialError("the signing key is not the certificate's authority")
        fields = {
            "authority": self.authority,
            "swarm": self.swarm_id,
            "peer": self.peer_id,
            "issued": self.issued_at,
            "expires": self.expires_at,
        }
        return _Signed.seal(self.KIND, fields, authority)

    @classmethod
    def from_signed(cls, signed: _Signed) -> Certificate:
        return cls(
            authority=signed.get("authority", str),
            swarm_id=signed.get("swarm", str),
            peer_id=signed.get("peer", str),
            issued_at=signed.get("issued", int),
            expires_at=signed.get("expires", int),
        )

    @classmethod
    def decode(cls, data: bytes) -> Certificate:
        """Read a certificate WITHOUT checking its signature (use CertificateVerifier.check for that)."""
        try:
            return cls.from_signed(_Signed.open(data, cls.KIND))
        except ValueError as e:
            raise CredentialError(f"not a valid swarmloco certificate: {e}") from None


@dataclass(frozen=True, kw_only=True)
class RevocationList:
    swarm_id: str
    sequence: int = 0  # grows with every change: a peer keeps the newest list it has seen
    # peer id -> unix time; its certificates issued up to then are void
    revoked: dict[str, int] = field(default_factory=dict)

    KIND = "revocations"

    def revoke(self, peer_id: str, at: int) -> RevocationList:
        return RevocationList(swarm_id=self.swarm_id, sequence=self.sequence + 1, revoked={**self.revoked, peer_id: at})

    def revoked_at(self, cert: Certificate) -> int | None:
        at = self.revoked.get(cert.peer_id)
        return at if at is not None and cert.issued_at <= at else None

    def sign(self, authority: Ed25519PrivateKey) -> bytes:
        return _Signed.seal(
            self.KIND, {"swarm": self.swarm_id, "seq": self.sequence, "revoked": self.revoked}, authority
        )

    @classmethod
    def verify(cls, data: bytes, authority: Ed25519PublicKey, swarm_id: str) -> RevocationList:
        """The list in ``data`` if the authority signed it for this swarm, else CredentialError."""
        try:
            signed = _Signed.open(data, cls.KIND)
            revoked = signed.get("revoked", dict)
            if not all(isinstance(at, int) and not isinstance(at, bool) for at in revoked.values()):
                raise ValueError("revocation times must be integers")
            result = cls(swarm_id=signed.get("swarm", str), sequence=signed.get("seq", int), revoked=revoked)
        except ValueError as e:
            raise CredentialError(f"not a valid revocation list: {e}") from None
        if not signed.signed_by(authority):
            raise CredentialError(
                "revocation list is not signed by this swarm's authority (forged or from another swarm); ignore it"
            )
        if result.swarm_id != swarm_id:
            raise CredentialError(f"revocation list is for swarm {result.swarm_id!r}, not {swarm_id!r}")
        return result


class CertificateVerifier:
    """Decides whether a peer may take part in this private swarm.

    Signature checks are cached per (peer, certificate); expiry and revocation are checked on
    every call, against ``clock`` (unix seconds, injectable for tests).

        >>> verifier.check("QmPeer...", certificate_bytes).expires_at
    """

    def __init__(
        self,
        authority: Ed25519PublicKey,
        swarm_id: str,
        *,
        revocations: bytes | None = None,
        clock: Callable[[], float] = time.time,
        cache_size: int = 4096,
    ) -> None:
        self.authority, self.swarm_id, self.clock, self.cache_size = authority, swarm_id, clock, cache_size
        self._authority_text = encode_public_key(authority)
        self.revocations = RevocationList(swarm_id=swarm_id)
        self._signature_checked: dict[tuple[str, bytes], Certificate] = {}
        if revocations is not None:
            self.update_revocations(revocations)

    def update_revocations(self, signed_list: bytes) -> bool:
        """Adopt a signed revocation list if it is newer than ours; CredentialError if forged."""
        revocations = RevocationList.verify(signed_list, self.authority, self.swarm_id)
        if revocations.sequence <= self.revocations.sequence:
            return False
        self.revocations = revocations
        return True

    def check(self, peer_id: str | PeerID, certificate: bytes | None) -> Certificate:
        """The peer's certificate if it admits ``peer_id`` (as authenticated by libp2p) now, else AccessDenied."""
        peer_id = str(peer_id)
        hint = INVITE_HINT.format(peer=peer_id)
        if not certificate:
            raise AccessDenied("missing", f"peer {peer_id} presented no certificate, and this swarm is private: {hint}")
        cert = self._signature_checked.get((peer_id, certificate)) or self._check_signed(peer_id, certificate, hint)
        now = self.clock()
        if now >= cert.expires_at:
            raise AccessDenied(
                "expired",
                f"the certificate of peer {peer_id} expired at {format_time(cert.expires_at)} "
                f"({(now - cert.expires_at) / 3600:.1f} h ago): {hint}",
            )
        revoked_at = self.revocations.revoked_at(cert)
        if revoked_at is not None:
            raise AccessDenied(
                "revoked",
                f"the swarm's authority revoked peer {peer_id} at {format_time(revoked_at)} "
                f"(revocation list #{self.revocations.sequence}); only a certificate issued "
                f"after that readmits it (`swarmloco swarm invite`)",
            )
        return cert

    def _check_signed(self, peer_id: str, certificate: bytes, hint: str) -> Certificate:
        try:
            signed = _Signed.open(certificate, Certificate.KIND)
            cert = Certificate.from_signed(signed)
        except ValueError as e:
            raise AccessDenied(
                "malformed", f"peer {peer_id} presented something that is not a swarmloco certificate ({e}): {hint}"
            ) from None
        if cert.swarm_id != self.swarm_id:
            raise AccessDenied(
                "wrong_swarm",
                f"peer {peer_id} holds a certificate for swarm {cert.swarm_id!r}, not this swarm "
                f"{self.swarm_id!r} (a different config gives a different swarm): {hint}",
            )
        if cert.peer_id != peer_id:
            raise AccessDenied(
                "wrong_peer",
                f"the certificate shown by peer {peer_id} was issued to peer {cert.peer_id}: run with "
                f"the identity file it was issued for (--identity), or {hint}",
            )
        if cert.authority != self._authority_text:
            raise AccessDenied(
                "wrong_authority",
                f"the certificate of peer {peer_id} comes from authority {cert.authority}, "
                f"not this swarm's ({self._authority_text}): {hint}",
            )
        if not signed.signed_by(self.authority):
            raise AccessDenied(
                "forged",
                f"the certificate of peer {peer_id} does not carry a valid signature of this swarm's "
                f"authority (altered or forged): {hint}",
            )
        if len(self._signature_checked) >= self.cache_size:
            del self._signature_checked[next(iter(self._signature_checked))]  # oldest first
        self._signature_checked[peer_id, certificate] = cert
        return cert


class CertificateAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorizer hook, admitting only peers with a valid certificate.

    hivemind's token scheme attaches an ``AccessToken(username, public_key, expiration_time,
    signature)`` to every request and response and signs the message with the private key the
    token names; the receiver checks the token (``is_token_valid``), that signature, a fresh
    nonce and the time. Here the token's ``signature`` field carries our certificate and the
    signing key is our libp2p identity key, so the token's public key hashes to the sender's
    peer id, and ``is_token_valid`` checks the certificate was issued to exactly that peer: a
    copied certificate is useless without its identity file. Requests that fail are dropped (the
    DHT call fails for the sender); responses that fail are ignored.

    ``load_certificate`` is called again when our certificate expires, so a renewed certificate
    written over the old file is picked up without a restart.

        >>> DHT(identity_path="peer.id", authorizer=CertificateAuthorizer(key, path.read_bytes, verifier), start=True)
    """

    def __init__(
        self, identity: RSAPrivateKey, load_certificate: Callable[[], bytes], verifier: CertificateVerifier
    ) -> None:
        super().__init__(identity)
        self.peer_id = peer_id_of_public_key(self.local_public_key.to_bytes())
        self._load_certificate, self._verifier = load_certificate, verifier
        # a peer learns of its own bad certificate here, not from silence
        verifier.check(self.peer_id, load_certificate())

    async def get_token(self) -> AccessToken:
        certificate = self._load_certificate()
        cert = self._verifier.check(self.peer_id, certificate)
        return AccessToken(
            username=self.peer_id,
            public_key=self.local_public_key.to_bytes(),
            expiration_time=str(cert.expires_at),
            signature=certificate,
        )

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            self._verifier.check(peer_id_of_public_key(access_token.public_key), access_token.signature)
            return True
        except AccessDenied as e:
            logger.debug(f"DHT access denied: {e}")
        except ValueError as e:  # the public key is not an RSA key
            logger.debug(f"DHT access denied, unreadable token: {e}")
        return False

    def update_revocations(self, signed_list: bytes) -> bool:
        """Adopt a newer signed revocation list (the DHT process holds its own copy of the verifier)."""
        return self._verifier.update_revocations(signed_list)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return self._verifier.clock() >= int(access_token.expiration_time)
