"""What a stage server's work is measured by: bytes on the wire by kind, and how busy it is.

``MeteredBackend`` wraps a stage server's ``StageBackend`` and counts the requests it receives and the replies
it sends (by codec) into the peer's ``Traffic``; ``BusyTime`` is the server's busy fraction, whose complement
is the pipeline's bubbles. More: docs/architecture.md, pipeline/.

    >>> busy = BusyTime(window_s=30.0); busy.add(start, end); busy.fractions()  # (recent, since the first request)
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
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
        return self._sent(request, await self.backend.forward(peer, request))

    async def backward(self, peer: PeerID, request: Backward) -> bytes:
        self.traffic.received.update(_request_frames(request))
        return self._sent(request, await self.backend.backward(peer, request))

    def _sent(self, request: Forward | Backward, reply: bytes) -> bytes:
        self.traffic.sent[_reply_kind(request)] += len(reply)
        if (codec := getattr(reply, "codec", None)) is not None:  # a ``Reply`` says its codec
            self.traffic.frames[codec] += 1
        return reply

    def info(self) -> dict[str, Any]:
        return self.backend.info()


class BusyTime:
    """Busy intervals of one compute thread, as fractions of wall time; ``add`` may run on another thread than ``fractions``.

    Intervals are those of a single thread, so they never overlap. Wall time starts at the first
    interval's start: a server waiting for its first trainer is not idle in a pipeline yet. The
    recent fraction covers the last ``window_s`` (or less, so far); both are None before the first.
    """

    def __init__(self, *, window_s: float = 30.0, clock: Callable[[], float] = time.perf_counter) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s, self.clock = window_s, clock
        self.first_start: float | None = None
        self.total_s = 0.0
        self._recent: deque[tuple[float, float]] = deque()  # (start, end), oldest first, those ending in the window
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            if self.first_start is None:
                self.first_start = start
            self.total_s += max(end - start, 0.0)
            self._recent.append((start, end))
            self._trim(end)

    def fractions(self) -> tuple[float | None, float | None]:
        """(busy fraction over the recent window, since the first interval), each in [0, 1]; None before any."""
        now = self.clock()
        with self._lock:
            if self.first_start is None:
                return None, None
            self._trim(now)
            since = max(now - self.window_s, self.first_start)
            recent = sum(min(end, now) - max(start, since) for start, end in self._recent if end > since)
            return _fraction(recent, now - since), _fraction(self.total_s, now - self.first_start)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][1] <= now - self.window_s:
            self._recent.popleft()


def _fraction(busy_s: float, wall_s: float) -> float:
    return min(max(busy_s / wall_s, 0.0), 1.0) if wall_s > 0 else 1.0  # no wall time yet: the first request runs
