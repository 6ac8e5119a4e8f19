"""Adaptive hop deadlines (swarm/pipeline/deadlines.py): the rule, the ban on deadlines missed in a row (the router's
growing back-off, on a ``FakeClock``), and a trainer's hops to a silent replica beside an honest one, in virtual time:
each silent call costs its adaptive deadline, not ``rpc_s``, and the silent replica leaves routing."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import pytest
import torch

from swarm.config import TrainerOptions
from swarm.dht.metrics import Traffic
from swarm.pipeline.boundary import boundary_ladders
from swarm.pipeline.deadlines import MIN_SAMPLES, NEW_PEER_SLACK, DeadlineRule, Deadlines
from swarm.pipeline.frames import LinkCodecs, Microbatch, Outgoing
from swarm.pipeline.hops import HopFailed, RemoteStages
from swarm.pipeline.protocol import Forward
from swarm.pipeline.routing import BAN_S, Peer, Router
from swarm.rpc.servicer import DIAL_BACKOFF_S, RemoteError, RequestError
from swarmtest.attacks import INT8
from swarmtest.clock import FakeClock
from swarmtest.configs import BATCH, SEQ, tiny_config
from swarmtest.fakes import EchoStages

RPC_S = 30.0


def rule(**kw: float) -> DeadlineRule:
    return DeadlineRule(rpc_s=RPC_S, **kw)  # type: ignore[arg-type]


def test_a_deadline_is_a_multiple_of_the_servers_p95_floored_and_capped() -> None:
    deadlines = Deadlines(rule(multiple=4.0, floor_s=2.0))
    assert deadlines.deadline(1, "a") == RPC_S  # nothing known: rpc_s
    for seconds in [1.0] * 19 + [2.5]:  # p95 of 20 samples: the largest
        deadlines.observe(1, "a", seconds)
    assert deadlines.deadline(1, "a") == 10.0
    assert deadlines.deadline(1, "a", transfer_s=4.0) == 16.0  # a frame larger than those measured gets its time
    assert deadlines.deadline(1, "a", transfer_s=100.0) == RPC_S  # capped
    fast = Deadlines(rule(multiple=4.0, floor_s=2.0))
    for _ in range(MIN_SAMPLES):
        fast.observe(1, "a", 0.01)
    assert fast.deadline(1, "a") == 2.0 and fast.deadline(1, "a", floor_s=10.0) == 10.0  # floors (a streamed call's)
    # a new server of a measured stage: the stage's p95 with more slack; of another stage: rpc_s
    assert fast.deadline(1, "new") == 2.0 and deadlines.deadline(1, "new") == min(RPC_S, NEW_PEER_SLACK * 4 * 2.5)
    assert fast.deadline(2, "new") == RPC_S


def test_misses_in_a_row_ask_for_a_ban_at_each_further_miss_until_a_success() -> None:
    deadlines = Deadlines(rule(misses=3))
    assert [deadlines.miss(1, "a") for _ in range(4)] == [False, False, True, True]
    deadlines.observe(1, "a", 0.1)
    assert not deadlines.miss(1, "a") and deadlines.misses(1, "a") == 1


def test_the_router_bans_a_server_for_a_growing_back_off_and_a_verdict_for_its_own_time() -> None:
    clock = FakeClock(0.0)
    router = Router(1, random.Random(0), clock)
    router.update(1, ["a", "b"])
    router.report_failure(1, "a", "missed")
    assert router.balancers[1].live_peers() == ["b"]
    clock.advance(BAN_S + 0.1)
    assert sorted(router.balancers[1].live_peers()) == ["a", "b"]
    router.report_failure(1, "a", "missed again")  # no success between: twice as long
    clock.advance(BAN_S + 0.1)
    assert router.balancers[1].live_peers() == ["b"]
    clock.advance(BAN_S)
    assert "a" in router.balancers[1].live_peers()
    router.ban(1, "b", 600.0, "condemned")
    clock.advance(599.0)
    assert router.balancers[1].live_peers() == ["a"]


@pytest.mark.timeout(120)
def test_a_silent_replica_costs_its_adaptive_deadline_not_rpc_s_and_leaves_routing() -> None:
    cfg = tiny_config(stages=1, steps=10, timeouts={"rpc_s": RPC_S})
    options = TrainerOptions(check_rate=0.0, deadline_floor_s=0.2)
    router = Router(1, random.Random(0))
    router.update(1, ["honest"])
    calls, counters = EchoStages(delay_s=0.01, silent={"silent"}), Counter[str]()  # "honest" echoes after 10 ms
    activations, gradients = boundary_ladders(cfg)
    remote = RemoteStages(
        cfg,
        calls,
        router,
        options,
        codecs=LinkCodecs({"activations": activations, "gradients": gradients}),
        counters=counters,
        traffic=Traffic(),
        fp32_bytes=Counter(),
    )
    x = Outgoing(torch.randn(BATCH, SEQ, cfg.model.d_model), None, INT8.encode(torch.randn(BATCH, SEQ, 64)), INT8)

    async def hop(i: int) -> None:
        await remote.forward_hop(Microbatch(f"mb{i}", (BATCH, SEQ, cfg.model.d_model), train=True), 1, 0, x)

    async def scenario() -> float:
        for i in range(10):  # the honest replica's service times
            await hop(i)
        router.update(1, ["honest", "silent"])  # a new replica joins: it answers nothing
        started = time.monotonic()
        for i in range(10, 1000):  # a silent replica charged its deadline is picked again once the honest catches up
            if counters["deadline_bans"]:
                break
            await hop(i)
        return time.monotonic() - started

    waited = asyncio.run(scenario())
    silent = calls.timeouts["silent"]
    assert len(silent) == options.deadline_misses and counters["deadline_bans"] == 1  # then banned
    assert all(t < RPC_S / 10 for t in silent), silent  # the stage's p95 × slack, or the floor; not rpc_s
    assert counters["hop_timeouts"] == len(silent) and "silent" not in router.balancers[1].live_peers()
    assert waited < sum(silent) + 30.0  # without: 3 × rpc_s of waiting


@pytest.mark.timeout(60)
def test_a_reply_is_decoded_onto_the_trainers_device_off_the_event_loop(monkeypatch) -> None:
    cfg = tiny_config(stages=1, steps=10, timeouts={"rpc_s": RPC_S})
    router = Router(1, random.Random(0))
    router.update(1, ["honest"])
    activations, gradients = boundary_ladders(cfg)
    device = torch.device("cpu")
    remote = RemoteStages(
        cfg,
        EchoStages(delay_s=0.01),
        router,
        TrainerOptions(check_rate=0.0),
        codecs=LinkCodecs({"activations": activations, "gradients": gradients}),
        counters=Counter(),
        traffic=Traffic(),
        fp32_bytes=Counter(),
        device=device,
    )
    decodes: list[tuple[str, object]] = []
    decode = type(activations).decode

    def spy(self, frame: bytes, **kw):  # type: ignore[no-untyped-def]
        decodes.append((threading.current_thread().name, kw.get("device")))
        return decode(self, frame, **kw)

    monkeypatch.setattr(type(activations), "decode", spy)
    x = Outgoing(torch.randn(BATCH, SEQ, cfg.model.d_model), None, INT8.encode(torch.randn(BATCH, SEQ, 64)), INT8)
    mb = Microbatch("mb0", (BATCH, SEQ, cfg.model.d_model), train=True)
    _, reply = asyncio.run(remote.forward_hop(mb, 1, 0, x))
    remote.shutdown()
    assert reply.value.device == device and reply.value.shape == (BATCH, SEQ, cfg.model.d_model)
    assert decodes and all(name.startswith("replies") and on is device for name, on in decodes), decodes


class DialBackedOff(EchoStages):
    """``EchoStages`` whose calls to ``peer`` fail as a trainer's daemon fails them while a dial backoff lasts."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes:
        if peer == self.peer:
            message = f"P2PDaemonError: failed to dial {peer}: dial backoff"
            raise RemoteError(RequestError.UNREACHABLE, message)
        return await super().forward(peer, request, timeout=timeout)


