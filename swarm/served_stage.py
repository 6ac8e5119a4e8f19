"""One stage as a stage server serves it (``ServedStage``), from its first request to a move or the end.

A ``StageRole`` (``swarm/roles.py``) builds one per stage it serves, a new one after each move: the
``StageServer``, its replica sync (``swarm/outer/replica.py``), the stage RPC service, the meter, the
periodic announcements and checkpoints. ``provide_local_state`` serves a replica's local weights
(``local/<stage>``), for a stage server's, a trainer's and a full peer's stages alike; ``stage_servicer`` builds the
stage RPC handlers of a stage server's stage and of a serving full peer's (``swarm/full.py``).

    >>> served = ServedStage(parts, stage, state, rebuilt=None, recoveries=0); await served.start()
    >>> ...; await served.close(retire=False); parts.on_log(served.record())
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from swarm.dht.metrics import Meter, Traffic
from swarm.hardware import describe
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import held_stage
from swarm.outer.transfer import StageState, stream_state, weights_hash
from swarm.parts import PeerParts, every, publish_metrics
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import StageServicer
from swarm.pipeline.server import StageServer
from swarm.recovery.checkfree import RECOVERY_LR_SCALE
from swarm.recovery.rebuild import Rebuilt, save_rebuild, save_stage_checkpoint
from swarm.rpc.blobs import BlobStream


def provide_local_state(parts: PeerParts, *syncs: ReplicaSync) -> None:
    """Serve ``local/<stage>`` of each replica held (a snapshot of its weights, streamed), instead of those served
    before; each blob served whole is logged with its hash, so a rebuild's inputs can be traced to their replica.

    With an outer step, ``state/<i>`` serves the global weights of the last round (what a newcomer
    joins from, and a rebuild or an export takes where two replicas vouch for them), which lag up to H
    inner steps behind; ``local/<i>`` is their fallback where no claim is vouched (``swarm/export.py``).
    """
    held = {sync.stage: sync for sync in syncs}

    async def provide(name: str) -> BlobStream:
        if (sync := held.get(held_stage(name))) is None:
            raise LookupError(f"this peer holds stages {sorted(held)}, not {name!r}")
        stage = sync.stage
        return stream_state(
            await sync.local_state(),
            on_sent=lambda sha256: parts.on_log({"event": "state_served", "stage": stage, "sha256": sha256[:16]}),
        )

    parts.outer_service.servicer.provide("local", provide)


def stage_servicer(parts: PeerParts, servers: Mapping[int, StageServer], traffic: Traffic) -> StageServicer:
    """The stage RPC handlers of the stages this peer serves (a stage server's one, a full peer's 1..S), their
    requests and replies counted into ``traffic``; one queue (``pending``) for them all, as they share a thread."""
    (stage, server), *others = servers.items()
    credentials = parts.config.credentials
    return StageServicer(
        MeteredBackend(server, traffic),
        stage=stage,
        max_request_bytes=server.max_request_bytes,
        max_pending=parts.config.max_pending,
        stream_timeout_s=parts.cfg.timeouts.rpc_s,
        verifier=credentials.verifier if credentials else None,
        other_stages={other: MeteredBackend(backend, traffic) for other, backend in others},
    )


class ServedStage:
    """One stage as this peer serves it, from its first request to a move or the end: server, replica sync, RPC service, meter.

    A ``rebuilt`` stage gets a fresh inner optimizer at lr × 1.1 (CheckFree) and announces itself ``recovered``.
    """

    def __init__(
        self, parts: PeerParts, stage: int, state: StageState | None, rebuilt: Rebuilt | None, recoveries: int
    ) -> None:
        cfg, config = parts.cfg, parts.config
        self.parts, self.stage, self.state, self.rebuilt = parts, stage, state, rebuilt
        self.server = StageServer(
            cfg,
            stage,
            start_step=state.schedule_step if state else 0,
            lr_scale=RECOVERY_LR_SCALE if rebuilt else 1.0,
            device=parts.device,
        )
        self.sync = parts.outer_service.sync(stage, self.server, parts.on_log)
        self.meter = Meter(role="stage", stage=stage, state="serving", name=config.name, device=describe(parts.device))
        self.meter.recoveries = recoveries
        self.servicer = stage_servicer(parts, {stage: self.server}, self.meter.traffic)
        self.started = time.perf_counter()
        self.background: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Install the state, take requests, and start announcing (and checkpointing)."""
        parts, sync, server = self.parts, self.sync, self.server
        provide_local_state(parts, sync)
        if self.state is not None:
            await sync.adopt(self.state)
        if self.rebuilt is not None:
            installed = await server.exclusive(lambda: weights_hash(dict(server.module.named_parameters())))
            out, me = parts.config.out, parts.membership.peer_id.to_base58()[-8:]
            dump = str(save_rebuild(self.rebuilt, out, me)) if out else None
            parts.on_log(
                {
                    "event": "recovered",
                    **self.rebuilt.event(),
                    "installed_hash": installed,
                    "lr_scale": RECOVERY_LR_SCALE,
                    "saved": dump,
                }
            )
        await self.servicer.add_p2p_handlers(parts.p2p, namespace=parts.cfg.swarm_id)
        self.started = time.perf_counter()
        self.background = [
            asyncio.create_task(every(parts.cfg.timeouts.announce_period_s, self.announce)),
            asyncio.create_task(sync.run()),
        ]
        if parts.config.checkpoint_every:
            self.background.append(asyncio.create_task(self.checkpoints()))
        parts.on_log(
            {"event": "serving", "stage": self.stage, "outer_round": sync.round, "global_hash": sync.global_hash}
        )

    def record(self) -> dict[str, Any]:
        return {
            "role": "stage",
            "stage": self.stage,
            "elapsed_s": time.perf_counter() - self.started,
            "queue": self.servicer.pending,
            "refused": self.servicer.refused,
            **self.server.info(),
            **self.sync.info(),
        }

    async def announce(self) -> None:
        membership, server = self.parts.membership, self.server
        status = server.status(queue=self.servicer.pending).copy(
            update={**self.sync.status_fields(), "recovered": self.rebuilt is not None}
        )
        await membership.announce(self.stage, status)
        await membership.publish_config()
        microbatch_tokens = self.parts.cfg.train.microbatch_size * self.parts.cfg.train.seq_len
        busy_recent, _ = server.busy.fractions()
        await publish_metrics(
            self.parts,
            self.meter.sample(
                status,
                tokens=server.counters["backward"] * microbatch_tokens,
                busy_fraction=busy_recent,
                dht_stores=membership.stores,
            ),
        )
        self.parts.on_log(self.record())

    async def checkpoints(self) -> None:
        """Write the stage's local weights to the checkpoint file every ``checkpoint_every`` inner steps (the rollback baseline)."""
        path, every_steps = self.parts.config.stage_checkpoint, self.parts.config.checkpoint_every
        assert path is not None  # PeerConfig checks that checkpoint_every comes with a file
        written = self.server.inner_steps
        while True:
            await asyncio.sleep(self.parts.cfg.timeouts.announce_period_s)
            if self.server.inner_steps < written + every_steps:
                continue
            written = self.server.inner_steps
            await save_stage_checkpoint(path, await self.sync.local_state())
            self.parts.on_log(
                {"event": "stage_checkpoint", "stage": self.stage, "inner_steps": written, "path": str(path)}
            )

    async def close(self, *, retire: bool) -> None:
        """Stop serving; ``retire`` the stage's record (a move: the next stage is announced as soon as it serves)."""
        for task in self.background:
            task.cancel()
        await self.servicer.remove_p2p_handlers(self.parts.p2p, namespace=self.parts.cfg.swarm_id)
        if retire:
            await self.parts.membership.retire(self.stage)
        self.server.shutdown()
        self.sync.close()
