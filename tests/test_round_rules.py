"""The outer round rules as plain functions of a replica's ``SyncState`` and its stage's records: when a round is due
or held back (``pacing``), which claim a replica follows (``following``), and how a result is installed (``install``).
No network, no clock: times are plain numbers."""

from __future__ import annotations

import torch

from swarm.dht.records import StageStatus
from swarm.outer.following import CatchUp, catch_up_plan, download_reason, still_ahead
from swarm.outer.group import RoundKey, RoundResult, RoundTiming
from swarm.outer.install import (
    after_round_done,
    after_round_missed,
    copy_into,
    done_alone,
    entered_with,
    keep_own_delta,
    lone_leader,
    lone_leader_is_late,
    move_by,
)
from swarm.outer.pacing import (
    hold_after_round,
    hold_back,
    progress_possible,
    progress_wait_s,
    round_call,
    steps_taken,
)
from swarm.outer.state import StageState
from swarm.outer.sync_state import SyncState

OWN, OTHER, THIRD = "0" * 16, "1" * 16, "2" * 16
KEY = RoundKey(stage=1, round=3)


def records(**rounds: tuple[int, str]) -> dict[str, StageStatus]:
    """Peer → its record, from peer=(outer_round, global_hash)."""
    return {peer: StageStatus(outer_round=r, global_hash=h) for peer, (r, h) in rounds.items()}


def at(round_: int, **rounds: tuple[int, str]) -> tuple[int, SyncState]:
    """A replica at ``round_`` holding ``OWN``, with its stage's other replicas' records."""
    return round_, SyncState(synced_at=0, global_hash=OWN, others=records(**rounds))


# pacing: when a round is due or held back


def test_a_round_is_opened_after_h_steps_joined_after_half_of_them_and_waited_for_before() -> None:
    state = SyncState(synced_at=10, global_hash=OWN)
    assert steps_taken(state, 30) == 20
    assert round_call(20, 20, held=False) == "open"
    assert (
        round_call(10, 20, held=False) == round_call(10, 19, held=False) == "join"
    )  # ⌈H/2⌉: the fastest sets the pace
    assert round_call(9, 20, held=False) == round_call(9, 19, held=False) == "wait"
    assert round_call(20, 20, held=True) == "join"  # held back: it still joins a round another opened


def test_a_round_done_alone_with_others_listed_holds_the_next_back_until_one_reaches_it_or_the_bound() -> None:
    others = records(b=(0, OWN))
    assert hold_after_round(True, others, now=100.0, wait_s=30.0) == 130.0
    assert hold_after_round(True, {}, now=100.0, wait_s=30.0) is None  # alone in its stage: nobody to wait for
    assert hold_after_round(False, others, now=100.0, wait_s=30.0) is None  # a round with others: no hold-back
    state = SyncState(synced_at=0, global_hash=OWN, others=others, alone_until=130.0)
    assert hold_back(state, round_=1, now=110.0) == 130.0  # b is a round behind
    assert hold_back(state, round_=1, now=130.0) is None  # the bound passed
    assert hold_back(SyncState(synced_at=0, global_hash=OWN, alone_until=130.0), round_=1, now=110.0) is None
    state.others = records(b=(1, OTHER))
    assert hold_back(state, round_=1, now=110.0) is None  # b reached round 1
    assert hold_back(SyncState(synced_at=0, global_hash=OWN, others=others), round_=1, now=0.0) is None


def test_after_a_missed_round_progress_is_waited_for_only_while_another_replica_may_make_it() -> None:
    assert progress_possible(records(b=(1, OWN)), 1, leader=None)  # b is at the round and may get past it
    assert progress_possible(records(b=(2, OWN)), 1, leader=None)
    assert not progress_possible(records(b=(0, OWN)), 1, leader=None)  # b cannot get past it before this one
    assert progress_possible(records(b=(0, OWN)), 1, leader="b")  # but b led it: its record lags
    assert not progress_possible({}, 1, leader="b")  # the leader left
    timing = RoundTiming(window_s=2.0, timeout_s=3.0)
    assert progress_wait_s(timing, 5.0) == timing.max_round_s + 10.0


# following: which claim a replica follows or adopts


def test_a_replica_behind_follows_the_vouched_later_claim_and_one_diverged_the_claim_held_by_more() -> None:
    round_, state = at(3, b=(5, OTHER), c=(5, OTHER), d=(9, THIRD))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=True)
    assert [(c.round, c.holders) for c in plan.downloads] == [(5, ("b", "c"))] and plan.skip_to is None
    assert download_reason(plan.downloads[0], round_) == "behind"
    round_, state = at(3, b=(3, OTHER), c=(3, OTHER))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=True)
    assert [c.holders for c in plan.downloads] == [("b", "c")]
    assert download_reason(plan.downloads[0], round_) == "diverged"
    round_, state = at(3, b=(3, OWN), c=(3, OTHER))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=True)
    assert plan == CatchUp()  # its own weights are held by more: it keeps them


def test_claims_past_reach_or_from_unknown_peers_are_not_followed() -> None:
    round_, state = at(3, b=(5, OTHER), c=(5, OTHER))
    plan = catch_up_plan(state, me="a", round_=round_, reach=4, known=None, accused=False, replicas_agree=True)
    assert plan == CatchUp()  # nothing honest gets to round 5 from where it was
    round_, state = at(3, b=(3, OWN), c=(5, OTHER), d=(5, OTHER))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known={"b"}, accused=False, replicas_agree=True)
    assert plan == CatchUp()  # c and d's word vouches for nothing: its own claim (a, b) is the vouched one


