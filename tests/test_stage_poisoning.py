"""One peer against a stage server, over real P2P on loopback: a gradient that would make the stage's weights
non-finite, or is far out of scale, is refused before it counts (the sender struck, then banned) while the stage
keeps training and announcing; forwards never followed by a backward evict only the flooder's cached inputs."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.p2p import P2P, PeerID

from swarm.config import TimeoutConfig
from swarm.node.config import PeerConfig
from swarm.node.node import Node
from swarm.pipeline.protocol import Backward, Forward, RemoteError, RequestError, StageClient, StageServicer
from swarm.pipeline.server import StageServer
from swarm.rpc.defences import PeerLimits
from swarmtest.attacks import HONEST_SCALE, INT8, activations, microbatch, poisoned
from swarmtest.configs import BATCH, LOOPBACK_MADDRS, SEQ, tiny_config
from swarmtest.node import BackgroundNode

TIMEOUTS = TimeoutConfig(rpc_s=10.0, matchmaking_s=2.0, announce_period_s=1.0, record_ttl_s=4.0)
WARMUP = 8  # honest microbatches before the attack: the screen's warm-up (GradNormScreen)


async def weights_finite(node: Node) -> bool:
    server = node.role.holder
    assert isinstance(server, StageServer)
    return await server.exclusive(lambda: all(bool(torch.isfinite(p).all()) for p in server.module.parameters()))


@pytest.mark.timeout(180)
def test_a_peer_poisoning_gradients_is_refused_and_banned_and_the_stage_keeps_training_and_its_record() -> None:
    cfg = tiny_config(stages=1, steps=200, outer={"method": "none"}, timeouts=TIMEOUTS)
    strikes = PeerLimits().strikes  # the node's own ban policy
    with BackgroundNode(PeerConfig(role="stage", stage=1, name="stage1-a", host_maddrs=LOOPBACK_MADDRS), cfg) as node:
        server = PeerID.from_base58(node.maddrs[0].rsplit("/p2p/", 1)[1])

        async def attack() -> dict:
            evil_p2p, honest_p2p = [
                await P2P.create(initial_peers=node.maddrs, host_maddrs=LOOPBACK_MADDRS) for _ in range(2)
            ]
            evil, honest = (StageClient(p2p, namespace=cfg.swarm_id) for p2p in (evil_p2p, honest_p2p))
            at_the_wire = 0
            try:
                for i in range(WARMUP):
                    await microbatch(honest, server, cfg, f"warmup{i}")
                for i in range(strikes):
                    with pytest.raises(RemoteError) as refused:
                        await microbatch(evil, server, cfg, f"evil{i}", grad=poisoned(cfg, i))
                    assert refused.value.code == RequestError.INVALID
                    # the 3.4e38 scale is refused at the wire (over BOUNDARY_MAX_ABS), the ×10⁴ one by the screen
                    wire = "over the receiver's limit" in refused.value.message
                    assert ("gradient refused" in refused.value.message) != wire, refused.value.message
                    at_the_wire += wire
                    await microbatch(honest, server, cfg, f"honest{i}")  # served between the attacks
                with pytest.raises(RemoteError) as refused:
                    await microbatch(evil, server, cfg, "evil-banned")
                assert refused.value.code == RequestError.BANNED
                await microbatch(honest, server, cfg, "after")
                return {**await honest.info(server, timeout=10), "at_the_wire": at_the_wire}
            finally:
                for p2p in (evil_p2p, honest_p2p):
                    await p2p.shutdown()

        info = asyncio.run(attack())
        assert node.call(weights_finite)
        steps = WARMUP + strikes + 1  # every honest microbatch is an inner batch here, and none was lost
        assert info["at_the_wire"] == strikes // 2 and info["refused_gradient"] == strikes - info["at_the_wire"]
        assert info["skipped_steps"] == 0 and info["inner_steps"] == steps
        assert math.isfinite(info["grad_norm"]) and info["grad_norm"] > 0
        # the stage's record, refreshed after the attack, is still valid and announced
        node.wait(
            "the record of the trained stage",
            lambda: any(s.inner_steps == steps for s in node.call(lambda n: n.membership.replicas(1)).values()),
            timeout=30,
        )


@pytest.mark.timeout(60)
def test_a_peer_flooding_forwards_evicts_only_its_own_cached_inputs() -> None:
    cfg = tiny_config(stages=1)
    server = StageServer(cfg, 1, max_cached=8)  # 2 inputs per peer

    async def scenario() -> None:
        host = await P2P.create(host_maddrs=LOOPBACK_MADDRS)
        maddrs = [str(m) for m in await host.get_visible_maddrs()]
        flooder_p2p, honest_p2p = [
            await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK_MADDRS) for _ in range(2)
        ]
        servicer = StageServicer(server, stage=1, max_request_bytes=server.max_request_bytes)
        await servicer.add_p2p_handlers(host, namespace=cfg.swarm_id)
        flooder, honest = (StageClient(p2p, namespace=cfg.swarm_id) for p2p in (flooder_p2p, honest_p2p))
        try:
            x = INT8.encode(activations(cfg))
            await honest.forward(host.peer_id, Forward(mb="h", stage=1, prev_stage=0, x=x), timeout=10)
            for i in range(40):  # five times the cache, never followed by a backward
                await flooder.forward(host.peer_id, Forward(mb=f"f{i}", stage=1, prev_stage=0, x=x), timeout=10)
            assert len(server.cache) == 3 and server.cache.evicted == 38
            grad = INT8.encode(torch.randn(BATCH, SEQ, cfg.model.d_model) * HONEST_SCALE)
            await honest.backward(host.peer_id, Backward(mb="h", stage=1, grad=grad), timeout=10)  # no resend needed
            with pytest.raises(RemoteError) as missed:  # the flooder lost its own oldest inputs
                await flooder.backward(host.peer_id, Backward(mb="f0", stage=1, grad=grad), timeout=10)
            assert missed.value.code == RequestError.CACHE_MISS
            await flooder.backward(host.peer_id, Backward(mb="f39", stage=1, grad=grad), timeout=10)
        finally:
            for p2p in (flooder_p2p, honest_p2p, host):
                await p2p.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
    assert server.counters["backward"] == 2 and server.counters["cache_miss"] == 1
