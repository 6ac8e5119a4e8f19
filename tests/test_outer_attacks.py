"""Attacks on the outer step, played against real peers on loopback: each replica its own hivemind DHT node and libp2p
daemon, its real ``Membership``, ``OuterService`` (blob service) and ``ReplicaSync``; the attacker a peer of its own.

A replica's holder is the tiny model's real stage 1, and an inner step moves every weight by a small seeded random
step: the outer step only ever sees weights, so this is all of training it needs, at no compute cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pytest
import torch
from hivemind.dht import DHT
from hivemind.dht.schema import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from compress.config import CodecConfig
from optim.config import OuterOptimConfig
from swarm.config import SwarmConfig, TimeoutConfig
from swarm.dht.membership import Membership, round_key
from swarm.dht.process import SwarmDHT
from swarm.dht.records import PROTOCOL_VERSION, StageStatus
from swarm.errors import ExportError
from swarm.events import Event, OuterRound, OuterStrike, StateDownload, of_kind
from swarm.export import download_model, export_sources
from swarm.model.stages import build_stage, stage_template
from swarm.outer.replica import ReplicaSync
from swarm.outer.service import OuterService
from swarm.outer.state import StageState, pack_state, weights_hash
from swarm.recovery.rebuild import rebuild_stage
from swarm.rpc.blobs import BlobClient, BlobServicer, TransferError
from swarmtest.configs import LOOPBACK, tiny_config

T = TypeVar("T")
STAGE = 1
TIMEOUTS = TimeoutConfig(rpc_s=2.0, matchmaking_s=1.0, announce_period_s=0.5, record_ttl_s=3.0)
STEP_EVERY_S = 0.1  # one inner step of every replica: a round every 0.3 s or so


def outer_config(method: str = "diloco", *, stages: int = 1) -> SwarmConfig:
    return tiny_config(
        stages=stages,
        outer=OuterOptimConfig(warm_start_steps=0, method=method, inner_steps=3),
        codecs=CodecConfig(pseudo_gradients="sparseloco" if method == "sparseloco" else "fp32"),
        timeouts=TIMEOUTS,
    )


def seeded_weights(cfg: SwarmConfig) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone() for name, p in build_stage(cfg.model, cfg.stages.num_stages, STAGE).named_parameters()
    }


class StageHolder:
    """A ``Holder``: stage 1 of the tiny model, whose inner step is a small seeded random move of every weight."""

    def __init__(self, cfg: SwarmConfig, seed: int, step_size: float = 3e-4) -> None:
        self.module = build_stage(cfg.model, cfg.stages.num_stages, STAGE)
        self.inner_steps = self.start_step = 0
        self.step_size, self.rng = step_size, torch.Generator().manual_seed(seed)

    async def exclusive(self, fn: Callable[[], T], *, change: str = "none") -> T:
        return fn()

    @torch.no_grad()
    def train(self) -> None:
        for p in self.module.parameters():
            p.add_(self.step_size * torch.randn(p.shape, generator=self.rng))
        self.inner_steps += 1


async def start_dht(initial_peers: list[str]) -> SwarmDHT:
    return await asyncio.to_thread(SwarmDHT, initial_peers=initial_peers or None, host_maddrs=[LOOPBACK])


@dataclasses.dataclass
class Peer:
    """A DHT node joined to the swarm, its P2P and membership; ``tasks`` run until ``stop``."""

    name: str
    dht: DHT
    membership: Membership
    p2p: P2P
    tasks: list[asyncio.Task] = dataclasses.field(default_factory=list)
    stopped: bool = False

    @property
    def id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    @classmethod
    async def join(cls, name: str, cfg: SwarmConfig, initial_peers: list[str]) -> Peer:
        dht = await start_dht(initial_peers)
        membership = Membership(dht)
        await membership.join(cfg, create=not initial_peers)
        return cls(name, dht, membership, await dht.replicate_p2p())

    def every(self, period_s: float, action: Callable[[], Any]) -> asyncio.Task:
        """Run ``action`` (sync or async) every ``period_s`` seconds until the peer stops (or the task is cancelled)."""

        async def loop() -> None:
            while True:
                if asyncio.iscoroutine(result := action()):
                    await result
                await asyncio.sleep(period_s)

        self.tasks.append(asyncio.create_task(loop()))
        return self.tasks[-1]

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.to_thread(self.dht.shutdown)


@dataclasses.dataclass
class Replica:
    """An honest replica of stage 1: it downloads the stage's state when it joins, trains, and takes part in rounds;
    ``joined_from``: the outer round of the state it downloaded on joining (None: it started the stage)."""

    peer: Peer
    holder: StageHolder
    sync: ReplicaSync
    events: list[Event]
    joined_from: int | None = None
    training: asyncio.Task | None = None  # its inner steps; cancelled: no more rounds once the one under way is done

    @classmethod
    async def start(cls, name: str, cfg: SwarmConfig, initial_peers: list[str], *, seed: int) -> Replica:
        peer = await Peer.join(name, cfg, initial_peers)
        service = OuterService(cfg, peer.membership, peer.p2p)
        await service.servicer.add_p2p_handlers(peer.p2p, namespace=cfg.swarm_id)
        state = await service.download(STAGE)
        holder, events = StageHolder(cfg, seed), list[Event]()
        sync = service.sync(STAGE, holder, events.append)
        if state is not None:
            await sync.adopt(state)
        replica = cls(peer, holder, sync, events, joined_from=state.round if state is not None else None)
        peer.every(cfg.timeouts.announce_period_s, replica.announce)
        replica.training = peer.every(STEP_EVERY_S, holder.train)
        peer.tasks.append(asyncio.create_task(sync.run()))
        return replica

    async def announce(self) -> None:
        status = StageStatus(inner_steps=self.holder.inner_steps, **self.sync.status_fields())
        await self.peer.membership.announce(STAGE, status)

    def rounds(self, *, contributors: int = 1) -> list[OuterRound]:
        return [e for e in of_kind(self.events, OuterRound) if e.outcome == "done" and e.contributors >= contributors]

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.holder.module.named_parameters()}

    async def stop(self) -> None:
        await self.peer.stop()
        self.sync.close()


def largest_norm_ratio(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest factor by which a tensor's norm differs from the reference's, either way (inf if not finite)."""
    ratios = [float(weights[n].norm() / reference[n].norm()) for n in reference]
    return max(max(r, 1 / r) if math.isfinite(r) and r > 0 else math.inf for r in ratios)


