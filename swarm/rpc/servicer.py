"""The one base of every swarmloco RPC service: request envelope, certificate check, rate limit, ban, error reply.

A handler of a ``GuardedServicer`` (stage RPC, blobs, the admission gate) meets a request in one order:
``screen(peer)`` (ban, rate) before anything is read, ``open_request(peer, data, Kind, max_bytes=…)`` (size,
envelope, field types, certificate), and ``refuse(error, peer)``: the one error reply, a strike only for an
invalid request. More: docs/architecture.md, rpc/.

    >>> echo = self.open_request(context.remote_id, request.metadata, Echo, max_bytes=1024)  # after self.screen(...)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, get_args, get_type_hints

import msgpack
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.rpc.auth import CERTIFICATE_FIELD, AccessDenied, CertificateVerifier
from swarm.rpc.defences import PeerGuard, PeerLimits

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger(__name__)

Request = TypeVar("Request", bound="DataclassInstance")  # a dataclass whose fields are the envelope's
MAX_STR_LEN = 1024  # the longest string any request field holds (ids and names; frames are bytes)
# dead or unreachable peers
TRANSPORT_ERRORS = (
    P2PDaemonError,
    P2PHandlerError,
    ConnectionError,
    asyncio.IncompleteReadError,
)

# libp2p refuses to dial an address again for a few seconds after a dial to it failed (go-libp2p's swarm backoff: 5 s
# at first), whatever the peer does now: the call never left this peer, and the peer may well be up by now
DIAL_BACKOFF = "dial backoff"
DIAL_BACKOFF_S = 5.0


def dial_backed_off(error: Exception) -> bool:
    """Whether ``error`` is this peer's own libp2p daemon refusing to dial (``DIAL_BACKOFF``), not the peer failing."""
    return DIAL_BACKOFF in str(error)


class RequestError(Exception):
    """A request the server refuses; ``code`` tells the client what to do about it."""

    INVALID = "invalid"  # malformed: never retry as is (a strike against the sender)
    BUSY = "busy"  # too many requests held, or this peer is over its rate: try another replica
    DENIED = "denied"  # private swarm: no valid certificate for the calling peer
    BANNED = "banned"  # the calling peer sent too much invalid data; refused for a while
    NOT_FOUND = "not_found"  # no such blob here (or not in time), or not a stage this server holds: ask another peer
    CACHE_MISS = "cache_miss"  # (stage RPC) backward without the forward input: resend it
    GONE = "gone"  # (stage RPC) a forward asked for weights the server no longer holds (a probe's): no one's fault
    INTERNAL = "internal"  # the server failed: try another replica
    TOO_LARGE = "too_large"  # (stage RPC) the reply cannot go as one unary message: ask again by stream
    UNREACHABLE = "unreachable"  # (client side) the call did not get through: try another replica

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class RemoteError(RequestError):
    """The error reply of a remote server, raised on the client."""


def pack_envelope(request: DataclassInstance, certificate: bytes | None = None) -> bytes:
    """The envelope of a request dataclass: a msgpack map of its fields, and the sender's certificate in a private swarm."""
    fields = dataclasses.asdict(request)
    if certificate is not None:
        fields[CERTIFICATE_FIELD] = certificate
    envelope: bytes = msgpack.packb(fields, use_bin_type=True)
    return envelope


def error_reply(error: RequestError) -> bytes:
    """The one error-reply format of every service."""
    reply: bytes = msgpack.packb({"error": error.code, "message": error.message}, use_bin_type=True)
    return reply


def remote_error(body: object) -> RemoteError | None:
    """The error an unpacked reply carries, or None if it is not an error reply."""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return RemoteError(body["error"], str(body.get("message", "")))
    return None


@functools.cache
def _field_types(kind: type[DataclassInstance]) -> dict[str, tuple[type, ...]]:
    """Each field of the request dataclass ``kind`` and the types it accepts (``bytes | None`` → (bytes, NoneType))."""
    hints = get_type_hints(kind)
    return {
        name: get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        for name, hint in hints.items()
        if name in kind.__dataclass_fields__
    }


