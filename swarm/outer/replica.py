"""One replica's side of the outer step (``ReplicaSync``): it takes part in rounds, installs their results and catches
up, as the round rules decide over its ``SyncState``: ``pacing`` (when a round is due or held back), ``following``
(which claim to follow or adopt), ``install`` (how a result is installed, and where that leaves the replica).

It composes matchmaking and its method's round (``allgather_round``, or NoLoCo's ``pair_round``), download and
accountability; ``service.ServedState`` serves the state it holds. docs/architecture.md (its outer/ paragraph and
"An outer round's path") tells the whole story. ``OuterService.sync`` makes one per replica a peer holds:

    >>> sync = outer_service.sync(stage, server, on_log); await sync.adopt(state)
    >>> task = asyncio.create_task(sync.run())   # cancel to stop; sync.close() after
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from optim.factory import build_outer_optimizer
from optim.outer import OuterOptimizer, Screening
from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.events import EventSink, OuterDeclared, OuterRound, StateDownload
from swarm.outer import pacing
from swarm.outer.accountability import Accountability
from swarm.outer.allgather import allgather_round
from swarm.outer.board import Board
from swarm.outer.claims import StateClaim
from swarm.outer.download import NoStateDelivered, StreamFetch, download_claim, later
from swarm.outer.following import catch_up_plan, download_reason, still_ahead
from swarm.outer.group import GroupNetwork, RoundKey, RoundResult, RoundTiming
from swarm.outer.install import (
    after_round_done,
    after_round_missed,
    apply_round,
    copy_into,
    done_alone,
    entered_with,
    load_outer,
    lone_leader,
    lone_leader_is_late,
    move_by,
)
from swarm.outer.matchmaking import RoundContext, expected_members, window_open
from swarm.outer.pacing import hold_after_round, hold_back, progress_possible, round_call, steps_taken
from swarm.outer.pairs import pair_round
from swarm.outer.state import StageState, weights_hash
from swarm.outer.sync_state import SyncState
from swarm.outer.threads import Holder, OuterThread, snapshot_weights
from swarm.outer.trust import StateTrust
from swarm.outer.verdicts import Verdicts
from swarm.rpc.blobs import TransferError
from swarm.rpc.defences import PeerGuard

logger = logging.getLogger(__name__)
PROGRESS_POLL_S = 0.5  # how often a late or failed replica looks for one that got past its round
StatusReader = Callable[[], Awaitable[Mapping[str, StageStatus]]]  # peer id → status of the stage's *other* replicas


class ReplicaSync:
    """The outer step of one replica: it polls the round rules (``pacing``, ``following``, ``install``) over its
    ``SyncState`` and carries out what they decide: rounds, installs, catch-up downloads. It runs the outer optimizer
    on a thread of its own and touches the weights only through ``Holder.exclusive``, briefly."""

    def __init__(
        self,
        cfg: SwarmConfig,
        stage: int,
        holder: Holder,
        *,
        net: GroupNetwork,
        board: Board,
        replicas: StatusReader,
        fetch: StreamFetch,
        on_log: EventSink = lambda event: None,
        clock: Callable[[], float] = time.time,
        guard: PeerGuard | None = None,
        trainers: StatusReader | None = None,
    ) -> None:
        self.cfg, self.stage, self.holder = cfg, stage, holder
        self.replicas, self.fetch, self.on_log, self.clock = replicas, fetch, on_log, clock
        self.params = dict(holder.module.named_parameters())
        self.outer = build_outer_optimizer(self.params, cfg.outer, cfg.codecs)
        self.timing = RoundTiming.of(cfg.timeouts)
        self.poll_s = self.timing.poll_s  # how often to look for a due or open round
        global_hash = weights_hash(self.outer.global_params) if self.outer else ""
        self.state = SyncState(synced_at=holder.inner_steps, global_hash=global_hash)
        self.counters: Counter[str] = Counter()
        self.round_s: list[float] = []  # wall time of each round done, declaration to install
        self.accountability = Accountability(  # strikes and bans of peers that sent bad Δ or states
            stage=stage, counters=self.counters, guard=guard, on_log=lambda event: self.on_log(event)
        )
        self.trust = StateTrust()  # whose word vouches, which rounds are within reach, how far a state may be
        self.verdicts = Verdicts.of(cfg.timeouts, trainers)  # ``trainers``' records: whom they condemned
        self.thread = OuterThread(stage)
        # what this replica brings to each round (``meet``): its network and board, its policies (read live)
        self.rounds = RoundContext(
            net=net,
            board=board,
            timing=self.timing,
            clock=clock,
            excluded=self.excluded,
            blame=self.accountability.strike,
            on_declared=lambda key, at: self.on_log(OuterDeclared(stage=key.stage, round=key.round, opened_at=at)),
        )
        self._fp32_bytes = 4 * sum(p.numel() for p in self.params.values())  # a dense fp32 Δ: what a payload saves
        self.installs = 0  # rounds installed and states adopted: changes of the local weights besides inner steps

    @property
    def me(self) -> str:
        return self.rounds.net.me

    @property
    def round(self) -> int:
        return self.outer.round if self.outer else 0

    @property
    def global_hash(self) -> str:
        return self.state.global_hash

    @property
    def _outer(self) -> OuterOptimizer[Any]:
        """The outer optimizer, for what only a swarm with an outer step does (``run`` takes no round without one)."""
        if self.outer is None:
            raise RuntimeError(f"stage {self.stage}: this swarm has no outer step")
        return self.outer

    @property
    def schedule_step(self) -> int:
        return self.holder.start_step + self.holder.inner_steps

    @property
    def horizon(self) -> int:
        """H of this replica's next round: 1 during the swarm's warm start (counted on the lr schedule), then H."""
        return self.cfg.outer.horizon(self.holder.start_step + self.state.synced_at)

    @property
    def progress_wait_s(self) -> float:
        return pacing.progress_wait_s(self.timing, self.cfg.timeouts.announce_period_s)

    @property
    def due(self) -> bool:
        """This replica has taken the H inner steps of its next round (and has an outer step to take)."""
        return self.outer is not None and steps_taken(self.state, self.holder.inner_steps) >= self.horizon

    def status_fields(self) -> dict[str, Any]:
        """The outer step's part of this replica's DHT record (its round, as announced: ``announced_round``)."""
        self.state.announced_round = self.round
        return {"outer_round": self.round, "global_hash": self.global_hash}

    def info(self) -> dict[str, Any]:
        return {**self.status_fields(), **self.counters}

    def excluded(self, peer: str) -> bool:
        """Whether ``peer`` is banned from this replica's rounds and downloads, or condemned by the trainers."""
        return self.accountability.excluded(peer) or self.verdicts.condemns(peer, now=self.clock())

    async def run(self) -> None:
        """Forever (cancel to stop): catch up when behind, take part in each round when due (or, with H/2 of its H
        steps, when another replica has opened it: the fastest sets the pace; ``pacing.round_call``)."""
        if self.outer is None:
            return
        next_check = 0.0
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                if time.monotonic() >= next_check:  # the records change once per announce period
                    next_check = time.monotonic() + self.cfg.timeouts.announce_period_s
                    if await self.catch_up():
                        continue
                taken, h = steps_taken(self.state, self.holder.inner_steps), self.horizon
                call = round_call(taken, h, held=taken >= h and self.waits_for_others())
                key = RoundKey(self.stage, self.round)
                if call == "open" or (call == "join" and await window_open(self.rounds, key)):
                    # Never open a round others have passed: a stale half of the stage would go on meeting on
                    # its own, round after round, one download behind the rest.
                    if not await self.catch_up():
                        await self.step(refresh=False)  # catch_up just read the stage's records
            except Exception as e:  # a peer or the network failed us: say so, keep serving, try again later
                logger.warning(
                    f"stage {self.stage} outer step: {type(e).__name__}: {e}", exc_info=not isinstance(e, TransferError)
                )

    async def step(self, *, refresh: bool = True) -> RoundResult:
        """One round: snapshot, encode Δ, meet the group, install the agreed result (or catch up). ``refresh``: read
        the stage's records first (whom to wait for; a replica that just joined counts), unless just read."""
        key, steps, me = RoundKey(self.stage, self.round), self.holder.inner_steps, self.me
        if refresh:
            self.state.others = await self.live_others()
        entered = entered_with(self.state.others, key.round, self.global_hash)
        snapshot = await snapshot_weights(self.holder)
        payload = await self.thread.run(self._outer.make_payload, snapshot)
        started = time.perf_counter()
        take_part = pair_round if self._outer.pairwise else allgather_round  # NoLoCo swaps with one partner
        result = lone_leader_is_late(await take_part(self.rounds, key, payload, expected=self.expected()), key, me)
        self.state.lone_leader = lone_leader(result, me)
        fp32_bytes = result.received * self._fp32_bytes
        self.counters.update(pseudo_grad_bytes=result.received_bytes, pseudo_grad_fp32_bytes=fp32_bytes)
        self.counters[f"outer_{result.outcome}"] += 1
        screening = None
        if result.outcome == "done":
            screening = await self._apply(result, snapshot, key.round)
            now, taken, alone = asyncio.get_running_loop().time(), steps - self.state.synced_at, done_alone(result, me)
            moved = self.state.moved
            self.trust.did_round(
                self.round, result.contributors, alone=alone, now=now, inner_steps=steps, moved=moved, steps=taken
            )
            hold = hold_after_round(alone, self.state.others, now=time.monotonic(), wait_s=self.progress_wait_s)
            self.state = after_round_done(
                self.state, result, me=me, entered=entered, inner_steps=steps, hold_until=hold
            )
            self.round_s.append(time.perf_counter() - started)
        else:
            self.accountability.commit_withheld(result, me=me)
            await self.thread.run(self._outer.discard_payload)  # the next payload carries this round's Δ again
            progressed = await self.await_progress(key.round, leader=result.leader)
            self.state = after_round_missed(self.state, progressed=progressed, inner_steps=steps)
        self.on_log(round_event(self, key, result, screening, time.perf_counter() - started))
        return result

    async def await_progress(self, round_: int, *, leader: str | None = None) -> bool:
        """After a late or failed round: wait (bounded) for a replica that got past it, and download its state; give up
        once none may (``pacing.progress_possible``)."""
        deadline = time.monotonic() + self.progress_wait_s
        # Look often, not once per announce period: a replica left out of a set sleeping a whole period (5 s) before
        # its first look took as long as the leader's next window, arrived just after it closed, was late again, and
        # so on — 22 rounds in a row of a 2-replica stage in one 8M-token run (docs/benchmarks.md, "At 8M tokens").
        while time.monotonic() < deadline:
            await asyncio.sleep(min(PROGRESS_POLL_S, self.cfg.timeouts.announce_period_s))
            if await self.catch_up():  # it also reads the stage's records into ``state.others``
                return True
            # (a leader whose record lags broke this off at once, and the retry met the leader's old commit: in an
            # 8M-token run, that second failure banned an honest partner and split the stage for the rest of the run)
            if not progress_possible(self.state.others, round_, leader=leader):
                break
        logger.warning(f"stage {self.stage}: no replica got past outer round {round_}; keeping it")
        return False

    async def catch_up(self) -> bool:
        """Read the stage's records and follow a better claim than this replica's own (``following.catch_up_plan``):
        download its state, or (NoLoCo) move the round counter on (``_skip_to``); True if it did."""
        self.state.others = await self.live_others()
        self.state.ahead = still_ahead(self.state.ahead, self.round)
        now, steps = asyncio.get_running_loop().time(), self.holder.inner_steps
        reach = self.trust.reach(now=now, inner_steps=steps, horizon=self.horizon, floor_s=self.poll_s)
        for peer in self.trust.liars(
            self.state.others, reach
        ):  # an identity announcing a round no training reaches lies
            self.accountability.strike(
                peer, f"it claims outer round {self.state.others[peer].outer_round}, beyond reach ({reach})"
            )
        plan = catch_up_plan(
            self.state,
            me=self.me,
            round_=self.round,
            reach=reach,
            known=self.trust.known if self.trust.has_history else None,
            accused=self.verdicts.accused(now=self.clock()),
            replicas_agree=self.outer is None or self.outer.replicas_agree,
        )
        if plan.skip_to is not None:
            await self._skip_to(plan.skip_to)
            return True
        for claim in plan.downloads:
            if await self._download(claim, download_reason(claim, self.round), reach):
                return True
        return False

    async def adopt(self, state: StageState) -> None:
        """Install a downloaded state: global weights, outer optimizer and round; local weights restart from the global ones."""
        if self.outer is not None:
            await self.thread.change(load_outer, self.outer, state)
        await self.holder.exclusive(functools.partial(copy_into, self.params, state.params), change="replaced")
        self.installs += 1
        self.state.synced_at = self.holder.inner_steps
        self.state.global_hash = weights_hash(state.params) if self.outer else ""
        self.trust.adopted(state.round, now=asyncio.get_running_loop().time(), inner_steps=self.state.synced_at)

    def close(self) -> None:
        self.thread.close()

    def waits_for_others(self) -> bool:
        """Whether a due round is held back (``pacing.hold_back``), after a round done alone with others listed."""
        self.state.alone_until = hold_back(self.state, round_=self.round, now=time.monotonic())
        return self.state.alone_until is not None

    def expected(self) -> set[str] | None:
        """Whom the window waits for (``expected_members``), from the records last read and the last round's members."""
        return expected_members(self.me, self.state.last_group, self.state.others, self.round, self.excluded)

    async def live_others(self) -> dict[str, StageStatus]:
        """The stage's other replicas as the DHT shows them now, banned and condemned (by trainers) ones left out."""
        others = await self.replicas()
        self.counters["outer_condemned"] += await self.verdicts.refresh(others, me=self.me, now=self.clock())
        return {peer: status for peer, status in others.items() if not self.excluded(peer)}

    async def _apply(self, result: RoundResult, snapshot: dict[str, torch.Tensor], round_: int) -> Screening | None:
        """Install a round done (alone: the snapshot becomes global) and hold its members to account."""
        alone, keep_own = done_alone(result, self.me), self.me not in result.contributors
        screening = await self._install(None if alone else result.payloads, snapshot, keep_own=keep_own)
        if screening is not None:
            self.accountability.hold_to_account(result, screening, round_, me=self.me)
            self.counters["outer_bounded"] += len(screening.bounded)  # no offence: what the bound held back, counted
        self.accountability.acquit(result, round_, me=self.me)
        return screening

    async def _install(
        self, payloads: tuple[bytes, ...] | None, snapshot: dict[str, torch.Tensor], *, keep_own: bool = False
    ) -> Screening | None:
        """Install a round's result (``install.apply_round``; ``payloads`` None: this replica's alone), then move the
        local weights to the new global ones, keeping the progress made during the exchange: work begun before the move
        keeps its gradients, and a stage server differentiates the weights its forward ran on."""
        applied = await apply_round(self._outer, self.thread, self.state, payloads, snapshot, keep_own=keep_own)
        if applied.target is not None:
            move = functools.partial(move_by, self.params, applied.target, snapshot)
            await self.holder.exclusive(move, change="moved")
            self.installs += 1
        return applied.screening

    async def _skip_to(self, round_: int) -> None:
        """Move the round counter on to ``round_`` (NoLoCo: ``following.catch_up_plan``), keeping the global weights, the
        outer optimizer's state and the local progress: no weights are taken on anyone's word. The trust's reach mark
        stays at the last round this replica knew first-hand: a skip is not an adoption."""
        skipped = round_ - self.round
        await self.thread.change(setattr, self._outer, "round", round_)
        self.counters["outer_rounds_skipped"] += skipped
        logger.info(f"stage {self.stage}: moved on to outer round {round_}, where the others are ({skipped} skipped)")

    async def _download(self, claim: StateClaim, reason: str, reach: int | None) -> bool:
        """Download and adopt the state ``claim`` announces, from one of its holders, if its round is within ``reach``
        and its weights near this replica's (``StateTrust.state_check``); False if none delivers it."""
        started = time.perf_counter()
        reference = self.outer.global_params if self.outer else self.params
        try:
            peer, state = await download_claim(
                self.fetch,
                claim,
                me=self.me,
                stage=self.stage,
                template=self.params,
                reference=reference,
                also=self.trust.state_check(reference, round_=self.round, horizon=self.horizon, reach=reach),
                blame=self.accountability.strike,
                ahead=self.state.ahead,
            )
        except NoStateDelivered as e:
            self.state.ahead = later(self.state.ahead, e.ahead)
            logger.warning(f"stage {self.stage}: could not catch up ({reason}): {e}")
            return False
        self.state.ahead = None
        await self.adopt(state)
        self.counters["state_downloads"] += 1
        self.on_log(download_event(self, peer, claim, reason, time.perf_counter() - started))
        return True


