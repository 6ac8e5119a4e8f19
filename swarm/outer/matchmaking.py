"""Matchmaking: the replicas of a stage that declare for the same round within its window form its group.

A replica declares its arrival in the DHT; the window closes ``window_s`` after it opened (at the
second earliest plausible arrival: one early declaration closes nobody's window), or as soon as every
replica it expects is in. A replica that finds the window closed is late and catches up by download, once
the (stale: older than the clock skew) declarations that closed it are backed by their payloads (``Backing``).

    >>> ctx = RoundContext(net=net, board=board, timing=timing, clock=time.time)
    >>> met = await meet(ctx, RoundKey(stage=1, round=7), payload)   # Group or late RoundResult
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from swarm.dht.records import StageStatus
from swarm.outer.board import Board
from swarm.outer.group import GroupNetwork, RoundKey, RoundResult, RoundTiming, gather_payloads

Blame = Callable[[str, str], None]  # (peer, why): a strike (``Accountability.strike``)


@dataclass(frozen=True)
class Group:
    """Who met for a round: the members (sorted peer ids, this peer among them) and each one's declared arrival."""

    members: tuple[str, ...]
    arrived: Mapping[str, float]


@dataclass(frozen=True, kw_only=True)
class RoundContext:
    """What a replica brings to each round of its stage: its network and board, the timing and clock, and its
    policies: whom it leaves out (``excluded``: banned, condemned), whom it strikes (``blame``), and whom it tells of
    its declaration (``on_declared(key, opened_at)``, once it is stored)."""

    net: GroupNetwork
    board: Board
    timing: RoundTiming
    clock: Callable[[], float]
    excluded: Callable[[str], bool] = lambda peer: False
    blame: Blame = lambda peer, why: None
    on_declared: Callable[[RoundKey, float], None] = lambda key, opened_at: None


async def meet(
    ctx: RoundContext, key: RoundKey, payload: bytes, *, expected: Collection[str] | None = None
) -> Group | RoundResult:
    """Offer ``payload`` on the board, declare for ``key``, wait out the window: the group, or a late ``RoundResult``.

    Once every peer in ``expected`` has arrived, the window closes without waiting out ``window_s`` (at once for an
    empty set); None waits it out. Peers ``ctx.excluded`` count as not declared; ``ctx.blame`` hears of each declarer
    that would close the window on a stale time and shows no payload (``Backing``).
    """
    net, timing, clock = ctx.net, ctx.timing, ctx.clock
    backing = Backing(ctx, key)
    now = clock()
    declared = await backing.read(own=now)
    if now > window_opening(declared, own=now, now=now, timing=timing) + timing.window_s:
        return RoundResult(outcome="late", reason=f"the window of {key} closed before this replica arrived")
    opened = now
    ctx.board.offer(key, net.me, payload)
    await net.declare(key, opened, opened + timing.max_round_s)
    # the arrival time the others read, which orders the leader: not when the store returned
    ctx.on_declared(key, opened)
    waited_for = None if expected is None else {p for p in expected if p != net.me and not ctx.excluded(p)}
    seen = await _arrivals(backing, opened, waited_for)
    now = clock()
    close = window_opening(seen, own=opened, now=now, timing=timing) + timing.window_s
    members = tuple(
        sorted(peer for peer, arrived in [*plausible_arrivals(seen, now, timing), (net.me, opened)] if arrived <= close)
    )
    if net.me not in members:
        return RoundResult(outcome="late", group=members, reason=f"arrived after the window of {key} closed")
    return Group(members, seen | {net.me: opened})


def expected_members(
    me: str,
    last_group: Iterable[str],
    others: Mapping[str, StageStatus],
    round_: int,
    excluded: Callable[[str], bool],
) -> set[str] | None:
    """Whom a replica at ``round_`` waits for: the members of its last round and every replica the records (``others``)
    show at this round or one behind (finishing its last round, or catching up to this one); if there are other
    replicas but none of those (records lag behind a replica that just caught up), the whole window (None); nobody
    when this replica is alone.

    Waiting only for the last round's members would keep a split group split: two halves that once met apart would
    each close their window as soon as their own half was in, round after round.
    """
    current = (peer for peer, s in others.items() if round_ - 1 <= s.outer_round <= round_)
    expected = {peer for peer in {*last_group, *current} if peer != me and not excluded(peer)}
    return expected or (None if others else set())


