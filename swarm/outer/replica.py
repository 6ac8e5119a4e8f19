"""One replica's side of the outer step (``ReplicaSync``): when it takes part in a round, how it installs the result,
how it catches up, and the stage state it serves.

It composes matchmaking and its method's round (``allgather_round``, or NoLoCo's ``pair_round``), the
state format, claims, download and accountability; docs/architecture.md (its outer/ paragraph and "An
outer round's path") tells the whole story. ``OuterService.sync`` makes one per replica a peer holds:

    >>> sync = outer_service.sync(stage, server, on_log); await sync.adopt(state)
    >>> task = asyncio.create_task(sync.run())   # cancel to stop; sync.close() after
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from optim.factory import build_outer_optimizer
from optim.outer import OuterOptimizer, Screening
from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.events import EventSink, OuterDeclared, OuterRound, StateDownload
from swarm.model.step import WeightChange
from swarm.outer.accountability import Accountability
from swarm.outer.allgather import allgather_round
from swarm.outer.board import Board
from swarm.outer.claims import StateClaim, claims_to_follow, round_to_meet
from swarm.outer.download import NoStateDelivered, Served, StreamFetch, download_claim, later
from swarm.outer.group import GroupNetwork, RoundKey, RoundResult, RoundTiming
from swarm.outer.matchmaking import RoundContext, expected_members, window_open
from swarm.outer.pairs import pair_round
from swarm.outer.snapshots import SharedSnapshot
from swarm.outer.state import StageState, stream_state, weights_hash
from swarm.outer.trust import StateTrust, distance
from swarm.outer.verdicts import Verdicts
from swarm.rpc.blobs import BlobStream, TransferError
from swarm.rpc.defences import PeerGuard

logger = logging.getLogger(__name__)
PROGRESS_POLL_S = 0.5  # how often a late or failed replica looks for one that got past its round
T = TypeVar("T")
StatusReader = Callable[[], Awaitable[Mapping[str, StageStatus]]]  # peer id → status of the stage's *other* replicas


class StateChanged(Exception):
    """The outer state changed (a round applied, a state adopted) while a stream of it was being sent."""


class Holder(Protocol):
    """What the outer step needs of a trainer (stage 0) or a stage server."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def inner_steps(self) -> int:
        """Inner steps taken by this process."""

    @property
    def start_step(self) -> int:
        """Where this process started on the lr schedule."""

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the compute thread: no inner step or request runs at the same time. ``change``: how ``fn``
        changes the weights (``swarm/model/step.py``): work begun before a move keeps its gradients, work begun
        before a replacement does not (a trainer drops them; a stage server leaves out the parameter gradients of
        forwards served before it)."""


async def snapshot_weights(holder: Holder) -> dict[str, torch.Tensor]:
    """A copy of the holder's weights, taken on its compute thread: no inner step or request tears it."""
    return await holder.exclusive(lambda: {name: p.detach().clone() for name, p in holder.module.named_parameters()})


