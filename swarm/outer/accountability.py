"""Holding peers to account in one replica's outer rounds and downloads: strikes, bans and pardons.

A peer whose Δ the outer optimizer dropped (if it served that Δ itself), a leader that served its
payload but no usable commit, and a peer that served a state it does not hold get a strike; two
within an hour ban it for an hour (``OUTER_PEER_LIMITS``): a banned peer's declarations, payloads,
claims and states are ignored. A leader's strike for a lost commit is taken back when it next leads.

    >>> accounts = Accountability(stage=1, counters=counters); accounts.strike(peer, "why"); accounts.excluded(peer)
"""

from __future__ import annotations

import logging
from collections import Counter

from optim.outer import Screening
from swarm.events import EventSink, OuterStrike
from swarm.outer.group import RoundResult
from swarm.rpc.defences import PeerGuard, PeerLimits

logger = logging.getLogger(__name__)
# Two offences within an hour (a Δ dropped or clipped, a withheld commit, a false state) keep a peer out of this
# replica's rounds and downloads for an hour: one may be bad luck (a diverged replica, a dropped link), a repeat is not.
OUTER_PEER_LIMITS = PeerLimits(strikes=2, strike_window_s=3600.0, ban_s=3600.0)


class Accountability:
    """The strikes and bans one replica keeps (in ``guard``, which a peer's replicas may share), counted in ``counters``
    (``outer_strikes``, ``outer_bans``) and logged (``OuterStrike``)."""

    def __init__(
        self,
        *,
        stage: int,
        counters: Counter[str],
        guard: PeerGuard | None = None,
        on_log: EventSink = lambda event: None,
    ) -> None:
        self.stage, self.counters, self.on_log = stage, counters, on_log
        self.guard = guard or PeerGuard(OUTER_PEER_LIMITS)
        self.unproven: set[str] = set()  # leaders struck for a commit that never came, until they lead a round with me

    def excluded(self, peer: str) -> bool:
        """Whether ``peer`` is banned from this replica's rounds and downloads."""
        return self.guard.banned_for(peer) > 0

    def strike(self, peer: str, reason: str) -> None:
        """Count one offence of ``peer`` (a dropped or clipped Δ, a withheld commit, a false state); enough ban it."""
        banned = self.guard.strike(peer)
        self.counters["outer_strikes"] += 1
        self.counters["outer_bans"] += banned
        logger.warning(f"stage {self.stage}: {'banned' if banned else 'a strike against'} {peer}: {reason}")
        self.on_log(OuterStrike(stage=self.stage, peer=peer, reason=reason, banned=banned))

    def hold_to_account(self, result: RoundResult, screening: Screening, round_: int, *, me: str) -> None:
        """A strike for each other member whose Δ for round ``round_`` the outer optimizer dropped, if it served that Δ
        itself (a payload relayed by the leader is only the leader's word). ``me``: this replica's peer id."""
        # Clipped is no offence: a pair clips the larger honest Δ of two replicas that trained at different speeds.
        offences = dict(screening.dropped)
        for index, why in sorted(offences.items()):
            sender = result.contributors[index]
            if sender != me and sender not in result.relayed:
                self.strike(sender, f"its pseudo-gradient for round {round_}: {why}")

    def commit_withheld(self, result: RoundResult, *, me: str) -> None:
        """A strike for the leader of a failed round, another replica: it served its payload moments ago, then no (or a
        false) commit — gone, or stalling the round, or a stream lost in transit, which looks the same (2 of 9
        8M-token runs on loopback had one; ``acquit``)."""
        if result.outcome == "failed" and result.leader not in (None, me):
            self.strike(result.leader, result.reason)
            self.unproven.add(result.leader)

    def acquit(self, result: RoundResult, round_: int, *, me: str) -> None:
        """Take back the strike of a leader whose commit never came, once it leads a round (``round_``) that this replica
        completes with it: a staller withholds its commits round after round and is banned at its second strike, while
        two streams lost in transit an hour apart would otherwise ban an honest partner and split the stage for an hour."""
        leader = result.leader
        if leader in self.unproven and leader != me and me in result.contributors:
            self.unproven.discard(leader)
            if self.guard.pardon(leader):
                logger.info(f"stage {self.stage}: {leader} led round {round_} with this replica: strike taken back")
