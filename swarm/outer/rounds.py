"""The outer step over the network: the replicas of a stage meet for a round, all-gather their pseudo-gradients, agree on the set
(or, for NoLoCo, swap them in pairs).

Round r of stage s, for each replica that takes part (``run_round``; the network is passed in):

1. **Matchmaking.** The replica declares itself for round r in stage s's declarations (DHT key
   ``{swarm}/outer/{s}``) with its arrival time. The window closes ``window_s`` after it opened,
   or as soon as everyone the replica expects (the members of its previous round and the replicas
   the DHT shows at its round) has arrived; whoever declared by then is the group; a replica that
   expects nobody goes on alone. So a long window, which tolerates members finishing their
   previous round at different times, costs nothing when the group is complete. A replica that
   finds the window already closed is *late*: it catches up by state download. Declared times are
   each one peer's word, so the window opens at the *second* earliest plausible arrival, this
   replica's own counted (``window_opening``): one declaration, however early, closes nobody's
   window, and times no live round can have are ignored.
2. **All-gather.** Each member fetches every other member's payload (the outer optimizer's encoded
   Δ, whatever the method) from that member's ``Board`` through the blob service of
   ``swarm/outer/transfer.py``. A member that vanished or is too slow is left out after ``timeout_s``.
3. **Commit.** Fetches can fail differently on different members, so the group's leader (the
   earliest arrival, then the smallest peer id, among the members whose payload arrived: one that
   serves none, gone or there only to stall, leads nothing) publishes the list of (contributor,
   SHA-256) it gathered, and every member applies exactly that set, fetching from the leader any
   payload it lacks. A member that arrived after the leader's window closed applies the leader's
   set without its own payload, and keeps its progress for the next round (``ReplicaSync``; a lone leader's
   set is the exception: that leader kept its own weights, which only its state reproduces, so the member
   catches up by download). ``apply`` sorts the
   payloads, so the same set gives bitwise identical global weights everywhere. A member that gets
   no commit (the leader died) ends the round as *failed* and catches up by state download; if no
   replica got further, everyone keeps round r and tries again later.

NoLoCo's round (``pairs=True``) shares step 1, then each member fetches only its partner's payload
(pairs drawn from the group by the round number): one transfer per member, no leader, no commit.

Peers the caller bans (``excluded``) count as not declared: they join no group and lead none.
Every wait is bounded (``RoundTiming.max_round_s``): a round never hangs. Views of the DHT can
still differ in rare races, and a replica that closes its window early can lead a smaller group
than a later arrival sees (two leaders); ``ReplicaSync`` then notices replicas at the same round
with different weight hashes, and the one with the larger peer id downloads the other's state.

    >>> result = await run_round(net, board, RoundKey(stage=1, round=7), payload, RoundTiming(window_s=5, timeout_s=30), clock=time.time)
    >>> result.outcome, result.contributors                                   # ("done", ("12D3…a", "12D3…b"))
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgpack

from optim.noloco import partners
from swarm.config import TimeoutConfig
from swarm.dht.membership import Membership
from swarm.rpc.blobs import BlobClient, TransferError

logger = logging.getLogger(__name__)

OUTCOMES = ("done", "late", "failed")
_BLOB = re.compile(r"outer/(\d+)/(\d+)/(commit|payload/([\w.-]+))")
MAX_COMMIT_BYTES = 1 << 16


@dataclass(frozen=True, order=True)
class RoundKey:
    stage: int
    round: int

    def blob(self, what: str) -> str:
        """Name of a blob of this round: ``commit`` or ``payload/<owner>``."""
        return f"outer/{self.stage}/{self.round}/{what}"


@dataclass(frozen=True, kw_only=True)
class RoundTiming:
    window_s: float  # matchmaking window, from the first arrival
    timeout_s: float  # one payload transfer
    settle_s: float = 0.5  # after the window closes, before reading who came: the last declarations land

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.timeout_s > 0 and self.settle_s >= 0):
            raise ValueError(f"round timing must be positive, got {self}")

    @classmethod
    def of(cls, timeouts: TimeoutConfig) -> RoundTiming:
        """The swarm's round timing: the matchmaking window, the RPC timeout, settling for half the window (at most 0.5 s)."""
        return cls(
            window_s=timeouts.matchmaking_s, timeout_s=timeouts.rpc_s, settle_s=min(0.5, timeouts.matchmaking_s / 2)
        )

    @property
    def poll_s(self) -> float:
        """How often the arrivals are read while the window is open."""
        return min(0.25, self.window_s / 10)

    @property
    def max_round_s(self) -> float:
        """The longest any member spends in a round: window, settle, gather, then the commit (which waits out the leader's gather)."""
        return self.window_s + self.settle_s + 3 * self.timeout_s


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    outcome: str  # done | late | failed
    payloads: tuple[bytes, ...] = ()  # the agreed set (done), in contributor order
    contributors: tuple[str, ...] = ()  # whose payloads, sorted
    group: tuple[str, ...] = ()  # who declared within the window, sorted
    leader: str | None = None  # whose commit fixed the set
    relayed: frozenset[str] = frozenset()  # contributors whose payload came from the leader, not from them
    received: int = 0  # payloads this member fetched
    received_bytes: int = 0
    reason: str = ""  # why the round was not done

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