def round_event(
    sync: ReplicaSync, key: RoundKey, result: RoundResult, screening: Screening | None, round_s: float
) -> OuterRound:
    """How round ``key`` ended, and where it left ``sync``'s replica."""
    contributors = result.contributors
    return OuterRound(
        stage=sync.stage,
        round=key.round,
        outcome=result.outcome,
        reason=result.reason,
        group=len(result.group),
        contributors=len(contributors),
        contributor_ids=contributors,  # whose Δ is in the set: a full peer is in every stage's
        leader=result.leader,
        outer_round=sync.round,
        global_hash=sync.global_hash,
        round_s=round_s,
        received_bytes=result.received_bytes,
        # whose Δ the screening left out or clipped (their senders got a strike unless relayed)
        dropped=tuple(sorted(contributors[i] for i in screening.dropped)) if screening else (),
        clipped=tuple(sorted(contributors[i] for i in screening.clipped)) if screening else (),
        bounded=tuple(sorted(contributors[i] for i in screening.bounded)) if screening else (),
    )


def download_event(sync: ReplicaSync, peer: str, claim: StateClaim, reason: str, download_s: float) -> StateDownload:
    """``sync``'s replica adopted ``claim``'s state from ``peer`` to catch up (``reason``: behind or diverged)."""
    return StateDownload(
        stage=sync.stage,
        from_peer=peer,
        reason=reason,
        vouched_by=len(claim.vouchers),
        download_s=download_s,
        outer_round=sync.round,
        global_hash=sync.global_hash,
    )
