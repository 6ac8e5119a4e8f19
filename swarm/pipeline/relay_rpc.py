"""Frames sent server to server: the RPC (``RelayServicer``: deliver, fetch), a stage server's backend that takes its
input from its inbox and sends its output on (``RelayBackend``), and the client both ends use (``RelayClient``: a
``StageClient`` that also pushes and fetches). The data structures are relay.py's; the trainer's side relaying.py.

    >>> node = RelayNode(relay_limits(cfg), me=str(p2p.peer_id), client=RelayClient(p2p, namespace=ns))
    >>> backend = RelayBackend(MeteredBackend(server, traffic), node, traffic)
    >>> await RelayServicer(node, traffic).add_p2p_handlers(p2p, namespace=ns)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads stream handlers from typing's AsyncIterator only)

import msgpack
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from compress.wire import raw_frame_bytes
from swarm.config import SwarmConfig
from swarm.dht.metrics import Traffic
from swarm.pipeline.inbound import boundary_limits
from swarm.pipeline.protocol import (
    MICROBATCH_ID,
    Backward,
    Forward,
    Reply,
    Sent,
    StageBackend,
    StageClient,
)
from swarm.pipeline.relay import Deliver, Fetch, Inbox, InboxKey, Outbox, RelayLimits, check_delivery
from swarm.rpc.defences import PeerLimits
from swarm.rpc.servicer import (
    TRANSPORT_ERRORS,
    GuardedServicer,
    RemoteError,
    RequestError,
    call_stream,
    linger,
    pack_envelope,
    receive_stream,
    remote_error,
    reply_parts,
)

logger = logging.getLogger(__name__)
CHUNK_BYTES = 2 << 20  # hivemind's unary payload bound: each message of a stream
ENVELOPE_BYTES = 4 << 10
WAIT_FOR_DELIVERY_S = 2.0  # a call by reference waits this long for its input (its sender replied once it was here)


def relay_limits(cfg: SwarmConfig) -> RelayLimits:
    """A stage server's relay limits: one frame within its wire limits, waits within the rpc timeout."""
    rpc_s = cfg.timeouts.rpc_s
    return RelayLimits(max_frame_bytes=boundary_limits(cfg).max_frame_bytes, ttl_s=rpc_s, keep_s=4 * rpc_s)


class RelayClient(StageClient):
    """A ``StageClient`` that also pushes a frame to a server (``push``) and fetches one by digest (``fetch``)."""

    async def push(self, peer: str, delivery: Deliver, *, timeout: float) -> None:
        await self._stream(peer, "rpc_deliver", pack_envelope(delivery, self.certificate()), ENVELOPE_BYTES, timeout)

    async def fetch(self, peer: Any, request: Fetch, *, timeout: float, max_bytes: int) -> bytes:
        """The frame of ``request``'s digest (verified by the caller) that ``peer`` sent or received."""
        body = await self._stream(peer, "rpc_fetch", pack_envelope(request, self.certificate()), max_bytes, timeout)
        if not isinstance(body, dict) or not isinstance(body.get("y"), bytes):
            raise RemoteError(RequestError.INTERNAL, "fetch reply holds no frame")
        frame: bytes = body["y"]
        return frame

    async def _stream(self, peer: Any, method: str, payload: bytes, max_reply: int, timeout: float) -> Any:
        peer_id = peer if isinstance(peer, PeerID) else PeerID.from_base58(str(peer))
        stub = RelayServicer.get_stub(self.p2p, peer_id, namespace=self.namespace)

        async def call() -> Any:
            data = await call_stream(
                getattr(stub, method),
                payload,
                chunk_bytes=CHUNK_BYTES,
                max_bytes=max_reply + ENVELOPE_BYTES,
                idle_s=timeout,
            )
            try:
                body = msgpack.unpackb(bytes(data), raw=False)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
                raise RemoteError(RequestError.INTERNAL, f"unreadable {method} reply: {e}") from None
            if (error := remote_error(body)) is not None:
                raise error
            return body

        try:
            return await asyncio.wait_for(call(), timeout)
        except TRANSPORT_ERRORS as e:
            raise RemoteError(RequestError.UNREACHABLE, f"{type(e).__name__}: {e}") from None