async def wait_for(what: str, check: Callable[[], bool], timeout: float, explain: Callable[[], Any] = str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s: {explain()}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def stopping(*peers: Replica | Peer) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await asyncio.gather(*(p.stop() for p in peers), return_exceptions=True)


# ---- item 2: a peer claiming a later round serves scaled weights ----------------------------------------------------


async def start_state_liar(
    cfg: SwarmConfig,
    initial_peers: list[str],
    *,
    round_: int = 0,
    scale: float,
    echo: ReplicaSync | None = None,
    name: str = "liar",
) -> Peer:
    """A peer announcing stage 1 at ``round_`` and serving the seeded weights ×``scale`` as that round's state (its
    record announces exactly those weights' hash, so only the vouching, not the hash check, can stop it). With
    ``echo``, it announces that honest replica's claim instead, round and weights hash as they change (so it holds a
    vouched claim, and only the hash check can stop it), and serves its weights as a state of that round."""
    liar = await Peer.join(name, cfg, initial_peers)
    weights = {name: scale * t for name, t in seeded_weights(cfg).items()}
    servicer = BlobServicer()

    async def provide(name: str) -> bytes:
        served_round = echo.round if echo else round_
        return pack_state(StageState(stage=STAGE, round=served_round, schedule_step=0, params=weights, optimizer=None))

    servicer.provide("state", provide)
    await servicer.add_p2p_handlers(liar.p2p, namespace=cfg.swarm_id)
    status = lambda: (  # noqa: E731
        StageStatus(**echo.status_fields())
        if echo
        else StageStatus(outer_round=round_, global_hash=weights_hash(weights))
    )
    liar.every(cfg.timeouts.announce_period_s, lambda: liar.membership.announce(STAGE, status()))
    liar.servicer = servicer  # type: ignore[attr-defined]  # its served_bytes tell whether anyone fetched the lie
    return liar


@pytest.mark.timeout(180)
def test_a_peer_claiming_a_later_round_with_scaled_weights_takes_over_no_replica() -> None:
    cfg = outer_config()
    seeded = seeded_weights(cfg)

    async def scenario() -> None:
        a = await Replica.start("a", cfg, [], seed=1)
        liar = await start_state_liar(cfg, a.peer.maddrs, round_=1000, scale=1000.0)
        async with stopping(a, liar):
            # alone with the liar, a has no second replica to vouch for anything: it tries the lone claim, and refuses
            # weights a thousand times its own
            await wait_for("download attempt of the lie", lambda: liar.servicer.served_bytes > 0, 60)
            rounds_before = len(a.rounds())
            await wait_for("two more rounds of a", lambda: len(a.rounds()) >= rounds_before + 2, 60, lambda: a.events)
            # a newcomer tries the liar's claim first (the latest round), refuses it, and takes a's state instead
            b = await Replica.start("b", cfg, a.peer.maddrs, seed=2)
            async with stopping(b):
                assert b.joined_from is not None and b.joined_from < 1000
                await wait_for(
                    "two rounds of a and b together",
                    lambda: len(a.rounds(contributors=2)) >= 2 and len(b.rounds(contributors=2)) >= 2,
                    90,
                    lambda: (a.events[-5:], b.events[-5:]),
                )
                for replica in (a, b):
                    took = [e for e in of_kind(replica.events, StateDownload) if e.from_peer == liar.id]
                    assert not took, replica.events
                    assert replica.sync.round < 1000
                    # the random inner steps grow the weights a little; a takeover would make them ×1000
                    assert largest_norm_ratio(replica.weights(), seeded) < 3.0
                    assert largest_norm_ratio(dict(replica.sync.outer.global_params), seeded) < 3.0

    asyncio.run(scenario())


async def wait_for_records(
    peer: Peer, what: str, check: Callable[[dict[str, StageStatus]], bool], timeout: float
) -> dict[str, StageStatus]:
    """The stage's records as ``peer`` reads them, once ``check`` passes on them."""
    deadline, found = time.monotonic() + timeout, {}
    while not check(found := {p.to_base58(): s for p, s in (await peer.membership.replicas(STAGE)).items()}):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f}s: {found}")
        await asyncio.sleep(0.1)
    return found


