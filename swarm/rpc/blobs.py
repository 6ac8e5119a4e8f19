"""Named blobs between peers: a small service over hivemind P2P that streams a blob in hash-checked chunks.

A stream is a header (the size, or the error reply), chunks of at most ``CHUNK_BYTES`` and a SHA-256 trailer;
``BlobServicer`` serves what providers registered by name prefix make (bytes or a ``BlobStream``), and
``BlobClient`` bounds, hashes and hands the chunks to a ``Sink`` (``stream``) or one buffer (``fetch``).
More: docs/architecture.md, rpc/.

    >>> data = await BlobClient(p2p, namespace=cfg.swarm_id).fetch(peer, "state/2", timeout=30, max_bytes=1 << 30)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 (hivemind reads stream handlers from typing's AsyncIterator only)

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from swarm.rpc.auth import CertificateVerifier
from swarm.rpc.defences import STATE_PREFIXES, PeerGuard, PeerLimits, ServingLimits
from swarm.rpc.servicer import TRANSPORT_ERRORS, GuardedServicer, RequestError, linger, pack_envelope, remote_error

logger = logging.getLogger(__name__)

CHUNK_BYTES = MAX_UNARY_PAYLOAD_SIZE // 2  # one stream message
BLOB_NAME = re.compile(r"\w[\w.-]{0,63}(/\w[\w.-]{0,63}){0,5}")  # e.g. "state/2", "outer/1/7/payload/12D3KooW…"
MAX_REQUEST_BYTES = 16 << 10  # a name and a certificate
UPLINK_BLOB_BYTES = 4 * CHUNK_BYTES  # a blob that measures the uplink: long enough to be more than one burst of it
UPLINK_SAMPLES = 16  # the fastest of the last this many such blobs measures it


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
    # False: it costs its receiver no budget (``ServingLimits``): a state served ahead of its holder's own record,
    # which the receiver refuses (``RecordBehind``), is the holder's doing, not the receiver's
    charged: bool = True

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
class BlobRequest:
    name: str  # matches BLOB_NAME; the part before the first '/' picks the provider


@dataclass
class _Ticket:
    """What admitting one blob request charged its peer, so that what it did not take can be given back."""

    give_back: Callable[[], None]  # the blob's place in its budget (``ServingLimits.budgets``)
    state: bool  # a stage's state: one of the peer's state streams, and its bytes counted
    reserved: int = 0  # bytes charged when the header went out
    sent: int = 0


class BlobServicer(GuardedServicer):
    """Serves named blobs from providers registered by name prefix (the part before the first '/').

    ``verifier`` makes it private: every request must carry a certificate admitting its sender.
    ``limits`` set the per-peer rate limit and ban policy, ``serving`` what one peer may take (``ServingLimits``:
    streams, times per blob, state bytes); a provider gets ``wait_s`` to deliver. ``counters``: refusals by bound
    (``refused_streams``, ``refused_state_streams``, ``refused_budget``, ``refused_bytes``) and ``uncharged`` (states
    served ahead of the holder's record, ``BlobStream.charged``).
    """

    def __init__(
        self,
        *,
        verifier: CertificateVerifier | None = None,
        limits: PeerLimits | None = None,
        serving: ServingLimits | None = None,
        wait_s: float = 60.0,
        linger_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(label="blob service", verifier=verifier, limits=limits, clock=clock)
        self.providers: dict[str, Provider] = {}
        # after a blob's trailer, its stream stays open until the client (which stops at the trailer) closes it, at most
        # this long (``servicer.linger``): closed from here, the daemon may reset it under the trailer still unsent
        self.wait_s, self.linger_s, self.clock = wait_s, linger_s, clock
        self.served_bytes = 0
        self.serving = serving or ServingLimits()
        self._open: Counter[PeerID] = Counter()  # streams open per peer
        self._open_states: Counter[PeerID] = Counter()  # of them, stage states
        # a token bucket of blobs per peer, per budgeted prefix (PeerGuard's, counting blobs instead of requests)
        self._budgets = {
            prefix: PeerGuard(PeerLimits(rate=1.0 / every_s, burst=burst), clock=clock)
            for prefix, burst, every_s in self.serving.budgets
        }
        state_bytes = self.serving.state_bytes()
        self._bytes = None if state_bytes is None else PeerGuard(state_bytes, clock=clock)  # state bytes per peer
        self._rates: deque[float] = deque(maxlen=UPLINK_SAMPLES)  # bytes/s of the last blobs sent whole
        self.uplink = (
            self.serving.upload_bytes_per_s
        )  # this holder's upload, as far as it knows: the bytes' share of it
        self.busy_refusals = 0  # requests refused for the serving limits
        self.counters: Counter[str] = Counter()

    def provide(self, prefix: str, provider: Provider) -> None:
        self.providers[prefix] = provider

    def bytes_left(self, peer: PeerID) -> float | None:
        """What ``peer`` may still take of state bytes now (below zero: a debt); None without a byte bound."""
        return None if self._bytes is None else self._bytes.tokens(peer)

    async def rpc_blob(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = context.remote_id
        try:
            self.screen(peer)
            name = self.open_request(peer, request.metadata, BlobRequest, max_bytes=MAX_REQUEST_BYTES).name
            ticket = self._admit(peer, name)
        except Exception as e:  # every failure becomes the error header; refuse() tells the sender's faults from ours
            yield runtime_pb2.ExpertResponse(metadata=self.refuse(e, peer))
            return
        self._open[peer] += 1
        self._open_states[peer] += ticket.state
        try:
            async with contextlib.aclosing(self._serve(peer, name, ticket)) as messages:  # settled when the peer leaves
                async for message in messages:
                    yield message
        finally:
            for table, held in ((self._open, 1), (self._open_states, int(ticket.state))):
                table[peer] -= held
                if not table[peer]:
                    del table[peer]

    async def _serve(
        self, peer: PeerID, name: str, ticket: _Ticket
    ) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
        """An admitted request's header, chunks and trailer (or its error header), charged as ``ServingLimits`` says."""
        try:
            blob = await self._lookup(name)
            blob = blob if isinstance(blob, BlobStream) else BlobStream.of(blob)
            self._reserve(peer, ticket, blob)
        except Exception as e:
            ticket.give_back()  # nothing was sent
            yield runtime_pb2.ExpertResponse(metadata=self.refuse(e, peer))
            return
        cut = False  # by this side (the blob changed or came short): the peer pays nothing; else what was sent
        try:
            yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"size": blob.size}))
            digest, started = hashlib.sha256(), self.clock()
            try:
                async for chunk in blob.chunks:
                    for start in range(0, len(chunk), CHUNK_BYTES):
                        # bytes for protobuf: a relayed blob is the bytearray it arrived in (``fetch``), which protobuf
                        # refuses, and the stream would end after its header
                        piece = bytes(chunk[start : start + CHUNK_BYTES])
                        digest.update(piece)
                        ticket.sent += len(piece)
                        yield runtime_pb2.ExpertResponse(metadata=piece)
            except Exception as e:  # the blob changed or vanished while it was sent: the client sees it truncated
                logger.info(f"blob {name} to {peer}: stopped after {ticket.sent} of {blob.size} bytes: {e}")
                cut = True
                return
            if ticket.sent != blob.size:
                logger.error(f"blob {name}: made {ticket.sent} bytes, announced {blob.size}; not finishing it")
                cut = True
                return
            yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"sha256": digest.digest()}))
            self._measure(ticket.sent, self.clock() - started)
            self.served_bytes += ticket.sent
            blob.on_sent(digest.hexdigest())
            await linger(self.linger_s)
        finally:  # also when the peer leaves part way (the stream closed or cancelled): it pays the bytes it took
            self._settle(peer, ticket, cut=cut)

    def _admit(self, peer: PeerID, name: str) -> _Ticket:
        """Refuse (busy) a peer over its streams, its budget for ``name`` or (a stage's state) its bytes; else charge
        the budget, and return the ticket that gives it back."""
        prefix = name.split("/", 1)[0]
        state = prefix in STATE_PREFIXES
        limits = self.serving
        if self._open[peer] >= limits.streams_per_peer:
            raise self._busy(
                "streams", f"peer {peer} holds {self._open[peer]} blob streams open, the most one peer may"
            )
        if state and self._open_states[peer] >= limits.state_streams_per_peer:
            raise self._busy(
                "state_streams",
                f"peer {peer} holds {self._open_states[peer]} state streams open, the most one peer may",
            )
        if state:
            self._check_bytes(peer)
        budget, key = self._budgets.get(prefix), (peer, name)  # per blob: a full peer takes every stage
        if budget is None:
            return _Ticket(give_back=lambda: None, state=state)
        if not budget.take(key):
            every_s = 1 / budget.limits.rate
            raise self._busy(
                "budget", f"peer {peer} took {name} {budget.limits.burst:g} times; once more every {every_s:.0f} s"
            )
        return _Ticket(give_back=lambda: budget.refund(key), state=state)

    def _check_bytes(self, peer: PeerID) -> None:
        """Refuse (busy) a peer whose bucket of state bytes is in debt: it took its share of this holder's upload."""
        if self._bytes is None or (tokens := self._bytes.tokens(peer)) > 0:
            return
        rate = self._bytes.limits.rate
        raise self._busy(
            "bytes",
            f"peer {peer} took its share of this holder's upload ({rate / 1e6:.2f} MB/s of state): "
            f"another state in {(1 - tokens) / rate:.0f} s",
        )

    def _reserve(self, peer: PeerID, ticket: _Ticket, blob: BlobStream) -> None:
        """Charge a state's bytes before its header goes out; one the holder serves ahead of its own record
        (``BlobStream.charged`` False: its receiver refuses it) costs the peer nothing."""
        if not ticket.state:
            return
        if not blob.charged:
            self.counters["uncharged"] += 1
            ticket.give_back()
            ticket.give_back = lambda: None
            return
        if self._bytes is not None:
            self._check_bytes(peer)  # another stream of the peer's may have been charged while this one was looked up
            self._bytes.charge(peer, blob.size)
            ticket.reserved = blob.size

    def _settle(self, peer: PeerID, ticket: _Ticket, *, cut: bool) -> None:
        """Give back the bytes charged and not sent, and, if this side cut the stream (``cut``), everything."""
        if self._bytes is not None and ticket.reserved:
            self._bytes.refund(peer, ticket.reserved - (0 if cut else min(ticket.sent, ticket.reserved)))
        if cut:
            ticket.give_back()

    def _measure(self, sent: int, seconds: float) -> None:
        """A blob sent whole in ``seconds``: the fastest of the last ``UPLINK_SAMPLES`` of at least ``UPLINK_BLOB_BYTES``
        is this holder's upload (``upload_bytes_per_s`` at least), of which each identity gets its share in state bytes.
        (A blob goes no faster than the uplink, so a peer cannot raise its own share beyond a share of the real one.)"""
        if self._bytes is None or sent < UPLINK_BLOB_BYTES or seconds <= 0:
            return
        self._rates.append(sent / seconds)
        self.uplink = max(self.serving.upload_bytes_per_s, *self._rates)
        self._bytes.limits = self.serving.state_bytes(self.uplink) or self._bytes.limits

    def _busy(self, bound: str, message: str) -> RequestError:
        self.busy_refusals += 1
        self.counters[f"refused_{bound}"] += 1
        return RequestError(RequestError.BUSY, message)

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
