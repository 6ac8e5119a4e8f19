"""One stage as a stage server serves it (``ServedStage``), and the stage RPC handlers of the stages a peer serves.

A ``StageRole`` builds one ``ServedStage`` per stage it serves, a new one after each move; a full peer with
``--serve`` builds only the handlers (``stage_servicer``).

    >>> served = ServedStage(ctx, stage, state, rebuilt=None, recoveries=0); await served.start()
    >>> ...; await served.close(retire=False); served.record()   # its progress record
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from swarm.dht.metrics import Meter, Traffic
from swarm.dht.records import StageStatus
from swarm.events import Recovered, Serving, StageProgress
from swarm.hardware import describe
from swarm.model.compiling import compile_stage
from swarm.node.context import NodeContext
from swarm.node.lifecycle import ReplicaLifecycle
from swarm.outer.state import StageState, weights_hash
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import StageServicer
from swarm.pipeline.relay_rpc import RelayBackend, RelayClient, RelayNode, RelayServicer, relay_limits
from swarm.pipeline.server import StageServer, warm_up
from swarm.recovery.checkfree import RECOVERY_LR_SCALE
from swarm.recovery.rebuild import Rebuilt, save_rebuild

logger = logging.getLogger(__name__)


def stage_servicer(ctx: NodeContext, servers: Mapping[int, StageServer], traffic: Traffic) -> StageServicer:
    """The stage RPC handlers of the stages this peer serves (a stage server's one, a full peer's 1..S), their
    requests and replies counted into ``traffic``; one queue (``pending``) for them all, as they share a thread."""
    (stage, server), *others = servers.items()
    credentials, rpc_s = ctx.peer_config.credentials, ctx.swarm_config.timeouts.rpc_s
    verifier = credentials.verifier if credentials else None
    # frames sent server to server (relay_rpc.py): a trainer's --relay asks for it, every server takes part
    client = ctx.client if isinstance(ctx.client, RelayClient) else None
    node = RelayNode(relay_limits(ctx.swarm_config), me=str(ctx.p2p.peer_id), client=client, push_timeout_s=rpc_s)
    servicer = StageServicer(
        RelayBackend(MeteredBackend(server, traffic), node),
        stage=stage,
        max_request_bytes=server.max_request_bytes,
        max_pending=ctx.peer_config.max_pending,
        stream_timeout_s=rpc_s,
        verifier=verifier,
        other_stages={other: RelayBackend(MeteredBackend(backend, traffic), node) for other, backend in others},
    )
    servicer.companions.append(RelayServicer(node, traffic, verifier=verifier, stream_timeout_s=rpc_s))
    return servicer


class ServedStage:
    """One stage as this peer serves it, from its first request to a move or the end: server, lifecycle, RPC service.

    A ``rebuilt`` stage gets a fresh inner optimizer at lr × 1.1 (CheckFree) and announces itself ``recovered``.
    """

    def __init__(
        self, ctx: NodeContext, stage: int, state: StageState | None, rebuilt: Rebuilt | None, recoveries: int
    ) -> None:
        self.ctx, self.stage, self.state, self.rebuilt = ctx, stage, state, rebuilt
        self.server = StageServer(
            ctx.swarm_config,
            stage,
            start_step=state.schedule_step if state else 0,
            lr_scale=RECOVERY_LR_SCALE if rebuilt else 1.0,
            device=ctx.device,
            keep_graph_mb=ctx.peer_config.keep_graph_mb,
            pace=ctx.pace,
        )
        self.compiled = compile_stage(self.server.module, ctx.peer_config.compile, ctx.device)  # in place, by block
        meter = Meter(
            role="stage", stage=stage, state="serving", name=ctx.peer_config.name, device=describe(ctx.device)
        )
        meter.recoveries = recoveries
        self.life = ReplicaLifecycle(ctx, meter, checkpoint_stage=stage)
        self.servicer = stage_servicer(ctx, {stage: self.server}, meter.traffic)
        self.started = time.perf_counter()

    async def start(self) -> None:
        """Install the state, take requests, and start announcing (and checkpointing)."""
        ctx, server = self.ctx, self.server
        (sync,) = await self.life.hold({self.stage: server}, {self.stage: self.state} if self.state else {})
        if self.rebuilt is not None:
            installed = await server.exclusive(lambda: weights_hash(dict(server.module.named_parameters())))
            out = ctx.peer_config.out
            dump = str(save_rebuild(self.rebuilt, out, ctx.me[-8:])) if out else None
            ctx.on_log(
                Recovered(**self.rebuilt.event(), installed_hash=installed, lr_scale=RECOVERY_LR_SCALE, saved=dump)
            )
        if (
            self.compiled.enabled and server.pace is None
        ):  # its first calls compile: paid here, not in a trainer's first deadlines
            warm_s = await server.exclusive(lambda: warm_up(server))
            logger.info(f"stage {self.stage}: compiled and warmed up in {warm_s:.1f}s before taking requests")
        await self.servicer.add_p2p_handlers(ctx.p2p, namespace=ctx.swarm_config.swarm_id)
        self.started = time.perf_counter()
        self.life.start(
            status=self._status,
            usage=self._usage,
            on_announced=lambda: ctx.on_log(self.record()),
            periodic_checkpoints=True,
        )
        ctx.on_log(Serving(stage=self.stage, outer_round=sync.round, global_hash=sync.global_hash))

    def record(self) -> StageProgress:
        """The stage server's progress record (the dashboard's and the role's result): this peer's queue and refusals,
        its server's numbers (``StageServer.info``) and its replica's round and outer counters."""
        return StageProgress.from_json(
            {
                "role": StageProgress.role,
                "stage": self.stage,
                "elapsed_s": time.perf_counter() - self.started,
                "queue": self.servicer.pending,
                "refused": self.servicer.refused,
                **self.server.info(),
                **self.life.syncs[0].info(),
            }
        )

    def _status(self, stage: int) -> StageStatus:
        return self.server.status(queue=self.servicer.pending).copy(update={"recovered": self.rebuilt is not None})

    def _usage(self) -> dict[str, Any]:
        microbatch_tokens = self.ctx.swarm_config.train.microbatch_size * self.ctx.swarm_config.train.seq_len
        busy_recent, _ = self.server.busy.fractions()
        return {"tokens": self.server.counters["backward"] * microbatch_tokens, "busy_fraction": busy_recent}

    async def close(self, *, retire: bool) -> None:
        """Stop serving; ``retire`` the stage's record (a move: the next stage is announced as soon as it serves)."""
        self.life.close()
        await self.servicer.remove_p2p_handlers(self.ctx.p2p, namespace=self.ctx.swarm_config.swarm_id)
        if retire:
            await self.ctx.membership.retire(self.stage)
        self.server.shutdown()
