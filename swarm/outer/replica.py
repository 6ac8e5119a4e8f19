"""One replica's side of the outer step: when it takes part in a round, how it installs the result, how it catches up.

A replica is a trainer's stage 0 or a stage server (a ``Holder``). Its ``ReplicaSync`` runs beside
the training or serving with its own thread for the outer optimizer, and touches the replica's
weights only through ``Holder.exclusive`` (the replica's compute thread), each time for an
instant: to snapshot them and to install a round's result. Requests keep being served meanwhile.

- **When.** Round r opens once this replica has taken H inner steps since its last snapshot
  (H = ``outer.inner_steps``, counted per replica; 1 during a warm start, ``outer.warm_start_steps``). A replica with at least H/2 steps joins earlier
  when it sees the round's window already open: the fastest replica sets the pace and the others
  meet it, however their step counts drift (a stage server fed by two trainers steps twice as
  often as each trainer). One with fewer steps sits the round out and downloads its result: its
  small Δ would count as much as the others' in the mean (and the group's outlier screening
  clips a Δ far above the others'). The window closes as soon as the replicas it expects are in
  (``_expected``: the last round's members and every replica at this round or one behind); a
  replica alone in its stage does not wait at all. A replica due for a round that the records show
  others have passed downloads their state instead of opening it: a stale half of the stage that
  met on its own would stay apart for good.
- **With whom.** DiLoCo and SparseLoCo all-gather over the round's group and apply the leader's set
  (``run_round``); NoLoCo swaps payloads with one partner (``run_round(pairs=True)``) and never forces replicas equal.
- **Alone.** A round nobody else joined changes no weight: the snapshot becomes the global
  weights (``OuterOptimizer.apply_alone``), so a replica alone in its stage never loses progress.
- **Install.** Training goes on during the exchange, so the new local weights are the round's
  global weights plus the progress made since the snapshot: θ ← θ + (θ_global − θ_snapshot),
  swapped in between two computations. Work begun before keeps its gradients, one move stale (a
  stage server differentiates the weights its forward ran on, stashed; a trainer adds the stage-0
  gradients of microbatches in flight and those it holds for its next inner step), as a download's
  replacement does not (``swarm/model/step.py`` ``WeightChange``). The
  global weights (held by the outer optimizer, served to newcomers, hashed into ``global_hash``)
  are bitwise identical on every member of the round.
- **Accountability.** The outer optimizer reports whose Δ it dropped or clipped (non-finite, far
  above this replica's own recent ‖Δ‖ or the group's median); each such sender that served its
  Δ itself, a leader that served its payload but no usable commit, and a peer that served a state
  it does not hold get a strike (``OUTER_PEER_LIMITS``); a banned peer's declarations, payloads,
  claims and states are ignored, so a repeat offender takes part in no later round.
- **Catch-up.** Every tick the replica reads its stage's records. Seeing a later round (this one
  was late, its round failed, or it had no steps to contribute), it downloads that state; seeing
  its own round with other weights (a group split by a DHT race), the copy held by fewer replicas
  (or, as many, by the larger peer ids) downloads the other, so the stage converges on one copy.
  It follows only claims vouched for by two or more replicas whenever the stage has one, and
  downloads exactly the claimed weights (``swarm/outer/transfer.py``): one peer announcing a
  later round takes over nothing. Local progress since the last snapshot is dropped on download.

``OuterService`` (``swarm/outer/service.py``) wires this to the swarm and makes a replica's ``ReplicaSync``:

    >>> sync = outer_service.sync(stage, server, on_log); await sync.adopt(state)
    >>> task = asyncio.create_task(sync.run())   # cancel to stop; sync.close() after
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import torch

from optim.factory import build_outer_optimizer
from optim.outer import Screening
from swarm.config import SwarmConfig
from swarm.dht.records import StageStatus
from swarm.model.step import WeightChange
from swarm.outer.rounds import (
    Board,
    GroupNetwork,
    RoundKey,
    RoundResult,
    RoundTiming,
    plausible_arrivals,
    run_round,
    window_opening,
)
from swarm.outer.transfer import (
    LONE_CLAIM_MAX_NORM_RATIO,
    StageState,
    StateClaim,
    StreamFetch,
    catch_up_claims,
    download_state,
    stage_claims,
    stream_state,
    weights_hash,
)
from swarm.rpc.blobs import BlobStream, TransferError
from swarm.rpc.defences import PeerGuard, PeerLimits

logger = logging.getLogger(__name__)
PROGRESS_POLL_S = 0.5  # how often a late or failed replica looks for one that got past its round
# Two offences within an hour (a Δ dropped or clipped, a withheld commit, a false state) keep a peer out of this
# replica's rounds and downloads for an hour: one may be bad luck (a diverged replica, a dropped link), a repeat is not.
OUTER_PEER_LIMITS = PeerLimits(strikes=2, strike_window_s=3600.0, ban_s=3600.0)
T = TypeVar("T")
StatusReader = Callable[[], Awaitable[Mapping[str, StageStatus]]]  # peer id → status of the stage's *other* replicas


class StateChanged(Exception):
    """The outer state changed (a round applied, a state adopted) while a stream of it was being sent."""


class Holder(Protocol):
    """What the outer step needs of a trainer (stage 0) or a stage server."""

    module: torch.nn.Module
    inner_steps: int  # taken by this process
    start_step: int  # where this process started on the lr schedule

    async def exclusive(self, fn: Callable[[], T], *, change: WeightChange = "none") -> T:
        """``fn()`` on the compute thread: no inner step or request runs at the same time. ``change``: how ``fn``
        changes the weights (``swarm/model/step.py``): work begun before a move keeps its gradients, work begun
        before a replacement does not (a trainer drops them; a stage server leaves out the parameter gradients of
        forwards served before it)."""


async def snapshot_weights(holder: Holder) -> dict[str, torch.Tensor]:
    """A copy of the holder's weights, taken on its compute thread: no inner step or request tears it."""
    return await holder.exclusive(lambda: {name: p.detach().clone() for name, p in holder.module.named_parameters()})