@pytest.mark.timeout(180)
def test_an_export_and_a_rebuild_take_no_weights_from_replicas_announcing_the_vouched_claim_and_serving_others() -> (
    None
):
    cfg = outer_config(stages=2)  # stage 1 has replicas; stage 2 (gone) is rebuilt from it
    seeded = lambda stage: {name: p.detach() for name, p in stage_template(cfg.model, 2, stage).items()}  # noqa: E731
    have = {s: StageState(stage=s, round=0, schedule_step=0, params=seeded(s), optimizer=None) for s in (0, 2)}

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            a = await Replica.start("a", cfg, [], seed=1)
            stack.push_async_callback(a.stop)
            b = await Replica.start("b", cfg, a.peer.maddrs, seed=2)
            stack.push_async_callback(b.stop)
            await wait_for(
                "a round of a and b together",
                lambda: a.rounds(contributors=2) and b.rounds(contributors=2),
                90,
                lambda: (a.events[-5:], b.events[-5:]),
            )
            for replica in (a, b):  # no more inner steps: their claim stays as it is while the export reads it
                replica.training.cancel()
            await wait_for(
                "a and b at rest on one state",
                lambda: not a.sync.due and not b.sync.due and a.sync.status_fields() == b.sync.status_fields(),
                60,
                lambda: (a.sync.status_fields(), b.sync.status_fields(), a.events[-6:], b.events[-6:]),
            )
            honest = a.sync.status_fields()
            liars = []
            for name in ("liar1", "liar2"):
                liars.append(await start_state_liar(cfg, a.peer.maddrs, scale=1000.0, echo=a.sync, name=name))
                stack.push_async_callback(liars[-1].stop)
            exporter = await Peer.join("exporter", cfg, a.peer.maddrs)
            stack.push_async_callback(exporter.stop)
            client = BlobClient(exporter.p2p, namespace=cfg.swarm_id)
            fetch = lambda peer, name, sink, max_bytes: client.stream(  # noqa: E731
                peer, name, sink, timeout=cfg.timeouts.rpc_s, max_bytes=max_bytes
            )
            replicas = OuterService(cfg, exporter.membership, exporter.p2p).replicas
            same = lambda found: all(  # noqa: E731
                (s.outer_round, s.global_hash) == (honest["outer_round"], honest["global_hash"]) for s in found.values()
            )
            everyone = {a.peer.id, b.peer.id, *(liar.id for liar in liars)}
            await wait_for_records(
                exporter, "the liars' records", lambda found: set(found) == everyone and same(found), 30
            )

            sources = export_sources(await exporter.membership.all_replicas(), 2, have=have)
            model, meta = await download_model(cfg, sources, fetch, have=have)
            assert meta["stages"]["1"]["peer"] in (a.peer.id, b.peer.id) and meta["stages"]["1"]["vouched_by"] == 4
            exported = {name: model.state_dict()[name] for name in seeded_weights(cfg)}  # stage 1 holds blocks.0
            assert weights_hash(exported) == honest["global_hash"]
            rebuilt = await rebuild_stage(cfg, 2, replicas, fetch)
            (source,) = rebuilt.sources
            assert source.peer in (a.peer.id, b.peer.id) and source.vouched_by == 4
            assert weights_hash(source.state.params) == honest["global_hash"]

            # a and b gone: only the liars vouch for the claim; neither the export nor the rebuild takes their word
            await asyncio.gather(a.stop(), b.stop())
            await wait_for_records(
                exporter, "only the liars' records", lambda found: set(found) == {liar.id for liar in liars}, 30
            )
            sources = export_sources(await exporter.membership.all_replicas(), 2, have=have)
            lie = "served weights hashing to [0-9a-f]+, its record claims " + honest["global_hash"]
            with pytest.raises(ExportError, match=f"stage 1: no replica of stage 1 delivered its state .*{lie}"):
                await download_model(cfg, sources, fetch, have=have)
            with pytest.raises(TransferError, match=lie):
                await rebuild_stage(cfg, 2, replicas, fetch)
            assert all(liar.servicer.served_bytes > 0 for liar in liars)

    asyncio.run(scenario())


