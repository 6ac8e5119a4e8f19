"""Stage RPC: the messages, the hivemind servicer of a stage server and the trainer's client.

A request or reply is a msgpack dict carried in the ``metadata`` bytes of hivemind's own
``ExpertRequest`` / ``ExpertResponse``; the tensors inside are compress/ wire frames, opaque here.
A payload above ``MAX_UNARY_PAYLOAD_SIZE`` travels as a stream of chunks. The servicer checks the
envelope (sizes, field types, microbatch id, stage), bounds how many requests a server holds, and
turns every refusal into an error reply, so a bad request never takes the server down. What a
stage computes lives behind ``StageBackend`` (``swarm/server.py``).

    >>> await StageServicer(backend, stage=2).add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> client = StageClient(p2p, namespace=cfg.swarm_id)
    >>> y = await client.forward(peer, Forward(mb="t1/7", stage=2, prev_stage=1, x=frame), timeout=30)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol  # typing's AsyncIterator: hivemind reads stream handlers from it

import msgpack
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from compress.errors import WireError

logger = logging.getLogger(__name__)

MICROBATCH_ID = re.compile(r"[\w.:/-]{1,128}")  # e.g. "mb17"; servers key inputs by (caller peer id, microbatch id)


class RequestError(Exception):
    """A request the server refuses; ``code`` tells the client what to do about it."""

    INVALID = "invalid"  # malformed: never retry as is
    BUSY = "busy"  # too many requests held: try another replica
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


_FIELD_TYPES = {"mb": str, "stage": int, "prev_stage": int, "x": bytes, "train": bool, "grad": bytes}


def pack(message: Forward | Backward) -> bytes:
    return msgpack.packb(dataclasses.asdict(message), use_bin_type=True)


def unpack(data: bytes, kind: type[Forward] | type[Backward], *, max_bytes: int) -> Forward | Backward:
    """Parse a request of ``kind``; raises ``RequestError(INVALID)`` for anything malformed."""
    if len(data) > max_bytes:
        raise RequestError(RequestError.INVALID, f"request of {len(data)} bytes is over the limit of {max_bytes}")
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=1024, max_array_len=0, max_map_len=16)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RequestError(RequestError.INVALID, f"request is not a msgpack map: {e}") from None
    names = {f.name for f in dataclasses.fields(kind)}
    if not isinstance(fields, dict) or set(fields) - names:
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request takes fields {sorted(names)}")
    for name, value in fields.items():
        expected = _FIELD_TYPES[name]
        optional = name == "x" and kind is Backward
        if not (isinstance(value, expected) and (expected is bool or not isinstance(value, bool))) and not (optional and value is None):
            raise RequestError(RequestError.INVALID, f"field {name!r} must be {expected.__name__}, got {type(value).__name__}")
    try:
        message = kind(**fields)
    except TypeError as e:
        raise RequestError(RequestError.INVALID, f"{kind.__name__} request: {e}") from None
    if not MICROBATCH_ID.fullmatch(message.mb):
        raise RequestError(RequestError.INVALID, f"microbatch id {message.mb[:40]!r} must match {MICROBATCH_ID.pattern}")
    return message


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
    """hivemind P2P handlers of one stage server: forward, backward (unary or streamed) and info."""

    def __init__(self, backend: StageBackend, *, stage: int, max_request_bytes: int, max_pending: int = 8) -> None:
        self.backend, self.stage = backend, stage
        self.max_request_bytes, self.max_pending = max_request_bytes, max_pending
        self.pending = 0  # requests admitted and not answered yet (the queue length others see)
        self.refused = 0  # requests answered with an error

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        info = {**self.backend.info(), "stage": self.stage, "pending": self.pending, "refused": self.refused}
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(info, use_bin_type=True))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Forward, request.metadata, context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Backward, request.metadata, context.remote_id))

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Forward, requests, context):
            yield response

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Backward, requests, context):
            yield response

    async def _serve_stream(self, kind: type[Forward] | type[Backward], requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        parts, size = [], 0
        async for chunk in requests:
            size += len(chunk.metadata)
            if size > self.max_request_bytes:  # stop reading: never buffer more than the limit
                reply = self._refuse(RequestError(RequestError.INVALID, f"streamed request over the limit of {self.max_request_bytes} bytes"))
                break
            parts.append(chunk.metadata)
        else:
            reply = await self._serve(kind, b"".join(parts), context.remote_id)
        for part in _chunks(reply):
            yield runtime_pb2.ExpertResponse(metadata=part)

    async def _serve(self, kind: type[Forward] | type[Backward], data: bytes, peer: PeerID) -> bytes:
        if self.pending >= self.max_pending:
            return self._refuse(RequestError(RequestError.BUSY, f"{self.pending} requests in progress"))
        self.pending += 1
        try:
            request = unpack(data, kind, max_bytes=self.max_request_bytes)
            if request.stage != self.stage:
                raise RequestError(RequestError.INVALID, f"this server holds stage {self.stage}, not {request.stage}")
            call = self.backend.forward if kind is Forward else self.backend.backward
            return _reply(await call(peer, request))
        except RequestError as e:
            return self._refuse(e)
        except WireError as e:
            return self._refuse(RequestError(RequestError.INVALID, f"bad tensor frame: {type(e).__name__}: {e}"))
        except Exception as e:  # the server keeps serving whatever one request did
            logger.exception(f"stage {self.stage}: {kind.__name__} from {peer} failed")
            return self._refuse(RequestError(RequestError.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            self.pending -= 1

    def _refuse(self, error: RequestError) -> bytes:
        self.refused += 1
        logger.debug(f"stage {self.stage}: refused a request: {error}")
        return _reply(error=error)


TRANSPORT_ERRORS = (P2PDaemonError, P2PHandlerError, ConnectionError, asyncio.IncompleteReadError)  # dead or unreachable peers


class StageClient:
    """Calls stage servers; replies are frames, failures raise ``RemoteError`` or ``asyncio.TimeoutError``."""

    def __init__(self, p2p: P2P, *, namespace: str) -> None:
        self.p2p, self.namespace = p2p, namespace

    async def forward(self, peer: PeerID, request: Forward, *, timeout: float) -> bytes:
        return await self._call(peer, "forward", pack(request), timeout)

    async def backward(self, peer: PeerID, request: Backward, *, timeout: float) -> bytes:
        return await self._call(peer, "backward", pack(request), timeout)

    async def info(self, peer: PeerID, *, timeout: float) -> dict[str, Any]:
        stub = StageServicer.get_stub(self.p2p, peer, namespace=self.namespace)
        reply = await stub.rpc_info(runtime_pb2.ExpertUID(uid=""), timeout=timeout)
        return msgpack.unpackb(reply.serialized_info, raw=False)

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
