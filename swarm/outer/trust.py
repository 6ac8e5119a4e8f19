"""What one replica trusts of a state it did not make: whose word vouches, which rounds are within reach, how far weights.

A replica remembers the contributors of its last few rounds with others (only they vouch for a claim: an identity
costs nothing), the round and time it last knew the stage's state, by a round with others or an adoption (a claim
further ahead than time allows since, at the fastest a round can go, is beyond reach), and how far its global weights
moved per inner step in its own rounds (a state further from its own than that allows for the rounds between is
refused, and its source struck).

A round done alone tells nothing of the others: it leaves both the vouchers and the reach's mark as they were. Else a
replica that fell out of its group (a round failed, a download too) would count its reach from its own lone rounds,
which keep pace with the group's: a group two rounds ahead stays out of reach, and it never rejoins.

    >>> trust.did_round(8, ("a", "b"), now=t, inner_steps=40, moved=0.3, steps=20); trust.state_check(g, round_=8, ...)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from swarm.dht.records import StageStatus
from swarm.outer.state import StageState

# rounds whose contributors vouch: a Sybil must first take part in this replica's rounds, and is screened there
RECENT_ROUNDS = 4
SPEED_FACTOR = 16.0  # how much faster than this replica another may take its inner steps (a bigger GPU, no traffic)
DISTANCE_FACTOR = 4.0  # how much further per round than its own largest recent move an honest state may be
MOVES_KEPT = 8  # own rounds whose move per inner step is remembered
ABSURD_FACTOR = 10  # a claim this many times further ahead than the reach is no lagging clock or a fast peer: a lie


@dataclass(frozen=True)
class _Mark:
    round: int
    at: float  # event-loop time (virtual in tests)
    inner_steps: int


class StateTrust:
    """One replica's memory of its recent rounds, for judging claims and the states downloaded for them."""

    def __init__(self) -> None:
        self._first: _Mark | None = None  # the first round done or state adopted: the inner-step rate is measured since
        self._known_at: _Mark | None = None  # the last round with others, or adoption (else the first): reach's mark
        self._recent: deque[frozenset[str]] = deque(maxlen=RECENT_ROUNDS)
        self._moves: deque[float] = deque(maxlen=MOVES_KEPT)  # global weights' move per inner step, own rounds

    @property
    def has_history(self) -> bool:
        """Whether this replica has done a round or adopted a state (a newcomer has not: newcomer rules apply)."""
        return self._first is not None

    @property
    def known(self) -> frozenset[str]:
        """The peers that contributed to this replica's last ``RECENT_ROUNDS`` rounds with others: the only ones whose
        word vouches."""
        return frozenset().union(*self._recent)

    def did_round(
        self,
        round_: int,
        contributors: Collection[str],
        *,
        alone: bool = False,
        now: float,
        inner_steps: int,
        moved: float,
        steps: int,
    ) -> None:
        """A round done (``alone``: with no other replica), this replica now at ``round_``; its global weights moved by
        at most ``moved`` over ``steps``."""
        if steps > 0 and moved > 0:
            self._moves.append(moved / steps)
        mark = _Mark(round_, now, inner_steps)
        self._first = self._first or mark
        if not alone:
            self._recent.append(frozenset(contributors))
        if not alone or self._known_at is None:
            self._known_at = mark

    def adopted(self, round_: int, *, now: float, inner_steps: int) -> None:
        mark = _Mark(round_, now, inner_steps)
        self._first, self._known_at = self._first or mark, mark

    def reach(self, *, now: float, inner_steps: int, horizon: int, floor_s: float) -> int | None:
        """The latest round a claim may hold (None: no history, no bound): one more than the last round this replica
        did with others or adopted (or its first round, if it only did rounds alone), plus as many rounds as fit since,
        each at least ``floor_s`` (a replica's loop takes no two rounds closer) and at least ``horizon`` inner steps at
        ``SPEED_FACTOR`` × this replica's measured rate."""
        if self._first is None or self._known_at is None:
            return None
        lifetime = now - self._first.at
        rate = (inner_steps - self._first.inner_steps) / lifetime if lifetime >= 1.0 else 0.0
        round_s = max(floor_s, horizon / (SPEED_FACTOR * rate) if rate > 0 else 0.0)
        return self._known_at.round + 1 + int(max(0.0, now - self._known_at.at) / round_s)

    def absurd(self, round_: int, reach: int | None) -> bool:
        """A claimed round ``ABSURD_FACTOR`` times further past the reach's mark than the reach: struck, not ignored."""
        if reach is None or self._known_at is None:
            return False
        return round_ - self._known_at.round > ABSURD_FACTOR * max(1, reach - self._known_at.round)

    def weights_check(
        self, reference: Mapping[str, torch.Tensor], round_: int, horizon: int
    ) -> Callable[[StageState], None] | None:
        """What a downloaded state's weights must pass, held to ``reference`` (this replica's global weights at
        ``round_``): a distance of at most ``DISTANCE_FACTOR`` × its largest recent move per inner step × ``horizon``
        per round between, one more for a state at its own round. None while it has no move to go by."""
        per_step = max(self._moves, default=0.0)
        if per_step <= 0:
            return None

        def check(state: StageState) -> None:
            allowed = DISTANCE_FACTOR * per_step * horizon * (1 + max(0, state.round - round_))
            if (far := distance(state.params, reference)) > allowed:
                raise ValueError(
                    f"weights {far:.4g} from this replica's global ones, beyond {allowed:.4g} for round {state.round} "
                    f"from round {round_}: not a state training reaches"
                )

        return check

    def state_check(
        self, reference: Mapping[str, torch.Tensor], *, round_: int, horizon: int, reach: int | None
    ) -> Callable[[StageState], None]:
        """What a state downloaded to catch up must pass besides its claim: a round within ``reach``, weights within
        ``weights_check``'s distance of ``reference`` (the replica's global weights at ``round_``)."""
        near = self.weights_check(reference, round_, horizon)

        def check(state: StageState) -> None:
            if reach is not None and state.round > reach:
                raise ValueError(f"served round {state.round}, beyond round {reach} that this replica reaches")
            if near is not None:
                near(state)

        return check

    def liars(self, others: Mapping[str, StageStatus], reach: int | None) -> list[str]:
        """The peers whose records claim a round absurdly beyond ``reach`` (``absurd``): struck, not only ignored."""
        return [peer for peer, status in others.items() if self.absurd(status.outer_round, reach)]


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """‖a − b‖ over every tensor of ``b``, in float32 (a tensor at a time: no copy of the whole state)."""
    total = 0.0
    for name, ref in b.items():
        total += float((a[name].detach().float() - ref.detach().float()).norm()) ** 2
    return math.sqrt(total)