# ---- item 3: one peer's round declarations stall every round -------------------------------------------------------


async def start_round_staller(cfg: SwarmConfig, initial_peers: list[str], honest: list[Replica]) -> DHT:
    """A DHT node that keeps declaring itself in the honest replicas' next round with a time that would close the
    window before they arrive: 0 (the DHT's schema refuses it) and, in turn, a window and a bit ago (plausible)."""
    signer = RSASignatureValidator(RSAPrivateKey())  # its records are signed: only the schema and the readers stop them
    dht = await asyncio.to_thread(
        DHT, initial_peers=initial_peers, start=True, host_maddrs=[LOOPBACK], record_validators=[signer]
    )
    subkey, key = dht.peer_id.to_base58().encode() + signer.local_public_key, round_key(cfg.swarm_id, STAGE)

    async def declare(opened_at: float) -> None:
        for round_ in sorted({replica.sync.round for replica in honest}):
            value = {"round": round_, "opened_at": opened_at, "version": PROTOCOL_VERSION}
            await dht.store(key, value, get_dht_time() + 30, subkey=subkey, return_future=True)

    async def stall() -> None:
        while True:
            await declare(0.0)
            await asyncio.sleep(0.1)
            await declare(get_dht_time() - cfg.timeouts.matchmaking_s - 0.5)
            await asyncio.sleep(0.1)

    dht.stall = asyncio.create_task(stall())  # type: ignore[attr-defined]
    return dht


@pytest.mark.timeout(180)
def test_a_peer_declaring_every_round_long_opened_stalls_no_round() -> None:
    cfg = outer_config()

    async def scenario() -> None:
        a = await Replica.start("a", cfg, [], seed=1)
        b = await Replica.start("b", cfg, a.peer.maddrs, seed=2)
        staller = await start_round_staller(cfg, a.peer.maddrs, [a, b])
        try:
            async with stopping(a, b):
                await wait_for(
                    "four rounds of a and b together",
                    lambda: len(a.rounds(contributors=2)) >= 4 and len(b.rounds(contributors=2)) >= 4,
                    120,
                    lambda: (a.events[-5:], b.events[-5:]),
                )
                assert a.sync.global_hash == b.sync.global_hash or a.sync.round != b.sync.round
        finally:
            staller.stall.cancel()
            await asyncio.to_thread(staller.shutdown)

    asyncio.run(scenario())


# ---- item 5: a member of the round sends a ×1000 pseudo-gradient ----------------------------------------------------


@pytest.mark.timeout(180)
def test_a_member_sending_a_scaled_pseudo_gradient_is_dropped_named_and_banned_from_later_rounds() -> None:
    cfg = outer_config()
    seeded = seeded_weights(cfg)

    async def scenario() -> None:
        a = await Replica.start("a", cfg, [], seed=1)
        x = await Replica.start("x", cfg, a.peer.maddrs, seed=2)
        outer, make_payload = x.sync.outer, x.sync.outer.make_payload
        # x takes part in every round as an honest replica would, but sends 1000 × its Δ = θ_global − θ_local
        outer.make_payload = lambda local: make_payload(
            {name: g - 1000.0 * (g - local[name]) for name, g in outer.global_params.items()}
        )
        async with stopping(a, x):
            banned = lambda: [e for e in of_kind(a.events, OuterStrike) if e.banned]  # noqa: E731
            await wait_for("x banned by a", banned, 90, lambda: a.events[-5:])
            after = len(a.rounds())
            await wait_for("three rounds of a after the ban", lambda: len(a.rounds()) >= after + 3, 60)
        (ban,) = banned()
        assert ban.peer == x.peer.id
        strikes = of_kind(a.events, OuterStrike)
        assert [e.peer for e in strikes] == [x.peer.id] * 2 and "this replica's own" in strikes[0].reason
        together = a.rounds(contributors=2)
        assert together, "x never made it into a round"
        for r in together:  # x's Δ went into no round of a: dropped each time, never clipped and applied
            assert r.dropped == (x.peer.id,) and r.clipped == (), r
        for r in a.rounds()[after:]:  # banned: x is in no group of a any more
            assert (r.group, r.contributors) == (1, 1), r
        assert not [e for e in of_kind(a.events, StateDownload) if e.from_peer == x.peer.id]
        assert largest_norm_ratio(a.weights(), seeded) < 3.0
        assert largest_norm_ratio(dict(a.sync.outer.global_params), seeded) < 3.0

    asyncio.run(scenario())
