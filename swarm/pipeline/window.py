"""The trainer's transport window: how many microbatches to keep in flight (``Window``, after BBR), and what each
one is stamped with when it starts (``Departure``), to judge its staleness when it lands.

    >>> window = Window(cap=4)
    >>> delivered, started = window.delivered, time.perf_counter()  # when a microbatch starts
    >>> window.land(delivered, started, now=time.perf_counter())  # when it lands: the new ``window.size``
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Departure:
    """What a training microbatch is stamped with when it starts, to judge it when it lands."""

    inner_steps: int  # stage 0's steps then: its staleness is the steps taken before it lands
    weights: int  # stage 0's weights epoch then (``Trainer.exclusive(change="replaced")`` starts a new one)
    at: float  # perf_counter then
    delivered: int  # microbatches landed before it started (``Window.delivered``)


class Window:
    """How many microbatches to keep in flight: a transport window over the pipeline.

    Its size is the bandwidth-delay product, as BBR measures it — the highest recent delivery rate
    (microbatches landed during one microbatch's round trip ÷ that round trip) × the lowest recent
    round trip — rounded up, plus one: the next microbatch always waits at the bottleneck, and while
    the pipeline has room (round trips stay at their minimum) each landing lets the window grow by
    one. Clamped to [1, ``cap``]; it starts at 1.

    That one waiting microbatch lengthens every round trip by a service time, and a window sized on
    such round trips would grow without end. So, as BBR's ProbeRTT, every ``probe_every`` landings
    the window drops the extra one until a microbatch started after that lands: its round trip,
    without our own queue, stays in the ``history`` the lowest one is taken from.

        >>> window = Window(cap=4)
        >>> delivered, started = window.delivered, time.perf_counter()  # when a microbatch starts
        >>> window.land(delivered, started, now=time.perf_counter())  # when it lands: the new ``window.size``
    """

    def __init__(self, cap: int, *, history: int = 64, probe_every: int = 32) -> None:
        self.cap, self.size = cap, 1
        self.delivered = 0  # microbatches landed (their gradients used or dropped)
        self._round_trips: deque[float] = deque(maxlen=history)  # seconds, start to landing
        self._rates: deque[float] = deque(maxlen=history)  # microbatches per second
        self._probe_every, self._probed_at = probe_every, 0  # landings between probes; delivered at the last one
        self._probe_since: float | None = None  # when the probe in progress began

    def land(self, delivered_before: int, started: float, *, now: float) -> int:
        """A microbatch that started at ``started`` when ``delivered_before`` had landed has landed now."""
        self.delivered += 1
        round_trip = max(now - started, 1e-6)
        self._round_trips.append(round_trip)
        self._rates.append((self.delivered - delivered_before) / round_trip)
        if self._probe_since is not None and started >= self._probe_since:
            self._probe_since = None  # measured without the extra microbatch
        elif self._probe_since is None and self.delivered - self._probed_at >= self._probe_every:
            self._probe_since, self._probed_at = now, self.delivered
        headroom = 0 if self._probe_since is not None else 1
        self.size = max(1, min(self.cap, math.ceil(self.in_flight_estimate - 1e-6) + headroom))
        return self.size

    @property
    def round_trip_s(self) -> float | None:
        """The lowest recent round trip: the pipeline's latency without queueing."""
        return min(self._round_trips, default=None)

    @property
    def microbatches_per_s(self) -> float | None:
        """The highest recent delivery rate."""
        return max(self._rates, default=None)

    @property
    def in_flight_estimate(self) -> float:
        """The bandwidth-delay product: microbatches in flight that keep the pipeline full, without a queue."""
        return (self.microbatches_per_s or 0.0) * (self.round_trip_s or 0.0)
