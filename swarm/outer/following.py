"""Which claim a replica catching up follows: a state to download and adopt, or (NoLoCo) a round to move on to.

Pure rules over a replica's ``SyncState``, its round and what it trusts (``StateTrust``: whose word vouches, which
rounds are within reach), on top of ``claims.claims_to_follow`` and ``claims.round_to_meet``;
``ReplicaSync.catch_up`` carries the plan out.

    >>> plan = catch_up_plan(state, me="a", round_=7, reach=9, known=trust.known, accused=False, replicas_agree=True)
    >>> plan.downloads  # claims to try, best first; plan.skip_to: NoLoCo's round to meet the others at
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from swarm.outer.claims import StateClaim, claims_to_follow, round_to_meet
from swarm.outer.download import Served
from swarm.outer.sync_state import SyncState


@dataclass(frozen=True)
class CatchUp:
    """What a replica does after reading its stage's records: move its round counter on to ``skip_to`` (NoLoCo),
    or try ``downloads`` in order (best first) until one delivers; neither: it stays where it is."""

    skip_to: int | None = None
    downloads: tuple[StateClaim, ...] = ()


def catch_up_plan(
    state: SyncState,
    *,
    me: str,
    round_: int,
    reach: int | None,
    known: Collection[str] | None,
    accused: bool,
    replicas_agree: bool,
) -> CatchUp:
    """The catch-up of a replica at ``round_`` (``known``: the peers whose word vouches, None for a replica with no
    history of its own yet; ``accused``: a counted trainers' verdict names it; ``reach``: ``StateTrust.reach``).

    Where replicas never agree (NoLoCo), a replica with a history of its own (a round done, a state adopted) only
    moves its round counter on (``round_to_meet``): there is no stage state to converge on, only a round to meet the
    others at, and a download would throw away its own progress since its last round. (A NoLoCo replica a round behind
    stayed behind for good: the holders of the claim it followed, a round every second, had moved on by the time they
    served their state, ``RecordBehind``; or the half of the stage ahead held a claim vouched by peers of which it
    knew only one, and its own half's vouched claim kept it off that.)"""
    follow = claims_to_follow(
        state.others,
        me=me,
        round_=round_,
        weights_hash=state.global_hash,
        # members of its last round that entered it from other global weights (their records said so) end it on
        # other weights too: a split to converge with, not their own doing; accused: they left this replica out
        last_group=() if accused else state.same_entry,
        replicas_agree=replicas_agree,
        known=known,
        reach=reach,
        # the lone leader of the round this replica came late to: its state, on its own word if it is one of the
        # peers whose word vouches (a Sybil that closes every round alone never becomes one)
        leader=state.lone_leader if known is None or state.lone_leader in known else None,
        settling=state.last_group,
    )
    if (
        not replicas_agree and known is not None
    ):  # NoLoCo: its own weights are as good as any; the round is all it lacks
        return CatchUp(skip_to=round_to_meet(follow, state.others, round_=round_, known=known, reach=reach))
    return CatchUp(downloads=tuple(follow))


def download_reason(claim: StateClaim, round_: int) -> str:
    """Why a replica at ``round_`` downloads ``claim``'s state: it is behind, or its weights diverged at its round."""
    return "behind" if claim.round > round_ else "diverged"


def still_ahead(ahead: Served | None, round_: int) -> Served | None:
    """A state kept because it was served ahead of its holder's record, unless this replica got to its round itself
    (then it is of no more use)."""
    return ahead if ahead is not None and ahead[1].round > round_ else None