class GroupNetwork(Protocol):
    """One peer's view of the network for its outer rounds (a real one below; tests pass an in-memory one)."""

    me: str  # this peer's id

    async def declare(self, key: RoundKey, opened_at: float, expiration: float) -> None: ...

    async def declarations(self, key: RoundKey) -> dict[str, float]:
        """Peer id → arrival time of those who declared for ``key`` (records may lag or be missing)."""

    async def fetch(self, peer: str, name: str, timeout: float) -> bytes:
        """A whole, hash-checked blob from ``peer``'s board, or ``TransferError``."""


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


class Board:
    """What this peer offers its groups: the payloads it holds and the commits it leads (the ``outer`` blob provider).

    Entries are dropped ``retention_s`` after they were first offered: by then every member has
    finished the round, one way or another.
    """

    def __init__(self, *, retention_s: float, clock: Callable[[], float]) -> None:
        self.retention_s, self.clock = retention_s, clock
        self._payloads: dict[RoundKey, dict[str, bytes]] = {}
        self._commits: dict[RoundKey, bytes | None] = {}  # None: this peer does not lead that round
        self._decided: dict[RoundKey, asyncio.Event] = {}
        self._offered_at: dict[RoundKey, float] = {}
        self._own_tries: dict[RoundKey, set[bytes]] = {}  # digests of this peer's own payloads per round, retries too

    def offer(self, key: RoundKey, owner: str, payload: bytes) -> None:
        self._forget_old()
        self._offered_at.setdefault(key, self.clock())
        self._payloads.setdefault(key, {})[owner] = payload

    def earlier_tries(self, key: RoundKey, mine: bytes) -> set[bytes]:
        """Record ``mine``, the digest of this peer's payload for ``key``; returns those of its payloads for ``key``
        before it (a replica that tries a round again makes a new payload each time)."""
        tries = self._own_tries.setdefault(key, set())
        earlier = tries - {mine}
        tries.add(mine)
        return earlier

    def commit(self, key: RoundKey, entries: list[tuple[str, bytes]] | None) -> None:
        """Publish the agreed (owner, digest) list of a round this peer leads; None: it does not lead it."""
        self._commits[key] = (
            None if entries is None else msgpack.packb([[owner, d] for owner, d in entries], use_bin_type=True)
        )
        self._event(key).set()

    async def get(self, name: str) -> bytes:
        """A blob named ``outer/<stage>/<round>/(commit|payload/<owner>)``; a commit is waited for until decided."""
        match = _BLOB.fullmatch(name)
        if match is None:
            raise LookupError(f"not an outer-round blob: {name!r}")
        key = RoundKey(int(match[1]), int(match[2]))
        if key not in self._offered_at:  # this peer takes no part in that round: nothing to wait for
            raise LookupError(f"no part in {key}")
        if match[4] is not None:
            payload = self._payloads.get(key, {}).get(match[4])
            if payload is None:
                raise LookupError(f"no payload of {match[4]} for {key}")
            return payload
        await self._event(key).wait()  # bounded by the blob service
        commit = self._commits.get(key)
        if commit is None:
            raise LookupError(f"this peer does not lead {key}")
        return commit

    def _event(self, key: RoundKey) -> asyncio.Event:
        return self._decided.setdefault(key, asyncio.Event())

    def _forget_old(self) -> None:
        for key in [k for k, t in self._offered_at.items() if self.clock() - t > self.retention_s]:
            for table in (self._payloads, self._commits, self._decided, self._offered_at, self._own_tries):
                table.pop(key, None)


def parse_commit(data: bytes) -> list[tuple[str, bytes]]:
    """The leader's (owner, digest) list; TransferError if malformed."""
    try:
        entries = msgpack.unpackb(data, raw=False, max_bin_len=64, max_str_len=256)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise TransferError(f"unreadable commit: {e}") from None
    ok = (
        isinstance(entries, list)
        and entries
        and all(
            isinstance(e, list)
            and len(e) == 2
            and isinstance(e[0], str)
            and isinstance(e[1], bytes)
            and len(e[1]) == 32
            for e in entries
        )
    )
    if not ok or len({e[0] for e in entries}) != len(entries):
        raise TransferError("malformed commit: expected distinct [owner, sha256] pairs")
    return [(owner, d) for owner, d in entries]


