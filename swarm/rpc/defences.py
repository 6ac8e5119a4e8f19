"""A stage server's defences against misbehaving peers: per-peer request rates and bans, and what one identity may
take of a peer's serving (pure code).

``PeerGuard`` gives every remote peer a token bucket and counts its invalid requests: ``strikes`` of them within
``strike_window_s`` ban it for ``ban_s``; the table is bounded, the longest-silent forgotten first. ``ServingLimits``
bounds one identity's streams, bytes and requests held (blobs.py, pipeline/protocol.py). Time is injected. More:
docs/architecture.md, rpc/.

    >>> guard.banned_for(peer) or not guard.take(peer)  # refuse; guard.strike(peer) after an invalid request
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

STATE_PREFIXES = ("state", "local")  # blobs that are a whole stage's weights (and its outer optimizer's)


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


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """What one identity may take of a peer's serving, whatever it asks (issue 42, bounded serving); over any bound it
    is told busy, no strike (a joiner chasing a stage whose rounds cut its downloads is no liar).

    Blobs (``BlobServicer``): streams open at once, per blob a budget of times, and for a stage's state (``state/``,
    ``local/``) bytes: a token bucket of ``peer_share`` of the holder's upload, refilled continuously up to
    ``burst_bytes``; the upload is the fastest of its last blobs sent whole, ``upload_bytes_per_s`` at least. A state is
    admitted while the peer's bucket is not in debt, charged its size when its header goes out and given back what was
    not sent, so one identity takes at most ``burst_bytes`` + ``peer_share`` × upload × t + one state in t seconds. A 125m middle stage of 3 (28.3M parameters) is 113 MB of fp32
    weights, 226 MB as a state with its momentum: one identity gets it whole at once, then one every 72 s at the
    defaults (2.5 MB/s, a fifth of a 100 Mbit/s uplink), where it took 16 GB in 200 s unbounded.

    Forwards (``StageServicer``): requests held at once, of the server's ``max_pending``.
    """

    # an outer round fetches one payload per member at a time, per stage: a full peer holds every stage (2 limited
    # full peers' rounds of 3 stages, which then failed); a joiner downloads one state (a retry after a cut: two)
    streams_per_peer: int = 16
    state_streams_per_peer: int = 2
    # per prefix: (times each blob at once, seconds to earn one more), per (peer, blob). A joiner needs a stage's state
    # once, two or three times if rounds cut it; a round's member fetches each of its blobs once (twice if cut)
    budgets: tuple[tuple[str, float, float], ...] = (("state", 4.0, 60.0), ("local", 4.0, 60.0), ("outer", 3.0, 60.0))
    # the holder's upload: at least this (a volunteer's 100 Mbit/s; math.inf: no byte bound), or as fast as its recent
    # blobs went out (``BlobServicer.uplink``); and one identity's share of it: a stage's
    # other replicas, a joiner and a drainer are 4 identities asking one holder, each one's fair share a quarter
    upload_bytes_per_s: float = 12.5e6
    peer_share: float = 0.2
    burst_bytes: float = float(64 << 20)
    # of a stage server's requests held at once (``max_pending``, 8 by default): a trainer keeps at most 4
    # microbatches in flight (``TrainerOptions.in_flight``), and a check's recompute or a probe may come with them
    pending_per_peer: int = 6

    def __post_init__(self) -> None:
        problems = [
            self.streams_per_peer < 1 or not 1 <= self.state_streams_per_peer <= self.streams_per_peer,
            any(burst < 1 or every_s <= 0 for _, burst, every_s in self.budgets),
            not self.upload_bytes_per_s > 0 or not 0 < self.peer_share <= 1 or not 1 <= self.burst_bytes < math.inf,
            self.pending_per_peer < 1,
        ]
        if any(problems):
            raise ValueError(
                f"serving limits: at least one stream (state streams within the streams), one blob per budget, one "
                f"request held, a positive upload, a share in (0, 1] and a finite burst of at least a byte, got {self}"
            )

    def state_bytes(self, uplink: float = 0.0) -> PeerLimits | None:
        """One identity's bucket of state bytes (``PeerGuard``'s, counting bytes) on an upload of ``uplink`` bytes/s
        measured (``upload_bytes_per_s`` at least); None without a byte bound."""
        if math.isinf(self.upload_bytes_per_s):
            return None
        return PeerLimits(rate=self.peer_share * max(uplink, self.upload_bytes_per_s), burst=self.burst_bytes)


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

    def take(self, peer: Hashable, amount: float = 1.0) -> bool:
        """Spend ``amount`` of the peer's budget (one request); False if it has not that much left right now."""
        if self.tokens(peer) < amount:
            return False
        self._state(peer).tokens -= amount
        return True

    def charge(self, peer: Hashable, amount: float) -> None:
        """Spend ``amount`` of the peer's budget even past zero: a debt the refill pays off (bytes being sent)."""
        self.tokens(peer)
        self._state(peer).tokens -= amount

    def tokens(self, peer: Hashable) -> float:
        """The peer's budget now (below zero: a debt), refilled up to ``burst`` since it was last looked at."""
        state, now = self._state(peer), self.clock()
        state.tokens = min(self.limits.burst, state.tokens + (now - state.refilled_at) * self.limits.rate)
        state.refilled_at = now
        return state.tokens

    def refund(self, peer: Hashable, amount: float = 1.0) -> None:
        """Give back ``amount`` that ``take`` or ``charge`` spent (refused for another reason, or cut short by this
        side)."""
        state = self._state(peer)
        state.tokens = min(self.limits.burst, state.tokens + amount)

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
