"""Stage RPC: the messages, the hivemind servicer of a stage server and the trainer's client.

``Forward`` / ``Backward`` travel as msgpack in hivemind's ``ExpertRequest`` metadata (tensors as compress/
frames), by stream when too large for one message (``needs_stream``); ``StageServicer`` is a ``GuardedServicer``
in front of a ``StageBackend``, and ``StageClient`` calls it. More: docs/architecture.md, pipeline/ and rpc/.

    >>> y = await client.forward(peer, Forward(mb="t1/7", stage=2, prev_stage=1, x=frame), timeout=30)
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 (hivemind reads stream handlers from typing's AsyncIterator only)

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from compress.errors import WireError
from compress.wire import DEFAULT_LIMITS, raw_frame_bytes
from swarm.rpc.admission import Credentials
from swarm.rpc.auth import Certificate, CertificateVerifier
from swarm.rpc.defences import PeerLimits, ServingLimits
from swarm.rpc.servicer import (  # RemoteError, RequestError: the stage RPC's callers import them from here too
    TRANSPORT_ERRORS,
    GuardedServicer,
    RemoteError,
    RequestError,
    call_stream,
    chunked,
    linger,
    open_envelope,
    pack_envelope,
    receive_stream,
    remote_error,
    reply_parts,
)

logger = logging.getLogger(__name__)

MICROBATCH_ID = re.compile(r"[\w.:/-]{1,128}")  # e.g. "mb17"; servers key inputs by (caller peer id, microbatch id)
# The largest unary reply a server sends. hivemind's persistent connection carries one message of at most
# DEFAULT_MAX_MSG_SIZE (4 MiB) with its envelopes, and drops a larger unary reply without a word (1.1.12's oversize
# branch builds its error with a field the protobuf lacks, so not even an error arrives and the caller times out).
# 64 KiB below it leaves room for those envelopes; hivemind's own request bound, MAX_UNARY_PAYLOAD_SIZE, is 2 MiB.
MAX_UNARY_REPLY_BYTES: int = DEFAULT_MAX_MSG_SIZE - (64 << 10)
REPLY_SLACK_BYTES = 4 << 10  # a reply's envelope around its frame: the msgpack map and the server's timings
# A streamed call's server says "still on it" this often while the request waits and computes; its caller gives up
# after its timeout (``rpc_s``) of silence, or after MAX_STREAM_CALL_TIMEOUTS timeouts in all (a server that only ever
# keeps the call alive is as good as hung). A stage of the 20m preset at 16 × 1024 tokens computes a backward for
# over a minute on two CPU cores: a hop's time is the work's, which a fixed deadline cannot know.
KEEPALIVE_S = 5.0
MAX_STREAM_CALL_TIMEOUTS = 10


@dataclass(frozen=True, kw_only=True)
class Forward:
    mb: str  # microbatch id, unique per trainer
    stage: int  # the stage asked to compute
    prev_stage: int  # where the input comes from (0 = the embedding): tells servers the path order
    x: bytes  # activation frame, (B, T, d); b"" when it comes by reference (``x_from``)
    train: bool = True  # False: evaluation, nothing is kept for backward
    # run on the weights a forward of this server reported (``Reply.weights``: outer installs, inner steps), not the
    # current ones: a backward probe's (probing.py), judging a gradient taken there. Refused once they are gone
    on_epoch: int | None = None
    on_step: int | None = None
    # frames sent server to server (relay.py): the input was delivered by this peer, its frame hashing to ``x_digest``
    # (of ``ref_bytes`` raw bytes, the reply's bound); the output goes to ``deliver_to``, the trainer told its digest
    x_from: str | None = None
    x_digest: bytes | None = None
    ref_bytes: int = 0
    deliver_to: str | None = None


@dataclass(frozen=True, kw_only=True)
class Backward:
    mb: str
    stage: int
    grad: bytes  # frame of dLoss/d(output), (B, T, d); b"" when it comes by reference (``grad_from``)
    x: bytes | None = None  # the forward input again, when the server no longer holds it
    grad_from: str | None = None  # as ``Forward.x_from``, ``x_digest``, ``ref_bytes``, ``deliver_to``
    grad_digest: bytes | None = None
    ref_bytes: int = 0
    deliver_to: str | None = None


def pack(message: Forward | Backward, certificate: bytes | None = None) -> bytes:
    return pack_envelope(message, certificate)


def max_reply_bytes(message: Forward | Backward) -> int:
    """The most a reply to ``message`` can take: a server replies in the codec and shape of the frame it was sent (the
    activations of a forward, the gradient of a backward), so its reply is at most that frame with its body stored
    raw (zstd may shrink the request far more than the reply: an embedding's int8 codes are few distinct rows)."""
    if message.deliver_to is not None:  # its frame goes on to the next server: the reply holds its digest only
        return REPLY_SLACK_BYTES
    frame = message.x if isinstance(message, Forward) else message.grad
    return (raw_frame_bytes(frame) or len(frame) or message.ref_bytes) + REPLY_SLACK_BYTES


def needs_stream(payload: bytes, message: Forward | Backward) -> bool:
    """Whether a call must go by stream: its request is over hivemind's unary bound, or the reply it can get is."""
    request_too_large: bool = len(payload) > MAX_UNARY_PAYLOAD_SIZE  # (hivemind's bound is untyped)
    return request_too_large or max_reply_bytes(message) > MAX_UNARY_REPLY_BYTES


def unpack(data: bytes, kind: type[Forward] | type[Backward], *, max_bytes: int) -> Forward | Backward:
    """Parse a request of ``kind`` (a certificate it carries is left aside); ``RequestError(INVALID)`` if malformed."""
    return _check_microbatch(open_envelope(data, kind, max_bytes=max_bytes)[0])


def _check_microbatch(message: Forward | Backward) -> Forward | Backward:
    if not MICROBATCH_ID.fullmatch(message.mb):
        raise RequestError(
            RequestError.INVALID, f"microbatch id {message.mb[:40]!r} must match {MICROBATCH_ID.pattern}"
        )
    return message


class Reply(bytes):
    """A reply frame, and what its server said about it: the codec it chose (server side only), how long it held the
    request (from taking it to the reply being ready, waiting for its compute thread included), how long it
    computed, and for a forward the weights it ran on ((outer installs, inner steps): a backward probe asks for them
    again, ``Forward.on_epoch``). Plain bytes to a caller that needs only the frame; a trainer times its links with
    the rest (``compress/adaptive.py``). None where the server did not say (an older release). A relayed reply
    (``Forward.deliver_to``) is empty, and ``sent`` says what went on: ``Sent``."""

    codec: str | None
    server_s: float | None
    compute_s: float | None
    weights: tuple[int, int] | None
    sent: Sent | None

    def __new__(
        cls,
        frame: bytes,
        *,
        codec: str | None = None,
        server_s: float | None = None,
        compute_s: float | None = None,
        weights: tuple[int, int] | None = None,
        sent: Sent | None = None,
    ) -> Reply:
        reply = super().__new__(cls, frame)
        reply.codec, reply.server_s, reply.compute_s, reply.weights = codec, server_s, compute_s, weights
        reply.sent = sent
        return reply


@dataclass(frozen=True)
class Sent:
    """What a server sent on to the next server instead of replying with it: the frame's SHA-256 (its commitment:
    the receiver computes on a frame of this digest or refuses, and the trainer fetches it by digest to check it),
    its raw bytes (the next reply's bound) and whether the next server took it."""

    digest: bytes
    raw_bytes: int
    delivered: bool


_TIMINGS = ("server_s", "compute_s")


def _reply(frame: bytes) -> bytes:
    timings = {name: value for name in _TIMINGS if (value := getattr(frame, name, None)) is not None}
    weights = getattr(frame, "weights", None)
    at = {} if weights is None else {"epoch": weights[0], "step": weights[1]}
    sent: Sent | None = getattr(frame, "sent", None)
    relayed = {} if sent is None else {"sent": [sent.digest, sent.raw_bytes, sent.delivered]}
    reply: bytes = msgpack.packb({"y": frame, **timings, **at, **relayed}, use_bin_type=True)
    return reply


def _sent(value: object) -> Sent | None:
    if isinstance(value, list) and len(value) == 3:
        digest, raw, delivered = value
        if isinstance(digest, bytes) and len(digest) == 32 and type(raw) is int and raw >= 0:
            return Sent(digest, raw, delivered is True)
    return None


def parse_reply(data: bytes) -> Reply:
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RemoteError(RequestError.INTERNAL, f"unreadable reply: {e}") from None
    if isinstance(body, dict) and isinstance(body.get("y"), bytes):
        epoch, step = body.get("epoch"), body.get("step")
        weights = (epoch, step) if type(epoch) is int and type(step) is int and min(epoch, step) >= 0 else None
        return Reply(
            body["y"],
            server_s=_seconds(body.get("server_s")),
            compute_s=_seconds(body.get("compute_s")),
            weights=weights,
            sent=_sent(body.get("sent")),
        )
    if (error := remote_error(body)) is not None:
        raise error
    raise RemoteError(RequestError.INTERNAL, "reply holds neither a frame nor an error")


def _seconds(value: object) -> float | None:
    """A timing a server sent, if it is one (anything else is as good as not said: it only informs a codec choice)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 else None


def _chunks(data: bytes) -> list[bytes]:
    return chunked(data, MAX_UNARY_PAYLOAD_SIZE)


class StageBackend(Protocol):
    """What a stage server computes; raises ``RequestError`` or ``WireError`` for bad input."""

    async def forward(self, peer: PeerID, request: Forward) -> bytes: ...

    async def backward(self, peer: PeerID, request: Backward) -> bytes: ...

    def info(self) -> dict[str, Any]: ...


class StageServicer(GuardedServicer):
    """hivemind P2P handlers of one stage server: forward, backward (unary or streamed) and info.

    A peer has one set of handlers per namespace, so a peer that serves several stages (a full peer with
    ``--serve``) passes the others' backends as ``other_stages``: each request goes to its stage's backend.

    ``verifier`` makes the swarm private: every request must carry a certificate admitting its
    sender (for ``rpc_info``, in the request's ``uid``, its only field). ``limits`` set the
    per-peer rate limit and ban policy; a streamed request must arrive within ``stream_timeout_s``. It holds at most
    ``max_pending`` requests at once, at most ``serving.pending_per_peer`` of them one peer's (more are refused busy:
    one identity cannot hold the whole queue of the compute thread); ``refused_held`` counts those refusals.
    """

    def __init__(
        self,
        backend: StageBackend,
        *,
        stage: int,
        max_request_bytes: int,
        max_pending: int = 8,
        verifier: CertificateVerifier | None = None,
        limits: PeerLimits | None = None,
        stream_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        other_stages: Mapping[int, StageBackend] | None = None,
        serving: ServingLimits | None = None,
    ) -> None:
        self.backends = {stage: backend, **(other_stages or {})}
        label = f"stage {stage}" if len(self.backends) == 1 else f"stages {', '.join(map(str, sorted(self.backends)))}"
        super().__init__(label=label, verifier=verifier, limits=limits, clock=clock)
        self.backend, self.stage = backend, stage
        self.max_request_bytes, self.max_pending = max_request_bytes, max_pending
        self.stream_timeout_s = stream_timeout_s
        self.pending = 0  # requests admitted and not answered yet (the queue length others see)
        self.pending_per_peer = min(max_pending, (serving or ServingLimits()).pending_per_peer)
        self._held: Counter[PeerID] = Counter()  # of them, each peer's
        self.refused_held = 0  # requests refused busy: their peer held its most already
        self.companions: list[ServicerBase] = []  # services opened and closed with it (relay_rpc.py's)

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, **kwargs: Any) -> None:
        await super().add_p2p_handlers(p2p, wrapper, **kwargs)
        for companion in self.companions:
            await companion.add_p2p_handlers(p2p, **kwargs)

    async def remove_p2p_handlers(self, p2p: P2P, **kwargs: Any) -> None:
        await super().remove_p2p_handlers(p2p, **kwargs)
        for companion in self.companions:
            await companion.remove_p2p_handlers(p2p, **kwargs)

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        try:
            self.screen(context.remote_id)
            self.check_access(context.remote_id, request.uid.encode() or None)
        except RequestError as e:
            return runtime_pb2.ExpertInfo(serialized_info=self.refuse(e, context.remote_id))
        info = {**self.backend.info(), "stage": self.stage, "pending": self.pending, "refused": self.refused}
        if len(self.backends) > 1:  # a peer serving several stages: the first's fields, and each one's
            info["stages"] = {str(stage): backend.info() for stage, backend in self.backends.items()}
        return runtime_pb2.ExpertInfo(serialized_info=msgpack.packb(info, use_bin_type=True))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Forward, request.metadata, context.remote_id))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=await self._serve(Backward, request.metadata, context.remote_id))

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Forward, requests, context.remote_id):
            yield response

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._serve_stream(Backward, requests, context.remote_id):
            yield response

    async def _serve_stream(
        self, kind: type[Forward] | type[Backward], requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A streamed call: the request in chunks, then keep-alives (empty messages, every ``KEEPALIVE_S`` while the
        request waits and computes: a big microbatch on a CPU computes for longer than ``rpc_s``), then the reply."""
        answer = asyncio.ensure_future(self._answer_stream(kind, requests, peer))
        try:
            while not answer.done():
                await asyncio.wait([answer], timeout=KEEPALIVE_S)
                if not answer.done():
                    yield runtime_pb2.ExpertResponse(metadata=b"")
            for part in reply_parts(answer.result(), MAX_UNARY_PAYLOAD_SIZE):
                yield runtime_pb2.ExpertResponse(metadata=part)
            await linger(self.stream_timeout_s)  # until the caller, its reply whole, closes the stream
        finally:
            answer.cancel()  # the caller left: nothing is waiting for the reply

    async def _answer_stream(
        self, kind: type[Forward] | type[Backward], requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID
    ) -> bytes:
        try:
            self._admit(peer)  # a stream holds its slot while it arrives: slow streams cannot pile up
            try:
                data = await receive_stream(requests, max_bytes=self.max_request_bytes, timeout_s=self.stream_timeout_s)
                return await self._handle(kind, data, peer)
            finally:
                self._release(peer)
        except RequestError as e:
            return self.refuse(e, peer)

    async def _serve(self, kind: type[Forward] | type[Backward], data: bytes, peer: PeerID) -> bytes:
        try:
            self._admit(peer)
        except RequestError as e:
            return self.refuse(e, peer)
        try:
            reply = await self._handle(kind, data, peer)
        finally:
            self._release(peer)
        if len(reply) > MAX_UNARY_REPLY_BYTES:  # hivemind would drop it unsaid: say so, both here and to the caller
            message = (
                f"a {kind.__name__.lower()} reply of {len(reply)} bytes is over the unary limit of "
                f"{MAX_UNARY_REPLY_BYTES} bytes; ask by stream"
            )
            logger.warning(f"{self.label}: {message} (to {peer})")
            return self.refuse(RequestError(RequestError.TOO_LARGE, message), peer)
        return reply

    def _admit(self, peer: PeerID) -> None:
        """Take a place for ``peer``'s request; busy if the server holds its most, or the peer its share of them."""
        self.screen(peer)
        if self.pending >= self.max_pending:
            raise RequestError(RequestError.BUSY, f"{self.pending} requests in progress")
        if self._held[peer] >= self.pending_per_peer:
            self.refused_held += 1
            raise RequestError(
                RequestError.BUSY,
                f"peer {peer} holds {self._held[peer]} of this server's {self.max_pending} requests, the most one peer may",
            )
        self.pending += 1
        self._held[peer] += 1

    def _release(self, peer: PeerID) -> None:
        self.pending -= 1
        self._held[peer] -= 1
        if not self._held[peer]:
            del self._held[peer]

    async def _handle(self, kind: type[Forward] | type[Backward], data: bytes, peer: PeerID) -> bytes:
        """The reply to an admitted request: the backend's frame, or an error (every request gets one)."""
        try:
            request = _check_microbatch(self.open_request(peer, data, kind, max_bytes=self.max_request_bytes))
            if (backend := self.backends.get(request.stage)) is None:
                # not the sender's fault: a server that moved to another stage keeps getting its old stage's requests
                # until every trainer's view of the DHT has caught up, and a strike for each would ban them all
                held = ", ".join(map(str, sorted(self.backends)))
                raise RequestError(
                    RequestError.NOT_FOUND, f"this server holds stage {held}, not {request.stage} (it may have moved)"
                )
            if isinstance(request, Forward):
                return _reply(await backend.forward(peer, request))
            return _reply(await backend.backward(peer, request))
        except Exception as e:  # refuse() tells the sender's faults from ours
            return self.refuse(e, peer)

    def classify(self, error: Exception) -> RequestError:
        if isinstance(error, WireError):  # the sender's tensors do not decode, or do not fit the stage
            return RequestError(RequestError.INVALID, f"bad tensor frame: {type(error).__name__}: {error}")
        return super().classify(error)


class StageClient:
    """Calls stage servers; replies are frames, failures raise ``RemoteError`` or ``asyncio.TimeoutError``.

    With ``credentials`` (a private swarm) every request carries this peer's certificate, read
    from its file at the first call and again once it has expired (the authority may renew it).
    """

    def __init__(self, p2p: P2P, *, namespace: str, credentials: Credentials | None = None) -> None:
        self.p2p, self.namespace, self.credentials = p2p, namespace, credentials
        self._certificate: bytes | None = None
        self._expires_at = 0

    async def forward(self, peer: PeerID, request: Forward, *, timeout: float) -> Reply:
        return await self._call(peer, request, timeout)

    async def backward(self, peer: PeerID, request: Backward, *, timeout: float) -> Reply:
        return await self._call(peer, request, timeout)

    async def info(self, peer: PeerID, *, timeout: float) -> dict[str, Any]:
        stub = StageServicer.get_stub(self.p2p, peer, namespace=self.namespace)
        reply = await stub.rpc_info(runtime_pb2.ExpertUID(uid=(self.certificate() or b"").decode()), timeout=timeout)
        info = msgpack.unpackb(reply.serialized_info, raw=False)
        if (error := remote_error(info)) is not None:
            raise error
        if not isinstance(info, dict):
            raise RemoteError(RequestError.INTERNAL, f"info reply is not a map: {info!r:.80}")
        return info

    def certificate(self) -> bytes | None:
        """The certificate to send with a request (None in a public swarm)."""
        if self.credentials is None:
            return None
        if self._certificate is None or self.credentials.verifier.clock() >= self._expires_at:
            self._certificate = self.credentials.certificate_bytes()
            self._expires_at = Certificate.decode(self._certificate).expires_at
        return self._certificate

    async def _call(self, peer: PeerID, request: Forward | Backward, timeout: float) -> Reply:
        stub = StageServicer.get_stub(self.p2p, peer, namespace=self.namespace)
        method, payload = type(request).__name__.lower(), pack(request, self.certificate())
        max_reply = max_reply_bytes(request)
        deadline = time.monotonic() + MAX_STREAM_CALL_TIMEOUTS * timeout  # a unary call has ``timeout`` in all
        try:
            if not needs_stream(payload, request):
                try:
                    reply = await getattr(stub, f"rpc_{method}")(
                        runtime_pb2.ExpertRequest(metadata=payload), timeout=timeout
                    )
                    return parse_reply(reply.metadata)
                except RemoteError as e:
                    if e.code != RequestError.TOO_LARGE:
                        raise
                    # a reply larger than its request's frame foretold (a server of another release): once more, by
                    # stream, bounded by what the server said it holds
                    max_reply = max(max_reply, _said_size(e.message))
            stream = self._call_stream(stub, method, payload, max_reply, idle_s=timeout)
            return await asyncio.wait_for(stream, max(deadline - time.monotonic(), 0.0))
        except TRANSPORT_ERRORS as e:
            raise RemoteError(RequestError.UNREACHABLE, f"{type(e).__name__}: {e}") from None

    @staticmethod
    async def _call_stream(stub: Any, method: str, payload: bytes, max_reply: int, idle_s: float) -> Reply:
        call = getattr(stub, f"rpc_{method}_stream")
        reply = await call_stream(call, payload, chunk_bytes=MAX_UNARY_PAYLOAD_SIZE, max_bytes=max_reply, idle_s=idle_s)
        return parse_reply(reply)


def _said_size(message: str) -> int:
    """The reply size a ``too_large`` refusal names ("a forward reply of N bytes …"), capped at what any frame of the
    swarm's default wire limits can take; 0 if it names none."""
    found = re.search(r"reply of (\d+) bytes", message)
    return min(int(found.group(1)), DEFAULT_LIMITS.max_frame_bytes + REPLY_SLACK_BYTES) if found else 0
