"""Stage servers with frames sent server to server, on loopback (real hivemind peers): each one a ``StageServer``
behind ``RelayBackend`` and ``MeteredBackend``, with its ``RelayServicer``; and a trainer's ``RelayClient``.

    async with RelayLab(cfg, {"a": 1, "b": 2}) as lab:
        trainer = Trainer(cfg, lab.client, lab.router, options=TrainerOptions(relay=True))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from swarm.config import SwarmConfig
from swarm.dht.metrics import Traffic
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import StageBackend, StageServicer
from swarm.pipeline.relay_rpc import RelayBackend, RelayClient, RelayNode, RelayServicer, relay_limits
from swarm.pipeline.routing import Router
from swarm.pipeline.server import StageServer
from swarmtest.configs import LOOPBACK_MADDRS


@dataclass
class RelayPeer:
    name: str
    p2p: P2P
    server: StageServer
    node: RelayNode
    servicer: StageServicer
    relay: RelayServicer
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id


class RelayLab:
    """A trainer's P2P and one stage server per entry of ``replicas`` (name → stage), routed by ``router`` (a fixed path
    is the caller's: ``router.draw_path``). ``wrap`` may put a backend (an attacker's) in front of a named server's."""

    def __init__(self, cfg: SwarmConfig, replicas: dict[str, int], *, wrap: dict[str, Any] | None = None) -> None:
        self.cfg, self.replicas, self.wrap = cfg, replicas, wrap or {}
        self.peers: dict[str, RelayPeer] = {}
        self.by_id: dict[PeerID, RelayPeer] = {}
        self.router = Router(cfg.stages.num_stages, random.Random(0))

    async def __aenter__(self) -> RelayLab:
        self.host = await P2P.create(host_maddrs=LOOPBACK_MADDRS)
        maddrs = [str(m) for m in await self.host.get_visible_maddrs()]
        self.client = RelayClient(self.host, namespace=self.cfg.swarm_id)
        for name, stage in self.replicas.items():
            p2p = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK_MADDRS)
            server, traffic = StageServer(self.cfg, stage), Traffic()
            node = RelayNode(
                relay_limits(self.cfg),
                me=str(p2p.peer_id),
                client=RelayClient(p2p, namespace=self.cfg.swarm_id),
                push_timeout_s=self.cfg.timeouts.rpc_s,
            )
            inner: StageBackend = MeteredBackend(server, traffic)
            if name in self.wrap:
                inner = self.wrap[name](inner)
            servicer = StageServicer(
                RelayBackend(inner, node), stage=stage, max_request_bytes=server.max_request_bytes, max_pending=16
            )
            relay = RelayServicer(node, traffic)
            servicer.companions.append(relay)
            await servicer.add_p2p_handlers(p2p, namespace=self.cfg.swarm_id)
            peer = RelayPeer(name, p2p, server, node, servicer, relay, traffic)
            self.peers[name], self.by_id[p2p.peer_id] = peer, peer
        for stage in range(1, self.cfg.stages.num_stages + 1):
            self.router.update(stage, [p.peer_id for p in self.peers.values() if p.server.stage == stage])
        return self

    async def kill(self, name: str) -> None:
        """The server's peer goes away (its calls fail as unreachable)."""
        await self.peers[name].p2p.shutdown()

    async def __aexit__(self, *exc: object) -> None:
        for peer in self.peers.values():
            peer.server.shutdown()
            await peer.p2p.shutdown()
        await self.host.shutdown()
