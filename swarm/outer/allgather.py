"""The all-gather round (DiLoCo, SparseLoCo): every member fetches every other's payload, the leader fixes the set.

After matchmaking, each member fetches the others' payloads; fetches can fail differently on different
members, so the leader (the earliest arrival whose payload came) publishes the (owner, SHA-256) list it
gathered, and every member applies exactly that set, fetching from the leader any payload it lacks.

    >>> result = await allgather_round(RoundContext(net=net, board=board, timing=timing, clock=time.time), key, payload)
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from swarm.outer.board import MAX_COMMIT_BYTES, digest, parse_commit
from swarm.outer.group import GroupNetwork, RoundKey, RoundResult, RoundTiming, gather_payloads
from swarm.outer.matchmaking import Group, RoundContext, meet
from swarm.rpc.blobs import TransferError


class _EarlierTry(Exception):
    """The leader's set holds this replica's payload of an earlier try of the round (its commit never came)."""


@dataclass
class _Gathered:
    """The payloads this member holds for a round and how it got them."""

    got: dict[str, bytes]  # owner → payload, this member's own included
    received: list[bytes]  # the payloads it fetched, from their owners or from the leader
    relayed: set[str] = field(default_factory=set)  # owners whose payload it has only the leader's word for

    def result(self, outcome: str, met: Group, leader: str, **fields: Any) -> RoundResult:
        return RoundResult(
            outcome=outcome,
            group=met.members,
            leader=leader,
            received=len(self.received),
            received_bytes=sum(map(len, self.received)),
            **fields,
        )


async def allgather_round(
    ctx: RoundContext, key: RoundKey, payload: bytes, *, expected: Collection[str] | None = None
) -> RoundResult:
    """Take part in outer round ``key`` with ``payload``: the agreed payloads or why there are none. ``expected``
    goes to the matchmaking (``meet``)."""
    net, board, timing = ctx.net, ctx.board, ctx.timing
    mine = digest(payload)
    earlier = board.earlier_tries(key, mine)  # recorded even if late: a leader may have taken what this peer offered
    met = await meet(ctx, key, payload, expected=expected)
    if isinstance(met, RoundResult):
        return met
    fetched = await gather_payloads(net, key, [peer for peer in met.members if peer != net.me], timing.timeout_s)
    gathered = _Gathered(got={net.me: payload} | fetched, received=list(fetched.values()))
    for owner, data in gathered.got.items():
        board.offer(key, owner, data)  # the leader hands out what others could not fetch themselves
    # The first to arrive leads (a late arrival that joined takes its set), of those whose payload came: one that serves
    # none (gone, or declared only to stall the round) leads nothing.
    leader = min(gathered.got, key=lambda peer: (met.arrived[peer], peer))
    if leader == net.me:
        entries = sorted((owner, digest(data)) for owner, data in gathered.got.items())
        board.commit(key, entries)
    else:
        board.commit(key, None)
        try:
            entries = await _follow_commit(net, key, leader, timing, mine, earlier, gathered, ctx.excluded)
        except _EarlierTry:
            # The leader took this replica's payload of an earlier try, whose commit never reached it; the set is
            # honest, but this replica has undone that Δ since: it is late, and downloads the result.
            reason = f"the leader's set of {key} holds this replica's payload of an earlier try"
            return RoundResult(outcome="late", group=met.members, leader=leader, reason=reason)
        except TransferError as e:
            return gathered.result("failed", met, leader, reason=f"no usable commit from leader {leader}: {e}")
    return gathered.result(
        "done",
        met,
        leader,
        payloads=tuple(gathered.got[owner] for owner, _ in entries),
        contributors=tuple(owner for owner, _ in entries),
        relayed=frozenset(gathered.relayed),
    )


async def _follow_commit(
    net: GroupNetwork,
    key: RoundKey,
    leader: str,
    timing: RoundTiming,
    mine: bytes,
    earlier: set[bytes],
    gathered: _Gathered,
    excluded: Callable[[str], bool],
) -> list[tuple[str, bytes]]:
    """The leader's commit (at most ``MAX_COMMIT_BYTES``) less the payloads of peers ``excluded`` here, each payload
    it names that this member lacks fetched from the leader into ``gathered``; ``TransferError`` if unusable,
    ``_EarlierTry`` if it holds an earlier try of mine."""
    commit = await net.fetch(leader, key.blob("commit"), 2 * timing.timeout_s, max_bytes=MAX_COMMIT_BYTES)
    # A leader that has not (yet) counted a verdict or a ban this member has counted may take the payload of a peer
    # this member left out: that payload stays out here (this member's global weights then differ from the leader's
    # for the round, and the stage's records settle which weights the others follow: ``claims_to_follow``).
    entries = [(owner, wanted) for owner, wanted in parse_commit(commit) if owner == net.me or not excluded(owner)]
    got = gathered.got
    for owner, wanted in entries:
        if owner == net.me and wanted in earlier:
            raise _EarlierTry
        if owner == net.me and wanted != mine:
            raise TransferError("the leader's commit holds another payload as this replica's own")
        if owner not in got or digest(got[owner]) != wanted:
            got[owner] = await net.fetch(leader, key.blob(f"payload/{owner}"), timing.timeout_s)
            gathered.received.append(got[owner])
            gathered.relayed.add(owner)
            if digest(got[owner]) != wanted:
                raise TransferError(f"the leader's copy of {owner}'s payload does not match its commit")
    return entries
