"""Attacks on the outer step, played against real peers on loopback: each replica its own hivemind DHT node and libp2p
daemon, its real ``Membership``, ``OuterService`` (blob service) and ``ReplicaSync``; the attacker a peer of its own.

A replica (``swarmtest.loopback.LoopbackReplica``) holds the tiny model's real stage 1, and an inner step moves every
weight by a small seeded random step: the outer step only ever sees weights, so this is all of training it needs, at no
compute cost. The attackers come from ``swarmtest.attacks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

from swarm.dht.records import StageStatus
from swarm.errors import ExportError
from swarm.events import OuterStrike, StateDownload, of_kind
from swarm.export import download_model, export_sources
from swarm.model.stages import stage_template
from swarm.outer.group import RoundTiming
from swarm.outer.service import OuterService
from swarm.outer.state import StageState, weights_hash
from swarm.recovery.rebuild import rebuild_stage
from swarm.rpc.blobs import BlobClient, TransferError
from swarmtest.attacks import garbage_weights, start_round_staller, start_state_liar
from swarmtest.configs import LOOPBACK_ROUND_TIMEOUTS, outer_config
from swarmtest.loopback import STAGE, LoopbackReplica, Peer, largest_norm_ratio, seeded_weights, stopping, wait_for

# ---- item 2: a peer claiming a later round serves scaled weights ----------------------------------------------------


@pytest.mark.timeout(180)
def test_a_peer_claiming_a_later_round_with_scaled_weights_takes_over_no_replica() -> None:
    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)
    seeded = seeded_weights(cfg)

    async def scenario() -> None:
        a = await LoopbackReplica.start("a", cfg, [], seed=1)
        liar = await start_state_liar(cfg, a.peer.maddrs, round_=1000, scale=1000.0)
        async with stopping(a, liar):
            # alone with the liar, a has no second replica to vouch for anything, and round 1000 is beyond what time lets
            # a reach from its own rounds: it never downloads the claim, and bans the liar for it
            banned = lambda: [e for e in of_kind(a.events, OuterStrike) if e.banned and e.peer == liar.id]  # noqa: E731
            await wait_for("the liar banned by a", banned, 60, lambda: a.events[-5:])
            assert all("beyond reach" in e.reason for e in of_kind(a.events, OuterStrike)), a.events
            rounds_before = len(a.rounds())
            await wait_for("two more rounds of a", lambda: len(a.rounds()) >= rounds_before + 2, 60, lambda: a.events)
            # a newcomer tries the liar's claim first (the latest round), refuses it, and takes a's state instead
            b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
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


@pytest.mark.timeout(180)
def test_two_colluders_announcing_a_far_round_with_garbage_weights_take_over_no_replica_and_are_banned() -> None:
    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)
    seeded = seeded_weights(cfg)
    garbage = garbage_weights(cfg)  # the seeded weights' norms: no norm check refuses them; both serve the same

    async def scenario() -> None:
        a = await LoopbackReplica.start("a", cfg, [], seed=1)
        b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
        async with stopping(a, b):
            await wait_for(
                "a round of a and b together", lambda: a.rounds(contributors=2) and b.rounds(contributors=2), 90
            )
            liars = [
                await start_state_liar(cfg, a.peer.maddrs, round_=10**6, scale=1.0, weights=garbage, name=name)
                for name in ("liar1", "liar2")
            ]
            async with stopping(*liars):
                ids = {liar.id for liar in liars}
                banned = lambda r: {e.peer for e in of_kind(r.events, OuterStrike) if e.banned}  # noqa: E731
                await wait_for("both liars banned by a and b", lambda: all(banned(r) >= ids for r in (a, b)), 60)
                rounds = [len(r.rounds(contributors=2)) for r in (a, b)]
                await wait_for(
                    "two more rounds of a and b together",
                    lambda: all(len(r.rounds(contributors=2)) >= n + 2 for r, n in zip((a, b), rounds)),
                    60,
                    lambda: (a.events[-5:], b.events[-5:]),
                )
            for replica in (a, b):
                assert not [e for e in of_kind(replica.events, StateDownload) if e.from_peer in ids], replica.events
                assert replica.sync.round < 1000
                reasons = [e.reason for e in of_kind(replica.events, OuterStrike) if e.peer in ids]
                assert reasons and all("beyond reach" in why for why in reasons), reasons
                assert largest_norm_ratio(replica.weights(), seeded) < 3.0

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
    cfg = outer_config(
        stages=2, timeouts=LOOPBACK_ROUND_TIMEOUTS
    )  # stage 1 has replicas; stage 2 (gone) is rebuilt from it
    seeded = lambda stage: {name: p.detach() for name, p in stage_template(cfg.model, 2, stage).items()}  # noqa: E731
    have = {s: StageState(stage=s, round=0, schedule_step=0, params=seeded(s), optimizer=None) for s in (0, 2)}

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            a = await LoopbackReplica.start("a", cfg, [], seed=1)
            stack.push_async_callback(a.stop)
            b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
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


@pytest.mark.timeout(180)
def test_a_peer_declaring_every_round_long_opened_stalls_no_round() -> None:
    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)

    async def scenario() -> None:
        a = await LoopbackReplica.start("a", cfg, [], seed=1)
        b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
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


@pytest.mark.timeout(240)
def test_two_identities_declaring_every_round_long_opened_with_no_payload_stall_no_round_and_get_banned() -> None:
    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)
    ago_s = RoundTiming.of(cfg.timeouts).max_round_s / 2  # a time a live round can have, far past any clock skew

    async def scenario() -> None:
        a = await LoopbackReplica.start("a", cfg, [], seed=1)
        b = await LoopbackReplica.start("b", cfg, a.peer.maddrs, seed=2)
        stallers = [await start_round_staller(cfg, a.peer.maddrs, [a, b], ago_s=ago_s) for _ in range(2)]
        ids = {staller.peer_id.to_base58() for staller in stallers}
        try:
            async with stopping(a, b):
                seen: set[str] = set()

                async def declared() -> bool:
                    found = await a.peer.membership.round_declarations(STAGE, a.sync.round)
                    seen.update(ids & {peer.to_base58() for peer in found})
                    return seen == ids

                deadline = time.monotonic() + 30
                while not await declared():
                    assert time.monotonic() < deadline, "the stallers' declarations never showed"
                    await asyncio.sleep(0.1)
                done = [len(r.rounds(contributors=2)) for r in (a, b)]
                await wait_for(
                    "four rounds of a and b together once the stallers declare",
                    lambda: all(len(r.rounds(contributors=2)) >= n + 4 for r, n in zip((a, b), done)),
                    90,
                    lambda: (a.events[-5:], b.events[-5:]),
                )
                banned = lambda r: {e.peer for e in of_kind(r.events, OuterStrike) if e.banned}  # noqa: E731
                # A staller is struck when its declaration would close a window: two of them would. Once a replica
                # banned one, the other's declaration alone closes nobody's window (``window_opening``): it stalls
                # nothing and shows no more, so it may stay at one strike with that replica.
                await wait_for(
                    "a and b each to ban a staller, leaving at most one that alone stalls nothing",
                    lambda: all(banned(r) and len(ids - banned(r)) <= 1 for r in (a, b)),
                    60,
                )
                for replica in (a, b):
                    reasons = {e.reason for e in of_kind(replica.events, OuterStrike)}
                    assert reasons and all("shows no payload" in why for why in reasons), reasons
        finally:
            for staller in stallers:
                staller.stall.cancel()
                await asyncio.to_thread(staller.shutdown)

    asyncio.run(scenario())


# ---- item 5: a member of the round sends a ×1000 pseudo-gradient ----------------------------------------------------


@pytest.mark.timeout(180)
def test_a_member_sending_a_scaled_pseudo_gradient_is_dropped_named_and_banned_from_later_rounds() -> None:
    cfg = outer_config(timeouts=LOOPBACK_ROUND_TIMEOUTS)
    seeded = seeded_weights(cfg)

    async def scenario() -> None:
        a = await LoopbackReplica.start("a", cfg, [], seed=1)
        x = await LoopbackReplica.start("x", cfg, a.peer.maddrs, seed=2)
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