class ReplicaSync:
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
        on_log: Callable[[dict[str, Any]], None] = lambda record: None,
        clock: Callable[[], float] = time.time,
        guard: PeerGuard | None = None,
    ) -> None:
        self.cfg, self.stage, self.holder = cfg, stage, holder
        self.guard = guard or PeerGuard(OUTER_PEER_LIMITS)  # strikes and bans of peers that sent bad Δ or states
        self.net, self.board, self.replicas, self.fetch, self.on_log, self.clock = (
            net,
            board,
            replicas,
            fetch,
            on_log,
            clock,
        )
        self.params = dict(holder.module.named_parameters())
        self.outer = build_outer_optimizer(self.params, cfg.outer, cfg.codecs)
        self.timing = RoundTiming.of(cfg.timeouts)
        self.poll_s = self.timing.poll_s  # how often to look for a due or open round
        self.synced_at = holder.inner_steps  # inner steps at the last snapshot or download
        self.global_hash = weights_hash(self.outer.global_params) if self.outer else ""
        self.counters: Counter[str] = Counter()
        self.round_s: list[float] = []  # wall time of each round done, declaration to install
        # a dense fp32 Δ: what a payload saves against
        self._fp32_bytes = 4 * sum(p.numel() for p in self.params.values())
        self._changes = 0  # changes of the outer state (global weights, optimizer, round): a served stream's version
        self._last_group: tuple[str, ...] = ()  # contributors of the last round done
        self._others: Mapping[str, StageStatus] = {}  # the stage's other replicas, as the DHT showed them last
        self._unproven: set[str] = set()  # leaders struck for a commit that never came, until they lead a round with me
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"outer{stage}")

    @property
    def round(self) -> int:
        return self.outer.round if self.outer else 0

    @property
    def schedule_step(self) -> int:
        return self.holder.start_step + self.holder.inner_steps

    @property
    def horizon(self) -> int:
        """H of this replica's next round: 1 during the swarm's warm start (counted on the lr schedule), then H."""
        return self.cfg.outer.horizon(self.holder.start_step + self.synced_at)

    @property
    def due(self) -> bool:
        """This replica has taken the H inner steps of its next round (and has an outer step to take)."""
        return self.outer is not None and self.holder.inner_steps - self.synced_at >= self.horizon

    def status_fields(self) -> dict[str, Any]:
        """The outer step's part of this replica's DHT record."""
        return {"outer_round": self.round, "global_hash": self.global_hash}

    def info(self) -> dict[str, Any]:
        return {**self.status_fields(), **self.counters}

    async def run(self) -> None:
        """Forever (cancel to stop): catch up when behind, take part in each round when due."""
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
                if taken >= h or (taken >= (h + 1) // 2 and await self._window_open()):
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
            self._others = {peer: s for peer, s in (await self.replicas()).items() if not self.excluded(peer)}
        snapshot = await snapshot_weights(self.holder)
        payload = await self._on_thread(self.outer.make_payload, snapshot)
        started = time.perf_counter()
        result = await run_round(
            self.net,
            self.board,
            key,
            payload,
            self.timing,
            clock=self.clock,
            expected=self._expected(),
            excluded=self.excluded,
            pairs=self.outer.pairwise,  # NoLoCo swaps with one partner
            on_declared=lambda opened_at: self.on_log(
                {"event": "outer_declared", "stage": self.stage, "round": key.round, "opened_at": opened_at}
            ),
        )
        if result.outcome == "done" and result.contributors != (self.net.me,) and len(result.contributors) == 1:
            # A leader alone kept its own weights (``apply_alone``): applying its Δ here would not reproduce them
            # (rounding, or SparseLoCo's top-k of a dense move), and the two would stay apart for good, each in
            # the other's last group. Its state does reproduce them: catch up by download, as a late member.
            result = dataclasses.replace(
                result, outcome="late", reason=f"the leader of {key} was alone in its set; its state is downloaded"
            )
        self.counters.update(
            pseudo_grad_bytes=result.received_bytes, pseudo_grad_fp32_bytes=result.received * self._fp32_bytes
        )
        self.counters[f"outer_{result.outcome}"] += 1
        screening = None
        if result.outcome == "done":
            alone = result.contributors == (self.net.me,)
            screening = await self._install(
                None if alone else result.payloads, snapshot, keep_own=self.net.me not in result.contributors
            )
            if screening is not None:
                self._hold_to_account(result, screening)
            self._acquit(result)
            self.synced_at, self._last_group = steps, result.contributors
            self.round_s.append(time.perf_counter() - started)
        else:
            if result.outcome == "failed" and result.leader not in (None, self.net.me):
                # it served its payload moments ago, then no (or a false) commit: gone, or stalling the round —
                # or a stream lost in transit (2 of 9 8M-token runs on loopback had one), which looks the same
                self.strike(result.leader, result.reason)
                self._unproven.add(result.leader)
            await self._on_thread(self.outer.discard_payload)  # the next payload carries this round's Δ again
            if not await self._await_progress(key.round, leader=result.leader):
                self.synced_at = steps  # nobody got past this round: try it again after another H steps
        self.on_log(
            {
                "event": "outer_round",
                "stage": self.stage,
                "round": key.round,
                "outcome": result.outcome,
                "reason": result.reason,
                "group": len(result.group),
                "contributors": len(result.contributors),
                "contributor_ids": list(result.contributors),  # whose Δ is in the set: a full peer is in every stage's
                "leader": result.leader,
                "outer_round": self.round,
                "global_hash": self.global_hash,
                "round_s": time.perf_counter() - started,
                "received_bytes": result.received_bytes,
                # whose Δ the screening left out or clipped (their senders got a strike unless relayed)
                "dropped": sorted(result.contributors[i] for i in screening.dropped) if screening else [],
                "clipped": sorted(result.contributors[i] for i in screening.clipped) if screening else [],
            }
        )
        return result

    async def catch_up(self) -> bool:
        """Download the stage's state if the records show a better claim than this replica's own (``catch_up_claims``:
        a later round, or this round with other weights held by more replicas); True if it did."""
        others = {peer: status for peer, status in (await self.replicas()).items() if not self.excluded(peer)}
        self._others = others
        # A member of this replica's last round applied the same commit: other weights for that round are its own
        # doing (its screening differed, or it lies), not a split group to converge with.
        claims = stage_claims(
            {peer: s for peer, s in others.items() if not self._disowned(peer, s)},
            me=(self.net.me, self.round, self.global_hash),
        )
        follow = catch_up_claims(claims, round_=self.round, weights_hash=self.global_hash, me=self.net.me)
        if self.outer is not None and not self.outer.replicas_agree:  # NoLoCo: other weights at my round are normal
            follow = [claim for claim in follow if claim.round > self.round]
        for claim in follow:
            if await self._download(claim, "behind" if claim.round > self.round else "diverged"):
                return True
        return False

    async def adopt(self, state: StageState) -> None:
        """Install a downloaded state: global weights, outer optimizer and round; local weights restart from the global ones."""
        if self.outer is not None:

            def load_outer() -> None:
                groups = self.outer.optimizer.state_dict()[
                    "param_groups"
                ]  # our own hyper-parameters, never the sender's
                slots = state.optimizer["state"] if state.optimizer else {}
                self.outer.load_state_dict(
                    {
                        "round": state.round,
                        "params": state.params,
                        "optimizer": {"state": slots, "param_groups": groups},
                    }
                )

            await self._changing(load_outer)

        @torch.no_grad()
        def load_local() -> None:
            for name, p in self.params.items():
                p.copy_(state.params[name])

        await self.holder.exclusive(load_local, change="replaced")
        self.synced_at = self.holder.inner_steps
        self.global_hash = weights_hash(state.params) if self.outer else ""

    async def export_state(self, name: str) -> BlobStream:
        """The ``state/<stage>`` blob: global weights, outer optimizer state, round and schedule step, streamed.

        Each chunk is copied on the outer thread from the live tensors, so serving a state copies
        none of it; a round applied (or a state adopted) meanwhile cuts the stream short, and the
        receiver tries again or elsewhere rather than getting a mix of two rounds.
        """
        if name != f"state/{self.stage}":
            raise LookupError(f"this peer holds stage {self.stage}")
        if self.outer is None:  # no outer step: the local weights are the stage's weights
            return stream_state(await self.local_state())

        def take() -> tuple[int, StageState]:  # on the outer thread: the references, and the version they are of
            state = StageState(
                stage=self.stage,
                round=self.outer.round,
                schedule_step=self.schedule_step,
                params=dict(self.outer.global_params),
                optimizer=self.outer.optimizer.state_dict(),  # its tensors are the live buffers, not copies
            )
            return self._changes, state

        version, state = await self._on_thread(take)

        def unchanged(copy: Callable[[], bytes]) -> bytes:
            if self._changes != version:
                raise StateChanged(f"stage {self.stage}'s outer state changed while it was sent")
            return copy()

        return stream_state(state, read=lambda copy: self._on_thread(unchanged, copy))

    async def local_state(self) -> StageState:
        """This replica's current (local) weights as a stage state, no optimizer: what a rebuild merges, an export saves,
        a checkpoint keeps (``state/<stage>`` serves the global weights of the last round instead)."""
        params = await snapshot_weights(self.holder)
        return StageState(
            stage=self.stage, round=self.round, schedule_step=self.schedule_step, params=params, optimizer=None
        )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _install(
        self, payloads: tuple[bytes, ...] | None, snapshot: dict[str, torch.Tensor], *, keep_own: bool = False
    ) -> Screening | None:
        """Install a round's result; ``payloads`` None: the round was this replica's alone, and the snapshot becomes global.
        ``keep_own``: this replica's Δ is not in the set (it arrived after the leader's window closed), so its local
        weights keep that progress on top of the new global ones, for its next round to send.
        Returns what the outer optimizer made of the payloads (None alone)."""
        if payloads is None:
            # nothing to agree on: the local weights, and the progress since the snapshot, stay as they are
            await self._changing(self.outer.apply_alone, snapshot)
            self.global_hash = await self._on_thread(weights_hash, self.outer.global_params)
            return None
        target = {name: torch.empty_like(t) for name, t in snapshot.items()}
        old_global = {name: g.clone() for name, g in self.outer.global_params.items()} if keep_own else None
        # target ← the new global weights
        screening = await self._changing(self.outer.apply, list(payloads), target)
        self.global_hash = await self._on_thread(weights_hash, self.outer.global_params)
        if old_global is not None:
            for name, t in target.items():
                t.add_(snapshot[name] - old_global[name])  # + this replica's Δ, which the group did not receive

        @torch.no_grad()
        def swap() -> None:
            for name, p in self.params.items():
                p.add_(target[name] - snapshot[name])  # the new global weights + the progress made during the exchange

        # the swap moves the weights and keeps this replica's progress: work begun before it keeps its gradients, and a
        # stage server differentiates the weights such work's forward ran on
        await self.holder.exclusive(swap, change="moved")
        return screening

    def _disowned(self, peer: str, status: StageStatus) -> bool:
        """``peer`` took part in this replica's last round, yet announces other weights for it."""
        return peer in self._last_group and status.outer_round == self.round and status.global_hash != self.global_hash

    def excluded(self, peer: str) -> bool:
        """Whether ``peer`` is banned from this replica's rounds and downloads."""
        return self.guard.banned_for(peer) > 0

    def strike(self, peer: str, reason: str) -> None:
        """Count one offence of ``peer`` (a dropped or clipped Δ, a withheld commit, a false state); enough ban it."""
        banned = self.guard.strike(peer)
        self.counters["outer_strikes"] += 1
        self.counters["outer_bans"] += banned
        logger.warning(f"stage {self.stage}: {'banned' if banned else 'a strike against'} {peer}: {reason}")
        self.on_log({"event": "outer_strike", "stage": self.stage, "peer": peer, "reason": reason, "banned": banned})

    def _hold_to_account(self, result: RoundResult, screening: Screening) -> None:
        """A strike for each member whose Δ the outer optimizer dropped, if it served that Δ itself (a
        payload relayed by the leader is only the leader's word)."""
        # Clipped is no offence: a pair clips the larger honest Δ of two replicas that trained at different speeds.
        offences = dict(screening.dropped)
        for index, why in sorted(offences.items()):
            sender = result.contributors[index]
            if sender != self.net.me and sender not in result.relayed:
                self.strike(sender, f"its pseudo-gradient for round {self.round - 1}: {why}")

    def _acquit(self, result: RoundResult) -> None:
        """Take back the strike of a leader whose commit never came, once it leads a round that this replica completes
        with it: a staller withholds its commits round after round and is banned at its second strike, while two
        streams lost in transit an hour apart would otherwise ban an honest partner and split the stage for an hour."""
        leader = result.leader
        if leader in self._unproven and leader != self.net.me and self.net.me in result.contributors:
            self._unproven.discard(leader)
            if self.guard.pardon(leader):
                logger.info(
                    f"stage {self.stage}: {leader} led round {self.round - 1} with this replica: strike taken back"
                )

    def _expected(self) -> set[str] | None:
        """Whom the window waits for: the last round's members and every replica the records show at this round or one
        behind (finishing its last round, or catching up to this one); if there are other replicas but none of those
        (records lag behind a replica that just caught up), the whole window (None); nobody when this replica is alone.

        Waiting only for the last round's members would keep a split group split: two halves that once met
        apart would each close their window as soon as their own half was in, round after round.
        """
        current = (peer for peer, s in self._others.items() if self.round - 1 <= s.outer_round <= self.round)
        expected = {peer for peer in {*self._last_group, *current} if peer != self.net.me and not self.excluded(peer)}
        return expected or (None if self._others else set())

    async def _await_progress(self, round_: int, *, leader: str | None = None) -> bool:
        """After a late or failed round: wait (bounded) for a replica that got past it, and download its state; not at
        all once no other replica is listed at that round or later (the partner left: nobody will get past it without
        this one, and a full peer would otherwise sit out the whole bound before training on alone) — unless the
        round's ``leader``, another replica, is still listed: it has likely finished that round, and its record, written
        once per announce period, may not show it yet."""
        deadline = time.monotonic() + self.timing.max_round_s + 2 * self.cfg.timeouts.announce_period_s
        # Look often, not once per announce period: a replica left out of a set sleeping a whole period (5 s) before
        # its first look took as long as the leader's next window, arrived just after it closed, was late again, and
        # so on — 22 rounds in a row of a 2-replica stage in one 8M-token run (docs/benchmarks.md, "At 8M tokens").
        while time.monotonic() < deadline:
            await asyncio.sleep(min(PROGRESS_POLL_S, self.cfg.timeouts.announce_period_s))
            if await self.catch_up():  # it also reads the stage's records into ``_others``
                return True
            # (a leader whose record lags broke this off at once, and the retry met the leader's old commit: in an
            # 8M-token run, that second failure banned an honest partner and split the stage for the rest of the run)
            if leader not in self._others and not any(s.outer_round >= round_ for s in self._others.values()):
                break
        logger.warning(f"stage {self.stage}: no replica got past outer round {round_}; keeping it")
        return False

    async def _download(self, claim: StateClaim, reason: str) -> bool:
        """Download and adopt the state ``claim`` announces, from one of its holders; False if none delivers it."""
        holders = [peer for peer in claim.holders if peer != self.net.me]
        started = time.perf_counter()
        try:
            peer, state = await download_state(
                self.fetch,
                holders,
                stage=self.stage,
                template=self.params,
                blame=lambda peer, why: self.strike(peer, f"its state for round {claim.round}: {why}"),
                check=claim.acceptance(
                    self.outer.global_params if self.outer else self.params, max_norm_ratio=LONE_CLAIM_MAX_NORM_RATIO
                ),
            )
        except TransferError as e:
            logger.warning(f"stage {self.stage}: could not catch up ({reason}): {e}")
            return False
        await self.adopt(state)
        self.counters["state_downloads"] += 1
        self.on_log(
            {
                "event": "state_download",
                "stage": self.stage,
                "from": peer,
                "reason": reason,
                "vouched_by": len(claim.holders),
                "download_s": time.perf_counter() - started,
                "outer_round": self.round,
                "global_hash": self.global_hash,
            }
        )
        return True

    async def _window_open(self) -> bool:
        """Whether another replica has opened this replica's next round and its window is still open."""
        seen, now = await self.net.declarations(RoundKey(self.stage, self.round)), self.clock()
        others = {peer: t for peer, t in plausible_arrivals(seen, now, self.timing) if peer != self.net.me}
        return (
            bool(others) and now <= window_opening(others, own=now, now=now, timing=self.timing) + self.timing.window_s
        )

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def _changing(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the outer thread, as a change of the outer state: a stream of the old one stops."""

        def change() -> T:
            self._changes += 1
            return fn(*args)

        return await self._on_thread(change)
