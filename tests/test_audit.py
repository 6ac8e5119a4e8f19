"""HopAudit (swarm/pipeline/audit.py): a checked forward judged by the loss each output gives, not by a vote.

Replicas are fakes whose outputs are constant tensors; the trainer's loss of an output is a table by that constant,
so each case sets the losses it is about: a garbler (or two colluders, or a server passing its input through) fails
and its reply does not land; an honest replica behind the other, but better than skipping its stage, is not failed;
two harmful failures among a server's last sixteen judgements by the loss make it unfit, routed around until its outer
round moves on, and never condemn it (that takes a failed backward probe); agreeing outright is no judgement, and a
suspect that agrees vouches for nothing: colluders that agree with each other pass, until one of them is suspect, and
then the honest replica is asked. The losses at real shapes are tests/test_stage_checks.py's."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import torch

from compress.codec_base import Codec
from swarm.config import TrainerOptions
from swarm.dht.records import StageStatus
from swarm.pipeline.audit import HopAudit
from swarm.pipeline.boundary import boundary_ladders
from swarm.pipeline.checking import CheckRule, HopChecker
from swarm.pipeline.frames import LinkCodecs, Microbatch, Outgoing
from swarm.pipeline.protocol import Forward
from swarm.pipeline.routing import Peer, Router
from swarmtest.clock import FakeClock
from swarmtest.configs import tiny_config

SHAPE = (2, 8, 16)  # (B, T, d)
INPUT = 0.0  # the hop's input: the constant every output is told apart by (its loss is the skip's)


class FakeReplicas:
    """``HopCalls`` over replicas of stage 1 answering with ``torch.full(SHAPE, level)``."""

    def __init__(self, levels: dict[str, float]) -> None:
        self.levels = levels
        self.codecs = LinkCodecs(dict(zip(("activations", "gradients"), boundary_ladders(tiny_config()), strict=True)))
        self.checkers: list[str] = []  # the replica asked to recompute each check, in order (``other_replica``)
        self._ids = 0

    def new_id(self) -> str:
        self._ids += 1
        return f"mb{self._ids}"

    def other_replica(self, stage: int, tried: list[Peer]) -> Peer | None:
        left = [peer for peer in self.levels if peer not in tried]
        if left:
            self.checkers.append(left[0])
        return left[0] if left else None

    async def call(
        self, mb: Microbatch, peer: Peer, request: Forward, codec: str
    ) -> tuple[torch.Tensor, torch.Tensor | None, bytes, Codec] | None:
        reply_codec = self.codecs.choose("activations", peer, mb.shape)
        return torch.full(SHAPE, self.levels[str(peer)]), None, b"", reply_codec

    async def decode(self, kind: str, frame: bytes, shape: tuple[int, ...]) -> tuple[Codec, torch.Tensor, None]:
        return self.codecs.choose(kind, "any", shape), torch.full(SHAPE, INPUT), None


def audit_of(replicas: FakeReplicas, losses: dict[float, float]) -> tuple[HopAudit, Counter[str]]:
    """An audit checking every forward, whose loss of an output is ``losses[its constant]``."""

    async def loss_of(mb: Microbatch, h: torch.Tensor) -> float:
        return losses[round(float(h.flatten()[0]), 3)]

    router = Router(1, random.Random(0))
    router.update(1, list(replicas.levels))
    counters: Counter[str] = Counter()
    audit = HopAudit(replicas, router, TrainerOptions(check_rate=1.0), counters=counters, loss_of=loss_of)
    return audit, counters


def check(audit: HopAudit, replicas: FakeReplicas, peer: str) -> bool:
    """``peer`` answered a training forward of stage 1 (the path's last): whether its reply lands."""
    mb = Microbatch(replicas.new_id(), SHAPE, train=True, path=(1,), targets=torch.zeros(SHAPE[:2], dtype=torch.long))
    request = Forward(mb=mb.id, stage=1, prev_stage=0, x=b"", train=True)
    y = Outgoing(torch.full(SHAPE, replicas.levels[peer]), None)
    return asyncio.run(audit.forward(mb, request, "int8", peer, y))


def test_an_output_worse_than_the_others_and_than_skipping_fails_does_not_land_and_two_harmful_ones_make_it_unfit() -> (
    None
):
    replicas = FakeReplicas({"evil": 3.0, "honest": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 3.0: 4.5, INPUT: 3.6})  # honest 3.0, skipping 3.6, evil 4.5
    assert not check(audit, replicas, "evil") and counters["check_failures"] == 1
    assert "evil" in audit.checker.suspects and not audit.excluded_now()  # one failure: suspect, still routed
    assert not check(audit, replicas, "evil")
    assert audit.excluded_now() == {"evil"} and counters["check_rests"] == 1  # 2 of its last 16 judgements failed
    # unfit is no verdict: nothing in the trainer's record, nothing for the outer rounds
    assert not audit.checker.is_condemned("evil") and counters["check_strikes"] == 0 and not audit.condemned_now()
    assert "evil" in audit.checker.suspects  # back from its rest, its forwards land only once checked
    assert not audit.excluded_now() - {"evil"} and audit.checker.passed["honest"] == 2


class LiarWhenNotKept(FakeReplicas):
    """``liar`` answers its training forwards honestly and every forward not kept (a check's recompute, validation: a
    server cannot tell them apart) with ``GARBAGE``."""

    GARBAGE = 3.0

    def __init__(self, levels: dict[str, float], liar: str) -> None:
        super().__init__(levels)
        self.liar = liar

    async def call(
        self, mb: Microbatch, peer: Peer, request: Forward, codec: str
    ) -> tuple[torch.Tensor, torch.Tensor | None, bytes, Codec] | None:
        reply = await super().call(mb, peer, request, codec)
        if reply is not None and peer == self.liar and not request.train:
            return torch.full(SHAPE, self.GARBAGE), *reply[1:]
        return reply


def test_a_server_lying_only_as_a_checker_is_found_unfit_though_it_passes_as_the_checked_in_between() -> None:
    """Its training forwards pass their checks (by the loss: the replicas drifted apart), and each pass is a judgement
    in its history; its recomputes for others' checks fail harmfully. Two such failures among its last 16 judgements
    make it unfit, however many passes come between (among the last 4 they never met)."""
    replicas = LiarWhenNotKept({"honest": 1.0, "liar": 1.5}, liar="liar")
    audit, counters = audit_of(replicas, {1.0: 3.0, 1.5: 3.05, LiarWhenNotKept.GARBAGE: 4.5, INPUT: 3.6})
    assert check(audit, replicas, "honest") and counters["check_failures"] == 1  # the liar's recompute failed
    while audit.checker.passed["liar"] < 4 and counters["checks"] < 40:  # on probation: half its forwards checked
        assert check(audit, replicas, "liar")  # its kept forward: 3.05 against 3.0, within the margin
    assert not audit.excluded_now() and audit.checker.passed["liar"] >= 4
    while counters["check_failures"] < 2 and counters["checks"] < 60:  # the honest server's forwards, on probation
        assert check(audit, replicas, "honest")
    assert audit.excluded_now() == {"liar"} and counters["check_rests"] == 1
    assert "honest" not in audit.checker.suspects and not audit.condemned_now()


def test_an_unfit_server_rests_until_its_outer_round_moves_on_or_its_rest_ends_which_doubles() -> None:
    """A replica behind the others gives outputs worse than no work until it syncs with them: its next round ends
    its rest. Without records (outer off) the rest runs ``rest_s``, doubled per rest, at most ``ban_s``."""
    clock = FakeClock()
    checker = HopChecker(CheckRule(rest_s=30.0, ban_s=100.0), clock=clock)
    rounds = {"behind": 4}
    assert checker.rest("behind", 4) == 30.0 and checker.unfit_now(rounds.get) == {"behind"}
    rounds["behind"] = 5  # it took part in a round: its weights are the others' now
    assert checker.unfit_now(rounds.get) == set() and "behind" in checker.suspects
    assert checker.rest("evil", None) == 30.0 and checker.rest("evil", None) == 60.0
    clock.advance(59.0)
    assert checker.unfit_now(rounds.get) == {"evil"}
    clock.advance(2.0)
    assert checker.unfit_now(rounds.get) == set()
    assert checker.rest("evil", None) == 100.0  # at most ban_s
    assert not checker.condemned_now()


def test_the_audit_reads_an_unfit_servers_round_from_its_record() -> None:
    replicas = FakeReplicas({"behind": 3.0, "ahead": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 3.0: 4.5, INPUT: 3.6})
    records = {"behind": StageStatus(outer_round=7), "ahead": StageStatus(outer_round=7)}
    audit.router.update_records(1, records)
    for _ in range(2):
        assert not check(audit, replicas, "behind")
    assert audit.excluded_now() == {"behind"} and audit.checker.unfit["behind"][1] == 7
    audit.router.update_records(1, {**records, "behind": StageStatus(outer_round=8)})
    assert audit.excluded_now() == set()


def test_a_replica_behind_the_other_but_better_than_skipping_its_stage_is_not_failed() -> None:
    replicas = FakeReplicas({"behind": 2.0, "ahead": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 2.0: 3.4, INPUT: 3.6})  # 13% behind, 6% better than skipping
    for _ in range(5):
        assert check(audit, replicas, "behind")
    assert counters["checks_behind"] == 5 and counters["check_failures"] == 0
    assert not audit.checker.is_condemned("behind") and "behind" in audit.checker.suspects  # checked more


def test_outputs_within_the_margin_land_and_each_is_cleared_only_if_it_beats_the_stage_skipped() -> None:
    replicas = FakeReplicas({"a": 1.0, "b": 2.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 2.0: 3.1, INPUT: 3.6})  # 3% apart: both pass, both beat the skip
    assert check(audit, replicas, "b") and counters["check_disagreements"] == 1 and counters["check_failures"] == 0
    assert audit.checker.passed == Counter({"a": 1, "b": 1}) and not audit.checker.suspects
    # a server passing its input through gives the skip's loss: early on within the margin of an honest output
    lazy = FakeReplicas({"lazy": INPUT, "honest": 1.0})
    audit, counters = audit_of(lazy, {1.0: 5.40, INPUT: 5.45})
    assert check(audit, lazy, "lazy") and counters["check_failures"] == 0  # it lands: within 5% of the other's
    assert audit.checker.passed == Counter({"honest": 1}) and audit.checker.suspects == {"lazy"}


def test_a_server_passing_its_input_through_fails_once_its_stage_does_work_but_is_never_condemned() -> None:
    """No worse than skipping the stage: its outputs do not land, every one is checked, but it is not harmful."""
    replicas = FakeReplicas({"lazy": INPUT, "honest": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.2, INPUT: 5.3})  # d_model 768 after 10 steps: 3.19 against 5.33
    for _ in range(6):
        assert not check(audit, replicas, "lazy")
    assert (
        counters["check_failures"] == 6 and not audit.checker.is_condemned("lazy") and "lazy" in audit.checker.suspects
    )


def test_colluders_agreeing_pass_each_other_but_fail_against_an_honest_replica_whatever_their_number() -> None:
    """No vote: two liars agreeing is one check passed, not a verdict on the honest server."""
    replicas = FakeReplicas({"evil": 3.0, "evil2": 3.0, "honest": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 3.0: 4.5, INPUT: 3.6})
    assert check(audit, replicas, "evil") and replicas.checkers[-1] == "evil2"  # agree exactly: passes
    assert counters["check_disagreements"] == 0
    assert check(audit, replicas, "honest") and replicas.checkers[-1] == "evil"  # an honest server checked by a liar
    assert (
        counters["check_failures"] == 1 and "evil" in audit.checker.suspects and "honest" not in audit.checker.suspects
    )
    assert audit.checker.passed["honest"] == 1


def test_a_suspect_agreeing_vouches_for_nothing_the_next_replica_is_asked() -> None:
    """Two colluders, both suspect once an honest replica caught each: agreeing with each other neither clears them
    nor lands their output; the check goes on to the honest replica, and the loss judges."""
    replicas = FakeReplicas({"evil": 3.0, "evil2": 3.0, "honest": 1.0})
    audit, counters = audit_of(replicas, {1.0: 3.0, 3.0: 4.5, INPUT: 3.6})
    audit.checker.suspect("evil", "evil2")
    assert not check(audit, replicas, "evil") and replicas.checkers[-2:] == ["evil2", "honest"]
    assert counters["checks"] == 2 and counters["check_failures"] == 1 and audit.checker.passed["evil"] == 0
    assert {"evil", "evil2"} <= audit.checker.suspects
    del replicas.levels["honest"]  # no one else to ask: unchecked, it lands, and clears no one
    assert check(audit, replicas, "evil") and audit.checker.passed == Counter({"honest": 1})


def test_outputs_too_far_apart_for_honest_drift_pass_neither_while_the_loss_cannot_tell() -> None:
    """At the start every output gives a loss near chance: a garbler's random activations pass the loss, but not the
    distance (√2 from the true output; honest drift ≤ 0.82). Neither is cleared: both stay suspect, checked on every
    forward, until the loss can tell (cleared, a garbler landed 98% of its forwards unchecked: +46% val)."""
    replicas = FakeReplicas({"garbler": -1.0, "honest": 1.0})  # relative error 2
    audit, counters = audit_of(replicas, {1.0: 5.50, -1.0: 5.52, INPUT: 5.5})  # all near chance
    assert check(audit, replicas, "garbler")  # lands (the loss says it does no harm yet), but proves nothing
    assert counters["checks_unresolved"] == 1 and audit.checker.passed == Counter()
    assert audit.checker.suspects == {"garbler", "honest"} and audit.checker.unproven("garbler")


def test_with_checking_off_no_forward_is_checked_validation_included() -> None:
    replicas = FakeReplicas({"evil": 3.0, "honest": 1.0})
    router = Router(1, random.Random(0))
    router.update(1, list(replicas.levels))
    counters: Counter[str] = Counter()
    audit = HopAudit(replicas, router, TrainerOptions(check_rate=0.0), counters=counters)
    for train in (True, False):
        mb = Microbatch(
            replicas.new_id(), SHAPE, train=train, path=(1,), targets=torch.zeros(SHAPE[:2], dtype=torch.long)
        )
        request = Forward(mb=mb.id, stage=1, prev_stage=0, x=b"", train=train)
        assert asyncio.run(audit.forward(mb, request, "int8", "evil", Outgoing(torch.full(SHAPE, 3.0), None)))
    assert counters["checks"] == 0 and not replicas.checkers
