"""This peer's outer-step service (``OuterService``): its other replicas, a ``ReplicaSync`` per replica held, the state
each serves (``ServedState``), state downloads.

It wires ``ReplicaSync`` to the swarm: one blob service (outer-round payloads and commits, and the state
of each stage the peer holds), the DHT records, and state downloads for a newcomer.

    >>> outer_service = OuterService(cfg, membership, p2p); await outer_service.servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> state = await outer_service.download(stage)                       # None: nobody holds the stage yet
    >>> server = StageServer(cfg, stage, start_step=state.schedule_step); sync = outer_service.sync(stage, server, on_log)
    >>> await sync.adopt(state); task = asyncio.create_task(sync.run())   # cancel to stop; sync.close() after
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from optim.outer import OuterOptimizer
from optim.payload import max_payload_bytes
from swarm.config import SwarmConfig
from swarm.dht.membership import Membership
from swarm.dht.records import StageStatus
from swarm.events import EventSink
from swarm.model.stages import EDGE_STAGE
from swarm.outer.accountability import OUTER_PEER_LIMITS
from swarm.outer.board import Board
from swarm.outer.claims import newcomer_claims, stage_claims
from swarm.outer.download import NoStateDelivered, Served, download_for_newcomer, later
from swarm.outer.group import P2PGroupNetwork, RoundTiming
from swarm.outer.replica import ReplicaSync
from swarm.outer.snapshots import SharedSnapshot
from swarm.outer.state import StageState, state_bytes_bound, stream_state
from swarm.outer.threads import Holder, snapshot_weights
from swarm.rpc.auth import CertificateVerifier
from swarm.rpc.blobs import BlobClient, BlobServicer, BlobStream, Sink
from swarm.rpc.defences import PeerGuard

logger = logging.getLogger(__name__)


class OuterService:
    """This peer's outer-step plumbing over the swarm: one blob service, one board and one client, whatever stage it holds.

    The blob service answers ``outer/…`` from the board and ``state/<stage>`` from the current
    ``ReplicaSync``; ``verifier`` and ``certificate`` make it private as the stage RPCs are.
    """

    def __init__(
        self,
        cfg: SwarmConfig,
        membership: Membership,
        p2p: P2P,
        *,
        verifier: CertificateVerifier | None = None,
        certificate: Callable[[], bytes | None] = lambda: None,
    ) -> None:
        self.cfg, self.membership = cfg, membership
        self.guard = PeerGuard(OUTER_PEER_LIMITS)  # one record of offences, whatever stage this peer holds
        self.board = Board(retention_s=RoundTiming.of(cfg.timeouts).max_round_s, clock=get_dht_time)
        self.servicer = BlobServicer(verifier=verifier, wait_s=2 * cfg.timeouts.rpc_s)
        self.servicer.provide("outer", self.board.get)
        self.servicer.provide("state", self._export_state)
        self.client = BlobClient(p2p, namespace=cfg.swarm_id, certificate=certificate)
        self.held: dict[int, ServedState] = {}  # stage → the state this peer serves, of the replica sync holding it

    async def replicas(self, stage: int) -> dict[str, StageStatus]:
        """The other live replicas of ``stage``."""
        found = await self.membership.replicas(stage)
        return {peer.to_base58(): status for peer, status in found.items() if peer != self.membership.peer_id}

    async def trainers(self) -> dict[str, StageStatus]:
        """The live trainers (stage 0's replicas, this peer included), whose records carry their verdicts."""
        return {peer.to_base58(): status for peer, status in (await self.membership.replicas(EDGE_STAGE)).items()}

    def sync(self, stage: int, holder: Holder, on_log: EventSink, *, alongside: bool = False) -> ReplicaSync:
        """The outer step of ``holder``, whose state this peer serves from now on: instead of the stage it held before
        (a server that moved), or ``alongside`` the others (a full peer holds every stage)."""
        params = dict(holder.module.named_parameters())
        bound = state_bytes_bound(params)
        net = P2PGroupNetwork(self.membership, self.client, max_payload_bytes=max_payload_bytes(params))
        sync = ReplicaSync(
            self.cfg,
            stage,
            holder,
            net=net,
            board=self.board,
            replicas=functools.partial(self.replicas, stage),
            fetch=lambda peer, name, sink: self._stream(peer, name, sink, bound),
            on_log=on_log,
            clock=get_dht_time,
            guard=self.guard,
            trainers=self.trainers,
        )
        if not alongside:
            self.held.clear()
        self.held[stage] = ServedState(sync)
        return sync

    async def local_state(self, stage: int) -> StageState:
        """The current (local) weights of the replica of ``stage`` this peer holds (``ServedState.local_state``)."""
        return await self.held[stage].local_state()

    async def download(self, stage: int) -> StageState | None:
        """The current state of ``stage`` from its replicas; None if it has no replica.

        The claims vouched for by two or more replicas are tried, latest round first; only a stage
        where no two replicas agree falls back to a lone claim whose weights stay within
        ``NEWCOMER_MAX_NORM_RATIO`` of the seeded ones (``download_for_newcomer``). Records of
        replicas that just died stay listed until their TTL runs out, so a peer that finds only
        dead ones keeps reading the records (every announce period) until they expire — then the
        stage has no replica (None) — and raises ``TransferError`` only if replicas are still
        listed after a record's lifetime but none delivers.
        """
        timeouts, model, num_stages = self.cfg.timeouts, self.cfg.model, self.cfg.stages.num_stages
        deadline = time.monotonic() + timeouts.record_ttl_s + timeouts.announce_period_s
        ahead: Served | None = None  # a state served before its holder's record claimed it, until the records do
        while True:
            others = {peer: s for peer, s in (await self.replicas(stage)).items() if not self.guard.banned_for(peer)}
            if not others:
                return None
            # nothing of the stage is drawn (a 0.5B stage's seeded weights took a joiner seconds to tens of seconds)
            claims = newcomer_claims(stage_claims(others))
            try:
                _, _, state = await download_for_newcomer(
                    self._stream,
                    claims,
                    model=model,
                    num_stages=num_stages,
                    stage=stage,
                    blame=self._blame,
                    ahead=ahead,
                )
                return state
            except NoStateDelivered as e:
                ahead = later(ahead, e.ahead)
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(timeouts.announce_period_s)  # the records may have changed: read them again

    async def _export_state(self, name: str) -> BlobStream:
        """``state/<stage>`` from the replica sync of that stage, if this peer holds it."""
        stage = held_stage(name)
        served = None if stage is None else self.held.get(stage)
        if served is None:
            raise LookupError(f"this peer holds stages {sorted(self.held)}, not {name!r}")
        return await served.export_state(name)

    def _blame(self, peer: str, why: str) -> None:
        """A strike against ``peer``, which served a state it does not hold (or no stage's state at all)."""
        if self.guard.strike(peer):
            logger.warning(f"banned {peer} from this peer's outer rounds and downloads: {why}")

    async def _stream(self, peer: str, name: str, sink: Sink, max_bytes: int) -> str:
        return await self.client.stream(peer, name, sink, timeout=self.cfg.timeouts.rpc_s, max_bytes=max_bytes)


class StateChanged(Exception):
    """The outer state changed (a round applied, a state adopted) while a stream of it was being sent."""


class ServedState:
    """The stage state one replica serves: ``state/<stage>`` (its last round's global weights and outer optimizer,
    streamed from the live tensors) and its local weights (``local/<stage>``, a rebuild's, an export's, a checkpoint's),
    copied once per version for the downloads that ask at once.

    >>> served = ServedState(sync); blob = await served.export_state("state/1"); state = await served.local_state()
    """

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync
        holder = sync.holder
        # a version of the local weights: inner steps, and the outer step's changes of them
        self._snapshot = SharedSnapshot(
            functools.partial(snapshot_weights, holder),
            lambda: (holder.inner_steps, sync.round, sync.thread.changes, sync.installs),
        )

    async def export_state(self, name: str) -> BlobStream:
        """The ``state/<stage>`` blob (global weights, outer optimizer state, round, schedule step), streamed: each chunk
        copied on the outer thread from the live tensors; a round applied or a state adopted meanwhile cuts the stream
        short (``StateChanged``), so a receiver never gets a mix of two rounds."""
        if name != f"state/{self.sync.stage}":
            raise LookupError(f"this peer holds stage {self.sync.stage}")
        if self.sync.outer is None:  # no outer step: the local weights are the stage's weights
            return stream_state(await self.local_state())
        return await self._stream_outer(self.sync.outer)

    async def local_state(self) -> StageState:
        """The replica's current (local) weights as a stage state, no optimizer: what a rebuild merges, an export saves,
        a checkpoint keeps (``state/<stage>`` serves the global weights of the last round instead)."""
        params = await self._snapshot.get()  # one copy on the compute thread, shared by the downloads of its version
        sync = self.sync
        return StageState(
            stage=sync.stage, round=sync.round, schedule_step=sync.schedule_step, params=params, optimizer=None
        )

    async def _stream_outer(self, outer: OuterOptimizer[Any]) -> BlobStream:
        """The outer state, cut short by a change of it (``StateChanged``)."""
        sync, thread = self.sync, self.sync.thread

        def take() -> tuple[int, StageState]:  # on the outer thread: the references, and the version they are of
            state = StageState(
                stage=sync.stage,
                round=outer.round,
                schedule_step=sync.schedule_step,
                params=dict(outer.global_params),
                optimizer=outer.optimizer.state_dict(),  # its tensors are the live buffers, not copies
            )
            return thread.changes, state

        version, state = await thread.run(take)

        def unchanged(copy: Callable[[], bytes]) -> bytes:
            if thread.changes != version:
                raise StateChanged(f"stage {sync.stage}'s outer state changed while it was sent")
            return copy()

        blob = stream_state(state, read=lambda copy: thread.run(unchanged, copy))
        # a round past the replica's record: its receiver refuses it (``RecordBehind``), so it costs the receiver nothing
        announced = sync.state.announced_round
        return dataclasses.replace(blob, charged=not (announced is not None and state.round > announced))


def held_stage(name: str) -> int | None:
    """The stage a ``<kind>/<stage>`` blob name asks for; None if it names none."""
    _, _, stage = name.partition("/")
    return int(stage) if stage.isdigit() else None
