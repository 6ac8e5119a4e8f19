"""Claims: which state a replica may download, and what the state it gets must pass.

Replicas announce ``(outer_round, global_hash)`` in their stage records. A claim announced by two or
more replicas (for a replica catching up: two that took part in its recent rounds) is *vouched for*;
whenever a stage has one, lone claims are ignored. Every claim's weights, vouched or not, must stay near
the downloader's own (``check_plausible``): neither one peer's word nor many identities install anything.

    >>> claims = catch_up_claims(stage_claims(others, me=(me, 7, own_hash)), round_=7, weights_hash=own_hash, me=me)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm.dht.records import StageStatus
from swarm.outer.state import StageState, weights_hash

# What a state's weights are held to: a replica's own or the seeded weights, or their norms (name → norm)
Reference = Mapping[str, torch.Tensor] | Mapping[str, float]
# A lone claim's weights may differ from a replica's own by at most this factor in any tensor's norm: an honest
# replica a few rounds ahead differs by a few percent, a liar's scaled (×1000) or zeroed weights by far more.
LONE_CLAIM_MAX_NORM_RATIO = 10.0
# A newcomer compares with the seeded initial weights, which training moves much further (yet not ×100).
NEWCOMER_MAX_NORM_RATIO = 100.0

StateCheck = Callable[[StageState], None]  # raises ValueError for a state the downloader must not adopt


class RecordBehind(ValueError):
    """A holder served a later round than its record claims: it did a round after it last announced (records lag by
    up to an announce period). Refused, since nothing vouches for the later weights, but no sign of a lie: no strike."""


@dataclass(frozen=True, kw_only=True)
class StateClaim:
    """Replicas announcing that they hold the global weights ``weights_hash`` after ``round`` outer rounds."""

    round: int
    weights_hash: str  # "" when the stage has no outer step (nothing to vouch for)
    holders: tuple[str, ...]  # peer ids, sorted; the downloader's own id when it holds this state too
    known: frozenset[str] | None = None  # the holders whose word counts (None: every one's; ``StateTrust.known``)

    @property
    def vouchers(self) -> tuple[str, ...]:
        """The holders whose word counts towards vouching."""
        return self.holders if self.known is None else tuple(p for p in self.holders if p in self.known)

    @property
    def vouched(self) -> bool:
        """Announced by more than one replica whose word counts: no single peer's word."""
        return len(self.vouchers) >= 2 and bool(self.weights_hash)

    def check(self, state: StageState) -> None:
        """ValueError unless ``state`` is exactly the claimed one: its round, and weights that hash as announced
        (``RecordBehind`` for a later round: the holder's record lags, which is refused but not blamed)."""
        if state.round > self.round:
            raise RecordBehind(f"served the state of round {state.round}, its record still claims round {self.round}")
        if state.round != self.round:
            raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
        if self.weights_hash and (served := weights_hash(state.params)) != self.weights_hash:
            raise ValueError(f"served weights hashing to {served}, its record claims {self.weights_hash}")

    def acceptance(self, reference: Reference, *, max_norm_ratio: float, also: StateCheck | None = None) -> StateCheck:
        """What a state downloaded for this claim must pass: when vouched for, be exactly the claimed one (``check``);
        on one peer's word only, be of the claimed round or a later one (the peer may have done rounds since it
        announced; its word is all there is either way). Either way its weights' norms stay within
        ``max_norm_ratio`` of ``reference``'s (``check_plausible``: identities are free, so vouching skips no check),
        and it passes ``also`` (the downloader's own: ``StateTrust``'s reach and distance)."""

        def check(state: StageState) -> None:
            if self.vouched:
                self.check(state)
            elif state.round < self.round:
                raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
            check_plausible(state.params, reference, max_norm_ratio=max_norm_ratio)
            if also is not None:
                also(state)

        return check


def stage_claims(
    others: Mapping[str, StageStatus],
    *,
    me: tuple[str, int, str] | None = None,
    known: Collection[str] | None = None,
) -> list[StateClaim]:
    """The stage's claims from its replicas' records (``others``) and, as (peer id, round, hash), the downloader's own.
    ``known``: the peers whose word vouches (the downloader itself always does), None: everyone's."""
    holders: dict[tuple[int, str], list[str]] = {}
    for peer, status in others.items():
        holders.setdefault((status.outer_round, status.global_hash), []).append(peer)
    if me is not None and me[2]:
        holders.setdefault((me[1], me[2]), []).append(me[0])
    counted = None if known is None else frozenset(known) | ({me[0]} if me is not None else set())
    return [
        StateClaim(round=r, weights_hash=h, holders=tuple(sorted(peers)), known=counted)
        for (r, h), peers in holders.items()
    ]


def newcomer_claims(claims: Sequence[StateClaim]) -> list[StateClaim]:
    """The claims a replica with no state of its own tries, best first: the vouched ones if the stage has any (latest
    round, then most holders), else the lone ones (latest round first)."""
    vouched = [c for c in claims if c.vouched]
    return sorted(vouched or claims, key=lambda c: (-c.round, -len(c.holders), c.holders))


def newcomer_acceptance(seeded: Reference) -> Callable[[StateClaim], StateCheck]:
    """What a peer holding none of a stage's weights asks of each claim's state: exactly the claimed one when vouched
    for, else weights within ``NEWCOMER_MAX_NORM_RATIO`` of the ``seeded`` ones (the stage's seeded weights, or
    their norms: ``stages.seeded_norms``) (``StateClaim.acceptance``)."""
    return lambda claim: claim.acceptance(seeded, max_norm_ratio=NEWCOMER_MAX_NORM_RATIO)


