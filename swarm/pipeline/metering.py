"""Bytes on the wire by kind, counted where a stage server answers stage calls.

A thin wrapper around a stage server's ``StageBackend``: requests count as received, replies as
sent, into the peer's ``Traffic`` (``swarm/dht/metrics.py``), which its metrics record publishes.
A trainer counts its own calls (``Trainer._count``, which also knows what fp32 would have cost).

    >>> traffic = Traffic()
    >>> servicer = StageServicer(MeteredBackend(server, traffic), stage=1, max_request_bytes=server.max_request_bytes)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hivemind.p2p import PeerID

from swarm.dht.metrics import Traffic
from swarm.pipeline.protocol import Backward, Forward, StageBackend


def _request_frames(request: Forward | Backward) -> Counter[str]:
    if isinstance(request, Forward):
        return Counter({_reply_kind(request): len(request.x)})
    return Counter({"gradients": len(request.grad), "activations": len(request.x or b"")})  # x: an input resent


def _reply_kind(request: Forward | Backward) -> str:
    if isinstance(request, Backward):
        return "gradients"
    return "activations" if request.train else "eval"  # validation traffic apart, as the trainer counts it


class MeteredBackend:
    """A stage server's ``StageBackend``: requests count as received, replies as sent."""

    def __init__(self, backend: StageBackend, traffic: Traffic) -> None:
        self.backend, self.traffic = backend, traffic

    async def forward(self, peer: PeerID, request: Forward) -> bytes:
        self.traffic.received.update(_request_frames(request))
        reply = await self.backend.forward(peer, request)
        self.traffic.sent[_reply_kind(request)] += len(reply)
        return reply

    async def backward(self, peer: PeerID, request: Backward) -> bytes:
        self.traffic.received.update(_request_frames(request))
        reply = await self.backend.backward(peer, request)
        self.traffic.sent[_reply_kind(request)] += len(reply)
        return reply

    def info(self) -> dict[str, Any]:
        return self.backend.info()