class ReplicaSync:
    """The outer step of one replica: its rounds, their installs, its catch-up downloads, the state it serves. It runs
    the outer optimizer on a thread of its own and touches the weights only through ``Holder.exclusive``, briefly."""

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
        self.net, self.board, self.replicas, self.fetch = net, board, replicas, fetch
        self.on_log, self.clock = on_log, clock
        self.params = dict(holder.module.named_parameters())
        self.outer = build_outer_optimizer(self.params, cfg.outer, cfg.codecs)
        self.timing = RoundTiming.of(cfg.timeouts)
        self.poll_s = self.timing.poll_s  # how often to look for a due or open round
        self.synced_at = holder.inner_steps  # inner steps at the last snapshot or download
        self.global_hash = weights_hash(self.outer.global_params) if self.outer else ""
        self.counters: Counter[str] = Counter()
        self.round_s: list[float] = []  # wall time of each round done, declaration to install
        self.accountability = Accountability(  # strikes and bans of peers that sent bad Δ or states
            stage=stage, counters=self.counters, guard=guard, on_log=lambda event: self.on_log(event)
        )
        self._fp32_bytes = 4 * sum(p.numel() for p in self.params.values())  # a dense fp32 Δ: what a payload saves
        self._changes = 0  # changes of the outer state (global weights, optimizer, round): a served stream's version
        self._last_group: tuple[str, ...] = ()  # contributors of the last round done
        self._same_entry: tuple[str, ...] = ()  # those of them that entered it from this replica's global weights
        self._lone_leader: str | None = None  # the leader of the last round, if it closed it alone before this one came
        self._alone_until: float | None = None  # after a round alone with others listed: how long it waits for them
        self.trust = StateTrust()  # whose word vouches, which rounds are within reach, how far a state may be
        self._moved = 0.0  # how far the last round installed moved the global weights (at most)
        self._others: Mapping[str, StageStatus] = {}  # the stage's other replicas, as the DHT showed them last
        self._ahead: Served | None = None  # a state served before its holder's record claimed it (``claimed_ahead``)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"outer{stage}")
        self.announced_round: int | None = None  # the round of this replica's last record (``status_fields``)
        # the local weights, copied once per version for the downloads that ask at once (``local_state``)
        self._snapshot = SharedSnapshot(
            functools.partial(snapshot_weights, holder), lambda: (holder.inner_steps, self.round, self._changes)
        )
        self.verdicts = Verdicts.of(cfg.timeouts, trainers)  # ``trainers``' records: whom they condemned

    @property
    def rounds(self) -> RoundContext:
        """What this replica brings to each round (``meet``): its network and board as they are now, its policies."""
        return RoundContext(
            net=self.net,
            board=self.board,
            timing=self.timing,
            clock=self.clock,
            excluded=self.excluded,
            blame=self.accountability.strike,
            on_declared=lambda key, at: self.on_log(OuterDeclared(stage=key.stage, round=key.round, opened_at=at)),
        )

    @property
    def round(self) -> int:
        return self.outer.round if self.outer else 0

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
        return self.cfg.outer.horizon(self.holder.start_step + self.synced_at)

    @property
    def progress_wait_s(self) -> float:
        """How long this replica waits for others to get past a round (``await_progress``) or reach its round
        (``_waits_for_others``): a round's longest, and two announce periods for their records to show it."""
        return self.timing.max_round_s + 2 * self.cfg.timeouts.announce_period_s

    @property
    def due(self) -> bool:
        """This replica has taken the H inner steps of its next round (and has an outer step to take)."""
        return self.outer is not None and self.holder.inner_steps - self.synced_at >= self.horizon

    def status_fields(self) -> dict[str, Any]:
        """The outer step's part of this replica's DHT record (its round, as announced: ``announced_round``)."""
        self.announced_round = self.round
        return {"outer_round": self.round, "global_hash": self.global_hash}

    def info(self) -> dict[str, Any]:
        return {**self.status_fields(), **self.counters}

    def excluded(self, peer: str) -> bool:
        """Whether ``peer`` is banned from this replica's rounds and downloads, or condemned by the trainers."""
        return self.accountability.excluded(peer) or self.verdicts.condemns(peer, now=self.clock())

    async def run(self) -> None:
        """Forever (cancel to stop): catch up when behind, take part in each round when due (or, with H/2 of its H
        steps, when another replica has opened it: the fastest sets the pace)."""
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
                taken, h = self.holder.inner_steps - self.synced_at, self.horizon
                key = RoundKey(self.stage, self.round)
                due = taken >= h and not self._waits_for_others()
                if due or (taken >= (h + 1) // 2 and await window_open(self.rounds, key)):
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
        key, steps = RoundKey(self.stage, self.round), self.holder.inner_steps
        if refresh:
            self._others = await self._live_others()
        entered = {
            p for p, s in self._others.items() if (s.outer_round, s.global_hash) == (key.round, self.global_hash)
        }
        snapshot = await snapshot_weights(self.holder)
        payload = await self._on_thread(self._outer.make_payload, snapshot)
        started = time.perf_counter()
        take_part = pair_round if self._outer.pairwise else allgather_round  # NoLoCo swaps with one partner
        result = await take_part(self.rounds, key, payload, expected=self._expected())
        result = _lone_leader_is_late(result, key, self.net.me)
        self._lone_leader = _lone_leader(result, self.net.me)
        fp32_bytes = result.received * self._fp32_bytes
        self.counters.update(pseudo_grad_bytes=result.received_bytes, pseudo_grad_fp32_bytes=fp32_bytes)
        self.counters[f"outer_{result.outcome}"] += 1
        screening = None
        if result.outcome == "done":
            screening = await self._apply(result, snapshot, key.round)
            now, taken = asyncio.get_running_loop().time(), steps - self.synced_at
            alone = result.contributors == (self.net.me,)
            self.trust.did_round(
                self.round, result.contributors, alone=alone, now=now, inner_steps=steps, moved=self._moved, steps=taken
            )
            self.synced_at, self._last_group = steps, result.contributors
            self._same_entry = tuple(p for p in result.contributors if p in entered or p == self.net.me)
            self.round_s.append(time.perf_counter() - started)
            self._alone_until = time.monotonic() + self.progress_wait_s if alone and self._others else None
        else:
            self.accountability.commit_withheld(result, me=self.net.me)
            await self._on_thread(self._outer.discard_payload)  # the next payload carries this round's Δ again
            if not await await_progress(self, key.round, leader=result.leader):
                self.synced_at = steps  # nobody got past this round: try it again after another H steps
        self.on_log(round_event(self, key, result, screening, time.perf_counter() - started))
        return result

    async def catch_up(self) -> bool:
        """Download the stage's state if the records show a better claim than this replica's own (``claims_to_follow``:
        a later round, or this round with other weights held by more replicas); True if it did.

        Where replicas never agree (NoLoCo), a replica with a history of its own (a round done, a state adopted) only
        moves its round counter on (``round_to_meet``, ``_skip_to``) instead: there is no stage state to converge on,
        only a round to meet the others at, and a download would throw away its own progress since its last round.
        (A NoLoCo replica a round behind stayed behind for good: the holders of the claim it followed, a round every
        second, had moved on by the time they served their state, ``RecordBehind``; or the half of the stage ahead
        held a claim vouched by peers of which it knew only one, and its own half's vouched claim kept it off that.)"""
        self._others = await self._live_others()
        if self._ahead is not None and self._ahead[1].round <= self.round:
            self._ahead = None  # this replica got there itself: the kept state is of no more use
        now, steps = asyncio.get_running_loop().time(), self.holder.inner_steps
        reach = self.trust.reach(now=now, inner_steps=steps, horizon=self.horizon, floor_s=self.poll_s)
        for peer in self.trust.liars(self._others, reach):  # an identity announcing a round no training reaches lies
            self.accountability.strike(
                peer, f"it claims outer round {self._others[peer].outer_round}, beyond reach ({reach})"
            )
        follow = claims_to_follow(
            self._others,
            me=self.net.me,
            round_=self.round,
            weights_hash=self.global_hash,
            # members of its last round that entered it from other global weights (their records said so) end it on
            # other weights too: a split to converge with, not their own doing
            last_group=() if self.verdicts.accused(now=self.clock()) else self._same_entry,  # accused: they left me out
            replicas_agree=self.outer is None or self.outer.replicas_agree,
            known=self.trust.known if self.trust.has_history else None,
            reach=reach,
            # the lone leader of the round this replica came late to: its state, on its own word if it is one of
            # the peers whose word vouches (a Sybil that closes every round alone never becomes one)
            leader=self._lone_leader if not self.trust.has_history or self._lone_leader in self.trust.known else None,
        )
        if self.outer is not None and not self.outer.replicas_agree and self.trust.has_history:
            # NoLoCo: its own weights are as good as any replica's; the round is all it lacks
            meet_at = round_to_meet(follow, self._others, round_=self.round, known=self.trust.known, reach=reach)
            if meet_at is None:
                return False
            await self._skip_to(meet_at)
            return True
        for claim in follow:
            if await self._download(claim, "behind" if claim.round > self.round else "diverged", reach):
                return True
        return False

    async def adopt(self, state: StageState) -> None:
        """Install a downloaded state: global weights, outer optimizer and round; local weights restart from the global ones."""
        if self.outer is not None:
            await self._changing(_load_outer, self.outer, state)
        await self.holder.exclusive(functools.partial(_copy_into, self.params, state.params), change="replaced")
        self._snapshot.invalidate()
        self.synced_at = self.holder.inner_steps
        self.global_hash = weights_hash(state.params) if self.outer else ""
        self.trust.adopted(state.round, now=asyncio.get_running_loop().time(), inner_steps=self.synced_at)

    async def export_state(self, name: str) -> BlobStream:
        """The ``state/<stage>`` blob (global weights, outer optimizer state, round, schedule step), streamed: each chunk
        copied on the outer thread from the live tensors; a round applied or a state adopted meanwhile cuts the stream
        short (``StateChanged``), so a receiver never gets a mix of two rounds."""
        if name != f"state/{self.stage}":
            raise LookupError(f"this peer holds stage {self.stage}")
        if self.outer is None:  # no outer step: the local weights are the stage's weights
            return stream_state(await self.local_state())
        return await _stream_outer(self, self.outer)

    async def local_state(self) -> StageState:
        """This replica's current (local) weights as a stage state, no optimizer: what a rebuild merges, an export saves,
        a checkpoint keeps (``state/<stage>`` serves the global weights of the last round instead)."""
        params = await self._snapshot.get()  # one copy on the compute thread, shared by the downloads of its version
        return StageState(
            stage=self.stage, round=self.round, schedule_step=self.schedule_step, params=params, optimizer=None
        )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _apply(self, result: RoundResult, snapshot: dict[str, torch.Tensor], round_: int) -> Screening | None:
        """Install a round done (alone: the snapshot becomes global) and hold its members to account."""
        alone = result.contributors == (self.net.me,)
        keep_own = self.net.me not in result.contributors
        screening = await self._install(None if alone else result.payloads, snapshot, keep_own=keep_own)
        if screening is not None:
            self.accountability.hold_to_account(result, screening, round_, me=self.net.me)
        self.accountability.acquit(result, round_, me=self.net.me)
        return screening

    async def _install(
        self, payloads: tuple[bytes, ...] | None, snapshot: dict[str, torch.Tensor], *, keep_own: bool = False
    ) -> Screening | None:
        """Install a round's result (``payloads`` None: this replica's alone; the snapshot becomes global) and return the
        outer optimizer's ``Screening`` of the payloads. ``keep_own``: this replica's Δ is not in the set (it arrived
        after the leader's window closed): its local weights keep that progress for its next round to send."""
        outer = self._outer
        if payloads is None:
            # nothing to agree on: the local weights, and the progress since the snapshot, stay as they are
            self._moved = await self._on_thread(distance, snapshot, outer.global_params)
            await self._changing(outer.apply_alone, snapshot)
            self.global_hash = await self._on_thread(weights_hash, outer.global_params)
            return None
        target = {name: torch.empty_like(t) for name, t in snapshot.items()}
        old_global = {name: g.clone() for name, g in outer.global_params.items()} if keep_own else None
        own = await self._on_thread(distance, snapshot, outer.global_params)  # with the move below: ≥ the global's move
        screening: Screening = await self._changing(outer.apply, list(payloads), target)  # target ← new global weights
        self.global_hash = await self._on_thread(weights_hash, outer.global_params)
        self._moved = own + await self._on_thread(distance, outer.global_params, snapshot)
        if old_global is not None:
            for name, t in target.items():
                t.add_(snapshot[name] - old_global[name])  # + this replica's Δ, which the group did not receive
        # the new global weights + the progress made during the exchange: a move that keeps this replica's progress, so
        # work begun before it keeps its gradients, and a stage server differentiates the weights its forward ran on
        await self.holder.exclusive(functools.partial(_move_by, self.params, target, snapshot), change="moved")
        self._snapshot.invalidate()
        return screening

    async def _live_others(self) -> dict[str, StageStatus]:
        """The stage's other replicas as the DHT shows them now, banned and condemned (by trainers) ones left out."""
        others = await self.replicas()
        self.counters["outer_condemned"] += await self.verdicts.refresh(others, me=self.net.me, now=self.clock())
        return {peer: status for peer, status in others.items() if not self.excluded(peer)}

    def _waits_for_others(self) -> bool:
        """Whether to hold back a round that is due, after a round done alone while other replicas were listed: until
        one of them reaches this replica's round (its record, or its declaration: ``window_open``), or a bound passes.

        The others were a round behind (finishing their last round, or late to this replica's): opening the next round
        at once would take this replica through it alone again, just before they arrive, round after round: two
        halves of the stage a round apart, each following no claim of the other (one behind; one lone). Waiting, it
        meets them at its round, or follows their claim there (more holders, other weights: ``catch_up``)."""
        if self._alone_until is None:
            return False
        caught_up = any(status.outer_round >= self.round for status in self._others.values())
        if caught_up or not self._others or time.monotonic() >= self._alone_until:
            self._alone_until = None
        return self._alone_until is not None

    def _expected(self) -> set[str] | None:
        """Whom the window waits for (``expected_members``), from the records last read and the last round's members."""
        return expected_members(self.net.me, self._last_group, self._others, self.round, self.excluded)

    async def _skip_to(self, round_: int) -> None:
        """Move the round counter on to ``round_`` (``round_to_meet``: within reach, on a followed claim or a known
        peer's word), keeping the global weights, the outer optimizer's state and the local progress.

        Only for an outer step whose replicas never agree (NoLoCo): the round is then nothing but when to meet (the
        matchmaking key, the pairing's seed); no weights are taken on anyone's word, so a liar's claim moves no weights,
        and it moves the counter no further than honest training reaches (``StateTrust.reach``). The trust's reach mark
        stays at the last round this replica knew first-hand: a skip is not an adoption."""
        skipped = round_ - self.round
        await self._changing(setattr, self._outer, "round", round_)
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
                me=self.net.me,
                stage=self.stage,
                template=self.params,
                reference=reference,
                also=self.trust.state_check(reference, round_=self.round, horizon=self.horizon, reach=reach),
                blame=self.accountability.strike,
                ahead=self._ahead,
            )
        except NoStateDelivered as e:
            self._ahead = later(self._ahead, e.ahead)
            logger.warning(f"stage {self.stage}: could not catch up ({reason}): {e}")
            return False
        self._ahead = None
        await self.adopt(state)
        self.counters["state_downloads"] += 1
        self.on_log(download_event(self, peer, claim, reason, time.perf_counter() - started))
        return True

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _changing(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the outer thread, as a change of the outer state: a stream of the old one stops."""

        def change() -> T:
            self._changes += 1
            return fn(*args)

        return await self._on_thread(change)


async def _stream_outer(sync: ReplicaSync, outer: OuterOptimizer[Any]) -> BlobStream:
    """``sync``'s outer state (``ReplicaSync.export_state``), cut short by a change of it (``StateChanged``)."""

    def take() -> tuple[int, StageState]:  # on the outer thread: the references, and the version they are of
        state = StageState(
            stage=sync.stage,
            round=outer.round,
            schedule_step=sync.schedule_step,
            params=dict(outer.global_params),
            optimizer=outer.optimizer.state_dict(),  # its tensors are the live buffers, not copies
        )
        return sync._changes, state

    version, state = await sync._on_thread(take)

    def unchanged(copy: Callable[[], bytes]) -> bytes:
        if sync._changes != version:
            raise StateChanged(f"stage {sync.stage}'s outer state changed while it was sent")
        return copy()

    blob = stream_state(state, read=lambda copy: sync._on_thread(unchanged, copy))
    # a round past this replica's record: its receiver refuses it (``RecordBehind``), so it costs the receiver nothing
    ahead = sync.announced_round is not None and state.round > sync.announced_round
    return dataclasses.replace(blob, charged=not ahead)


async def await_progress(sync: ReplicaSync, round_: int, *, leader: str | None = None) -> bool:
    """After a late or failed round of ``sync``'s replica: wait (bounded) for a replica that got past it, and download
    its state; give up once no replica is listed at that round or later and the round's ``leader`` is not listed either
    (its record lags by up to an announce period): the partner left, and nobody gets past the round without this one."""
    deadline = time.monotonic() + sync.progress_wait_s
    # Look often, not once per announce period: a replica left out of a set sleeping a whole period (5 s) before
    # its first look took as long as the leader's next window, arrived just after it closed, was late again, and
    # so on — 22 rounds in a row of a 2-replica stage in one 8M-token run (docs/benchmarks.md, "At 8M tokens").
    while time.monotonic() < deadline:
        await asyncio.sleep(min(PROGRESS_POLL_S, sync.cfg.timeouts.announce_period_s))
        if await sync.catch_up():  # it also reads the stage's records into ``_others``
            return True
        # (a leader whose record lags broke this off at once, and the retry met the leader's old commit: in an
        # 8M-token run, that second failure banned an honest partner and split the stage for the rest of the run)
        if leader not in sync._others and not any(s.outer_round >= round_ for s in sync._others.values()):
            break
    logger.warning(f"stage {sync.stage}: no replica got past outer round {round_}; keeping it")
    return False


def _load_outer(outer: OuterOptimizer[Any], state: StageState) -> None:
    """Load a downloaded state into the outer optimizer: its global weights, round and buffers, under this replica's
    own hyper-parameters (never the sender's)."""
    groups = outer.optimizer.state_dict()["param_groups"]
    slots = state.optimizer["state"] if state.optimizer else {}
    optimizer = {"state": slots, "param_groups": groups}
    outer.load_state_dict({"round": state.round, "params": state.params, "optimizer": optimizer})


@torch.no_grad()
def _copy_into(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    for name, p in params.items():
        p.copy_(values[name])


@torch.no_grad()
def _move_by(
    params: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]
) -> None:
    """θ ← θ + (target − snapshot): to the new global weights, keeping the progress made since the snapshot."""
    for name, p in params.items():
        p.add_(target[name] - snapshot[name])


def _lone_leader(result: RoundResult, me: str) -> str | None:
    """The other replica whose payload alone made up the round's set, if so: it led the round alone."""
    return result.contributors[0] if len(result.contributors) == 1 and result.contributors != (me,) else None


def _lone_leader_is_late(result: RoundResult, key: RoundKey, me: str) -> RoundResult:
    """A round done whose set is another replica's alone, as late: that leader kept its own weights (``apply_alone``),
    which applying its Δ here would not reproduce (rounding, or SparseLoCo's top-k of a dense move), and the two would
    stay apart for good, each in the other's last group. Its state does reproduce them: catch up by download."""
    if result.outcome == "done" and _lone_leader(result, me) is not None:
        return dataclasses.replace(
            result, outcome="late", reason=f"the leader of {key} was alone in its set; its state is downloaded"
        )
    return result


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