@pytest.mark.timeout(60)
def test_a_dial_backoff_keeps_the_server_out_only_until_it_ends_and_counts_no_failure() -> None:
    """A WAN-lab trainer's first call to a stage met its own daemon's dial backoff (an earlier dial, before the server
    listened, had failed): the server was banned for BAN_S and 10 hops went around its stage. The backoff says nothing
    of the server now: it is routed around for DIAL_BACKOFF_S, and its next real failure is its first."""
    cfg = tiny_config(stages=1, steps=10, timeouts={"rpc_s": RPC_S})
    clock = FakeClock(0.0)
    router = Router(1, random.Random(0), clock)
    router.update(1, ["new"])
    activations, gradients = boundary_ladders(cfg)
    counters = Counter[str]()
    remote = RemoteStages(
        cfg,
        DialBackedOff("new"),
        router,
        TrainerOptions(check_rate=0.0),
        codecs=LinkCodecs({"activations": activations, "gradients": gradients}),
        counters=counters,
        traffic=Traffic(),
        fp32_bytes=Counter(),
    )
    x = Outgoing(torch.randn(BATCH, SEQ, cfg.model.d_model), None, INT8.encode(torch.randn(BATCH, SEQ, 64)), INT8)
    with pytest.raises(HopFailed):
        asyncio.run(remote.forward_hop(Microbatch("mb0", (BATCH, SEQ, cfg.model.d_model), train=True), 1, 0, x))
    remote.shutdown()
    assert counters["hop_dial_backoff"] == 1 and counters["hop_failures"] == 0
    assert router.live_peers(1) == []
    clock.advance(DIAL_BACKOFF_S + 0.1)
    assert router.live_peers(1) == ["new"]
    router.report_failure(1, "new", "unreachable")  # its first failure: BAN_S, not twice that
    clock.advance(BAN_S + 0.1)
    assert router.live_peers(1) == ["new"]
