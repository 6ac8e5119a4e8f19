"""An outer round's vocabulary: its key, timing and result, and the network its members see.

A round is stage ``s``'s round ``r`` (``RoundKey``); ``RoundTiming`` bounds every wait in it and
``RoundResult`` says how it ended. ``GroupNetwork`` is one peer's view of the others (declarations in
the DHT, payloads and commits over hivemind P2P: ``P2PGroupNetwork``; tests pass an in-memory one).

    >>> net = P2PGroupNetwork(membership, blobs, max_payload_bytes=max_payload_bytes(params)); RoundKey(1, 7).blob("commit")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm.config import TimeoutConfig
from swarm.dht.membership import Membership
from swarm.rpc.blobs import BlobClient, TransferError

logger = logging.getLogger(__name__)

OUTCOMES = ("done", "late", "failed")


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
    # a declared time older than this when read is one peer's word: it makes nobody late unless its payload is shown
    clock_skew_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.timeout_s > 0 and self.settle_s >= 0 and self.clock_skew_s >= 0):
            raise ValueError(f"round timing must be positive, got {self}")

    @classmethod
    def of(cls, timeouts: TimeoutConfig) -> RoundTiming:
        """The swarm's round timing: the matchmaking window, the RPC timeout, settling for half the window (at most
        0.5 s), the clock skew (at most half the window: a declaration that makes a replica late is older than that)."""
        return cls(
            window_s=timeouts.matchmaking_s,
            timeout_s=timeouts.rpc_s,
            settle_s=min(0.5, timeouts.matchmaking_s / 2),
            clock_skew_s=min(timeouts.clock_skew_s, timeouts.matchmaking_s / 2),
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

    async def fetch(self, peer: str, name: str, timeout: float, *, max_bytes: int | None = None) -> bytes:
        """A whole, hash-checked blob from ``peer``'s board of at most ``max_bytes`` (None: the largest payload of this
        peer's stage), or ``TransferError``."""


async def gather_payloads(net: GroupNetwork, key: RoundKey, peers: Sequence[str], timeout: float) -> dict[str, bytes]:
    """The payloads of ``peers`` for round ``key``, fetched at once; a peer whose payload does not come is left out."""
    fetched = await asyncio.gather(*(_fetch_or_none(net, peer, key.blob(f"payload/{peer}"), timeout) for peer in peers))
    return {peer: data for peer, data in zip(peers, fetched) if data is not None}


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

    async def fetch(self, peer: str, name: str, timeout: float, *, max_bytes: int | None = None) -> bytes:
        bound = self.max_payload_bytes if max_bytes is None else max_bytes  # refused by its announced size, unread
        # a bytearray, the buffer the blob arrived in: read as bytes, never copied (a payload may be a whole stage)
        return await self.blobs.fetch(peer, name, timeout=timeout, max_bytes=bound)  # type: ignore[return-value]
