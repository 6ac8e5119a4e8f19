"""One peer process: its DHT node, its membership records and its role (trainer or stage server).

The peer that starts with no initial peers creates the swarm and publishes its config; any
other joins through initial peers and fetches (or checks) the config. A stage server serves its
stage over hivemind P2P and re-announces itself every ``announce_period_s``; a trainer keeps its
router in sync with the announced replicas and trains. On ``stop`` (SIGINT / SIGTERM in the CLI)
the peer retires its DHT records and shuts its DHT down.

Every replica takes part in its stage's outer rounds (``swarm/replica.py``). A peer that joins a
running swarm first downloads its stage's current state from a live replica, so it starts at the
stage's round and weights without pausing anyone. ``--role auto`` (``choose_role``) takes the role
the swarm needs most: a server for a stage nobody serves, else a trainer if there is none, else a
server of the bottleneck stage. Stage servers rebalance (SWARM): every ``rebalance_period_s``
(± 20%) each reads the stages' throughput and at most the one peer ``plan_move`` names moves:
it downloads the new stage's state while still serving, then announces it and retires its old record.

Data and logging come in from the caller (swarm/ never imports peer/):

    >>> options = NodeOptions(role="stage", stage=1, initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3…"])
    >>> asyncio.run(run_node(None, options, on_ready=print))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import PeerID

from swarm.admission import GATE_NAMESPACE, AdmissionGate, Credentials, start_dht
from swarm.config import SwarmConfig
from swarm.membership import Membership, StageStatus, pick_stage
from swarm.metrics import Meter, MeteredBackend, MeteredCalls
from swarm.protocol import StageClient, StageServicer
from swarm.rebalance import Snapshot, StageLoad, choose_stage_for_newcomer, next_check_delay, plan_move
from swarm.replica import PeerSync
from swarm.routing import Router
from swarm.server import StageServer
from swarm.stages import EDGE_STAGE
from swarm.state_sync import StageState, TransferError
from swarm.trainer import Batch, Trainer, TrainerOptions

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

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role != "stage" and self.stage is not None:
            raise ValueError("a trainer holds stage 0, --role auto picks its own stage; --stage is for --role stage")
        if self.stage is not None and self.stage < 1:
            raise ValueError(f"stage servers serve stages 1..S, got stage {self.stage}")
        if self.steps < 1 or self.max_pending < 1 or (self.rebalance_period_s or 0) < 0:
            raise ValueError("steps and max_pending must be positive, rebalance_period_s non-negative")

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


async def _until_stopped(work: Awaitable[dict[str, Any]], stop: asyncio.Event) -> dict[str, Any]:
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
    """Rebalancing moves this server to ``stage``; ``state`` was downloaded while it still served the old one (None: nobody held it)."""

    stage: int
    state: StageState | None


async def _serve(cfg: SwarmConfig, options: NodeOptions, stage: int, membership: Membership, p2p: Any, peer_sync: PeerSync,
                 on_log: LogFn, ready: Callable[[], None], stop: asyncio.Event) -> dict[str, Any]:
    """Serve ``stage`` from its current state, moving when rebalancing says so, until ``stop``. Returns the final record."""
    state = await peer_sync.download(stage)  # None: nobody serves this stage yet, so it starts from the seeded weights
    while isinstance(outcome := await _serve_stage(cfg, options, stage, state, membership, p2p, peer_sync, on_log, ready, stop), Move):
        on_log({"event": "move", "from": stage, "to": outcome.stage, "downloaded": outcome.state is not None})
        stage, state, ready = outcome.stage, outcome.state, lambda: None
    return outcome


async def _serve_stage(cfg: SwarmConfig, options: NodeOptions, stage: int, state: StageState | None, membership: Membership, p2p: Any,
                       peer_sync: PeerSync, on_log: LogFn, ready: Callable[[], None], stop: asyncio.Event) -> dict[str, Any] | Move:
    """Serve ``stage`` until ``stop`` (returns the final record) or a rebalancing move (returns it); ``ready`` once the handlers take calls."""
    server = StageServer(cfg, stage, start_step=state.schedule_step if state else 0)
    sync = peer_sync.sync(stage, server, on_log)
    if state is not None:
        await sync.adopt(state)
    meter = Meter(role="stage", stage=stage, state="serving")
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
        status = server.status(queue=servicer.pending).copy(update=sync.status_fields())
        await membership.announce(stage, status)
        await membership.publish_config()
        await membership.publish_metrics(meter.sample(status, tokens=server.counters["backward"] * microbatch_tokens))
        on_log({**record(), "metrics": meter.last.dict()})

    background = [asyncio.create_task(_every(cfg.timeouts.announce_period_s, announce)), asyncio.create_task(sync.run())]
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


async def _next_move(cfg: SwarmConfig, stage: int, membership: Membership, peer_sync: PeerSync, period_s: float) -> Move:
    """Wait until rebalancing moves this server: its target stage, with that stage's state downloaded."""
    me, rng = membership.peer_id.to_base58(), random.Random(f"rebalance/{membership.peer_id}")

    async def plan() -> int | None:
        return plan_move(stage_loads(await membership.all_replicas(), cfg.stages.num_stages), me)

    while True:
        await asyncio.sleep(next_check_delay(period_s, rng))
        try:
            if (target := await plan()) is None:
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
