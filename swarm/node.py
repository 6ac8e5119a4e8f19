"""One peer process: its DHT node, its membership records and its role (trainer or stage server).

The peer that starts with no initial peers creates the swarm and publishes its config; any
other joins through initial peers and fetches (or checks) the config. A stage server serves its
stage over hivemind P2P and re-announces itself every ``announce_period_s``; a trainer keeps its
router in sync with the announced replicas and trains. On ``stop`` (SIGINT / SIGTERM in the CLI)
the peer retires its DHT records and shuts its DHT down.

Every replica takes part in its stage's outer rounds (``swarm/outer/replica.py``). A peer that joins a
running swarm first downloads its stage's current state from a live replica, so it starts at the
stage's round and weights without pausing anyone. ``--role auto`` (``choose_role``) takes the role
the swarm needs most: a server for a stage nobody serves, else a trainer if there is none, else a
server of the bottleneck stage. Stage servers rebalance (SWARM): every ``rebalance_period_s``
(± 20%) each reads the stages' throughput and at most the one peer ``plan_move`` names moves:
it downloads the new stage's state while still serving, then announces it and retires its old record.

A middle stage that lost every replica is rebuilt from its neighbours (CheckFree, ``swarm/recovery/rebuild.py``):
by a joining peer (``--role auto`` takes an empty stage first; so does ``--role stage`` pointed at one),
or else by the server ``plan_move`` names, found by servers that rebalance within an announce period of
the hole appearing. One claimant at a time (a DHT claim), a fresh optimizer at lr × 1.1, a ``recovered``
mark in its record and a ``recovered`` log event with the merge inputs. With ``stage_checkpoint`` a
server also writes its stage state every ``checkpoint_every`` inner steps, and a server started on a
stage with no live replica loads that file instead (the rollback baseline of ``scripts/bench_recovery.py``).

Data and logging come in from the caller (swarm/ never imports peer/):

    >>> options = NodeOptions(role="stage", stage=1, initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3…"])
    >>> asyncio.run(run_node(None, options, on_ready=print))
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID

from swarm.rpc.admission import GATE_NAMESPACE, AdmissionGate, Credentials, start_dht
from swarm.config import SwarmConfig
from swarm.dht.membership import Membership, StageStatus, pick_stage
from swarm.dht.metrics import Meter, MeteredBackend, MeteredCalls
from swarm.pipeline.protocol import StageClient, StageServicer
from swarm.recovery.rebalance import Snapshot, StageLoad, choose_stage_for_newcomer, next_check_delay, plan_move
from swarm.recovery.rebuild import (PRIORITY_JOINER, PRIORITY_MOVER, Rebuilt, acquire_claim, empty_stages, load_stage_checkpoint, rebuild_stage,
                           save_rebuild, swarm_has_trained)
from swarm.recovery.checkfree import RECOVERY_LR_SCALE, NoRecoverySource
from swarm.outer.replica import PeerSync
from swarm.pipeline.routing import Router
from swarm.pipeline.server import StageServer
from swarm.model.stages import EDGE_STAGE
from swarm.outer.transfer import StageState, TransferError, pack_state, weights_hash
from swarm.pipeline.trainer import Batch, Trainer, TrainerOptions

logger = logging.getLogger(__name__)
ROLES = ("auto", "trainer", "stage")
REBALANCE_PERIOD_S = 30.0
DataFactory = Callable[[SwarmConfig], tuple[Iterator[Batch], Sequence[Batch]]]  # → (train batches, val batches)
LogFn = Callable[[dict[str, Any]], None]


@dataclass(kw_only=True)
class NodeOptions:
    role: str  # auto | trainer | stage
    stage: int | None = None  # stage servers: the stage to serve; None = the one with fewest replicas
    initial_peers: list[str] = field(default_factory=list)  # none: this peer creates the swarm
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None  # libp2p key file (created if missing): a stable peer id
    credentials: Credentials | None = None  # private swarms: this peer's certificate, and the check of everyone else's
    swarm_name: str = SwarmConfig().name  # which published config to fetch when none is given
    steps: int = 100  # trainers: inner steps of stage 0 to run
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    max_pending: int = 8  # stage servers: requests held at once; more are refused as busy
    wait_for_stages_s: float = 120.0  # trainers: how long to wait for every stage to have a replica
    rebalance_period_s: float | None = None  # stage servers: seconds between rebalancing checks (± 20%); 0 = never move
    recovery_dir: str | None = None  # where a peer that rebuilds a stage saves the merge inputs and result (None: nowhere)
    stage_checkpoint: str | None = None  # stage servers: a state file written every checkpoint_every inner steps, and
    checkpoint_every: int = 0  # loaded on start when the stage has no live replica (rollback); 0 = never write it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != "stage" and self.stage is not None:
            raise ValueError("a trainer holds stage 0, --role auto picks its own stage; --stage is for --role stage")
        if self.stage is not None and self.stage < 1:
            raise ValueError(f"stage servers serve stages 1..S, got stage {self.stage}")
        if self.steps < 1 or self.max_pending < 1 or (self.rebalance_period_s or 0) < 0 or self.checkpoint_every < 0:
            raise ValueError("steps and max_pending must be positive, rebalance_period_s and checkpoint_every non-negative")
        if self.checkpoint_every and not self.stage_checkpoint:
            raise ValueError("checkpoint_every needs a stage_checkpoint file to write")

    @property
    def rebalance_every_s(self) -> float:
        """The rebalancing period; 0 = never. A server pinned to ``stage`` stays there unless a period is given."""
        if self.rebalance_period_s is not None:
            return self.rebalance_period_s
        return 0.0 if self.stage is not None else REBALANCE_PERIOD_S


async def run_node(cfg: SwarmConfig | None, options: NodeOptions, *, data: DataFactory | None = None, on_log: LogFn = lambda record: None,
                   on_ready: Callable[[list[str]], None] = lambda maddrs: None, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run one peer until its work is done (trainer) or ``stop`` is set; returns its last record."""
    if options.role == "trainer" and data is None:
        raise ValueError("a trainer needs data")
    stop = stop or asyncio.Event()
    dht = await start_dht(initial_peers=options.initial_peers, host_maddrs=options.host_maddrs, announce_maddrs=options.announce_maddrs,
                          identity_path=options.identity_path, credentials=options.credentials)
    membership = Membership(dht)
    stage: int | None = None
    try:
        cfg = await membership.join(cfg, create=not options.initial_peers, name=options.swarm_name)
        if cfg.stages.num_stages < (options.stage or 0):
            raise ValueError(f"this swarm has stages 1..{cfg.stages.num_stages}, not {options.stage}")
        ready = lambda: on_ready([str(maddr) for maddr in dht.get_visible_maddrs()])
        p2p = await dht.replicate_p2p()
        verifier = options.credentials.verifier if options.credentials else None
        await AdmissionGate(verifier).add_p2p_handlers(p2p, namespace=GATE_NAMESPACE)  # tells refused peers why
        client = StageClient(p2p, namespace=cfg.swarm_id, credentials=options.credentials)
        peer_sync = PeerSync(cfg, membership, p2p, verifier=verifier, certificate=client.certificate)
        await peer_sync.servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
        role, stage = choose_role(await membership.all_replicas(), cfg.stages.num_stages) if options.role == "auto" else (options.role, options.stage)
        if role == "stage":
            stage = stage or pick_stage(await membership.all_replicas())
            return await _serve(cfg, options, stage, membership, p2p, peer_sync, on_log, ready, stop)
        if data is None:
            raise ValueError("this swarm needs a trainer, and a trainer needs data")
        stage = EDGE_STAGE
        ready()
        return await _until_stopped(_train(cfg, options, membership, client, peer_sync, data, on_log), stop)
    finally:
        if stage is not None:
            with contextlib.suppress(Exception):  # best effort: the record expires anyway
                await asyncio.wait_for(asyncio.gather(membership.retire_all(), membership.publish_metrics(None)), timeout=5)
        dht.shutdown()


