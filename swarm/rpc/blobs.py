"""Named blobs between peers: a small service over hivemind P2P that streams a blob in hash-checked chunks.

A stream is a header (the size, or the error reply), chunks of at most ``CHUNK_BYTES`` and a SHA-256 trailer;
``BlobServicer`` serves what providers registered by name prefix make (bytes or a ``BlobStream``), and
``BlobClient`` bounds, hashes and hands the chunks to a ``Sink`` (``stream``) or one buffer (``fetch``).
More: docs/architecture.md, rpc/.

    >>> data = await BlobClient(p2p, namespace=cfg.swarm_id).fetch(peer, "state/2", timeout=30, max_bytes=1 << 30)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 (hivemind reads stream handlers from typing's AsyncIterator only)

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from swarm.rpc.auth import CertificateVerifier
from swarm.rpc.defences import PeerGuard, PeerLimits
from swarm.rpc.servicer import TRANSPORT_ERRORS, GuardedServicer, RequestError, pack_envelope, remote_error

logger = logging.getLogger(__name__)

CHUNK_BYTES = MAX_UNARY_PAYLOAD_SIZE // 2  # one stream message
BLOB_NAME = re.compile(r"\w[\w.-]{0,63}(/\w[\w.-]{0,63}){0,5}")  # e.g. "state/2", "outer/1/7/payload/12D3KooW…"
MAX_REQUEST_BYTES = 16 << 10  # a name and a certificate


class TransferError(Exception):
    """A blob did not arrive whole: the peer refused, vanished, timed out, or sent bytes that do not match."""


class StreamCut(TransferError):
    """The stream ended early: before its header, part way through the blob, or before its trailer."""


@dataclass(frozen=True, kw_only=True)
class BlobStream:
    """A blob made as it is sent: ``size`` bytes in all, from ``chunks`` (any sizes; the service splits them into
    messages). ``chunks`` may stop early by raising: the client then sees a truncated blob. ``on_sent`` hears
    the SHA-256 (hex) of a blob sent whole."""

    size: int
    chunks: AsyncIterator[bytes]
    on_sent: Callable[[str], None] = field(default=lambda sha256: None)

    @classmethod
    def of(cls, data: bytes) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            yield data

        return cls(size=len(data), chunks=chunks())


Provider = Callable[
    [str], Awaitable["bytes | BlobStream"]
]  # full blob name → blob; raises LookupError if there is none


class Sink(Protocol):
    """Where a streamed blob goes, chunk by chunk; ValueError from either method refuses the blob."""

    def open(self, size: int) -> None:
        """The blob's announced size (already within the client's ``max_bytes``), before its first byte."""

    def write(self, chunk: bytes) -> None:
        """The next bytes, in order. Nothing may use them before the stream's hash is checked (``stream`` returns)."""


class BufferSink:
    """Collects a blob in one buffer of its announced size: no second copy while it arrives."""

    def __init__(self) -> None:
        self.data = bytearray()
        self._filled = 0

    def open(self, size: int) -> None:
        self.data = bytearray(size)

    def write(self, chunk: bytes) -> None:
        self.data[self._filled : self._filled + len(chunk)] = chunk
        self._filled += len(chunk)


