"""Peer metrics: the small signed record every peer publishes to the DHT every few seconds.

``Meter`` builds a peer's ``PeerMetrics`` (cumulative counters, rates, losses) and ``Traffic`` counts its wire
bytes by kind, once; ``swarmloco dashboard`` draws the records and each peer logs them as it publishes them.
Who counts what, and why the counters are cumulative: docs/architecture.md, dht/.

    >>> await membership.publish_metrics(meter.sample(server.status(queue=0), tokens=12_288, dht_stores=membership.stores))
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.dht.records import PeerMetrics, StageStatus
from swarm.events import TrainerProgress, Training


@dataclass
class Traffic:
    """Bytes of wire frames by kind, in each direction, and the boundary frames sent by codec."""

    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)
    frames: Counter[str] = field(default_factory=Counter)  # codec name → activation and gradient frames sent


class Meter:
    """A peer's metrics as they change: role, stage, state and losses are set where they happen;
    ``sample`` adds the stage status and turns a running token count into a rate."""

    def __init__(
        self,
        *,
        role: str,
        stage: int,
        state: str,
        name: str | None = None,
        device: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.role, self.stage, self.state, self.name, self.device = role, stage, state, name, device
        self.traffic = Traffic()
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.recoveries = 0
        self.window: int | None = None  # a trainer's, and its staleness, from its last progress record
        self.staleness_mean: float | None = None
        self.staleness_max: int | None = None
        self.last: PeerMetrics | None = None  # the latest sample: what the peer published
        self._clock = clock
        self._started = clock()
        self._since = (self._started, 0)  # (time, tokens) of the previous sample

    def observe(self, record: Training) -> None:
        """Take the losses of a trainer's or full peer's progress record, and a trainer's window and staleness (a
        non-finite loss is dropped: the DHT schema refuses it)."""
        for name, value in (("train_loss", record.train_loss), ("val_loss", record.val_loss)):
            if value is not None:
                setattr(self, name, float(value) if math.isfinite(value) else None)
        if isinstance(record, TrainerProgress):
            self.window = record.window
            self.staleness_mean = None if record.staleness_mean is None else float(record.staleness_mean)
            self.staleness_max = record.staleness_max

    def sample(
        self,
        status: StageStatus,
        *,
        tokens: int,
        bans: int = 0,
        busy_fraction: float | None = None,
        dht_stores: int = 0,
    ) -> PeerMetrics:
        """The record to publish now; ``tokens``: processed since the peer started; ``busy_fraction``: a stage server's,
        recent; ``dht_stores``: the peer's DHT stores since it started (``Membership.stores``)."""
        now = self._clock()
        (then, before), self._since = self._since, (now, tokens)
        self.last = PeerMetrics(
            role=self.role,
            name=self.name,
            stage=self.stage,
            state=self.state,
            step=status.inner_steps,
            train_loss=self.train_loss,
            val_loss=self.val_loss,
            tokens_per_s=max(tokens - before, 0) / max(now - then, 1e-9),
            tokens=tokens,
            uptime_s=max(now - self._started, 0.0),
            bytes_sent=dict(self.traffic.sent),
            bytes_received=dict(self.traffic.received),
            frames_sent=dict(self.traffic.frames),
            outer_round=status.outer_round,
            recoveries=self.recoveries,
            bans=bans,
            busy_fraction=busy_fraction,
            device=self.device,
            window=self.window,
            staleness_mean=self.staleness_mean,
            staleness_max=self.staleness_max,
            dht_stores=dht_stores,
            version=status.version,
        )
        return self.last