class RelayNode:
    """One peer's relay state: the frames delivered to it (``inbox``), those it sent or took (``outbox``), and how it
    pushes to another server (``client``; to itself straight into its own inbox)."""

    def __init__(
        self,
        limits: RelayLimits,
        *,
        me: str,
        client: RelayClient | None,
        push_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits, self.me, self.client, self.push_timeout_s = limits, me, client, push_timeout_s
        self.inbox, self.outbox = Inbox(limits, clock=clock), Outbox(limits, clock=clock)

    async def push(self, to: str, delivery: Deliver) -> bool:
        """Whether ``to`` took the delivery (a dead, refusing or unknown peer did not: the reply says so)."""
        try:
            if to == self.me:
                self.inbox.put(self.me, delivery)
            elif self.client is None:
                return False
            else:
                await self.client.push(to, delivery, timeout=self.push_timeout_s)
        except (RequestError, TimeoutError, ValueError) as e:
            logger.info(f"delivery of {delivery.mb}'s {delivery.kind} to {to} failed: {e}")
            return False
        return True

    def info(self) -> dict[str, Any]:
        return {"inbox": len(self.inbox), "inbox_bytes": self.inbox.nbytes, "outbox": len(self.outbox)}


class RelayBackend:
    """A ``StageBackend`` in front of another: a call by reference takes its input from the inbox (``x_from``: the
    frame its sender delivered, if it hashes to the committed digest; else ``MISSING_INPUT``), and a call that names
    ``deliver_to`` sends its output there and replies with its digest (``Reply.sent``) instead of the frame. Frames
    delivered count as received in ``traffic``, frames pushed as sent (the inner backend counts them as its own
    request and reply: the link that carried them)."""

    def __init__(self, backend: StageBackend, node: RelayNode) -> None:
        self.backend, self.node = backend, node

    async def forward(self, peer: PeerID, request: Forward) -> bytes:
        trainer = str(peer)
        if request.x_from is not None:
            key = InboxKey(trainer, request.mb, "activations", request.x_from)
            frame = await self.node.inbox.take(key, request.x_digest, wait_s=WAIT_FOR_DELIVERY_S)
            self.node.outbox.keep(trainer, request.mb, frame)
            request = dataclasses.replace(request, x=frame, x_from=None, x_digest=None, ref_bytes=0)
        to, request = request.deliver_to, dataclasses.replace(request, deliver_to=None)
        reply = await self.backend.forward(peer, request)
        return reply if to is None else await self._send_on(trainer, request.mb, "activations", reply, to)

    async def backward(self, peer: PeerID, request: Backward) -> bytes:
        trainer, received = str(peer), None
        if request.grad_from is not None:
            key = InboxKey(trainer, request.mb, "gradients", request.grad_from)
            received = await self.node.inbox.take(key, request.grad_digest, wait_s=WAIT_FOR_DELIVERY_S)
            request = dataclasses.replace(request, grad=received, grad_from=None, grad_digest=None, ref_bytes=0)
        to, request = request.deliver_to, dataclasses.replace(request, deliver_to=None)
        reply = await self.backend.backward(peer, request)
        self.node.outbox.forget(trainer, request.mb)  # its forward's frames: the trainer has no more use for them
        if received is not None:
            self.node.outbox.keep(trainer, request.mb, received)  # a probe of this backward fetches what it was given
        return reply if to is None else await self._send_on(trainer, request.mb, "gradients", reply, to)

    def info(self) -> dict[str, Any]:
        return {**self.backend.info(), "relay": self.node.info()}

    async def _send_on(self, trainer: str, mb: str, kind: str, reply: bytes, to: str) -> Reply:
        started, frame = time.perf_counter(), bytes(reply)
        committed = self.node.outbox.keep(trainer, mb, frame)
        delivered = await self.node.push(to, Deliver(trainer=trainer, mb=mb, kind=kind, frame=frame))
        server_s = getattr(reply, "server_s", None)
        return Reply(
            b"",
            codec=getattr(reply, "codec", None),
            server_s=None if server_s is None else server_s + time.perf_counter() - started,
            compute_s=getattr(reply, "compute_s", None),
            weights=getattr(reply, "weights", None),
            sent=Sent(committed, raw_frame_bytes(frame) or len(frame), delivered),
        )


class RelayServicer(GuardedServicer):
    """The relay RPC of a stage server: ``rpc_deliver`` (a frame pushed by another server, into the inbox within the
    sender's share; malformed or oversized: refused invalid, a strike) and ``rpc_fetch`` (a frame the caller's
    microbatch sent or received here, by digest). Both streamed: a frame of any size crosses."""

    def __init__(
        self,
        node: RelayNode,
        traffic: Traffic,
        *,
        limits: PeerLimits | None = None,
        verifier: Any = None,
        stream_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(label="relay", verifier=verifier, limits=limits, clock=clock)
        self.node, self.traffic, self.stream_timeout_s = node, traffic, stream_timeout_s
        self.max_request_bytes = node.limits.max_frame_bytes + ENVELOPE_BYTES

    async def rpc_deliver(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in reply_parts(await self._deliver(requests, context.remote_id), CHUNK_BYTES):
            yield runtime_pb2.ExpertResponse(metadata=part)
        await linger(self.stream_timeout_s)  # until the caller, its reply whole, closes the stream

    async def rpc_fetch(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in reply_parts(await self._fetch(requests, context.remote_id), CHUNK_BYTES):
            yield runtime_pb2.ExpertResponse(metadata=part)
        await linger(self.stream_timeout_s)

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID, kind: type[Any]) -> Any:
        self.screen(peer)
        data = await receive_stream(requests, max_bytes=self.max_request_bytes, timeout_s=self.stream_timeout_s)
        request = self.open_request(peer, data, kind, max_bytes=self.max_request_bytes)
        if not MICROBATCH_ID.fullmatch(request.mb):
            raise RequestError(RequestError.INVALID, f"microbatch id {request.mb[:40]!r} is malformed")
        return request

    async def _deliver(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID) -> bytes:
        try:
            delivery: Deliver = await self._receive(requests, peer, Deliver)
            check_delivery(delivery, self.node.limits)
            self.node.inbox.put(str(peer), delivery)
            self.traffic.received[delivery.kind] += len(delivery.frame)
            done: bytes = msgpack.packb({"ok": True}, use_bin_type=True)
            return done
        except Exception as e:
            return self.refuse(e, peer)

    async def _fetch(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: PeerID) -> bytes:
        try:
            request: Fetch = await self._receive(requests, peer, Fetch)
            trainer, node = str(peer), self.node
            frame = node.outbox.get(trainer, request.mb, request.digest) or node.inbox.find(
                trainer, request.mb, request.digest
            )
            if frame is None:
                raise RequestError(RequestError.NOT_FOUND, f"no frame of {request.mb} with that digest is held here")
            self.traffic.sent["relay_fetch"] += len(frame)
            reply: bytes = msgpack.packb({"y": frame}, use_bin_type=True)
            return reply
        except Exception as e:
            return self.refuse(e, peer)
