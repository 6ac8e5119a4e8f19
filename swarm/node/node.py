"""One peer (``Node``): joins the swarm, opens the P2P services every role shares, builds its role and runs it.

``swarm_config`` is the swarm's (shared, hashed); ``peer_config`` this peer's own. Data and logging come in from
the caller (swarm/ never imports peer/); docs/architecture.md ("A peer's life") tells the whole story.

    >>> node = Node(PeerConfig(role="stage", stage=1, initial_peers=["/ip4/127.0.0.1/tcp/4100/p2p/12D3…"]))
    >>> await node.start()          # joined: node.swarm_config is the swarm's config, node.role the role it plays
    >>> record = await node.run()   # until node.stop() (from another task) or, for a trainer, its last step
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Literal

import torch
from hivemind import DHT

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership, check_access, pick_stage, pipeline_replicas
from swarm.dht.process import SwarmDHT
from swarm.dht.reachability import RELAY_WAIT_S, Reachability, visible_maddrs, wait_for_circuit
from swarm.dht.revocations import RevocationFollower
from swarm.dht.start import start_dht
from swarm.events import EventSink, Fault, Progress
from swarm.hardware import available_memory, describe, resolve_device
from swarm.model.sizing import StageFootprint, check_fits
from swarm.model.stages import EDGE_STAGE
from swarm.node.config import PeerConfig
from swarm.node.context import DataFactory, NodeContext
from swarm.node.placement import choose_role
from swarm.node.roles.full import FullRole
from swarm.node.roles.stage_server import StageRole
from swarm.node.roles.trainer import TrainerRole
from swarm.outer.service import OuterService
from swarm.pipeline.pacing import load_pace
from swarm.pipeline.relay_rpc import RelayClient
from swarm.rpc.admission import GATE_NAMESPACE, AdmissionGate
from swarm.rpc.auth import encode_public_key

logger = logging.getLogger(__name__)


class Node:
    """One peer of a swarm, from joining to leaving: ``start`` joins and builds the role, ``run`` plays it, ``stop`` ends it.

    ``swarm_config`` is the swarm's config for the peer that creates the swarm (or to check the published one
    against); None fetches the config named ``peer_config.swarm_name``. ``on_ready`` gets the peer's addresses once,
    when its role takes calls. ``on_fault`` is what a scheduled fault does (``PeerConfig.faults``): SIGKILL of the
    whole peer, or ``crash`` (in-process tests), an abrupt stop that leaves its records to expire.
    """

    def __init__(
        self,
        peer_config: PeerConfig,
        swarm_config: SwarmConfig | None = None,
        *,
        data: DataFactory | None = None,
        on_log: EventSink = lambda event: None,
        on_ready: Callable[[list[str]], None] = lambda maddrs: None,
        on_fault: Literal["kill", "crash"] = "kill",
    ) -> None:
        if peer_config.role in ("trainer", "full") and data is None:
            raise ValueError(f"a {peer_config.role} peer needs data")
        self.peer_config, self.swarm_config, self.data = peer_config, swarm_config, data
        self.on_log, self.on_ready, self.on_fault = on_log, on_ready, on_fault
        self.dht: DHT | None = None
        self.membership: Membership | None = None
        self.outer_service: OuterService | None = None
        self.revocations: RevocationFollower | None = None  # private swarms: follows the authority's newest list
        self.role: StageRole | TrainerRole | FullRole | None = None
        self.maddrs: list[str] = []  # where others join through, once ready
        self.reachability: Reachability | None = None  # how others reach this peer, and why (once it joins)
        self._said_ready = False
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self._running = self._crashed = False

    async def start(self) -> None:
        """Join (or create) the swarm, open the P2P services every role shares, and build the role."""
        if self.dht is not None:
            raise RuntimeError("this node has started already")
        warm_up_optimizers()  # on a thread, while this one joins
        device = resolve_device(self.peer_config.device)  # before joining: a peer without its device fails at once
        self.dht = await self._join()
        try:
            ctx = await self._open_services(self.dht, device)
            if (spec := self.peer_config.pace_as) is not None:  # recording one takes a while: the loop runs on
                boundaries = self.peer_config.pace_boundaries
                pace = await asyncio.to_thread(load_pace, ctx.swarm_config, spec, boundaries, log=logger.info)
                ctx = dataclasses.replace(ctx, pace=pace)
            self.role = await self._build_role(ctx)
        except BaseException:
            await self._shut_down()
            raise

    async def _join(self) -> SwarmDHT:
        """Start this peer's DHT node and join the swarm: its config fetched, or checked, or (first peer) published."""
        config = self.peer_config
        authority = encode_public_key(config.credentials.verifier.authority) if config.credentials else None
        if self.swarm_config is not None:
            check_access(self.swarm_config, authority)  # before this peer starts a swarm that lets anyone in
        self.reachability = reachability = config.chosen_reachability()
        logger.info(reachability.describe())
        self.dht = dht = await start_dht(
            initial_peers=config.initial_peers,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs,
            credentials=config.credentials,
            identity_path=str(config.identity) if config.identity else None,
            reachability=reachability,
        )
        try:
            if reachability.behind_nat:
                await self._say_how_others_reach_it(dht)
            self.membership = Membership(dht)
            self.swarm_config = cfg = await self.membership.join(
                self.swarm_config, create=not config.initial_peers, name=config.swarm_name
            )
            check_access(cfg, authority)
            if cfg.stages.num_stages < (config.stage or 0):
                raise ValueError(f"this swarm has stages 1..{cfg.stages.num_stages}, not {config.stage}")
        except BaseException:
            await self._shut_down()
            raise
        return dht

    async def _open_services(self, dht: SwarmDHT, device: torch.device) -> NodeContext:
        """The P2P services every role shares (admission gate, stage client, outer service, revocations): the context."""
        config, cfg, membership = self.peer_config, self.swarm_config, self.membership
        assert cfg is not None and membership is not None
        p2p = await dht.replicate_p2p()
        verifier = config.credentials.verifier if config.credentials else None
        await AdmissionGate(verifier).add_p2p_handlers(p2p, namespace=GATE_NAMESPACE)  # tells refused peers why
        client = RelayClient(p2p, namespace=cfg.swarm_id, credentials=config.credentials)  # stage RPC and relay
        self.outer_service = OuterService(cfg, membership, p2p, verifier=verifier, certificate=client.certificate)
        await self.outer_service.servicer.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
        if config.credentials is not None:
            self.revocations = RevocationFollower(
                membership, config.credentials, on_log=self.on_log, period_s=cfg.timeouts.announce_period_s
            )
        return NodeContext(
            swarm_config=cfg,
            peer_config=config,
            membership=membership,
            p2p=p2p,
            client=client,
            outer_service=self.outer_service,
            on_log=self.on_log,
            ready=self._ready,
            stop=self._stop,
            device=device,
        )

    async def _build_role(self, ctx: NodeContext) -> StageRole | TrainerRole | FullRole:
        """The role asked for, or (``--role auto``) the one the swarm needs most, if this peer's memory holds it."""
        config, cfg = self.peer_config, ctx.swarm_config
        replicas = pipeline_replicas(await ctx.membership.all_replicas())  # full peers serve no path
        if config.role == "auto":
            whole = StageFootprint.whole_model(cfg, outer=True).total_bytes <= available_memory(ctx.device)
            role, chosen = choose_role(
                replicas, cfg.stages.num_stages, whole_model_fits=whole and self.data is not None
            )
            stage: int | None = chosen
            logger.info(f"--role auto: {role}" + (f" of stage {stage}" if role == "stage" else ""))
        else:
            role, stage = config.role, config.stage
        if (
            self.reachability is not None and self.reachability.mode == "client" and role == "stage"
        ):  # it only calls out: nobody could call it
            role, stage = "trainer", None
        held = (stage or pick_stage(replicas)) if role == "stage" else EDGE_STAGE  # a full peer's: every stage
        footprint = StageFootprint.whole_model(cfg, outer=True) if role == "full" else StageFootprint.of(cfg, held)
        logger.info(f"{describe(ctx.device)}: {footprint.describe()}")
        check_fits(footprint, available=available_memory(ctx.device), device=describe(ctx.device))
        if role == "stage":
            return StageRole(ctx, held)
        if self.data is None:
            raise ValueError(f"this swarm needs a {role}, and a {role} needs data")
        if role == "full" and ctx.pace is not None:
            raise ValueError("--pace-as is for trainers and stage servers: this swarm needs a full peer")
        return FullRole(ctx, self.data) if role == "full" else TrainerRole(ctx, self.data)

    async def run(self) -> Progress | None:
        """Play the role (``start`` first if not yet) until a trainer's last step or ``stop``; returns the last progress
        record (None if stopped before one).

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
        return self.peer_config.fault_step(self.peer_config.name) if self.peer_config.name else None

    async def _inject_fault(self) -> None:
        """The fault hook (``PeerConfig.faults``, swarmtest/faults.py): once this peer's inner step reaches its fault's,
        it dies. Polled every 10 ms (every step of a CPU-sized model), not hooked into the step: the roles stay free of
        test code."""
        step = self._fault_step()
        assert step is not None and self.role is not None
        role = self.role
        while (seen := role.holder.inner_steps if role.holder is not None else -1) < step:  # -1: not started
            await asyncio.sleep(0.01)
        stage = role.stage if isinstance(role, StageRole) else EDGE_STAGE
        self.on_log(Fault(peer=self.peer_config.name or "", step=seen, stage=stage, action=self.on_fault))
        logger.warning(f"fault injected: {self.peer_config.name} dies at its inner step {seen} ({self.on_fault})")
        if self.on_fault == "kill":
            _kill_this_peer()
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
            target=_import_quietly, args=("torch._dynamo",), name="warm-up-optimizers", daemon=True
        ).start()


def _import_quietly(module: str) -> None:
    """Import ``module``, saying nothing if it fails: a peer that exits at once (refused by its swarm: a clear one-line
    error) tears the import down under this daemon thread, whose traceback would bury that line. The optimizer's own
    import, where it is needed, fails loudly."""
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001  (interpreter shutdown raises anything mid-import)
        pass


def _kill_this_peer() -> None:
    """SIGKILL this process, and its whole process group when it leads one (``spawn_peer`` starts peers so): the
    DHT and libp2p daemons die with it, as in a power cut, leaving records that only expire."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
