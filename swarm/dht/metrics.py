"""Peer metrics: the small signed record every peer publishes to the DHT every few seconds.

Each peer stores a ``PeerMetrics`` under ``{swarm_id}/metrics`` with its own subkey (peer id +
owner marker, as stage records), so one DHT get returns every live peer's latest numbers
(``Membership.metrics``), a record is schema-checked by every DHT node that stores it, and it
expires with its peer. ``scripts/dashboard.py`` draws them; each peer also logs the record it
published last with its JSONL lines (under ``"metrics"``), so the file and the dashboard agree.

Counters are cumulative (bytes, recoveries) so a reader that misses a record loses nothing;
tokens/s is a rate over the last period. Bytes are wire frames by kind, counted by thin wrappers
around the calls a trainer makes (``MeteredCalls``) and the ones a stage server answers
(``MeteredBackend``); other parts of a peer add their own kinds to ``meter.traffic``.

    >>> meter = Meter(role="stage", stage=1, state="serving")
    >>> servicer = StageServicer(MeteredBackend(server, meter.traffic), stage=1, max_request_bytes=server.max_request_bytes)
    >>> await membership.publish_metrics(meter.sample(server.status(queue=0), tokens=12_288))
    >>> await membership.metrics()  # {PeerID: PeerMetrics} of every live peer
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

import pydantic.v1 as pydantic
from hivemind.p2p import PeerID

from swarm.pipeline.protocol import Backward, Forward, StageBackend

if TYPE_CHECKING:  # both import swarm.dht.membership, which imports this module
    from swarm.dht.membership import StageStatus
    from swarm.pipeline.trainer import StageCalls

STATES = ("joining", "serving", "training", "recovering")  # joining: not yet working (state download, waiting for stages)
MAX_KINDS = 16

Kind = pydantic.constr(regex=r"^[a-z][a-z0-9_]{0,31}$", strict=True)  # activations, gradients, eval, ...
ByteCounts = Dict[Kind, pydantic.conint(ge=0, strict=True)]
Loss = Optional[pydantic.confloat(ge=0.0, strict=True, allow_inf_nan=False)]


class PeerMetrics(pydantic.BaseModel):
    """One peer's numbers; strict types, as hivemind's SchemaValidator requires."""

    role: pydantic.constr(regex=r"^(trainer|stage)$", strict=True)
    stage: pydantic.conint(ge=0, strict=True)  # 0 = trainers (the edge stage)
    state: pydantic.constr(regex=rf"^({'|'.join(STATES)})$", strict=True)
    step: pydantic.conint(ge=0, strict=True)  # inner steps of its stage replica
    train_loss: Loss = None  # trainers: mean over the last logged steps
    val_loss: Loss = None  # trainers: the last validation pass
    tokens_per_s: pydantic.confloat(ge=0.0, strict=True, allow_inf_nan=False) = 0.0  # over the last period
    bytes_sent: ByteCounts = {}  # wire frames by kind, since the peer started
    bytes_received: ByteCounts = {}
    outer_round: pydantic.conint(ge=0, strict=True) = 0
    recoveries: pydantic.conint(ge=0, strict=True) = 0  # stages this peer rebuilt from their neighbours
    bans: pydantic.conint(ge=0, strict=True) = 0  # peers it refuses to call right now
    version: pydantic.conint(ge=0, strict=True)

    @pydantic.validator("bytes_sent", "bytes_received")
    def _few_kinds(cls, counts: dict[str, int]) -> dict[str, int]:
        if len(counts) > MAX_KINDS:
            raise ValueError(f"at most {MAX_KINDS} kinds of traffic, got {len(counts)}")
        return counts


@dataclass
class Traffic:
    """Bytes of wire frames by kind, in each direction."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)


def _request_frames(request: Forward | Backward) -> Counter[str]:
    if isinstance(request, Forward):
        return Counter({_reply_kind(request): len(request.x)})
    return Counter({"gradients": len(request.grad), "activations": len(request.x or b"")})  # x: an input resent


def _reply_kind(request: Forward | Backward) -> str:
    if isinstance(request, Backward):
        return "gradients"
    return "activations" if request.train else "eval"  # validation traffic apart, as the trainer counts it


class MeteredCalls:
    """A trainer's ``StageCalls``: requests count as sent, replies as received."""

    def __init__(self, calls: StageCalls, traffic: Traffic) -> None:
        self.calls, self.traffic = calls, traffic

    async def forward(self, peer: PeerID, request: Forward, *, timeout: float) -> bytes:
        self.traffic.sent.update(_request_frames(request))
        reply = await self.calls.forward(peer, request, timeout=timeout)
        self.traffic.received[_reply_kind(request)] += len(reply)
        return reply

    async def backward(self, peer: PeerID, request: Backward, *, timeout: float) -> bytes:
        self.traffic.sent.update(_request_frames(request))
        reply = await self.calls.backward(peer, request, timeout=timeout)
        self.traffic.received[_reply_kind(request)] += len(reply)
        return reply


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


class Meter:
    """A peer's metrics as they change: role, stage, state and losses are set where they happen;
    ``sample`` adds the stage status and turns a running token count into a rate."""

    def __init__(self, *, role: str, stage: int, state: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self.stage, self.state = role, stage, state
        self.traffic = Traffic()
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.recoveries = 0
        self.last: PeerMetrics | None = None  # the latest sample: what the peer published
        self._clock = clock
        self._since = (clock(), 0)  # (time, tokens) of the previous sample

    def observe(self, record: Mapping[str, Any]) -> None:
        """Take the losses of a trainer's progress record (a non-finite one is dropped: the DHT schema refuses it)."""
        for name in ("train_loss", "val_loss"):
            if (value := record.get(name)) is not None:
                setattr(self, name, float(value) if math.isfinite(value) else None)

    def sample(self, status: StageStatus, *, tokens: int, bans: int = 0) -> PeerMetrics:
        """The record to publish now; ``tokens``: processed since the peer started."""
        now = self._clock()
        (then, before), self._since = self._since, (now, tokens)
        self.last = PeerMetrics(
            role=self.role, stage=self.stage, state=self.state, step=status.inner_steps, train_loss=self.train_loss,
            val_loss=self.val_loss, tokens_per_s=max(tokens - before, 0) / max(now - then, 1e-9),
            bytes_sent=dict(self.traffic.sent), bytes_received=dict(self.traffic.received), outer_round=status.outer_round,
            recoveries=self.recoveries, bans=bans, version=status.version)
        return self.last