async def run_round(
    net: GroupNetwork,
    board: Board,
    key: RoundKey,
    payload: bytes,
    timing: RoundTiming,
    *,
    clock: Callable[[], float],
    expected: Collection[str] | None = None,
    excluded: Callable[[str], bool] = lambda peer: False,
    on_declared: Callable[[float], None] = lambda opened_at: None,
    pairs: bool = False,
) -> RoundResult:
    """Take part in outer round ``key`` with ``payload``; returns the agreed payloads or why there are none.

    Once every peer in ``expected`` has arrived, the window closes without waiting out ``window_s``
    (at once for an empty set); None waits it out. Peers ``excluded`` (banned) count as not declared.
    ``on_declared`` is told the declared arrival time once the declaration is stored. ``pairs``: NoLoCo's
    round, which swaps payloads with one partner (``_swap_in_pairs``) instead of the group's all-gather.
    """
    if pairs:  # no leader, no commit: nothing to hash, no earlier try to recognise
        met = await _meet(net, board, key, payload, timing, clock, expected, excluded, on_declared)
        return met if isinstance(met, RoundResult) else await _swap_in_pairs(net, board, key, payload, met[0], timing)
    mine = digest(payload)
    earlier = board.earlier_tries(key, mine)  # recorded even if late: a leader may have taken what this peer offered
    met = await _meet(net, board, key, payload, timing, clock, expected, excluded, on_declared)
    if isinstance(met, RoundResult):
        return met
    group, arrived = met
    others = [peer for peer in group if peer != net.me]
    fetched = await asyncio.gather(
        *(_fetch_or_none(net, peer, key.blob(f"payload/{peer}"), timing.timeout_s) for peer in others)
    )
    got = {net.me: payload} | {peer: data for peer, data in zip(others, fetched) if data is not None}
    received = [data for data in fetched if data is not None]
    for owner, data in got.items():
        board.offer(key, owner, data)  # the leader hands out what others could not fetch themselves

    # The first to arrive leads (a late arrival that joined takes its set), of those whose payload came: one that serves
    # none (gone, or declared only to stall the round) leads nothing.
    leader = min(got, key=lambda peer: (arrived[peer], peer))
    relayed: set[str] = set()  # contributors whose payload this member has only the leader's word for
    if leader == net.me:
        entries = sorted((owner, digest(data)) for owner, data in got.items())
        board.commit(key, entries)
    else:
        board.commit(key, None)
        try:
            entries = parse_commit(await net.fetch(leader, key.blob("commit"), 2 * timing.timeout_s))
            for owner, wanted in entries:
                if owner == net.me and wanted in earlier:
                    # The leader took this replica's payload of an earlier try, whose commit never reached it; the
                    # set is honest, but this replica has undone that Δ since: it is late, and downloads the result.
                    return RoundResult(
                        outcome="late",
                        group=group,
                        leader=leader,
                        reason=f"the leader's set of {key} holds this replica's payload of an earlier try",
                    )
                if owner == net.me and wanted != mine:
                    raise TransferError("the leader's commit holds another payload as this replica's own")
                if owner not in got or digest(got[owner]) != wanted:
                    got[owner] = await net.fetch(leader, key.blob(f"payload/{owner}"), timing.timeout_s)
                    received.append(got[owner])
                    relayed.add(owner)
                    if digest(got[owner]) != wanted:
                        raise TransferError(f"the leader's copy of {owner}'s payload does not match its commit")
        except TransferError as e:
            return RoundResult(
                outcome="failed",
                group=group,
                leader=leader,
                received=len(received),
                received_bytes=sum(map(len, received)),
                reason=f"no usable commit from leader {leader}: {e}",
            )
    return RoundResult(
        outcome="done",
        payloads=tuple(got[owner] for owner, _ in entries),
        contributors=tuple(owner for owner, _ in entries),
        group=group,
        leader=leader,
        relayed=frozenset(relayed),
        received=len(received),
        received_bytes=sum(map(len, received)),
    )


