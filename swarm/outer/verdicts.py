"""Trainers' verdicts as one replica counts them: which servers of its stage it leaves out of its outer rounds.

A trainer that condemns a server (``swarm/pipeline/checking.py``) names it in its record until the ban ends
(``StageStatus.condemned``). Identities are free, so a verdict counts only from a trainer listed for
``SEASONING_PERIODS`` announce periods, never from one that condemns more than half of the stage's replicas, never
against this replica itself, and together they leave out at most half of the stage (docs/architecture.md, outer/).

    >>> book = Verdicts(seasoning_s=15.0, forget_s=30.0); book.read(trainers, replicas, me="a", now=t); book.condemns("c", now=t)
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping

from swarm.config import TimeoutConfig
from swarm.dht.records import StageStatus

logger = logging.getLogger(__name__)
SEASONING_PERIODS = 3  # announce periods a trainer must have been listed before its verdicts count
TrainerReader = Callable[[], Awaitable[Mapping[str, StageStatus]]]  # peer id → record of the swarm's trainers (stage 0)


class Verdicts:
    """One replica's count of the swarm's trainers' verdicts: whom they condemn now, and until when (DHT time)."""

    def __init__(self, *, seasoning_s: float, forget_s: float, trainers: TrainerReader | None = None) -> None:
        self.seasoning_s, self.forget_s, self.trainers = seasoning_s, forget_s, trainers
        self.first_seen: dict[str, float] = {}  # trainer → when this replica first saw it listed
        self._last_seen: dict[str, float] = {}
        self.condemned: dict[str, float] = {}  # peer → end of the latest verdict counted
        self.ignored: set[str] = set()  # trainers whose verdicts were left out at the last read: they condemn too many
        self._accused_until = -math.inf  # the end of the latest verdict counted against this replica itself

    @classmethod
    def of(cls, timeouts: TimeoutConfig, trainers: TrainerReader | None) -> Verdicts:
        """Verdicts read from ``trainers`` (None: none read), seasoned over announce periods, forgotten with a record."""
        seasoning_s = SEASONING_PERIODS * timeouts.announce_period_s
        return cls(seasoning_s=seasoning_s, forget_s=timeouts.record_ttl_s, trainers=trainers)

    async def refresh(self, replicas: Collection[str], *, me: str, now: float) -> int:
        """Read the trainers' records again and ``read`` them; how many peers are newly condemned."""
        return 0 if self.trainers is None else len(self.read(await self.trainers(), replicas, me=me, now=now))

    def read(self, trainers: Mapping[str, StageStatus], replicas: Collection[str], *, me: str, now: float) -> set[str]:
        """Count the verdicts of ``trainers`` (their records, as listed at ``now``) on ``replicas`` (the stage's
        replicas as listed, this one, ``me``, included or not); the peers newly condemned."""
        self._see(trainers, now)
        stage = {*replicas, me}
        votes: Counter[str] = Counter()
        until: dict[str, float] = {}
        self.ignored = set()
        for trainer, status in sorted(trainers.items()):
            if now - self.first_seen[trainer] < self.seasoning_s:
                continue  # a fresh identity's word counts for nothing yet
            named = {peer: end for peer, end in status.condemned.items() if peer in stage and end > now}
            if 2 * len(named) > len(stage):  # an honest trainer finds a minority wrong, or the stage is lost anyway
                self.ignored.add(trainer)
                continue
            for peer, end in named.items():
                votes[peer] += 1
                until[peer] = max(until.get(peer, 0.0), end)
        if votes.pop(me, 0):  # a replica keeps its own Δ: it is no judge's to take out of its own round
            self._accused_until = max(self._accused_until, until[me])
        # at most half of the stage left out on trainers' word: the most condemned first (then by id: alike everywhere)
        kept = sorted(votes, key=lambda peer: (-votes[peer], peer))[: len(stage) // 2]
        before, self.condemned = self.condemned, {peer: until[peer] for peer in kept}
        new = set(self.condemned) - set(before)
        if new:
            logger.warning(f"trainers condemn {sorted(new)}: left out of the outer rounds while the verdicts last")
        return new

    def condemns(self, peer: str, *, now: float) -> bool:
        """Whether ``peer``'s verdict, as last read, still runs at ``now``."""
        return self.condemned.get(peer, 0.0) > now

    def accused(self, *, now: float) -> bool:
        """Whether a verdict counted against this replica itself ran within ``forget_s`` of ``now``: the others leave
        its Δ out, so weights it holds apart from theirs at a round are no sign of a lie but a set they did not apply,
        and it follows theirs (``ReplicaSync.catch_up``)."""
        return now < self._accused_until + self.forget_s

    def _see(self, trainers: Mapping[str, StageStatus], now: float) -> None:
        """Note who is listed; forget a trainer unseen for ``forget_s`` (it starts over if it comes back)."""
        for trainer in trainers:
            self.first_seen.setdefault(trainer, now)
            self._last_seen[trainer] = now
        for trainer, seen in list(self._last_seen.items()):
            if now - seen > self.forget_s:
                del self._last_seen[trainer], self.first_seen[trainer]