def test_other_weights_of_a_member_that_entered_from_the_same_weights_are_its_own_doing_unless_accused() -> None:
    round_, state = at(3, b=(3, OTHER), c=(3, OTHER))
    state.same_entry = ("a", "b", "c")
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=True)
    assert plan == CatchUp()  # they applied the same commit: other weights are their doing, not a split
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=True, replicas_agree=True)
    assert [c.holders for c in plan.downloads] == [("b", "c")]  # accused: they left it out; it converges with them


def test_the_lone_leader_of_a_round_it_came_late_to_is_followed_on_its_word_only_if_its_word_vouches() -> None:
    round_, state = at(3, b=(3, OWN), c=(3, OWN), d=(4, OTHER))
    state.lone_leader = "d"
    newcomer = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=True)
    assert [c.holders for c in newcomer.downloads] == [("d",)]
    known = {"b", "c", "d"}
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=known, accused=False, replicas_agree=True)
    assert [c.holders for c in plan.downloads] == [("d",)]
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known={"b", "c"}, accused=False, replicas_agree=True)
    assert plan == CatchUp()  # a Sybil closing every round alone never becomes a peer whose word vouches


def test_a_noloco_replica_with_a_history_moves_its_round_on_and_a_newcomer_downloads() -> None:
    round_, state = at(3, b=(6, OTHER), c=(5, THIRD))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known={"b"}, accused=False, replicas_agree=False)
    assert plan == CatchUp(skip_to=6)  # b is a peer of its recent rounds: its word is enough for a round
    plan = catch_up_plan(state, me="a", round_=round_, reach=5, known={"b"}, accused=False, replicas_agree=False)
    assert plan == CatchUp(skip_to=5)  # b's round is beyond reach; c's lone claim is one it would follow (none vouched)
    plan = catch_up_plan(state, me="a", round_=round_, reach=4, known={"b"}, accused=False, replicas_agree=False)
    assert plan == CatchUp()  # nothing within reach: it stays
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=False)
    assert [c.round for c in plan.downloads] == [6, 5] and plan.skip_to is None  # a newcomer has weights to take
    round_, state = at(3, b=(3, OTHER), c=(3, OTHER))
    plan = catch_up_plan(state, me="a", round_=round_, reach=None, known=None, accused=False, replicas_agree=False)
    assert plan == CatchUp()  # other weights at its round are normal where replicas never agree


def test_a_state_served_ahead_is_kept_until_the_replica_gets_to_its_round_itself() -> None:
    served = ("b", StageState(stage=1, round=4, schedule_step=0, params={}, optimizer=None))
    assert still_ahead(served, 3) is served
    assert still_ahead(served, 4) is None and still_ahead(None, 3) is None


# install: how a result is installed, and where it leaves the replica


def test_a_set_made_of_another_replicas_payload_alone_is_late_and_its_leader_followed() -> None:
    theirs = RoundResult(outcome="done", contributors=("b",), leader="b")
    assert lone_leader(theirs, "a") == "b" and not done_alone(theirs, "a")
    late = lone_leader_is_late(theirs, KEY, "a")
    assert late.outcome == "late" and "alone in its set" in late.reason
    own = RoundResult(outcome="done", contributors=("a",), leader="a")
    assert lone_leader(own, "a") is None and done_alone(own, "a") and lone_leader_is_late(own, KEY, "a") is own
    both = RoundResult(outcome="done", contributors=("a", "b"), leader="a")
    assert lone_leader(both, "a") is None and lone_leader_is_late(both, KEY, "a") is both
    failed = RoundResult(outcome="failed", contributors=("b",), leader="b")
    assert lone_leader_is_late(failed, KEY, "a") is failed and lone_leader(failed, "a") == "b"


def test_a_round_done_sets_the_last_group_its_same_entry_and_the_hold_back() -> None:
    others = records(b=(3, OWN), c=(3, OTHER), d=(2, OWN))
    assert entered_with(others, 3, OWN) == {"b"}
    state = SyncState(synced_at=10, global_hash=OWN, others=others, lone_leader="x")
    result = RoundResult(outcome="done", contributors=("a", "b", "c"), leader="a")
    done = after_round_done(state, result, me="a", entered={"b"}, inner_steps=30, hold_until=None)
    assert (done.synced_at, done.last_group, done.same_entry) == (30, ("a", "b", "c"), ("a", "b"))
    assert done.alone_until is None and done.lone_leader == "x" and state.synced_at == 10  # a new state
    alone = after_round_done(
        state, RoundResult(outcome="done", contributors=("a",)), me="a", entered=(), inner_steps=30, hold_until=99.0
    )
    assert alone.alone_until == 99.0 and alone.same_entry == ("a",)


def test_a_missed_round_is_tried_again_after_another_h_steps_unless_a_state_was_adopted() -> None:
    state = SyncState(synced_at=10, global_hash=OWN)
    assert after_round_missed(state, progressed=True, inner_steps=30) is state
    assert after_round_missed(state, progressed=False, inner_steps=30).synced_at == 30


def test_an_install_moves_to_the_new_global_weights_keeping_the_progress_since_the_snapshot() -> None:
    snapshot, old_global = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.0, 0.0])}
    params = {"w": torch.tensor([1.5, 2.5])}  # progress of 0.5 made during the exchange
    target = {"w": torch.tensor([3.0, 3.0])}
    move_by(params, target, snapshot)
    assert torch.equal(params["w"], torch.tensor([3.5, 3.5]))
    keep_own_delta(target, snapshot, old_global)  # its Δ (snapshot − old global) was not in the set: kept
    assert torch.equal(target["w"], torch.tensor([4.0, 5.0]))
    copy_into(params, {"w": torch.tensor([7.0, 8.0])})
    assert torch.equal(params["w"], torch.tensor([7.0, 8.0]))