async def _swap_in_pairs(
    net: GroupNetwork, board: Board, key: RoundKey, payload: bytes, group: tuple[str, ...], timing: RoundTiming
) -> RoundResult:
    """NoLoCo's exchange, after the matchmaking: fetch the payload of this member's partner only.

    The group (sorted peer ids) is cut into pairs, a triple when odd, by ``noloco.partners`` seeded
    with the round number, so members that saw the same group pair the same way without another
    message. One transfer per member (two in a triple) instead of K − 1, no leader, no commit, and
    nobody waits on anyone's gather: a member whose partner's payload does not come applies its
    round alone. Members are never forced equal (gossip), so a pairing that differs between two
    members' views of the group (a DHT race) costs nothing but an uneven pair.

        >>> result = await run_round(net, board, RoundKey(stage=1, round=7), payload, timing, clock=time.time, pairs=True)
        >>> result.contributors                                   # ("12D3…a", "12D3…c"): me and my partner
    """
    board.commit(key, None)  # no commit in a pair round: a request for one is answered at once
    me = group.index(net.me)
    pair = next(indices for indices in partners(len(group), key.round) if me in indices)
    others = [group[i] for i in sorted(pair) if i != me]
    fetched = await asyncio.gather(
        *(_fetch_or_none(net, peer, key.blob(f"payload/{peer}"), timing.timeout_s) for peer in others)
    )
    got = {net.me: payload} | {peer: data for peer, data in zip(others, fetched) if data is not None}
    received = [data for data in fetched if data is not None]
    contributors = tuple(sorted(got))
    return RoundResult(
        outcome="done",
        payloads=tuple(got[peer] for peer in contributors),
        contributors=contributors,
        group=group,
        received=len(received),
        received_bytes=sum(map(len, received)),
    )


async def _meet(
    net: GroupNetwork,
    board: Board,
    key: RoundKey,
    payload: bytes,
    timing: RoundTiming,
    clock: Callable[[], float],
    expected: Collection[str] | None,
    excluded: Callable[[str], bool],
    on_declared: Callable[[float], None],
) -> tuple[tuple[str, ...], dict[str, float]] | RoundResult:
    """Matchmaking (step 1): offer ``payload``, declare, wait out the window. The group (sorted, this peer in it) and
    every member's declared arrival, or a late ``RoundResult``."""
    now = clock()
    declared = await _declarations(net, key, excluded)
    if now > window_opening(declared, own=now, now=now, timing=timing) + timing.window_s:
        return RoundResult(outcome="late", reason=f"the window of {key} closed before this replica arrived")
    opened = now
    board.offer(key, net.me, payload)
    await net.declare(key, opened, opened + timing.max_round_s)
    on_declared(opened)  # the arrival time the others read, which orders the leader: not when the store returned
    waited_for = None if expected is None else {peer for peer in expected if peer != net.me and not excluded(peer)}
    seen = await _arrivals(net, key, opened, waited_for, timing, clock, excluded)
    now = clock()
    close = window_opening(seen, own=opened, now=now, timing=timing) + timing.window_s
    group = tuple(
        sorted(peer for peer, arrived in [*plausible_arrivals(seen, now, timing), (net.me, opened)] if arrived <= close)
    )
    if net.me not in group:
        return RoundResult(outcome="late", group=group, reason=f"arrived after the window of {key} closed")
    return group, seen | {net.me: opened}


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


async def _arrivals(
    net: GroupNetwork,
    key: RoundKey,
    opened: float,
    expected: set[str] | None,
    timing: RoundTiming,
    clock: Callable[[], float],
    excluded: Callable[[str], bool],
) -> dict[str, float]:
    """Who else declared for ``key``: read until the window has closed and settled, or until every expected peer is in."""
    while True:
        seen = await _declarations(net, key, excluded)
        remaining = window_opening(seen, own=opened, now=clock(), timing=timing) + timing.window_s
        remaining += timing.settle_s - clock()
        if remaining <= 0 or (expected is not None and expected <= seen.keys()):
            return seen
        await asyncio.sleep(min(remaining, timing.poll_s))


async def _declarations(net: GroupNetwork, key: RoundKey, excluded: Callable[[str], bool]) -> dict[str, float]:
    """The other peers' declared arrivals for ``key``, those of excluded peers left out."""
    return {peer: t for peer, t in (await net.declarations(key)).items() if peer != net.me and not excluded(peer)}


async def _fetch_or_none(net: GroupNetwork, peer: str, name: str, timeout: float) -> bytes | None:
    try:
        return await net.fetch(peer, name, timeout)
    except TransferError as e:
        logger.info(f"outer round: leaving {peer} out: {e}")
        return None


class P2PGroupNetwork:
    """``GroupNetwork`` over the swarm: declarations in the DHT (``Membership``), payloads over hivemind P2P."""

    def __init__(self, membership: Membership, blobs: BlobClient, *, max_payload_bytes: int) -> None:
        self.membership, self.blobs, self.max_payload_bytes = membership, blobs, max_payload_bytes
        self.me = membership.peer_id.to_base58()

    async def declare(self, key: RoundKey, opened_at: float, expiration: float) -> None:
        await self.membership.declare_round(key.stage, key.round, opened_at=opened_at, expiration=expiration)

    async def declarations(self, key: RoundKey) -> dict[str, float]:
        return {
            peer.to_base58(): t for peer, t in (await self.membership.round_declarations(key.stage, key.round)).items()
        }

    async def fetch(self, peer: str, name: str, timeout: float) -> bytes:
        return await self.blobs.fetch(peer, name, timeout=timeout, max_bytes=self.max_payload_bytes)
