"""Named blobs between peers: a small service over hivemind P2P that streams a blob in hash-checked chunks.

A peer asks another for a named blob (``state/2``, ``outer/2/17/payload/<peer>``, …) and gets a
stream whose first message is a header (size and SHA-256, or the error reply of
``swarm/rpc/servicer.py``) and the rest raw chunks. The client bounds the size before it reads,
stops at the first byte too many, and checks the hash, so a truncated, corrupted or oversized
transfer raises ``TransferError`` and the caller tries another peer. The service has the defences
of every service (``GuardedServicer``): rate limit, ban after invalid requests, certificate check.

What is served comes from providers registered by name prefix: a stage's state
(``swarm/outer/transfer.py``), the outer step's payloads and commits (``swarm/outer/rounds.py``).

    >>> blobs = BlobServicer(verifier=creds.verifier); blobs.provide("state", lambda name: replica.export_state())
    >>> await blobs.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> data = await BlobClient(p2p, namespace=cfg.swarm_id).fetch(peer, "state/2", timeout=30, max_bytes=1 << 30)
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 (hivemind reads stream handlers from typing's AsyncIterator only)

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from swarm.rpc.auth import CertificateVerifier
from swarm.rpc.defences import PeerLimits
from swarm.rpc.servicer import TRANSPORT_ERRORS, GuardedServicer, RequestError, pack_envelope, remote_error

CHUNK_BYTES = MAX_UNARY_PAYLOAD_SIZE // 2  # one stream message
BLOB_NAME = re.compile(r"\w[\w.-]{0,63}(/\w[\w.-]{0,63}){0,5}")  # e.g. "state/2", "outer/1/7/payload/12D3KooW…"
MAX_REQUEST_BYTES = 16 << 10  # a name and a certificate
Provider = Callable[[str], Awaitable[bytes]]  # full blob name → blob; raises LookupError if there is none


class TransferError(Exception):
    """A blob did not arrive whole: the peer refused, vanished, timed out, or sent bytes that do not match."""


@dataclass(frozen=True, kw_only=True)
class BlobRequest:
    name: str  # matches BLOB_NAME; the part before the first '/' picks the provider


class BlobServicer(GuardedServicer):
    """Serves named blobs from providers registered by name prefix (the part before the first '/').

    ``verifier`` makes it private: every request must carry a certificate admitting its sender.
    ``limits`` set the per-peer rate limit and ban policy; a provider gets ``wait_s`` to deliver.
    """

    def __init__(
        self,
        *,
        verifier: CertificateVerifier | None = None,
        limits: PeerLimits | None = None,
        wait_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(label="blob service", verifier=verifier, limits=limits, clock=clock)
        self.providers: dict[str, Provider] = {}
        self.wait_s = wait_s
        self.served_bytes = 0

    def provide(self, prefix: str, provider: Provider) -> None:
        self.providers[prefix] = provider

    async def rpc_blob(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = context.remote_id
        try:
            self.screen(peer)
            data = await self._lookup(
                self.open_request(peer, request.metadata, BlobRequest, max_bytes=MAX_REQUEST_BYTES).name
            )
        except Exception as e:  # every failure becomes the error header; refuse() tells the sender's faults from ours
            yield runtime_pb2.ExpertResponse(metadata=self.refuse(e, peer))
            return
        yield runtime_pb2.ExpertResponse(
            metadata=msgpack.packb({"size": len(data), "sha256": hashlib.sha256(data).digest()})
        )
        for start in range(0, len(data), CHUNK_BYTES):
            yield runtime_pb2.ExpertResponse(metadata=data[start : start + CHUNK_BYTES])
        self.served_bytes += len(data)

    async def _lookup(self, name: str) -> bytes:
        if not BLOB_NAME.fullmatch(name):
            raise RequestError(RequestError.INVALID, f"blob name {name[:80]!r} must match {BLOB_NAME.pattern}")
        prefix = name.split("/", 1)[0]
        provider = self.providers.get(prefix)
        if provider is None:
            raise RequestError(RequestError.NOT_FOUND, f"no blob {name!r} here: nothing is served under {prefix!r}")
        try:
            return await asyncio.wait_for(provider(name), self.wait_s)
        except LookupError as e:
            raise RequestError(RequestError.NOT_FOUND, f"no blob {name!r} here: {e}") from None
        except TimeoutError:
            raise RequestError(RequestError.NOT_FOUND, f"no blob {name!r} here within {self.wait_s:g} s") from None


class BlobClient:
    """Fetches blobs from other peers' ``BlobServicer``; ``certificate`` (private swarms) goes with every request."""

    def __init__(self, p2p: P2P, *, namespace: str, certificate: Callable[[], bytes | None] = lambda: None) -> None:
        self.p2p, self.namespace, self.certificate = p2p, namespace, certificate
        self.received_bytes = 0

    async def fetch(self, peer: str | PeerID, name: str, *, timeout: float, max_bytes: int) -> bytes:
        """The blob, whole and hash-checked, within ``timeout`` seconds; else ``TransferError``."""
        peer = PeerID.from_base58(peer) if isinstance(peer, str) else peer
        request = pack_envelope(BlobRequest(name=name), self.certificate())
        try:
            data = await asyncio.wait_for(self._read(peer, request, max_bytes), timeout)
        except TimeoutError:
            raise TransferError(f"{name} from {peer}: no whole blob within {timeout:.1f}s") from None
        except TRANSPORT_ERRORS as e:
            raise TransferError(f"{name} from {peer}: {type(e).__name__}: {e}") from None
        self.received_bytes += len(data)
        return data

    async def _read(self, peer: PeerID, request: bytes, max_bytes: int) -> bytes:
        stream = await BlobServicer.get_stub(self.p2p, peer, namespace=self.namespace).rpc_blob(
            runtime_pb2.ExpertRequest(metadata=request)
        )
        try:
            header = msgpack.unpackb((await anext(stream)).metadata, raw=False, max_bin_len=64, max_str_len=4096)
        except (StopAsyncIteration, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise TransferError(f"unreadable header from {peer}: {e!r}") from None
        if (refusal := remote_error(header)) is not None:
            raise TransferError(f"{peer} refused: {refusal}")
        if not isinstance(header, dict):
            raise TransferError(f"{peer} sent a header that is not a map: {header!r:.80}")
        size, digest = header.get("size"), header.get("sha256")
        if not (isinstance(size, int) and 0 <= size <= max_bytes and isinstance(digest, bytes)):
            raise TransferError(f"{peer} announced a blob of {size!r} bytes; at most {max_bytes} are accepted")
        parts, received = [], 0
        async for message in stream:
            received += len(message.metadata)
            if received > size:  # stop reading: never buffer more than announced
                break
            parts.append(message.metadata)
        data = b"".join(parts)
        if received != size or hashlib.sha256(data).digest() != digest:
            raise TransferError(
                f"blob from {peer} does not match its header: {received} of {size} bytes, hash "
                f"{'ok' if hashlib.sha256(data).digest() == digest else 'mismatch'}"
            )
        return data
