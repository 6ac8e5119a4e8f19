"""One peer process: its DHT node, its membership records and its role (trainer or stage server).

The peer that starts with no initial peers creates the swarm and publishes its config; any
other joins through initial peers and fetches (or checks) the config. A stage server serves its
stage over hivemind P2P and re-announces itself every ``announce_period_s``; a trainer keeps its
router in sync with the announced replicas and trains. On ``stop`` (SIGINT / SIGTERM in the CLI)
the peer retires its DHT records and shuts its DHT down.

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

from hivemind.dht import DHT

from swarm.config import SwarmConfig
from swarm.membership import Membership, pick_stage
from swarm.protocol import StageClient, StageServicer
from swarm.routing import Router
from swarm.server import StageServer
from swarm.stages import EDGE_STAGE
from swarm.trainer import Batch, Trainer, TrainerOptions

logger = logging.getLogger(__name__)
ROLES = ("trainer", "stage")
DataFactory = Callable[[SwarmConfig], tuple[Iterator[Batch], Sequence[Batch]]]  # → (train batches, val batches)
LogFn = Callable[[dict[str, Any]], None]


@dataclass(kw_only=True)
class NodeOptions:
    role: str  # trainer | stage
    stage: int | None = None  # stage servers: the stage to serve; None = the one with fewest replicas
    initial_peers: list[str] = field(default_factory=list)  # none: this peer creates the swarm
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None  # libp2p key file (created if missing): a stable peer id
    swarm_name: str = SwarmConfig().name  # which published config to fetch when none is given
    steps: int = 100  # trainers: inner steps of stage 0 to run
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    max_pending: int = 8  # stage servers: requests held at once; more are refused as busy
    wait_for_stages_s: float = 120.0  # trainers: how long to wait for every stage to have a replica

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.role == "trainer" and self.stage is not None:
            raise ValueError("a trainer holds stage 0; --stage is for stage servers")
        if self.stage is not None and self.stage < 1:
            raise ValueError(f"stage servers serve stages 1..S, got stage {self.stage}")
        if self.steps < 1 or self.max_pending < 1:
            raise ValueError("steps and max_pending must be positive")


async def run_node(cfg: SwarmConfig | None, options: NodeOptions, *, data: DataFactory | None = None, on_log: LogFn = lambda record: None,
                   on_ready: Callable[[list[str]], None] = lambda maddrs: None, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run one peer until its work is done (trainer) or ``stop`` is set; returns its last record."""
    if options.role == "trainer" and data is None:
        raise ValueError("a trainer needs data")
    stop = stop or asyncio.Event()
    dht = DHT(initial_peers=options.initial_peers or None, start=True, host_maddrs=options.host_maddrs,
              announce_maddrs=options.announce_maddrs or None, identity_path=options.identity_path,
              check_if_identity_free=False)
    membership = Membership(dht)
    stage: int | None = None
    try:
        cfg = await membership.join(cfg, create=not options.initial_peers, name=options.swarm_name)
        if cfg.stages.num_stages < (options.stage or 0):
            raise ValueError(f"this swarm has stages 1..{cfg.stages.num_stages}, not {options.stage}")
        ready = lambda: on_ready([str(maddr) for maddr in dht.get_visible_maddrs()])
        p2p = await dht.replicate_p2p()
        if options.role == "stage":
            stage = options.stage or pick_stage(await membership.all_replicas())
            return await _serve(cfg, options, stage, membership, p2p, on_log, ready, stop)
        stage = EDGE_STAGE
        ready()
        return await _until_stopped(_train(cfg, options, membership, StageClient(p2p, namespace=cfg.swarm_id), data, on_log), stop)
    finally:
        if stage is not None:
            with contextlib.suppress(Exception):  # best effort: the record expires anyway
                await asyncio.wait_for(membership.retire(stage), timeout=5)
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


async def _serve(cfg: SwarmConfig, options: NodeOptions, stage: int, membership: Membership, p2p: Any, on_log: LogFn,
                 ready: Callable[[], None], stop: asyncio.Event) -> dict[str, Any]:
    """Serve ``stage`` until ``stop``; ``ready`` once the handlers take calls. Returns the final record."""
    server = StageServer(cfg, stage)
    servicer = StageServicer(server, stage=stage, max_request_bytes=server.max_request_bytes, max_pending=options.max_pending)
    await servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    started = time.perf_counter()

    def record() -> dict[str, Any]:
        return {"role": "stage", "stage": stage, "elapsed_s": time.perf_counter() - started, "queue": servicer.pending,
                "refused": servicer.refused, **server.info()}

    async def announce() -> None:
        await membership.announce(stage, server.status(queue=servicer.pending))
        await membership.publish_config()
        on_log(record())

    announcer = asyncio.create_task(_every(cfg.timeouts.announce_period_s, announce))
    ready()
    try:
        await stop.wait()  # serving happens in the P2P handlers
    finally:
        announcer.cancel()
        await servicer.remove_p2p_handlers(p2p, namespace=cfg.swarm_id)
        server.shutdown()
    on_log(record())
    return record()


async def _train(cfg: SwarmConfig, options: NodeOptions, membership: Membership, client: StageClient, data: DataFactory,
                 on_log: LogFn) -> dict[str, Any]:
    router = Router(cfg.stages.num_stages, random.Random(f"{cfg.train.seed}/{membership.peer_id}"))
    trainer = Trainer(cfg, client, router, options=options.trainer)
    batches, val_batches = data(cfg)

    async def refresh() -> None:
        for stage, replicas in (await membership.all_replicas()).items():
            if stage != EDGE_STAGE:
                router.update(stage, list(replicas))
        await membership.announce(EDGE_STAGE, trainer.status())
        await membership.publish_config()

    refresher = asyncio.create_task(_every(cfg.timeouts.announce_period_s, refresh))
    try:
        await _wait_for_stages(router, cfg.stages.num_stages, options.wait_for_stages_s)
        return await trainer.train(batches, steps=options.steps, val_batches=val_batches, on_log=on_log)
    finally:
        refresher.cancel()
        trainer.shutdown()


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