def catch_up_claims(
    claims: Sequence[StateClaim], *, round_: int, weights_hash: str, me: str, leader: str | None = None
) -> list[StateClaim]:
    """The claims a replica at ``round_`` holding ``weights_hash`` should download, best first; empty: keep its own.

    It follows a claim to a later round, or one at its own round with other weights (a group split
    by a DHT race) that has more holders than its own, or as many and the smallest peer id. With a
    vouched claim anywhere in the stage (its own included), it follows only vouched claims, and a
    later round of ``leader``'s: the leader of its round, which closed that round alone before this
    replica arrived (``install.lone_leader_is_late``), so only its state takes it past the round.
    """
    own = StateClaim(round=round_, weights_hash=weights_hash, holders=(me,))
    own = next((c for c in claims if c.round == round_ and c.weights_hash == weights_hash and me in c.holders), own)

    def better(c: StateClaim) -> bool:
        if c.round != round_:
            return c.round > round_
        if not c.weights_hash or c.weights_hash == weights_hash:
            return False
        return (-len(c.holders), c.holders[0]) < (-len(own.holders), own.holders[0])

    ahead = [c for c in claims if better(c)]
    if any(c.vouched for c in claims):
        ahead = [c for c in ahead if c.vouched or (c.round > round_ and leader in c.holders)]
    return sorted(ahead, key=lambda c: (-c.round, -len(c.holders), c.holders))


def claims_to_follow(
    others: Mapping[str, StageStatus],
    *,
    me: str,
    round_: int,
    weights_hash: str,
    last_group: Collection[str],
    replicas_agree: bool = True,
    known: Collection[str] | None = None,
    reach: int | None = None,
    leader: str | None = None,
    settling: Collection[str] = (),
) -> list[StateClaim]:
    """The claims a replica at ``round_`` holding ``weights_hash`` catches up to, best first (``catch_up_claims``),
    from the records of its stage's other replicas (``others``). Only ``known`` peers vouch (None: all), and a claim
    past round ``reach`` (None: no bound) is not followed: nothing honest gets there from where this replica was.
    ``leader``: the lone leader of the round this replica arrived late at, whose later round it follows on its own
    word (``catch_up_claims``).

    A member of its last round (``last_group``) applied the same commit: other weights for that round are its own
    doing (its screening differed, or it lies), not a split group to converge with, so that record is left out.
    Where replicas never agree (NoLoCo: ``replicas_agree`` False), other weights at its round are normal: only
    later rounds are followed.

    Other weights at its own round are judged only once the records have settled: while a live member of its last
    round (``settling``) still announces an earlier round, its holders of this round are not all counted, and a
    minority whose record came first (an attacker that applies its own set, one record per identity) could outnumber
    or tie the part of the honest majority shown so far (measured: the −9× flip's replica won a 1-to-1 tie on its peer
    id and the honest replica adopted its state; docs/benchmarks.md, "SparseLoCo bounded to the median member's norm").
    """
    disowned = {
        p for p, s in others.items() if p in last_group and s.outer_round == round_ and s.global_hash != weights_hash
    }
    within = {p: s for p, s in others.items() if p not in disowned and (reach is None or s.outer_round <= reach)}
    claims = stage_claims(within, me=(me, round_, weights_hash), known=known)
    follow = catch_up_claims(claims, round_=round_, weights_hash=weights_hash, me=me, leader=leader)
    settled = all(others[p].outer_round >= round_ for p in settling if p in others and p != me)
    return follow if replicas_agree and settled else [claim for claim in follow if claim.round > round_]


def round_to_meet(
    follow: Sequence[StateClaim],
    others: Mapping[str, StageStatus],
    *,
    round_: int,
    known: Collection[str],
    reach: int | None,
) -> int | None:
    """Where replicas never agree (NoLoCo), the round a replica at ``round_`` moves its counter on to, to meet the
    others there, keeping its own weights; None: it stays. The latest of the claims it would follow (``follow``, from
    ``claims_to_follow``) and of the rounds the records of ``known`` peers (those of its recent rounds: whose word
    vouches) claim, each no further than ``reach``.

    A known peer's word alone suffices for a round, though not for weights: the stage's halves split by a late round
    hold one vouched claim each, and ``claims_to_follow`` would keep the half behind off the other's claim (vouched
    by peers of which it knows only one) for good. Moving the counter takes nothing but the round on their word.
    """
    rounds = [c.round for c in follow if c.round > round_ and (reach is None or c.round <= reach)]
    rounds += [
        s.outer_round
        for peer, s in others.items()
        if peer in known and s.outer_round > round_ and (reach is None or s.outer_round <= reach)
    ]
    return max(rounds, default=None)


def check_plausible(params: Mapping[str, torch.Tensor], reference: Reference, *, max_norm_ratio: float) -> None:
    """ValueError if a tensor's norm differs from ``reference``'s by more than ``max_norm_ratio`` either way.

    ``reference`` holds tensors, or their norms (``stages.seeded_norms``: the seeded weights', without drawing them).
    """
    for name, value in params.items():
        # float32 norms: 20× faster than float64 copies on a CPU, and ×max_norm_ratio leaves room for their rounding
        given = reference[name]
        ref = float(given) if isinstance(given, float) else float(given.detach().float().norm())
        norm = float(value.detach().float().norm())
        if ref > 0 and not ref / max_norm_ratio <= norm <= ref * max_norm_ratio:
            raise ValueError(
                f"{name}: norm {norm:.4g} against {ref:.4g} here, beyond ×{max_norm_ratio:g}: not a replica's weights"
            )
