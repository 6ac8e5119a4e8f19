"""A stage server's defences against misbehaving peers: per-peer request rates and bans (pure code).

``PeerGuard`` gives every remote peer a token bucket and counts its invalid requests: ``strikes`` of them within
``strike_window_s`` ban it for ``ban_s``; the table is bounded, the longest-silent forgotten first. Time is
injected. More: docs/architecture.md, rpc/.

    >>> guard.banned_for(peer) or not guard.take(peer)  # refuse; guard.strike(peer) after an invalid request
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class PeerLimits:
    rate: float = 100.0  # requests per second a peer may sustain (a trainer sends 2 per hop: forward and backward)
    burst: float = 200.0  # requests a quiet peer may send at once
    strikes: int = 16  # invalid requests within strike_window_s that get a peer banned
    strike_window_s: float = 60.0
    ban_s: float = 300.0
    max_peers: int = 4096  # peers remembered at once

    def __post_init__(self) -> None:
        if min(self.rate, self.burst, self.strike_window_s, self.ban_s) <= 0 or self.strikes < 1 or self.max_peers < 1:
            raise ValueError(f"peer limits must be positive, got {self}")
        if self.burst < 1:
            raise ValueError(f"burst must allow at least one request, got {self.burst}")


@dataclass
class _PeerState:
    tokens: float
    refilled_at: float
    strikes: deque[float] = field(default_factory=deque)  # times of recent invalid requests
    banned_until: float = float("-inf")


class PeerGuard:
    """Rate limits and bans by peer id; ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(self, limits: PeerLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits or PeerLimits(), clock
        self._peers: OrderedDict[Hashable, _PeerState] = OrderedDict()

    def banned_for(self, peer: Hashable) -> float:
        """Seconds left of the peer's ban; 0.0 if it is not banned."""
        return max(0.0, self._state(peer).banned_until - self.clock())

    def take(self, peer: Hashable) -> bool:
        """Spend one request of the peer's budget; False if it has none left right now."""
        state, now = self._state(peer), self.clock()
        state.tokens = min(self.limits.burst, state.tokens + (now - state.refilled_at) * self.limits.rate)
        state.refilled_at = now
        if state.tokens < 1.0:
            return False
        state.tokens -= 1.0
        return True

    def refund(self, peer: Hashable) -> None:
        """Give back one request ``take`` spent (it was refused for another reason, or cut short by this side)."""
        state = self._state(peer)
        state.tokens = min(self.limits.burst, state.tokens + 1.0)

    def strike(self, peer: Hashable) -> bool:
        """Count an invalid request; True if it got the peer banned."""
        state, now = self._state(peer), self.clock()
        state.strikes.append(now)
        while state.strikes[0] <= now - self.limits.strike_window_s:
            state.strikes.popleft()
        if len(state.strikes) < self.limits.strikes:
            return False
        state.strikes.clear()
        state.banned_until = now + self.limits.ban_s
        return True

    def pardon(self, peer: Hashable) -> bool:
        """Take back the peer's latest strike (a ban stays); True if there was one to take back."""
        state = self._peers.get(peer)
        if state is None or not state.strikes:
            return False
        state.strikes.pop()
        return True

    def __len__(self) -> int:
        return len(self._peers)

    def _state(self, peer: Hashable) -> _PeerState:
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _PeerState(tokens=self.limits.burst, refilled_at=self.clock())
            if len(self._peers) > self.limits.max_peers:
                self._peers.popitem(last=False)
        self._peers.move_to_end(peer)
        return state
