"""A peer's libp2p identity: the RSA key behind its peer id, which also signs every record it stores in the DHT.

Signing records with that same key binds each record to the peer id it names (``OwnerBindingValidator``):
a reader derives the id from the record's owner key (``peer_from_subkey``) instead of trusting the id in front
of it. Why and how: docs/architecture.md, dht/.

    >>> with identity_file(None) as (path, new): identity_peer_id(load_identity_key(path))  # the DHT's peer id
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.rpc.auth import CredentialError, peer_id_of_public_key

__all__ = [
    "OWNER_MARKER",
    "IdentityKey",
    "OwnerBindingValidator",
    "identity_file",
    "identity_peer_id",
    "load_identity_key",
    "peer_from_subkey",
]
OWNER_MARKER = b"[owner:"  # subkey = peer id + this + the owner's public key + "]" (hivemind's format)


class IdentityKey(RSAPrivateKey):
    """hivemind's RSA key type around an existing libp2p identity key (``RSAPrivateKey()`` makes a new one)."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._private_key = private_key


def load_identity_key(path: Path | str) -> IdentityKey:
    """The key of a libp2p identity file, or a CredentialError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            raise ValueError(f"key type {crypto_pb2.KeyType.Name(proto.key_type)}, hivemind signs with RSA")
        key = serialization.load_der_private_key(proto.data, password=None)
    except FileNotFoundError:
        raise CredentialError(f"{path} does not exist") from None
    except (DecodeError, ValueError) as e:
        raise CredentialError(f"{path} is not a libp2p identity file: {e}") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise CredentialError(f"{path} holds a {type(key).__name__}, expected an RSA key")
    return IdentityKey(key)


def identity_peer_id(key: RSAPrivateKey) -> str:
    """The peer id (base58) that libp2p derives from this key."""
    return peer_id_of_public_key(key.get_public_key().to_bytes())


@contextlib.contextmanager
def identity_file(identity_path: Path | str | None) -> Iterator[tuple[Path, bool]]:
    """(the identity file to start the daemon with, whether it is new): ``identity_path`` (created if missing, as
    hivemind does), or a new file in a private temporary directory removed on exit. The daemon reads it once, at
    start: keep the block open until the DHT is up."""
    if identity_path is not None:
        path = Path(identity_path)
        if path.exists():
            yield path, False
        else:
            P2P.generate_identity(str(path))  # FileNotFoundError names a missing directory
            yield path, True
        return
    folder = Path(tempfile.mkdtemp(prefix="swarmloco-identity-"))  # mode 0700: the key stays private
    try:
        path = folder / "peer.id"
        P2P.generate_identity(str(path))
        yield path, True
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def peer_from_subkey(subkey: bytes) -> PeerID | None:
    """The peer id of the subkey's owner key, if the subkey names that id in front of it; else None (forged or malformed)."""
    head, marker, tail = subkey.partition(OWNER_MARKER)
    if not marker or not tail.endswith(b"]"):
        return None
    owner = _peer_id_of_owner(tail[:-1])
    return PeerID.from_base58(owner) if owner is not None and head == owner.encode() else None


@functools.lru_cache(maxsize=4096)  # every read parses every replica's key again
def _peer_id_of_owner(public_key: bytes) -> str | None:
    try:
        return peer_id_of_public_key(public_key)
    except ValueError:
        return None


class OwnerBindingValidator(RecordValidatorBase):
    """Refuses a signed record whose subkey names a peer id other than its owner key's.

    hivemind's ``RSASignatureValidator`` proves who signed a record, not that the peer id written
    beside the key is the signer's; this closes that gap on every DHT node that stores or returns
    the record. Records without an owner marker are left to the other validators.
    """

    def validate(self, record: DHTRecord) -> bool:
        if OWNER_MARKER not in record.subkey:
            return True
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
        except Exception:  # msgpack raises several types for garbage
            return False
        return isinstance(subkey, bytes) and peer_from_subkey(subkey) is not None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerBindingValidator)  # one is enough per DHT node