def _is_a(value: object, accepted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # msgpack booleans are ints to isinstance: a bool is only a bool here
        return bool in accepted
    return isinstance(value, accepted)


def open_envelope(data: bytes, kind: type[Request], *, max_bytes: int) -> tuple[Request, bytes | None]:
    """The request of dataclass ``kind`` and the certificate sent with it; ``RequestError(INVALID)`` for anything malformed.

    >>> open_envelope(msgpack.packb({"name": "state/2", "cert": b"..."}), BlobRequest, max_bytes=1024)
    (BlobRequest(name='state/2'), b'...')
    """
    if len(data) > max_bytes:
        raise RequestError(RequestError.INVALID, f"request of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        fields = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=MAX_STR_LEN,
            max_array_len=0,
            max_map_len=16,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RequestError(RequestError.INVALID, f"request is not a msgpack map: {e}") from None
    accepted = _field_types(kind) | {CERTIFICATE_FIELD: (bytes,)}
    if not isinstance(fields, dict) or set(fields) - accepted.keys():
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request takes fields {sorted(_field_types(kind))}")
    for name, value in fields.items():
        if not _is_a(value, accepted[name]):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in accepted[name])
            raise RequestError(RequestError.INVALID, f"field {name!r} must be {expected}, got {type(value).__name__}")
    certificate = fields.pop(CERTIFICATE_FIELD, None)
    try:
        return kind(**fields), certificate
    except TypeError as e:  # a missing field
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request: {e}") from None


async def receive_stream(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], *, max_bytes: int, timeout_s: float | None = None
) -> bytes:
    """A streamed request, reassembled; stops reading at the size limit. Every chunk must carry bytes, so a
    stream ends within that many chunks, and one buffer holds them (no per-chunk overhead). ``timeout_s``: the
    whole stream's bound, beyond which it is an invalid request (a stalled sender holds a slot)."""
    if timeout_s is not None:
        try:
            return await asyncio.wait_for(receive_stream(requests, max_bytes=max_bytes), timeout_s)
        except TimeoutError:
            raise RequestError(RequestError.INVALID, f"streamed request took over {timeout_s:.0f} s") from None
    data = bytearray()
    async for chunk in requests:
        if not chunk.metadata:
            raise RequestError(RequestError.INVALID, "empty chunk in a streamed request")
        if len(data) + len(chunk.metadata) > max_bytes:
            raise RequestError(RequestError.INVALID, f"streamed request over the limit of {max_bytes} bytes")
        data += chunk.metadata
    return bytes(data)


REPLY_LENGTH_BYTES = 8  # a streamed reply's first bytes: its length, so a stream cut short is told from one ended


def chunked(data: bytes, chunk_bytes: int) -> list[bytes]:
    """``data`` as a stream's messages of at most ``chunk_bytes`` (one empty message for no data)."""
    return [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]


def reply_parts(reply: bytes, chunk_bytes: int) -> list[bytes]:
    """A streamed reply's messages (``receive_reply`` reads them): its length, then its bytes, ≤ ``chunk_bytes`` each."""
    return chunked(len(reply).to_bytes(REPLY_LENGTH_BYTES, "big") + reply, chunk_bytes)