async def feed(blob: bytes | BlobStream, sink: Sink) -> str:
    """Pass a provider's blob into ``sink`` in-process, as a transfer would; returns its SHA-256 (hex)."""
    blob = blob if isinstance(blob, BlobStream) else BlobStream.of(blob)
    digest, fed = hashlib.sha256(), 0
    sink.open(blob.size)
    async for chunk in blob.chunks:
        digest.update(chunk)
        fed += len(chunk)
        sink.write(chunk)
    if fed != blob.size:
        raise TransferError(f"a blob of {blob.size} bytes made {fed}")
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """What one identity may take of a peer's blob service, whatever it asks: streams open at once, and per name prefix
    a budget of each blob (a whole stage's state for ``state/<i>``: the bytes are bounded through the count). A peer over
    either is told busy (no strike: it may be a joiner chasing a stage whose rounds cut its downloads). A stream this
    servicer cuts itself (the state changed while it was sent) gives its blob back to the budget."""

    # an outer round fetches one payload per member at a time, per stage: a full peer holds every stage (2 limited
    # full peers' rounds of 3 stages, which then failed); a joiner downloads one state
    streams_per_peer: int = 16
    # per prefix: (times each blob at once, seconds to earn one more). A joiner needs a stage's state once, two or three
    # times if rounds cut it; a peer re-downloading a 0.5 GB stage state every few seconds took 16 GB in 200 s (issue
    # 42), now at most 4 + 200/60 states of each stage
    budgets: tuple[tuple[str, float, float], ...] = (("state", 4.0, 60.0),)

    def __post_init__(self) -> None:
        if self.streams_per_peer < 1 or any(burst < 1 or every_s <= 0 for _, burst, every_s in self.budgets):
            raise ValueError(f"serving limits: at least one stream and one blob per budget, got {self}")


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
        serving: ServingLimits | None = None,
        wait_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(label="blob service", verifier=verifier, limits=limits, clock=clock)
        self.providers: dict[str, Provider] = {}
        self.wait_s = wait_s
        self.served_bytes = 0
        self.serving = serving or ServingLimits()
        self._open: Counter[PeerID] = Counter()  # streams open per peer
        # a token bucket of blobs per peer, per budgeted prefix (PeerGuard's, counting blobs instead of requests)
        self._budgets = {
            prefix: PeerGuard(PeerLimits(rate=1.0 / every_s, burst=burst), clock=clock)
            for prefix, burst, every_s in self.serving.budgets
        }
        self.busy_refusals = 0  # requests refused for the serving limits

    def provide(self, prefix: str, provider: Provider) -> None:
        self.providers[prefix] = provider

    async def rpc_blob(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = context.remote_id
        try:
            self.screen(peer)
            name = self.open_request(peer, request.metadata, BlobRequest, max_bytes=MAX_REQUEST_BYTES).name
            give_back = self._admit(peer, name)
            self._open[peer] += 1
        except Exception as e:  # every failure becomes the error header; refuse() tells the sender's faults from ours
            yield runtime_pb2.ExpertResponse(metadata=self.refuse(e, peer))
            return
        try:
            try:
                blob = await self._lookup(name)
            except Exception as e:
                give_back()  # nothing was sent
                yield runtime_pb2.ExpertResponse(metadata=self.refuse(e, peer))
                return
            blob = blob if isinstance(blob, BlobStream) else BlobStream.of(blob)
            yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"size": blob.size}))
            digest, sent = hashlib.sha256(), 0
            try:
                async for chunk in blob.chunks:
                    for start in range(0, len(chunk), CHUNK_BYTES):
                        # bytes for protobuf: a relayed blob is the bytearray it arrived in (``fetch``), which protobuf
                        # refuses, and the stream would end after its header
                        piece = bytes(chunk[start : start + CHUNK_BYTES])
                        digest.update(piece)
                        sent += len(piece)
                        yield runtime_pb2.ExpertResponse(metadata=piece)
            except Exception as e:  # the blob changed or vanished while it was sent: the client sees it truncated
                logger.info(f"blob {name} to {peer}: stopped after {sent} of {blob.size} bytes: {e}")
                give_back()  # our cut, not the peer's doing
                return
            if sent != blob.size:
                logger.error(f"blob {name}: made {sent} bytes, announced {blob.size}; not finishing it")
                return
            yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"sha256": digest.digest()}))
            self.served_bytes += sent
            blob.on_sent(digest.hexdigest())
        finally:
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]

    def _admit(self, peer: PeerID, name: str) -> Callable[[], None]:
        """Refuse (busy) a peer over its streams or its budget for ``name``; else charge the budget, and return what
        gives the charge back."""
        if self._open[peer] >= self.serving.streams_per_peer:
            self.busy_refusals += 1
            raise RequestError(
                RequestError.BUSY, f"peer {peer} holds {self._open[peer]} blob streams open, the most one peer may"
            )
        budget, key = self._budgets.get(name.split("/", 1)[0]), (peer, name)  # per blob: a full peer takes every stage
        if budget is None:
            return lambda: None
        if not budget.take(key):
            self.busy_refusals += 1
            limits = budget.limits
            raise RequestError(
                RequestError.BUSY,
                f"peer {peer} took {name} {limits.burst:g} times; once more every {1 / limits.rate:.0f} s",
            )
        return lambda: budget.refund(key)

    async def _lookup(self, name: str) -> bytes | BlobStream:
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

    async def fetch(self, peer: str | PeerID, name: str, *, timeout: float, max_bytes: int) -> bytearray:
        """The blob, whole and hash-checked, within ``timeout`` seconds; else ``TransferError``. (A ``bytearray``:
        the buffer it arrived in.)

        A stream that ends early is asked for once more within the same ``timeout``: on loopback, between two
        healthy peers, an outer round's commit stream ended before its header in 2 of 9 8M-token runs
        (docs/benchmarks.md), and without a second ask that round failed and struck an honest leader.
        """
        deadline = time.monotonic() + timeout
        try:
            return await self._fetch_once(peer, name, timeout, max_bytes)
        except StreamCut as e:
            if time.monotonic() >= deadline:
                raise
            logger.info(f"{e}; asking again")
        return await self._fetch_once(peer, name, deadline - time.monotonic(), max_bytes)

    async def _fetch_once(self, peer: str | PeerID, name: str, timeout: float, max_bytes: int) -> bytearray:
        sink = BufferSink()
        await self.stream(peer, name, sink, timeout=timeout, max_bytes=max_bytes)
        return sink.data

    async def stream(self, peer: str | PeerID, name: str, sink: Sink, *, timeout: float, max_bytes: int) -> str:
        """Feed the blob to ``sink`` as it arrives; returns its SHA-256 (hex) once it has arrived whole and
        hash-checked within ``timeout`` seconds. ``TransferError`` if it did not; ``sink``'s ValueError as is."""
        peer = PeerID.from_base58(peer) if isinstance(peer, str) else peer
        request = pack_envelope(BlobRequest(name=name), self.certificate())
        try:
            size, sha256 = await asyncio.wait_for(self._read(peer, request, sink, max_bytes), timeout)
        except TimeoutError:
            raise TransferError(f"{name} from {peer}: no whole blob within {timeout:.1f}s") from None
        except TRANSPORT_ERRORS as e:
            raise TransferError(f"{name} from {peer}: {type(e).__name__}: {e}") from None
        self.received_bytes += size
        return sha256

    async def _read(self, peer: PeerID, request: bytes, sink: Sink, max_bytes: int) -> tuple[int, str]:
        stream = await BlobServicer.get_stub(self.p2p, peer, namespace=self.namespace).rpc_blob(
            runtime_pb2.ExpertRequest(metadata=request)
        )
        try:
            header = _control(peer, await anext(stream, None), "header")
            if (refusal := remote_error(header)) is not None:
                raise TransferError(f"{peer} refused: {refusal}")
            size = header.get("size")
            if not (isinstance(size, int) and 0 <= size <= max_bytes):
                raise TransferError(f"{peer} announced a blob of {size!r} bytes; at most {max_bytes} are accepted")
            sink.open(size)
            digest, received = hashlib.sha256(), 0
            while received < size:
                message = await anext(stream, None)
                if message is None:
                    raise StreamCut(
                        f"blob from {peer} does not match its header: it ended after {received} of {size} bytes"
                    )
                chunk = message.metadata
                received += len(chunk)
                if received > size:  # stop reading: never take more than announced
                    raise TransferError(f"blob from {peer} does not match its header: over {size} bytes")
                digest.update(chunk)
                sink.write(chunk)
            trailer = _control(peer, await anext(stream, None), "trailer")
            if trailer.get("sha256") != digest.digest():
                raise TransferError(f"blob from {peer} does not match its header: {size} bytes, hash mismatch")
            return size, digest.hexdigest()
        finally:
            await stream.aclose()


def _control(peer: PeerID, message: runtime_pb2.ExpertResponse | None, what: str) -> dict[str, Any]:
    """A blob stream's header or trailer: a small map; TransferError if it is missing or unreadable."""
    if message is None:
        raise StreamCut(f"{peer} ended the stream before its {what}")
    try:
        value = msgpack.unpackb(message.metadata, raw=False, max_bin_len=64, max_str_len=4096)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise TransferError(f"unreadable {what} from {peer}: {e!r}") from None
    if not isinstance(value, dict):
        raise TransferError(f"{peer} sent a {what} that is not a map: {value!r:.80}")
    return value
