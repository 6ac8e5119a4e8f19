"""One peer: a ``Node`` owns its DHT node, membership records, P2P services and its role (trainer or stage server).

The peer that starts with no initial peers creates the swarm and publishes its config; any
other joins through initial peers and fetches (or checks) the config. A stage server serves its
stage over hivemind P2P and re-announces itself every ``announce_period_s``; a trainer keeps its
router in sync with the announced replicas and trains (the roles: ``swarm/roles.py``); a full peer trains the
whole model by itself and is one more replica of every stage (``swarm/full.py``). On ``stop``
(SIGINT / SIGTERM in the CLI) the peer retires its DHT records and shuts its DHT down. A peer of a
private swarm follows the authority's newest signed revocation list while it runs (its
``--revocations`` file and the DHT: ``swarm/dht/revocations.py``).

Every replica takes part in its stage's outer rounds (``swarm/outer/replica.py``). A peer that joins a
running swarm first downloads its stage's current state from a live replica, so it starts at the
stage's round and weights without pausing anyone. ``role="auto"`` (``choose_role``) takes the role
the swarm needs most: a server for a stage nobody serves, else a trainer if there is none, else a full
peer if the whole model fits and every stage has servers to spare, else a server of the bottleneck stage. Stage servers rebalance (SWARM) and rebuild lost stages (CheckFree);
with ``stage_checkpoint`` a server also writes its stage state every ``checkpoint_every`` inner
steps, and one started on a stage with no live replica loads that file instead (rollback).

A fault schedule (``PeerConfig.faults``) naming this peer makes it die at its own inner step N:
SIGKILL of the whole peer, or (``on_fault="crash"``, in-process tests) an abrupt stop that leaves
its records to expire.

Data and logging come in from the caller (swarm/ never imports peer/):

    >>> node = Node(PeerConfig(role="stage", stage=1, initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3…"]), on_ready=print)
    >>> await node.start()          # joined: node.cfg is the swarm's config, node.role the role it plays
    >>> record = await node.run()   # until node.stop() (from another task) or, for a trainer, its last step
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, Literal

from hivemind import DHT
from hivemind.p2p import PeerID

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership, check_access, pick_stage, pipeline_replicas
from swarm.dht.process import SwarmDHT
from swarm.dht.reachability import RELAY_WAIT_S, visible_maddrs, wait_for_circuit
from swarm.dht.records import StageStatus, serving
from swarm.dht.revocations import RevocationFollower
from swarm.dht.start import start_dht
from swarm.faults import kill_this_peer, wait_for_step
from swarm.full import FullRole
from swarm.hardware import available_memory, describe, resolve_device
from swarm.model.sizing import StageFootprint, check_fits
from swarm.model.stages import EDGE_STAGE
from swarm.outer.service import OuterService
from swarm.parts import LogFn, PeerParts
from swarm.peer_config import PeerConfig
from swarm.pipeline.protocol import StageClient
from swarm.recovery.rebalance import choose_stage_for_newcomer
from swarm.roles import DataFactory, StageRole, TrainerRole, stage_loads
from swarm.rpc.admission import GATE_NAMESPACE, AdmissionGate
from swarm.rpc.auth import encode_public_key

__all__ = ["Node", "choose_role", "stage_loads", "DataFactory", "LogFn"]
logger = logging.getLogger(__name__)


class Node:
    """One peer of a swarm, from joining to leaving: ``start`` joins and picks the role, ``run`` plays it, ``stop`` ends it.

    ``cfg`` is the swarm's config for the peer that creates the swarm (or to check the published one
    against); None fetches the config named ``config.swarm_name``. ``on_ready`` gets the peer's
    addresses once, when its role takes calls. ``on_fault`` is what a scheduled fault does.
    """

    def __init__(
        self,
        config: PeerConfig,
        cfg: SwarmConfig | None = None,
        *,
        data: DataFactory | None = None,
        on_log: LogFn = lambda record: None,
        on_ready: Callable[[list[str]], None] = lambda maddrs: None,
        on_fault: Literal["kill", "crash"] = "kill",
    ) -> None:
        if config.role in ("trainer", "full") and data is None:
            raise ValueError(f"a {config.role} peer needs data")
        self.config, self.cfg, self.data = config, cfg, data
        self.on_log, self.on_ready, self.on_fault = on_log, on_ready, on_fault
        self.dht: DHT | None = None
        self.membership: Membership | None = None
        self.outer_service: OuterService | None = None
        self.revocations: RevocationFollower | None = None  # private swarms: follows the authority's newest list
        self.role: StageRole | TrainerRole | FullRole | None = None
        self.maddrs: list[str] = []  # where others join through, once ready
        self._said_ready = False
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self._running = self._crashed = False

    async def start(self) -> None:
        """Join (or create) the swarm, start the P2P services every role shares, and choose the role."""
        if self.dht is not None:
            raise RuntimeError("this node has started already")
        warm_up_optimizers()  # on a thread, while this one joins
        config = self.config
        authority = encode_public_key(config.credentials.verifier.authority) if config.credentials else None
        if self.cfg is not None:
            check_access(self.cfg, authority)  # before this peer starts a swarm that lets anyone in
        device = resolve_device(config.device)  # before joining: a peer without the device it names fails at once
        reachability = config.chosen_reachability()
        logger.info(reachability.describe())
        self.dht = dht = await start_dht(
            initial_peers=config.initial_peers,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs,
            credentials=config.credentials,
            identity_path=str(config.identity) if config.identity else None,
            reachability=reachability,
        )
        if reachability.behind_nat:
            await self._say_how_others_reach_it(dht)
        try:
            self.membership = membership = Membership(dht)
            self.cfg = cfg = await membership.join(self.cfg, create=not config.initial_peers, name=config.swarm_name)
            check_access(cfg, authority)
            if cfg.stages.num_stages < (config.stage or 0):
                raise ValueError(f"this swarm has stages 1..{cfg.stages.num_stages}, not {config.stage}")
            p2p = await dht.replicate_p2p()
            verifier = config.credentials.verifier if config.credentials else None
            await AdmissionGate(verifier).add_p2p_handlers(p2p, namespace=GATE_NAMESPACE)  # tells refused peers why
            client = StageClient(p2p, namespace=cfg.swarm_id, credentials=config.credentials)
            self.outer_service = OuterService(cfg, membership, p2p, verifier=verifier, certificate=client.certificate)
            await self.outer_service.servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
            if config.credentials is not None:
                self.revocations = RevocationFollower(
                    membership, config.credentials, on_log=self.on_log, period_s=cfg.timeouts.announce_period_s
                )
            parts = PeerParts(
                cfg=cfg,
                config=config,
                membership=membership,
                p2p=p2p,
                client=client,
                outer_service=self.outer_service,
                on_log=self.on_log,
                ready=self._ready,
                stop=self._stop,
                device=device,
            )
            replicas = pipeline_replicas(await membership.all_replicas())  # full peers serve no path
            if config.role == "auto":
                whole = StageFootprint.whole_model(cfg, outer=True).total_bytes <= available_memory(device)
                role, stage = choose_role(
                    replicas, cfg.stages.num_stages, whole_model_fits=whole and self.data is not None
                )
                logger.info(f"--role auto: {role}" + (f" of stage {stage}" if role == "stage" else ""))
            else:
                role, stage = config.role, config.stage
            if reachability.mode == "client" and role == "stage":  # it only calls out: nobody could call it
                role, stage = "trainer", None
            if role == "stage":
                stage = stage or pick_stage(replicas)
            footprint = (
                StageFootprint.whole_model(cfg, outer=True)
                if role == "full"
                else StageFootprint.of(cfg, stage if role == "stage" else EDGE_STAGE)
            )
            logger.info(f"{describe(device)}: {footprint.describe()}")
            check_fits(footprint, available=available_memory(device), device=describe(device))
            if role == "stage":
                self.role = StageRole(parts, stage)
            elif self.data is None:
                raise ValueError(f"this swarm needs a {role}, and a {role} needs data")
            elif role == "full":
                self.role = FullRole(parts, self.data)
            else:
                self.role = TrainerRole(parts, self.data)
        except BaseException:
            await self._shut_down()
            raise

    async def run(self) -> dict[str, Any]:
        """Play the role (``start`` first if not yet) until a trainer's last step or ``stop``; returns the last record.

        Whatever ends it, the node then retires its records and shuts its DHT down.
        """
        self._running = True  # a stop() from now on (a signal while joining, say) lets run end, and waits for it
        try:
            if self.role is None:
                await self.start()
            assert self.role is not None
            background = [asyncio.create_task(self._inject_fault())] if self._fault_step() is not None else []
            if self.revocations is not None:
                background.append(asyncio.create_task(self.revocations.run()))
            try:
                return await self.role.run()
            finally:
                for task in background:
                    task.cancel()
        finally:
            await self._shut_down()
            self._finished.set()

    async def stop(self) -> None:
        """End ``run`` (a trainer stops mid-run) and wait until the node has left the swarm."""
        self._stop.set()
        if self._running:
            await self._finished.wait()
        else:
            await self._shut_down()

    def crash(self) -> None:
        """End ``run`` at once without retiring the records, as a dead peer would leave them (they expire)."""
        self._crashed = True
        self._stop.set()

    @staticmethod
    async def _say_how_others_reach_it(dht: SwarmDHT) -> None:
        circuits = await wait_for_circuit(dht)
        if circuits:
            logger.info(f"reachable through a relay at {circuits[0]}")
        else:
            logger.warning(
                f"no relay slot after {RELAY_WAIT_S:g} s: only peers this one has called can call it back "
                "(a relay must be an initial peer with a public address)"
            )

    def _ready(self) -> None:
        if not self._said_ready and self.dht is not None:
            self._said_ready = True  # once: behind NAT with no relay slot the addresses may be none
            self.maddrs = visible_maddrs(self.dht)
            self.on_ready(self.maddrs)

    def _fault_step(self) -> int | None:
        return self.config.fault_step(self.config.name) if self.config.name else None

    async def _inject_fault(self) -> None:
        step = self._fault_step()
        assert step is not None and self.role is not None
        role = self.role
        seen = await wait_for_step(step, lambda: role.holder.inner_steps if role.holder is not None else None)
        stage = role.stage if isinstance(role, StageRole) else EDGE_STAGE
        self.on_log({"event": "fault", "peer": self.config.name, "step": seen, "stage": stage, "action": self.on_fault})
        logger.warning(f"fault injected: {self.config.name} dies at its inner step {seen} ({self.on_fault})")
        if self.on_fault == "kill":
            kill_this_peer()
        self.crash()

    async def _shut_down(self) -> None:
        if self.dht is None:
            return
        if self.role is not None and self.membership is not None and not self._crashed:
            with contextlib.suppress(Exception):  # best effort: the record expires anyway
                await asyncio.wait_for(
                    asyncio.gather(self.membership.retire_all(), self.membership.publish_metrics(None)), timeout=5
                )
        self.dht.shutdown()
        self.dht = None


def warm_up_optimizers() -> None:
    """Import what a peer's first torch optimizer imports (``torch._dynamo``: 2 s of a CPU core) on a daemon thread.

    ``torch.optim.Optimizer.__init__`` imports it on first use; a peer builds its first optimizer (the inner AdamW)
    right after it joins, so the import would otherwise delay serving. Started before the DHT join, it runs while the
    join waits on the network; the optimizer's own import then finds it done (or waits for the rest).
    """
    if "torch._dynamo" not in sys.modules:
        threading.Thread(
            target=importlib.import_module, args=("torch._dynamo",), name="warm-up-optimizers", daemon=True
        ).start()


def choose_role(
    replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int, *, whole_model_fits: bool = False
) -> tuple[str, int]:
    """``--role auto``: (role, stage) this swarm needs most, in this order.

    1. A middle stage nobody serves is a hole in every path: serve it (the lowest such stage).
    2. With no trainer nothing trains: become one (stage 0).
    3. A peer that holds the whole model (``whole_model_fits``) in a pipeline that needs no more servers (``pipeline_is_served``:
       every middle stage has ``FULL_AFTER_SERVERS`` servers and none has requests waiting) becomes a full peer:
       one more server would sit idle, one more whole-model replica trains on its own data, sends no activations, and
       holds a copy of every stage that a lost stage is downloaded from instead of rebuilt.
    4. Otherwise serve the bottleneck, the stage with the least total throughput (SWARM's rule for newcomers).

    ``replicas`` are the pipeline's (``pipeline_replicas``): a full peer neither fills a hole in the paths nor drives
    them as a trainer.
    """
    loads = stage_loads(replicas, num_stages)
    empty = [stage for stage, servers in loads.items() if not servers]
    if empty:
        return "stage", empty[0]
    if not replicas.get(EDGE_STAGE):
        return "trainer", EDGE_STAGE
    if whole_model_fits and pipeline_is_served(replicas, num_stages):
        return "full", EDGE_STAGE
    try:
        return "stage", choose_stage_for_newcomer(loads)
    except ValueError:  # a server caught mid-move is listed in two stages: count replicas instead
        return "stage", pick_stage(replicas)


# servers per middle stage before ``--role auto`` prefers a full peer: one may fail and the paths still run
FULL_AFTER_SERVERS = 2


def pipeline_is_served(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> bool:
    """Every middle stage has ``FULL_AFTER_SERVERS`` servers and no server has a request waiting (a record's queue counts
    the request running too): one more server would add capacity nobody is asking for."""
    servers = [serving(replicas.get(stage, {})) for stage in range(1, num_stages + 1)]
    return all(
        len(stage) >= FULL_AFTER_SERVERS and all(status.queue <= 1 for status in stage.values()) for stage in servers
    )
