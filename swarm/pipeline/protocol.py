"""Stage RPC: the messages, the hivemind servicer of a stage server and the trainer's client.

A request or reply is a msgpack dict carried in the ``metadata`` bytes of hivemind's own
``ExpertRequest`` / ``ExpertResponse``; the tensors inside are compress/ wire frames, opaque here.
A payload above ``MAX_UNARY_PAYLOAD_SIZE`` travels as a stream of chunks. The servicer checks the
envelope (sizes, field types, microbatch id, stage), bounds how many requests a server holds, and
turns every refusal into an error reply, so a bad request never takes the server down. What a
stage computes lives behind ``StageBackend`` (``swarm/pipeline/server.py``).

Defences, in the order a request meets them: a peer banned for sending invalid data, or over its
request rate, is refused before its request is read (``swarm/rpc/defences.py``); in a private swarm
the request must carry a certificate (``swarm/rpc/auth.py``) admitting the peer libp2p authenticated;
then the envelope and the tensors are validated, and every invalid request is a strike.

    >>> await StageServicer(backend, stage=2, max_request_bytes=1 << 20, verifier=creds.verifier).add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> client = StageClient(p2p, namespace=cfg.swarm_id, credentials=creds)   # credentials: private swarms only
    >>> y = await client.forward(peer, Forward(mb="t1/7", stage=2, prev_stage=1, x=frame), timeout=30)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol  # typing's AsyncIterator: hivemind reads stream handlers from it

import msgpack
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from compress.errors import WireError
from swarm.rpc.admission import Credentials
from swarm.rpc.auth import CERTIFICATE_FIELD, AccessDenied, Certificate, CertificateVerifier
from swarm.rpc.defences import PeerGuard, PeerLimits

logger = logging.getLogger(__name__)

MICROBATCH_ID = re.compile(r"[\w.:/-]{1,128}")  # e.g. "mb17"; servers key inputs by (caller peer id, microbatch id)


class RequestError(Exception):
    """A request the server refuses; ``code`` tells the client what to do about it."""

    INVALID = "invalid"  # malformed: never retry as is
    BUSY = "busy"  # too many requests held, or this peer is over its rate: try another replica
    DENIED = "denied"  # private swarm: no valid certificate for the calling peer
    BANNED = "banned"  # the calling peer sent too much invalid data; refused for a while
    CACHE_MISS = "cache_miss"  # backward without the forward input: resend it
    INTERNAL = "internal"  # the server failed: try another replica
    UNREACHABLE = "unreachable"  # (client side) the call did not get through: try another replica

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class RemoteError(RequestError):
    """The error reply of a remote server, raised on the client."""


@dataclass(frozen=True, kw_only=True)
class Forward:
    mb: str  # microbatch id, unique per trainer
    stage: int  # the stage asked to compute
    prev_stage: int  # where the input comes from (0 = the embedding): tells servers the path order
    x: bytes  # activation frame, (B, T, d)
    train: bool = True  # False: evaluation, nothing is kept for backward


@dataclass(frozen=True, kw_only=True)
class Backward:
    mb: str
    stage: int
    grad: bytes  # frame of dLoss/d(output), (B, T, d)
    x: bytes | None = None  # the forward input again, when the server no longer holds it


_FIELD_TYPES = {"mb": str, "stage": int, "prev_stage": int, "x": bytes, "train": bool, "grad": bytes, CERTIFICATE_FIELD: bytes}


def pack(message: Forward | Backward, certificate: bytes | None = None) -> bytes:
    fields = dataclasses.asdict(message)
    if certificate is not None:
        fields[CERTIFICATE_FIELD] = certificate
    return msgpack.packb(fields, use_bin_type=True)


def unpack(data: bytes, kind: type[Forward] | type[Backward], *, max_bytes: int) -> Forward | Backward:
    """Parse a request of ``kind`` (a certificate it carries is left aside); ``RequestError(INVALID)`` if malformed."""
    return open_envelope(data, kind, max_bytes=max_bytes)[0]


def open_envelope(data: bytes, kind: type[Forward] | type[Backward], *, max_bytes: int) -> tuple[Forward | Backward, bytes | None]:
    """The request of ``kind`` and the certificate sent with it; raises ``RequestError(INVALID)`` for anything malformed."""
    if len(data) > max_bytes:
        raise RequestError(RequestError.INVALID, f"request of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=1024, max_array_len=0, max_map_len=16)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RequestError(RequestError.INVALID, f"request is not a msgpack map: {e}") from None
    names = {f.name for f in dataclasses.fields(kind)}
    if not isinstance(fields, dict) or set(fields) - names - {CERTIFICATE_FIELD}:
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request takes fields {sorted(names)}")
    for name, value in fields.items():
        expected = _FIELD_TYPES[name]
        optional = name == "x" and kind is Backward
        if not (isinstance(value, expected) and (expected is bool or not isinstance(value, bool))) and not (optional and value is None):
            raise RequestError(RequestError.INVALID, f"field {name!r} must be {expected.__name__}, got {type(value).__name__}")
    certificate = fields.pop(CERTIFICATE_FIELD, None)
    try:
        message = kind(**fields)
    except TypeError as e:
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request: {e}") from None
    if not MICROBATCH_ID.fullmatch(message.mb):
        raise RequestError(RequestError.INVALID, f"microbatch id {message.mb[:40]!r} must match {MICROBATCH_ID.pattern}")
    return message, certificate


def _reply(frame: bytes | None = None, error: RequestError | None = None) -> bytes:
    body = {"y": frame} if error is None else {"error": error.code, "message": error.message}
    return msgpack.packb(body, use_bin_type=True)


def parse_reply(data: bytes) -> bytes:
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RemoteError(RequestError.INTERNAL, f"unreadable reply: {e}") from None
    if isinstance(body, dict) and isinstance(body.get("y"), bytes):
        return body["y"]
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        raise RemoteError(body["error"], str(body.get("message", "")))
    raise RemoteError(RequestError.INTERNAL, "reply holds neither a frame nor an error")


def _chunks(data: bytes) -> list[bytes]:
    return [data[i : i + MAX_UNARY_PAYLOAD_SIZE] for i in range(0, len(data), MAX_UNARY_PAYLOAD_SIZE)] or [b""]


class StageBackend(Protocol):
    """What a stage server computes; raises ``RequestError`` or ``WireError`` for bad input."""

    async def forward(self, peer: PeerID, request: Forward) -> bytes: ...

    async def backward(self, peer: PeerID, request: Backward) -> bytes: ...

    def info(self) -> dict[str, Any]: ...


class StageServicer(ServicerBase):
    """hivemind P2P handlers of one stage server: forward, backward (unary or streamed) and info.

    ``verifier`` makes the swarm private: every request must carry a certificate admitting its
    sender (for ``rpc_info``, in the request's ``uid``, its only field). ``limits`` set the
    per-peer rate limit and ban policy; a streamed request must arrive within ``stream_timeout_s``.
    """

    def __init__(self, backend: StageBackend, *, stage: int, max_request_bytes: int, max_pending: int = 8,
                 verifier: CertificateVerifier | None = None, limits: PeerLimits | None = None,
                 stream_timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.stage = backend, stage
        self.max_request_bytes, self.max_pending = max_request_bytes, max_pending
        self.verifier, self.stream_timeout_s = verifier, stream_timeout_s
        self.guard = PeerGuard(limits, clock)
        self.pending = 0  # requests admitted and not answered yet (the queue length others see)
        self.refused = 0  # requests answered with an error
        self.bans = 0  # peers banned so far

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        try:
            self._screen(context.remote_id)
            self._check_access(context.remote_id, request.uid.encode() or None)
        except RequestError as e:
            return runtime_pb2.ExpertInfo(serialized_info=self._refuse(e, context.remote_id))
        info = {**self.backend.info(), "stage": self.stage, "pending": self.pending, "refused": self.refused}
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(info, use_bin_type=True))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Forward, request.metadata, context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Backward, request.metadata, context.remote_id))

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Forward, requests, context.remote_id):
            yield response

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Backward, requests, context.remote_id):
            yield response

    async def _serve_stream(self, kind: type[Forward] | type[Backward], requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            self._admit(peer)
            self.pending += 1  # a stream holds its slot while it arrives: slow streams cannot pile up
            try:
                data = await asyncio.wait_for(self._receive(requests), self.stream_timeout_s)
                reply = await self._handle(kind, data, peer)
            finally:
                self.pending -= 1
        except RequestError as e:
            reply = self._refuse(e, peer)
        except asyncio.TimeoutError:
            reply = self._refuse(RequestError(RequestError.INVALID, f"streamed request took over {self.stream_timeout_s:.0f} s"), peer)
        for part in _chunks(reply):
            yield runtime_pb2.ExpertResponse(metadata=part)

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> bytes:
        """A streamed request, reassembled; stops reading at the size limit. Every chunk must carry
        bytes, so a stream ends within that many chunks, and one buffer holds them (no per-chunk overhead)."""
        data = bytearray()
        async for chunk in requests:
            if not chunk.metadata:
                raise RequestError(RequestError.INVALID, "empty chunk in a streamed request")
            if len(data) + len(chunk.metadata) > self.max_request_bytes:
                raise RequestError(RequestError.INVALID, f"streamed request over the limit of {self.max_request_bytes} bytes")
            data += chunk.metadata
        return bytes(data)

    async def _serve(self, kind: type[Forward] | type[Backward], data: bytes, peer: PeerID) -> bytes:
        try:
            self._admit(peer)
        except RequestError as e:
            return self._refuse(e, peer)
        self.pending += 1
        try:
            return await self._handle(kind, data, peer)
        finally:
            self.pending -= 1

    def _screen(self, peer: PeerID) -> None:
        """Refuse a banned peer, or one over its request rate, before reading anything it sent."""
        if (left := self.guard.banned_for(peer)) > 0:
            limits = self.guard.limits
            raise RequestError(RequestError.BANNED, f"peer {peer} sent {limits.strikes} invalid requests within "
                                                    f"{limits.strike_window_s:.0f} s; refused for {left:.0f} s more")
        if not self.guard.take(peer):
            raise RequestError(RequestError.BUSY, f"peer {peer} is over its rate limit of {self.guard.limits.rate:g} requests/s")

    def _admit(self, peer: PeerID) -> None:
        self._screen(peer)
        if self.pending >= self.max_pending:
            raise RequestError(RequestError.BUSY, f"{self.pending} requests in progress")

    def _check_access(self, peer: PeerID, certificate: bytes | None) -> None:
        if self.verifier is not None:
            try:
                self.verifier.check(peer, certificate)
            except AccessDenied as e:
                raise RequestError(RequestError.DENIED, str(e)) from None

    async def _handle(self, kind: type[Forward] | type[Backward], data: bytes, peer: PeerID) -> bytes:
        """The reply to an admitted request: the backend's frame, or an error (every request gets one)."""
        try:
            request, certificate = open_envelope(data, kind, max_bytes=self.max_request_bytes)
            self._check_access(peer, certificate)
            if request.stage != self.stage:
                raise RequestError(RequestError.INVALID, f"this server holds stage {self.stage}, not {request.stage}")
            call = self.backend.forward if kind is Forward else self.backend.backward
            return _reply(await call(peer, request))
        except RequestError as e:
            return self._refuse(e, peer)
        except WireError as e:
            return self._refuse(RequestError(RequestError.INVALID, f"bad tensor frame: {type(e).__name__}: {e}"), peer)
        except Exception as e:  # the server keeps serving whatever one request did
            logger.exception(f"stage {self.stage}: {kind.__name__} from {peer} failed")
            return self._refuse(RequestError(RequestError.INTERNAL, f"{type(e).__name__}: {e}"), peer)

    def _refuse(self, error: RequestError, peer: PeerID) -> bytes:
        """The error reply; an invalid request is a strike against its sender."""
        self.refused += 1
        logger.debug(f"stage {self.stage}: refused a request of {peer}: {error}")
        if error.code == RequestError.INVALID and self.guard.strike(peer):
            self.bans += 1
            logger.warning(f"stage {self.stage}: banned peer {peer} for {self.guard.limits.ban_s:.0f} s after "
                           f"{self.guard.limits.strikes} invalid requests (the last: {error.message})")
        return _reply(error=error)


TRANSPORT_ERRORS = (P2PDaemonError, P2PHandlerError, ConnectionError, asyncio.IncompleteReadError)  # dead or unreachable peers


class StageClient:
    """Calls stage servers; replies are frames, failures raise ``RemoteError`` or ``asyncio.TimeoutError``.

    With ``credentials`` (a private swarm) every request carries this peer's certificate, read
    from its file at the first call and again once it has expired (the authority may renew it).
    """

    def __init__(self, p2p: P2P, *, namespace: str, credentials: Credentials | None = None) -> None:
        self.p2p, self.namespace, self.credentials = p2p, namespace, credentials
        self._certificate: bytes | None = None
        self._expires_at = 0

    async def forward(self, peer: PeerID, request: Forward, *, timeout: float) -> bytes:
        return await self._call(peer, "forward", pack(request, self.certificate()), timeout)

    async def backward(self, peer: PeerID, request: Backward, *, timeout: float) -> bytes:
        return await self._call(peer, "backward", pack(request, self.certificate()), timeout)

    async def info(self, peer: PeerID, *, timeout: float) -> dict[str, Any]:
        stub = StageServicer.get_stub(self.p2p, peer, namespace=self.namespace)
        reply = await stub.rpc_info(runtime_pb2.ExpertUID(uid=(self.certificate() or b"").decode()), timeout=timeout)
        info = msgpack.unpackb(reply.serialized_info, raw=False)
        if isinstance(info, dict) and isinstance(info.get("error"), str):
            raise RemoteError(info["error"], str(info.get("message", "")))
        return info

    def certificate(self) -> bytes | None:
        """The certificate to send with a request (None in a public swarm)."""
        if self.credentials is None:
            return None
        if self._certificate is None or self.credentials.verifier.clock() >= self._expires_at:
            self._certificate = self.credentials.certificate_bytes()
            self._expires_at = Certificate.decode(self._certificate).expires_at
        return self._certificate

    async def _call(self, peer: PeerID, method: str, payload: bytes, timeout: float) -> bytes:
        stub = StageServicer.get_stub(self.p2p, peer, namespace=self.namespace)
        try:
            if len(payload) <= MAX_UNARY_PAYLOAD_SIZE:
                reply = await getattr(stub, f"rpc_{method}")(runtime_pb2.ExpertRequest(metadata=payload), timeout=timeout)
                return parse_reply(reply.metadata)
            return await asyncio.wait_for(self._call_stream(stub, method, payload), timeout)
        except TRANSPORT_ERRORS as e:
            raise RemoteError(RequestError.UNREACHABLE, f"{type(e).__name__}: {e}") from None

    @staticmethod
    async def _call_stream(stub: Any, method: str, payload: bytes) -> bytes:
        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            for part in _chunks(payload):
                yield runtime_pb2.ExpertRequest(metadata=part)

        replies = await getattr(stub, f"rpc_{method}_stream")(requests())
        return parse_reply(b"".join([reply.metadata async for reply in replies]))