async def _until_stopped(work: Awaitable[Any], stop: asyncio.Event) -> Any:
    """The result of ``work``, or {} if ``stop`` comes first (``work`` is then cancelled)."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stopped):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else {}


async def _every(period_s: float, fn: Callable[[], Awaitable[None]]) -> None:
    """Call ``fn`` now and then every ``period_s``, logging (not raising) its failures."""
    while True:
        try:
            await fn()
        except Exception as e:
            logger.warning(f"periodic task failed: {type(e).__name__}: {e}")
        await asyncio.sleep(period_s)


def stage_loads(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> Snapshot:
    """The rebalancer's view of the DHT records: each middle stage's servers and their throughput."""
    return {stage: [StageLoad(peer_id=peer.to_base58(), throughput=status.samples_per_s) for peer, status in replicas.get(stage, {}).items()]
            for stage in range(1, num_stages + 1)}


def choose_role(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> tuple[str, int]:
    """``--role auto``: (role, stage) this swarm needs most, in this order.

    1. A middle stage nobody serves is a hole in every path: serve it (the lowest such stage).
    2. With no trainer nothing trains: become one (stage 0).
    3. Otherwise serve the bottleneck, the stage with the least total throughput (SWARM's rule for newcomers).
    """
    loads = stage_loads(replicas, num_stages)
    empty = [stage for stage, servers in loads.items() if not servers]
    if empty:
        return "stage", empty[0]
    if not replicas.get(EDGE_STAGE):
        return "trainer", EDGE_STAGE
    try:
        return "stage", choose_stage_for_newcomer(loads)
    except ValueError:  # a server caught mid-move is listed in two stages: count replicas instead
        return "stage", pick_stage(replicas)


@dataclass(frozen=True)
class Move:
    """Rebalancing moves this server to ``stage``; ``state`` was downloaded (or ``rebuilt``) while it still served the old one
    (None: nobody held it yet)."""

    stage: int
    state: StageState | None
    rebuilt: Rebuilt | None = None


async def _serve(cfg: SwarmConfig, options: NodeOptions, stage: int, membership: Membership, p2p: Any, peer_sync: PeerSync,
                 on_log: LogFn, ready: Callable[[], None], stop: asyncio.Event) -> dict[str, Any]:
    """Serve ``stage`` from its current state, moving when rebalancing says so, until ``stop``. Returns the final record."""
    initial = await _until_stopped(_initial_state(cfg, options, stage, membership, peer_sync, on_log), stop)
    if not initial:  # stopped while waiting for another peer's rebuild
        return {}
    state, rebuilt = initial
    recoveries = int(rebuilt is not None)
    while isinstance(outcome := await _serve_stage(cfg, options, stage, state, rebuilt, recoveries, membership, p2p, peer_sync, on_log,
                                                   ready, stop), Move):
        on_log({"event": "move", "from": stage, "to": outcome.stage, "downloaded": outcome.state is not None, "rebuilt": outcome.rebuilt is not None})
        stage, state, rebuilt, ready = outcome.stage, outcome.state, outcome.rebuilt, lambda: None
        recoveries += rebuilt is not None
    return outcome


async def _initial_state(cfg: SwarmConfig, options: NodeOptions, stage: int, membership: Membership, peer_sync: PeerSync,
                         on_log: LogFn) -> tuple[StageState | None, Rebuilt | None]:
    """What a starting server serves: a live replica's state; else its own checkpoint (rollback); else, if the swarm has
    trained (the stage was lost), the stage rebuilt from its neighbours; else (a new swarm) None: the seeded weights."""
    try:
        if (state := await peer_sync.download(stage)) is not None:
            return state, None
    except TransferError as e:  # the records still list replicas that just died
        logger.warning(f"stage {stage}: no listed replica delivered its state ({e}); taking the stage as lost")
    if options.stage_checkpoint and (path := Path(options.stage_checkpoint)).exists():
        state = load_stage_checkpoint(path, cfg, stage)
        on_log({"event": "rollback", "stage": stage, "schedule_step": state.schedule_step, "path": str(path)})
        return state, None
    while True:  # a joining peer: it rebuilds the stage unless another peer already claimed it
        if not swarm_has_trained(await membership.all_replicas()):
            return None, None
        try:
            if (rebuilt := await _claim_and_rebuild(cfg, stage, membership, peer_sync, PRIORITY_JOINER)) is not None:
                return rebuilt.state, rebuilt
        except NoRecoverySource as e:  # S = 1: no neighbour to rebuild from
            logger.warning(f"stage {stage} was lost and {e}; starting from the seeded weights")
            return None, None
        await asyncio.sleep(cfg.timeouts.announce_period_s)  # someone else rebuilds it: take its state once it serves
        if (state := await peer_sync.download(stage)) is not None:
            return state, None


async def _claim_and_rebuild(cfg: SwarmConfig, stage: int, membership: Membership, peer_sync: PeerSync, priority: int) -> Rebuilt | None:
    """Rebuild ``stage`` if this peer's claim stands; None if another peer's does or the rebuild failed (the claim is then
    withdrawn); ``NoRecoverySource`` if the stage has no neighbour to be rebuilt from."""
    timeouts = cfg.timeouts
    # the claim outlives a slow rebuild (two state downloads) and the first announce of the rebuilt stage
    if not await acquire_claim(membership, stage, priority=priority, ttl_s=2 * timeouts.rpc_s + timeouts.record_ttl_s,
                               settle_s=timeouts.announce_period_s):
        return None
    try:
        if await peer_sync.replicas(stage):  # it came back while we claimed: nothing to rebuild
            raise TransferError("the stage has a live replica again")
        fetch = lambda peer, name, max_bytes: peer_sync.client.fetch(peer, name, timeout=timeouts.rpc_s, max_bytes=max_bytes)
        return await rebuild_stage(cfg, stage, peer_sync.replicas, fetch)
    except (TransferError, NoRecoverySource) as e:
        logger.warning(f"stage {stage}: not rebuilding it: {e}")
        with contextlib.suppress(Exception):
            await membership.withdraw_recovery(stage)
        if isinstance(e, NoRecoverySource):
            raise
        return None


async def _serve_stage(cfg: SwarmConfig, options: NodeOptions, stage: int, state: StageState | None, rebuilt: Rebuilt | None, recoveries: int,
                       membership: Membership, p2p: Any, peer_sync: PeerSync, on_log: LogFn, ready: Callable[[], None],
                       stop: asyncio.Event) -> dict[str, Any] | Move:
    """Serve ``stage`` until ``stop`` (returns the final record) or a rebalancing move (returns it); ``ready`` once the handlers take calls.

    A ``rebuilt`` stage gets a fresh inner optimizer at lr × 1.1 (CheckFree) and announces itself ``recovered``."""
    server = StageServer(cfg, stage, start_step=state.schedule_step if state else 0, lr_scale=RECOVERY_LR_SCALE if rebuilt else 1.0)
    sync = peer_sync.sync(stage, server, on_log)
    _provide_local_state(peer_sync, stage, server, sync, on_log)
    if state is not None:
        await sync.adopt(state)
    if rebuilt is not None:
        installed = await server.exclusive(lambda: weights_hash(dict(server.module.named_parameters())))
        dump = str(save_rebuild(rebuilt, Path(options.recovery_dir), membership.peer_id.to_base58()[-8:])) if options.recovery_dir else None
        on_log({"event": "recovered", **rebuilt.event(), "installed_hash": installed, "lr_scale": RECOVERY_LR_SCALE, "saved": dump})
    meter = Meter(role="stage", stage=stage, state="serving")
    meter.recoveries = recoveries
    servicer = StageServicer(MeteredBackend(server, meter.traffic), stage=stage, max_request_bytes=server.max_request_bytes,
                             max_pending=options.max_pending, stream_timeout_s=cfg.timeouts.rpc_s,
                             verifier=options.credentials.verifier if options.credentials else None)
    microbatch_tokens = cfg.train.microbatch_size * cfg.train.seq_len
    await servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    started = time.perf_counter()

    def record() -> dict[str, Any]:
        return {"role": "stage", "stage": stage, "elapsed_s": time.perf_counter() - started, "queue": servicer.pending,
                "refused": servicer.refused, **server.info(), **sync.info()}

    async def announce() -> None:
        status = server.status(queue=servicer.pending).copy(update={**sync.status_fields(), "recovered": rebuilt is not None})
        await membership.announce(stage, status)
        await membership.publish_config()
        await membership.publish_metrics(meter.sample(status, tokens=server.counters["backward"] * microbatch_tokens))
        on_log({**record(), "metrics": meter.last.dict()})

    background = [asyncio.create_task(_every(cfg.timeouts.announce_period_s, announce)), asyncio.create_task(sync.run())]
    if options.checkpoint_every:
        background.append(asyncio.create_task(_checkpoints(stage, server, sync, Path(options.stage_checkpoint), options.checkpoint_every,
                                                           cfg.timeouts.announce_period_s, on_log)))
    watched = [asyncio.create_task(stop.wait())]  # serving happens in the P2P handlers; this waits for the end or a move
    if options.rebalance_every_s:
        watched.append(asyncio.create_task(_next_move(cfg, stage, membership, peer_sync, options.rebalance_every_s)))
    on_log({"event": "serving", "stage": stage, "outer_round": sync.round, "global_hash": sync.global_hash})
    ready()
    move = None
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        move = None if stop.is_set() else watched[1].result()
    finally:
        for task in background + watched:
            task.cancel()
        await servicer.remove_p2p_handlers(p2p, namespace=cfg.swarm_id)
        if move is not None:  # the new stage is announced as soon as it serves
            await membership.retire(stage)
        server.shutdown()
        sync.close()
    if move is not None:
        return move
    on_log(record())
    return record()


async def _local_state(stage: int, holder: Any, sync: Any) -> bytes:
    """This replica's current (local) weights as a state archive: what a rebuild merges, an export saves, a checkpoint keeps.

    With an outer step, ``state/<i>`` serves the global weights of the last round (what a newcomer
    joins from), which lag up to H inner steps behind; a lost neighbour is rebuilt from the latest.
    """
    params = await holder.exclusive(lambda: {name: p.detach().clone() for name, p in holder.module.named_parameters()})
    return pack_state(StageState(stage=stage, round=sync.round, schedule_step=sync.schedule_step, params=params, optimizer=None))


def _provide_local_state(peer_sync: PeerSync, stage: int, holder: Any, sync: Any, on_log: LogFn) -> None:
    """Serve ``local/<stage>``; each blob served is logged with its hash, so a rebuild's inputs can be traced to their replica."""
    async def provide(name: str) -> bytes:
        if name != f"local/{stage}":
            raise LookupError(f"this peer holds stage {stage}")
        blob = await _local_state(stage, holder, sync)
        on_log({"event": "state_served", "stage": stage, "sha256": hashlib.sha256(blob).hexdigest()[:16]})
        return blob

    peer_sync.servicer.provide("local", provide)


async def _checkpoints(stage: int, server: StageServer, sync: Any, path: Path, every: int, poll_s: float, on_log: LogFn) -> None:
    """Write the stage's local weights to ``path`` every ``every`` inner steps (the rollback baseline of the recovery benchmark)."""
    written = server.inner_steps
    while True:
        await asyncio.sleep(poll_s)
        if server.inner_steps < written + every:
            continue
        written = server.inner_steps
        blob = await _local_state(stage, server, sync)
        tmp = path.with_suffix(path.suffix + ".tmp")
        await asyncio.get_running_loop().run_in_executor(None, tmp.write_bytes, blob)
        tmp.replace(path)  # atomic: a kill mid-write leaves the previous checkpoint
        on_log({"event": "stage_checkpoint", "stage": stage, "inner_steps": written, "path": str(path)})


async def _next_move(cfg: SwarmConfig, stage: int, membership: Membership, peer_sync: PeerSync, period_s: float) -> Move:
    """Wait until rebalancing moves this server: its target stage, with that stage's state downloaded or rebuilt.

    Throughput is compared every ``period_s`` (± 20%); a stage with no replica is looked for every
    announce period, since every path skips it until someone fills it. A hole in a swarm that has
    trained is a lost stage: the mover claims and rebuilds it (``swarm/recovery/rebuild.py``).
    """
    me, rng, num_stages = membership.peer_id.to_base58(), random.Random(f"rebalance/{membership.peer_id}"), cfg.stages.num_stages
    hole_check_s = min(period_s, cfg.timeouts.announce_period_s)
    next_balance = time.monotonic() + next_check_delay(period_s, rng)

    async def plan() -> int | None:
        return plan_move(stage_loads(await membership.all_replicas(), num_stages), me)

    while True:
        await asyncio.sleep(next_check_delay(hole_check_s, rng))
        try:
            replicas = await membership.all_replicas()
            holes = empty_stages(replicas, num_stages)
            if not holes and time.monotonic() < next_balance:
                continue
            next_balance = time.monotonic() + next_check_delay(period_s, rng)
            if (target := plan_move(stage_loads(replicas, num_stages), me)) is None:
                continue
            if target in holes and swarm_has_trained(replicas):
                if (rebuilt := await _claim_and_rebuild(cfg, target, membership, peer_sync, PRIORITY_MOVER)) is not None:
                    return Move(target, rebuilt.state, rebuilt)
                continue
            state = await peer_sync.download(target)
            if await plan() == target:  # the download took a while: move only if that is still the plan
                return Move(target, state)
        except (ValueError, TransferError) as e:  # a server caught mid-move in two stages, or no state to be had
            logger.info(f"rebalancing: staying on stage {stage} for now: {e}")


async def _train(cfg: SwarmConfig, options: NodeOptions, membership: Membership, client: StageClient, peer_sync: PeerSync,
                 data: DataFactory, on_log: LogFn) -> dict[str, Any]:
    router = Router(cfg.stages.num_stages, random.Random(f"{cfg.train.seed}/{membership.peer_id}"))
    meter = Meter(role="trainer", stage=EDGE_STAGE, state="joining")
    state = await peer_sync.download(EDGE_STAGE)  # a trainer joining mid-run starts from the other trainers' stage 0
    trainer = Trainer(cfg, MeteredCalls(client, meter.traffic), router, options=options.trainer, start_step=state.schedule_step if state else 0)
    sync = peer_sync.sync(EDGE_STAGE, trainer, on_log)
    _provide_local_state(peer_sync, EDGE_STAGE, trainer, sync, on_log)  # what `swarmloco export` takes stage 0 from
    if state is not None:
        await sync.adopt(state)
    batches, val_batches = data(cfg)

    async def refresh() -> None:
        banned = 0
        for stage, replicas in (await membership.all_replicas()).items():
            if stage != EDGE_STAGE:
                router.update(stage, list(replicas))
                banned += len(replicas) - len(router.balancers[stage].live_peers())
        status = trainer.status().copy(update=sync.status_fields())
        await membership.announce(EDGE_STAGE, status)
        await membership.publish_config()
        await membership.publish_metrics(meter.sample(status, tokens=trainer.tokens, bans=banned))

    def log(record: dict[str, Any]) -> None:
        meter.observe(record)
        on_log({**record, **sync.info(), "metrics": meter.last and meter.last.dict()})  # the record published last

    refresher = asyncio.create_task(_every(cfg.timeouts.announce_period_s, refresh))
    syncer = asyncio.create_task(sync.run())
    try:
        await _wait_for_stages(router, cfg.stages.num_stages, options.wait_for_stages_s)
        meter.state = "training"
        return await trainer.train(batches, steps=options.steps, val_batches=val_batches, on_log=log)
    finally:
        refresher.cancel()
        syncer.cancel()
        trainer.shutdown()
        sync.close()


async def _wait_for_stages(router: Router, num_stages: int, timeout_s: float) -> None:
    """Start training once every middle stage has a replica (or train on with skips after ``timeout_s``)."""
    deadline, last_missing = time.monotonic() + timeout_s, None
    while (missing := sorted(set(range(1, num_stages + 1)) - set(router.live_stages()))) and time.monotonic() < deadline:
        if missing != last_missing:
            logger.warning(f"waiting for servers of stages {missing}")
            last_missing = missing
        await asyncio.sleep(0.5)
    if missing:
        logger.warning(f"no server for stages {missing} after {timeout_s:.0f}s: training skips them")
