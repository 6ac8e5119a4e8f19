"""Frames sent server to server (``--relay``, issue 43 §3), on loopback with real hivemind peers (swarmtest/relay.py):
the same training as the trainer's path with the trainer's link carrying the path's ends only; a dead next hop, a
missing and a forged delivery fall back and the microbatch lands; a garbling server is still caught (its committed
frames fetched by digest); malformed, oversized and unsolicited deliveries are refused or expire, the inbox bounded."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from compress.codecs import get_codec
from compress.config import CodecConfig
from peer.data import load_corpus
from swarm.config import SwarmConfig, TrainerOptions
from swarm.pipeline.relay import Deliver, Inbox, InboxKey, RelayLimits, digest
from swarm.pipeline.trainer import Trainer
from swarm.rpc.servicer import RemoteError, RequestError
from swarmtest.attacks import garble
from swarmtest.configs import BATCH, DATA, LOOPBACK_MADDRS, SEQ, tiny_config
from swarmtest.relay import RelayLab

INT8 = CodecConfig(activations="int8", gradients="int8")


def config(stages: int = 2) -> SwarmConfig:
    return tiny_config(stages=stages, steps=40, codecs=INT8, outer={"method": "none"}, model={"n_layers": stages})


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    corpus = load_corpus([DATA])
    sampler = corpus.sample_batches("train", seed=seed, batch_size=BATCH, seq_len=SEQ)
    return [next(sampler) for _ in range(n)]


async def run(
    cfg: SwarmConfig,
    replicas: dict[str, int],
    *,
    relay: bool,
    n: int = 6,
    path: list[int] | None = None,
    before: Any = None,
    **options: Any,
) -> tuple[list[float | None], Trainer, RelayLab]:
    """``n`` microbatches one after another through ``replicas``; their losses, the trainer and the lab (closed)."""
    torch.manual_seed(0)
    async with RelayLab(cfg, replicas) as lab:
        opts = TrainerOptions(in_flight=1, relay=relay, **({"check_rate": 0.0, "probe_rate": 0.0} | options))
        trainer = Trainer(cfg, lab.client, lab.router, options=opts)
        lab.router.draw_path = lambda paths: list(path or range(1, cfg.stages.num_stages + 1))  # type: ignore[method-assign]
        if before is not None:
            await before(lab)
        try:
            losses = [await trainer.train_microbatch(*batch) for batch in batches(n)]
        finally:
            await trainer.remote.close()
            trainer.shutdown()
    return losses, trainer, lab


def boundary_bytes(trainer: Trainer) -> int:
    traffic = trainer.traffic
    return sum((traffic.sent + traffic.received)[k] for k in ("activations", "gradients"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stages", [2, 3])
def test_relayed_training_is_the_trainers_path_training_with_one_over_s_of_the_trainers_bytes(stages: int) -> None:
    cfg = config(stages)
    replicas = {f"s{s}": s for s in range(1, stages + 1)}
    plain, t_plain, _ = asyncio.run(run(cfg, replicas, relay=False))
    relayed, t_relay, lab = asyncio.run(run(cfg, replicas, relay=True))
    assert None not in plain and None not in relayed
    assert relayed == pytest.approx(plain, rel=1e-5)  # the same frames, the same math
    ratio = boundary_bytes(t_relay) / boundary_bytes(t_plain)
    print(f"S={stages}: trainer boundary bytes {boundary_bytes(t_plain)} -> {boundary_bytes(t_relay)} ({ratio:.3f})")
    # 2 frames a microbatch a way cross the trainer's link instead of 2·S: 1/S of the frames. In bytes a little more:
    # the embedding's int8 frame (a few distinct rows) zstd-codes far smaller than the frames between servers
    frames = sum(t_relay.traffic.frames.values()) / sum(t_plain.traffic.frames.values())
    assert frames == pytest.approx(1 / stages) and ratio < 1 / stages + 0.25
    assert t_relay.counters["relay_fallbacks"] == 0 and t_relay.counters["completed"] == 6
    middle = lab.peers["s2"].traffic  # a middle server's frames: received from s1, sent on to s3 or the trainer
    assert middle.received["activations"] > 0 and middle.sent["activations"] > 0


@pytest.mark.timeout(180)
def test_relayed_training_with_probes_on_lands_every_microbatch_and_probes_pass() -> None:
    cfg = config(3)
    replicas = {"a": 1, "b": 2, "c": 3}
    plain, t_plain, _ = asyncio.run(run(cfg, replicas, relay=False, probe_rate=0.02))
    relayed, t_relay, _ = asyncio.run(run(cfg, replicas, relay=True, probe_rate=0.02))
    assert relayed == pytest.approx(plain, rel=1e-5)
    assert t_relay.counters["probes"] >= 6 and t_plain.counters["probes"] >= 6  # every server's first two, by digest
    assert t_relay.counters["probe_failures"] == 0 and t_relay.counters["relay_fetches"] > 0


@pytest.mark.timeout(180)
def test_a_dead_next_hop_falls_back_to_another_replica_and_every_microbatch_lands() -> None:
    cfg = config(2)

    async def kill_b1(lab: RelayLab) -> None:
        await lab.kill("b1")

    losses, trainer, _ = asyncio.run(run(cfg, {"a": 1, "b1": 2, "b2": 2}, relay=True, before=kill_b1))
    assert None not in losses and trainer.counters["completed"] == 6 and trainer.counters["failed"] == 0
    assert trainer.counters["relay_undelivered"] + trainer.counters["relay_fallbacks"] >= 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["forged", "withheld"])
def test_a_forged_or_withheld_delivery_falls_back_by_digest_and_the_results_are_the_honest_ones(fault: str) -> None:
    """The first server pushes a frame other than the one it committed (or says it delivered and did not): the next
    one refuses it (missing input), the trainer fetches the committed frame from its sender and goes on."""
    cfg = config(2)

    async def tamper(lab: RelayLab) -> None:
        node = lab.peers["a"].node
        push = node.push

        async def forged(to: str, delivery: Deliver) -> bool:
            if fault == "withheld":
                return True
            frame = bytearray(delivery.frame)
            frame[-1] ^= 0xFF
            return await push(to, dataclasses.replace(delivery, frame=bytes(frame)))

        node.push = forged  # type: ignore[method-assign]

    honest, _, _ = asyncio.run(run(cfg, {"a": 1, "b": 2}, relay=True, n=3))
    losses, trainer, lab = asyncio.run(run(cfg, {"a": 1, "b": 2}, relay=True, n=3, before=tamper))
    assert losses == pytest.approx(honest, rel=1e-5)
    assert trainer.counters["relay_missing_input"] == 3 and trainer.counters["relay_fallbacks"] == 3
    inbox = lab.peers["b"].node.inbox
    assert inbox.counters["mismatched" if fault == "forged" else "missing"] == 3 and len(inbox) == 0


@pytest.mark.timeout(300)
def test_a_garbling_replica_is_caught_with_relay_on_its_outputs_fetched_by_digest() -> None:
    """Stage 1 has three replicas, one garbling; its outputs go server to server, so each check fetches them by digest
    from the server that committed them. It fails its checks and its outputs do not land."""
    torch.manual_seed(0)
    cfg = tiny_config(stages=2, steps=40, codecs=INT8)
    corpus = load_corpus([DATA])
    kw = {"batch_size": BATCH, "seq_len": SEQ}

    async def scenario() -> tuple[dict[str, Any], Trainer, RelayLab]:
        async with RelayLab(cfg, {"evil": 1, "h1": 1, "h2": 1, "t": 2}) as lab:
            garble(lab.peers["evil"].server)
            options = TrainerOptions(in_flight=2, log_every=20, relay=True, probe_rate=0.0)
            trainer = Trainer(cfg, lab.client, lab.router, options=options)
            train, val = corpus.sample_batches("train", seed=1, **kw), corpus.val_batches(num_sequences=16, **kw)
            try:
                return await trainer.train(train, steps=40, val_batches=val), trainer, lab
            finally:
                trainer.shutdown()

    last, trainer, lab = asyncio.run(scenario())
    evil = lab.peers["evil"].peer_id
    print({k: last[k] for k in ("checks", "check_failures", "relay_fetches", "val_loss") if k in last})
    assert last["step"] == 40 and last["failed"] == 0
    assert last["check_failures"] >= 1 and trainer.counters["relay_fetches"] >= 1
    assert evil in trainer.remote.audit.checker.suspects or evil in trainer.remote.audit.excluded_now()
    assert lab.peers["evil"].server.counters["forward"] < 15  # caught early: the honest two served the rest


def test_the_inbox_is_bounded_per_sender_and_in_all_and_drops_what_nobody_takes() -> None:
    now = [0.0]
    limits = RelayLimits(max_frame_bytes=1 << 20, per_sender=2, per_sender_bytes=1 << 20, total=3, ttl_s=5.0)
    inbox = Inbox(limits, clock=lambda: now[0])
    frame = get_codec("int8").encode(torch.randn(2, 4, 8))

    def deliver(mb: str) -> Deliver:
        return Deliver(trainer="t", mb=mb, kind="activations", frame=frame)

    inbox.put("x", deliver("m1"))
    inbox.put("x", deliver("m2"))
    with pytest.raises(RequestError, match="holds its most") as refused:
        inbox.put("x", deliver("m3"))
    assert refused.value.code == RequestError.BUSY
    inbox.put("y", deliver("m1"))
    with pytest.raises(RequestError, match="inbox is full"):
        inbox.put("z", deliver("m1"))
    assert len(inbox) == 3 and inbox.nbytes == 3 * len(frame)
    now[0] = 6.0  # nobody asked: dropped at expiry
    inbox.expire()
    assert len(inbox) == 0 and inbox.nbytes == 0 and inbox.counters["expired"] == 3

    async def take() -> bytes:
        inbox.put("x", deliver("m4"))
        return await inbox.take(InboxKey("t", "m4", "activations", "x"), digest(frame), wait_s=0.0)

    assert asyncio.run(take()) == frame


@pytest.mark.timeout(120)
def test_malformed_oversized_and_unsolicited_deliveries_are_refused_clearly_and_expire() -> None:
    cfg = config(2)
    frame = get_codec("int8").encode(torch.randn(BATCH, SEQ, cfg.model.d_model))

    async def scenario() -> None:
        async with RelayLab(cfg, {"a": 1, "b": 2}) as lab:
            b = lab.peers["b"]
            maddrs = [str(m) for m in await b.p2p.get_visible_maddrs()]
            stranger = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK_MADDRS)
            try:
                from swarm.pipeline.relay_rpc import RelayClient

                client = RelayClient(stranger, namespace=cfg.swarm_id)
                to = str(b.peer_id)
                for bad, why in [
                    (Deliver(trainer="t", mb="m1", kind="activations", frame=b"not a frame"), "no frame header"),
                    (Deliver(trainer="t", mb="m1", kind="weights", frame=frame), "kind"),
                    (Deliver(trainer="t", mb="bad id!", kind="activations", frame=frame), "microbatch id"),
                ]:
                    with pytest.raises(RemoteError, match=why) as refused:
                        await client.push(to, bad, timeout=30)
                    assert refused.value.code == RequestError.INVALID
                # oversized: the server stops reading at its limit and refuses it (the stream cut, the pusher may see
                # only that); nothing of it is kept
                huge = frame + bytes(b.node.limits.max_frame_bytes)
                with pytest.raises(RemoteError):
                    await client.push(to, Deliver(trainer="t", mb="m1", kind="activations", frame=huge), timeout=30)
                assert b.relay.refused == 4 and len(b.node.inbox) == 0
                # unsolicited: taken in, bounded per sender, and never given to anyone who did not name its sender
                for i in range(b.node.limits.per_sender):
                    await client.push(to, Deliver(trainer="t", mb=f"u{i}", kind="activations", frame=frame), timeout=30)
                with pytest.raises(RemoteError, match="holds its most"):
                    await client.push(to, Deliver(trainer="t", mb="over", kind="activations", frame=frame), timeout=30)
                assert len(b.node.inbox) == b.node.limits.per_sender
                b.node.inbox.limits = dataclasses.replace(b.node.inbox.limits, ttl_s=1e-3)
                await asyncio.sleep(0.01)  # (the expiry's own clock: no condition to wait on)
                b.node.inbox.expire()
                assert len(b.node.inbox) == 0 and b.server.counters["forward"] == 0  # nothing computed on them
                assert b.relay.refused == 5
            finally:
                await stranger.shutdown()

    asyncio.run(scenario())