async def window_open(ctx: RoundContext, key: RoundKey) -> bool:
    """Whether another replica has opened round ``key`` and its window is still open."""
    timing, seen, now = ctx.timing, await ctx.net.declarations(key), ctx.clock()
    others = {peer: t for peer, t in plausible_arrivals(seen, now, timing) if peer != ctx.net.me}
    return bool(others) and now <= window_opening(others, own=now, now=now, timing=timing) + timing.window_s


def window_opening(arrivals: Mapping[str, float], *, own: float, now: float, timing: RoundTiming) -> float:
    """When a round's window opened, for a replica arriving at ``own`` that sees the other declarations ``arrivals``.

    Each declared time is one peer's word. A time no live round can have (before ``now − max_round_s``,
    or after ``now + window_s``: beyond any clock skew) is ignored; of the rest and ``own``, the window
    opens at the second earliest, so a single early declaration closes no window before this
    replica arrives, and never after ``own``, so a declaration from the future holds no window open.
    """
    times = sorted([own, *(t for _, t in plausible_arrivals(arrivals, now, timing))])
    return min(times[1] if len(times) > 1 else own, own)


def plausible_arrivals(arrivals: Mapping[str, float], now: float, timing: RoundTiming) -> list[tuple[str, float]]:
    """The (peer, declared time) pairs a live round can have: not before ``now − max_round_s``, not after ``now + window_s``."""
    return [(peer, t) for peer, t in arrivals.items() if now - timing.max_round_s <= t <= now + timing.window_s]


@dataclass
class Backing:
    """The declarations for one round as one replica reads them, backed: a declaration whose time is older than
    ``timing.clock_skew_s`` when read is one peer's word, and would it close this replica's window (make it late),
    its declarer must show its payload for the round (every honest declarer offers one before it declares; its
    board keeps it for ``max_round_s``). One that does not, within the transfer timeout, is blamed and left out."""

    ctx: RoundContext
    key: RoundKey
    backed: set[str] = field(default_factory=set)  # declarers that showed their payload
    unbacked: set[str] = field(default_factory=set)  # declarers that did not: left out of this round

    async def read(self, *, own: float) -> dict[str, float]:
        """The other peers' declared arrivals for the round, as this replica arriving at ``own`` may count them."""
        ctx, timing = self.ctx, self.ctx.timing
        while True:
            declared = await _declarations(ctx.net, self.key, ctx.excluded)
            seen = {p: t for p, t in declared.items() if p not in self.unbacked}
            now = ctx.clock()
            opening = window_opening(seen, own=own, now=now, timing=timing)
            if own <= opening + timing.window_s:
                return seen  # the window is open for this replica: no declaration makes it late
            stale = now - timing.clock_skew_s
            closers = [p for p, t in plausible_arrivals(seen, now, timing) if t <= min(opening, stale)]
            unproven = [p for p in closers if p not in self.backed]
            if not unproven:
                return seen
            shown = await gather_payloads(ctx.net, self.key, unproven, timing.timeout_s)
            self.backed |= shown.keys()
            for peer in set(unproven) - shown.keys():
                self.unbacked.add(peer)
                ctx.blame(peer, f"it declared for {self.key} long opened and shows no payload for it")
            if not self.unbacked & set(unproven):
                return seen


async def _arrivals(backing: Backing, opened: float, expected: set[str] | None) -> dict[str, float]:
    """Who else declared for the round: read until the window has closed and settled, or until every expected peer is in."""
    timing, clock = backing.ctx.timing, backing.ctx.clock
    while True:
        seen = await backing.read(own=opened)
        remaining = window_opening(seen, own=opened, now=clock(), timing=timing) + timing.window_s
        remaining += timing.settle_s - clock()
        if remaining <= 0 or (expected is not None and expected <= seen.keys()):
            return seen
        await asyncio.sleep(min(remaining, timing.poll_s))


async def _declarations(net: GroupNetwork, key: RoundKey, excluded: Callable[[str], bool]) -> dict[str, float]:
    """The other peers' declared arrivals for ``key``, those of excluded peers left out."""
    return {peer: t for peer, t in (await net.declarations(key)).items() if peer != net.me and not excluded(peer)}
