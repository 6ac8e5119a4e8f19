"""Adaptive hop deadlines: how long a trainer waits for a stage server, from that server's measured service times.

A hop's deadline is ``multiple`` × the p95 of the server's recent successful calls, floored by ``floor_s`` and by the
link's transfer estimate for the frame at hand, capped by ``rpc_s``; a server without its own history gets the stage's
p95 with more slack, or ``rpc_s`` if the stage has none. ``misses`` deadlines missed in a row (no success between)
ask the router for a ban, again at each later miss. Pure code; time is the caller's. docs/architecture.md, pipeline/.

    >>> timeout = deadlines.deadline(stage, peer, transfer_s=link_s); ...; deadlines.observe(stage, peer, elapsed)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

HISTORY = 32  # service times kept per server
MIN_SAMPLES = 5  # before them, a server's own p95 is not trusted
NEW_PEER_SLACK = 4.0  # a server judged by its stage's p95 (its own unknown) gets this much more time: it may be slower


@dataclass(frozen=True, kw_only=True)
class DeadlineRule:
    rpc_s: float  # the cap, and the deadline of a server nothing is known about
    multiple: float = 4.0  # × the recent p95
    floor_s: float = 2.0  # the least any call gets (a loaded host pauses for a second now and then)
    misses: int = 2  # deadlines missed in a row that get a server banned

    def __post_init__(self) -> None:
        if min(self.rpc_s, self.floor_s) <= 0 or self.multiple < 1 or self.misses < 1:
            raise ValueError(f"deadline rule must be positive (multiple ≥ 1), got {self}")


def p95(samples: deque[float] | list[float]) -> float:
    """The 95th percentile (nearest rank) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class Deadlines:
    """Per (stage, server): recent service times and consecutive misses."""

    def __init__(self, rule: DeadlineRule) -> None:
        self.rule = rule
        self._times: dict[tuple[int, Hashable], deque[float]] = {}
        self._misses: dict[tuple[int, Hashable], int] = {}

    def deadline(self, stage: int, peer: Hashable, *, transfer_s: float = 0.0, floor_s: float = 0.0) -> float:
        """Seconds to wait for this call: ``transfer_s``, the link's estimate for its frames (× ``multiple`` too, for
        a frame larger than those measured); ``floor_s``, a floor of the call's own (a streamed call's keep-alives)."""
        rule = self.rule
        own = self._times.get((stage, peer))
        if own is not None and len(own) >= MIN_SAMPLES:
            measured = rule.multiple * p95(own)
        elif stage_times := [t for (s, p), times in self._times.items() if s == stage and p != peer for t in times]:
            measured = NEW_PEER_SLACK * rule.multiple * p95(stage_times)
        else:
            return rule.rpc_s
        return min(rule.rpc_s, max(measured, rule.floor_s, floor_s, rule.multiple * transfer_s))

    def observe(self, stage: int, peer: Hashable, seconds: float) -> None:
        """A call served in ``seconds``: a service time, and the end of a run of misses."""
        self._times.setdefault((stage, peer), deque(maxlen=HISTORY)).append(seconds)
        self._misses.pop((stage, peer), None)

    def miss(self, stage: int, peer: Hashable) -> bool:
        """A deadline missed; True if the server has now missed ``misses`` in a row (and so at each further miss)."""
        key = (stage, peer)
        self._misses[key] = self._misses.get(key, 0) + 1
        return self._misses[key] >= self.rule.misses

    def misses(self, stage: int, peer: Hashable) -> int:
        return self._misses.get((stage, peer), 0)