async def call_stream(
    method: Callable[[AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable[AsyncIterator[runtime_pb2.ExpertResponse]]],
    payload: bytes,
    *,
    chunk_bytes: int,
    max_bytes: int,
    idle_s: float,
) -> bytes:
    """A streamed call of a stub's ``method``: ``payload`` sent in chunks, the reply read by its length
    (``receive_reply``), then the stream closed (which ends the server's ``linger``)."""

    async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for part in chunked(payload, chunk_bytes):
            yield runtime_pb2.ExpertRequest(metadata=part)

    replies = await method(requests())
    try:
        return await receive_reply(replies, max_bytes=max_bytes, idle_s=idle_s)
    finally:
        await replies.aclose()  # type: ignore[attr-defined]  # hivemind's reply stream is an async generator


async def linger(seconds: float) -> None:
    """After a streamed reply's last message, hold its stream open until the caller, the reply read whole by its
    length, closes it (hivemind then cancels the handler) or ``seconds`` pass. Closed from the server's end at once,
    the daemon may reset the libp2p stream with the reply's tail still unsent: the caller read a reply cut short
    (seen in the WAN lab at 50 ms round trips with 3-6 MB replies)."""
    await asyncio.sleep(seconds)


async def receive_reply(replies: AsyncIterator[runtime_pb2.ExpertResponse], *, max_bytes: int, idle_s: float) -> bytes:
    """A streamed reply (``reply_parts``), reassembled: keep-alives (empty messages) skipped, ``idle_s`` of silence a
    ``TimeoutError``, a length over ``max_bytes`` refused, and a stream that ends before its length is read a
    transport failure (``RemoteError`` unreachable: the link's, no fault of the server's), never a short reply."""
    data, length = bytearray(), None
    while length is None or len(data) < length:
        if (message := await asyncio.wait_for(anext(replies, None), idle_s)) is None:
            raise RemoteError(RequestError.UNREACHABLE, f"streamed reply cut short: {len(data)} of {length} bytes")
        data += message.metadata
        if length is None and len(data) >= REPLY_LENGTH_BYTES:
            length = int.from_bytes(data[:REPLY_LENGTH_BYTES], "big")
            del data[:REPLY_LENGTH_BYTES]
            if length > max_bytes:
                raise RemoteError(RequestError.INTERNAL, f"a streamed reply of {length} bytes, over {max_bytes}")
    if len(data) > length:
        raise RemoteError(RequestError.INTERNAL, f"a streamed reply longer than its {length} bytes")
    return bytes(data)


class GuardedServicer(ServicerBase):
    """A hivemind servicer with the swarm's defences; subclasses add ``rpc_*`` handlers (see the module docstring).

    ``verifier`` makes the swarm private (every request must carry a certificate admitting its
    sender); ``limits`` set the per-peer rate limit and ban policy; ``label`` names the service in logs.
    """

    def __init__(
        self,
        *,
        label: str,
        verifier: CertificateVerifier | None = None,
        limits: PeerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.verifier = label, verifier
        self.guard = PeerGuard(limits, clock)
        self.refused = 0  # requests answered with an error
        self.bans = 0  # peers banned so far

    def screen(self, peer: PeerID) -> None:
        """Refuse a banned peer, or one over its request rate, before reading anything it sent."""
        if (left := self.guard.banned_for(peer)) > 0:
            limits = self.guard.limits
            raise RequestError(
                RequestError.BANNED,
                f"peer {peer} sent {limits.strikes} invalid requests within "
                f"{limits.strike_window_s:.0f} s; refused for {left:.0f} s more",
            )
        if not self.guard.take(peer):
            raise RequestError(
                RequestError.BUSY, f"peer {peer} is over its rate limit of {self.guard.limits.rate:g} requests/s"
            )

    def access_denied(self, peer: PeerID, certificate: bytes | None) -> AccessDenied | None:
        """Why this swarm does not admit ``peer`` showing ``certificate``; None if it does (a public swarm admits everyone)."""
        if self.verifier is None:
            return None
        try:
            self.verifier.check(peer, certificate)
        except AccessDenied as e:
            return e
        return None

    def check_access(self, peer: PeerID, certificate: bytes | None) -> None:
        """``RequestError(DENIED)`` unless this swarm admits ``peer`` showing ``certificate``."""
        if (denied := self.access_denied(peer, certificate)) is not None:
            raise RequestError(RequestError.DENIED, str(denied))

    def open_request(self, peer: PeerID, data: bytes, kind: type[Request], *, max_bytes: int) -> Request:
        """The request of ``kind`` in ``data``, from a peer this swarm admits; else ``RequestError`` (INVALID or DENIED)."""
        request, certificate = open_envelope(data, kind, max_bytes=max_bytes)
        self.check_access(peer, certificate)
        return request

    def classify(self, error: Exception) -> RequestError:
        """What ``error``, raised while serving a request, tells the client; services add the errors that mean bad input."""
        return (
            error
            if isinstance(error, RequestError)
            else RequestError(RequestError.INTERNAL, f"{type(error).__name__}: {error}")
        )

    def refuse(self, error: Exception, peer: PeerID) -> bytes:
        """The error reply to a request that failed with ``error``; an invalid request is a strike against its sender."""
        refusal = self.classify(error)
        self.refused += 1
        if refusal.code == RequestError.INTERNAL:  # the server keeps serving whatever one request did
            logger.error(f"{self.label}: a request of {peer} failed", exc_info=error)
        else:
            logger.debug(f"{self.label}: refused a request of {peer}: {refusal}")
        if refusal.code == RequestError.INVALID and self.guard.strike(peer):
            self.bans += 1
            logger.warning(
                f"{self.label}: banned peer {peer} for {self.guard.limits.ban_s:.0f} s after "
                f"{self.guard.limits.strikes} invalid requests (the last: {refusal.message})"
            )
        return error_reply(refusal)
