"""NoLoCo's pair round: after matchmaking, each member fetches its partner's payload only.

The group (sorted peer ids) is cut into pairs, a triple when odd, by ``noloco.partners`` seeded with
the round number, so members that saw the same group pair alike with no further message. One transfer
per member, no leader, no commit; a member whose partner's payload does not come applies its round alone.

    >>> result = await pair_round(RoundContext(net=net, board=board, timing=timing, clock=time.time), key, payload)
"""

from __future__ import annotations

from collections.abc import Collection

from optim.noloco import partners
from swarm.outer.group import RoundKey, RoundResult, gather_payloads
from swarm.outer.matchmaking import RoundContext, meet


async def pair_round(
    ctx: RoundContext, key: RoundKey, payload: bytes, *, expected: Collection[str] | None = None
) -> RoundResult:
    """Take part in NoLoCo round ``key`` with ``payload``: the payloads of this member and its partner (or why none).

    Members are never forced equal (gossip), so a pairing that differs between two members' views of the group (a
    DHT race) costs nothing but an uneven pair. ``expected`` goes to ``meet``.
    """
    net, board, timing = ctx.net, ctx.board, ctx.timing
    met = await meet(ctx, key, payload, expected=expected)
    if isinstance(met, RoundResult):
        return met
    board.commit(key, None)  # no commit in a pair round: a request for one is answered at once
    me = met.members.index(net.me)
    pair = next(indices for indices in partners(len(met.members), key.round) if me in indices)
    fetched = await gather_payloads(net, key, [met.members[i] for i in sorted(pair) if i != me], timing.timeout_s)
    got = {net.me: payload} | fetched
    contributors = tuple(sorted(got))
    return RoundResult(
        outcome="done",
        payloads=tuple(got[peer] for peer in contributors),
        contributors=contributors,
        group=met.members,
        received=len(fetched),
        received_bytes=sum(map(len, fetched.values())),
    )
