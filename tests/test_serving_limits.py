"""Bounded serving (swarm/rpc/blobs.py, ServingLimits): one identity cannot take a holder's blob service, in streams
or in whole-state downloads; others are still served, and a stream the holder cuts itself costs the peer nothing."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from compress.codecs import get_codec
from swarm.outer.claims import RecordBehind, StateClaim
from swarm.outer.snapshots import SharedSnapshot
from swarm.outer.state import unpack_state
from swarm.outer.threads import snapshot_weights
from swarm.pipeline.protocol import Forward, StageServicer, pack
from swarm.rpc.blobs import CHUNK_BYTES, BlobClient, BlobRequest, BlobServicer, BlobStream, ServingLimits, TransferError
from swarm.rpc.servicer import RequestError, pack_envelope
from swarmtest.clock import FakeClock
from swarmtest.configs import FAST_TIMEOUTS, outer_config
from swarmtest.fakes import EchoBackend, RandomStepHolder
from swarmtest.replicas import ReplicaGroup

STATE = b"s" * 1000  # a stage's state, as far as the service is concerned


def request(name: str) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=pack_envelope(BlobRequest(name=name)))


def context(peer: str) -> P2PContext:
    return P2PContext(handle_name="test", local_id="holder", remote_id=peer)


async def fetch(servicer: BlobServicer, name: str, peer: str) -> tuple[dict, int]:
    """The reply's header and the bytes of blob that followed it."""
    replies = [r.metadata async for r in servicer.rpc_blob(request(name), context(peer))]
    whole = len(replies) > 1 and replies[-1].startswith(msgpack.packb({"sha256": b""})[:8])  # its hash trailer came
    return msgpack.unpackb(replies[0]), sum(len(r) for r in replies[1 : -1 if whole else None])


def servicer(clock: FakeClock, **limits: object) -> BlobServicer:
    out = BlobServicer(linger_s=0.0, serving=ServingLimits(**limits), clock=clock)  # type: ignore[arg-type]

    async def state(name: str) -> bytes:
        return STATE

    out.provide("state", state)
    out.provide("outer", state)
    return out


def test_a_peer_gets_its_budget_of_states_then_one_a_minute_and_others_are_still_served() -> None:
    clock = FakeClock(1000.0)
    holder = servicer(clock, budgets=(("state", 4.0, 60.0),))

    async def scenario() -> list[str | None]:
        codes = [(await fetch(holder, "state/1", "drainer"))[0].get("error") for _ in range(6)]
        honest, sent = await fetch(holder, "state/1", "joiner")
        assert honest["size"] == len(STATE) and sent == len(STATE)
        assert (await fetch(holder, "state/2", "drainer"))[0]["size"] == len(STATE)  # each stage has its own budget
        assert (await fetch(holder, "outer/1/2/payload/x", "drainer"))[0]["size"] == len(STATE)  # other blobs: free
        clock.now += 60.0
        return codes + [(await fetch(holder, "state/1", "drainer"))[0].get("error")]

    codes = asyncio.run(scenario())
    assert codes == [None] * 4 + [RequestError.BUSY] * 2 + [None]
    assert holder.busy_refusals == 2 and holder.guard.banned_for("drainer") == 0.0  # busy, never a strike
    assert holder.served_bytes == (4 + 1 + 1 + 1 + 1) * len(STATE)


def test_a_peer_holds_at_most_its_streams_open_and_a_closed_one_frees_its_place() -> None:
    clock, release = FakeClock(1000.0), asyncio.Event()
    holder = BlobServicer(linger_s=0.0, serving=ServingLimits(streams_per_peer=2), clock=clock)

    async def slow(name: str) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            await release.wait()
            yield STATE

        return BlobStream(size=len(STATE), chunks=chunks())

    holder.provide("outer", slow)

    async def scenario() -> None:
        streams = [holder.rpc_blob(request(f"outer/1/{i}"), context("greedy")) for i in range(2)]
        for stream in streams:  # each stream's header is out: both open, waiting for their chunks
            assert "size" in msgpack.unpackb((await stream.__anext__()).metadata)
        third, _ = await fetch(holder, "outer/1/3", "greedy")
        assert third["error"] == RequestError.BUSY and "2 blob streams" in third["message"]
        other = asyncio.create_task(fetch(holder, "outer/1/4", "other"))  # another peer is not held back
        await asyncio.sleep(0)
        release.set()
        assert (await other)[0]["size"] == len(STATE)
        for stream in streams:
            async for _ in stream:
                pass
        assert (await fetch(holder, "outer/1/5", "greedy"))[0]["size"] == len(STATE)  # places freed

    asyncio.run(scenario())


def test_a_state_the_holder_cut_itself_is_given_back_to_the_peers_budget() -> None:
    clock = FakeClock(1000.0)
    holder = BlobServicer(linger_s=0.0, serving=ServingLimits(budgets=(("state", 1.0, 60.0),)), clock=clock)
    cut = [True]

    async def changing(name: str) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            yield STATE[:10]
            if cut[0]:
                raise RuntimeError("the state changed while it was sent")
            yield STATE[10:]

        return BlobStream(size=len(STATE), chunks=chunks())

    holder.provide("state", changing)

    async def scenario() -> None:
        header, sent = await fetch(holder, "state/1", "joiner")
        assert "size" in header and sent == 10  # cut short: the joiner sees it truncated
        cut[0] = False
        header, sent = await fetch(holder, "state/1", "joiner")  # its one blob is still there to take
        assert sent == len(STATE)
        assert (await fetch(holder, "state/1", "joiner"))[0]["error"] == RequestError.BUSY

    asyncio.run(scenario())


# ---- state bytes: a token bucket of a share of the holder's upload, per identity ----


def test_serving_limits_are_validated() -> None:
    for bad in (
        {"streams_per_peer": 0},
        {"state_streams_per_peer": 17},
        {"budgets": (("state", 0.5, 60.0),)},
        {"upload_bytes_per_s": 0.0},
        {"peer_share": 1.5},
        {"burst_bytes": float("inf")},
        {"pending_per_peer": 0},
    ):
        with pytest.raises(ValueError, match="serving limits"):
            ServingLimits(**bad)  # type: ignore[arg-type]
    assert ServingLimits(upload_bytes_per_s=float("inf")).state_bytes() is None  # no byte bound
    defaults = ServingLimits().state_bytes()
    assert defaults is not None and defaults.rate == 2.5e6 and defaults.burst == 64 << 20


def test_a_drainer_gets_its_share_of_the_upload_in_state_bytes_and_others_are_still_served() -> None:
    """Upload 2000 B/s, a share of a quarter: a drainer asking for a 1000-byte state every 0.1 s for 100 s gets its
    burst, one state over it and 500 B/s; a joiner's state and the outer blobs still go."""
    clock = FakeClock(1000.0)
    holder = servicer(clock, budgets=(), upload_bytes_per_s=2000.0, peer_share=0.25, burst_bytes=1500.0)

    async def scenario() -> tuple[int, list[str]]:
        got, messages = 0, []
        for _ in range(1000):
            header, sent = await fetch(holder, "state/1", "drainer")
            got += sent
            messages += [header["message"]] if "error" in header else []
            clock.advance(0.1)
        assert (await fetch(holder, "state/1", "joiner"))[1] == len(STATE)
        assert (await fetch(holder, "outer/1/2/payload/x", "drainer"))[1] == len(STATE)  # not a state: no bytes bound
        return got, messages

    got, messages = asyncio.run(scenario())
    assert 500 * 100 - len(STATE) <= got <= 1500 + 500 * 100 + len(STATE)
    assert holder.counters["refused_bytes"] == len(messages) > 900
    assert "took its share of this holder's upload (0.00 MB/s of state)" in messages[0]
    assert holder.guard.banned_for("drainer") == 0.0  # busy, never a strike


def test_the_share_is_of_the_upload_the_holder_measures_and_never_below_the_configured_one() -> None:
    """A holder whose blobs go out at 8 MiB/s (over a configured 1 MB/s) gives each identity its share of 8 MiB/s; a
    blob too small to measure anything, or one sent in no time, changes nothing."""
    clock, big = FakeClock(1000.0), bytes(8 * CHUNK_BYTES)
    holder = servicer(clock, budgets=(), upload_bytes_per_s=1e6, peer_share=0.5, burst_bytes=1.0)

    async def timed(name: str) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(big), CHUNK_BYTES):
                clock.advance(0.125)  # the uplink takes an eighth of a second for each MiB
                yield big[start : start + CHUNK_BYTES]

        return BlobStream(size=len(big), chunks=chunks())

    holder.provide("local", timed)

    async def scenario() -> None:
        assert (await fetch(holder, "state/1", "a"))[1] == len(STATE)  # 1000 bytes: measures nothing
        assert holder.uplink == 1e6
        assert (await fetch(holder, "local/1", "b"))[1] == len(big)
        assert holder.uplink == 8 * CHUNK_BYTES
        left = holder.bytes_left("b")
        assert left is not None and left < 0
        clock.advance(1.0)  # half of 8 MiB/s refills its debt of 8 MiB in 2 s, not 16
        assert holder.bytes_left("b") == pytest.approx(left + 4 * CHUNK_BYTES)

    asyncio.run(scenario())


def test_a_peer_holds_at_most_its_state_streams_but_its_outer_streams_are_not_held_back() -> None:
    release = asyncio.Event()
    holder = BlobServicer(
        linger_s=0.0, serving=ServingLimits(state_streams_per_peer=2, budgets=()), clock=FakeClock(1000.0)
    )

    async def slow(name: str) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            await release.wait()
            yield STATE

        return BlobStream(size=len(STATE), chunks=chunks())

    holder.provide("state", slow)
    holder.provide("local", slow)
    holder.provide("outer", slow)

    async def scenario() -> None:
        streams = [holder.rpc_blob(request(name), context("greedy")) for name in ("state/1", "local/1")]
        for stream in streams:
            assert "size" in msgpack.unpackb((await stream.__anext__()).metadata)
        third, _ = await fetch(holder, "state/2", "greedy")
        assert third["error"] == RequestError.BUSY and "2 state streams" in third["message"]
        outer = asyncio.create_task(fetch(holder, "outer/1/3", "greedy"))
        joiner = asyncio.create_task(fetch(holder, "state/1", "joiner"))
        await asyncio.sleep(0)
        release.set()
        assert (await outer)[1] == (await joiner)[1] == len(STATE)
        for stream in streams:
            async for _ in stream:
                pass
        assert (await fetch(holder, "state/2", "greedy"))[1] == len(STATE)  # places freed

    asyncio.run(scenario())
    assert holder.counters["refused_state_streams"] == 1


def test_a_peer_that_leaves_part_way_pays_the_bytes_sent_and_a_holder_cut_pays_nothing() -> None:
    """Charged its size when the header goes out, a state gives back what was not sent: a drainer cannot take a
    state's first chunks for free, an honest peer whose stream broke is not charged the rest."""
    clock, big = FakeClock(1000.0), bytes(3 * CHUNK_BYTES)
    holder = BlobServicer(
        linger_s=0.0,
        serving=ServingLimits(budgets=(), upload_bytes_per_s=1.0, peer_share=1.0, burst_bytes=4.0 * CHUNK_BYTES),
        clock=clock,
    )
    cut = [False]

    async def state(name: str) -> BlobStream:
        async def chunks() -> AsyncIterator[bytes]:
            yield big[:CHUNK_BYTES]
            if cut[0]:
                raise RuntimeError("the state changed while it was sent")
            yield big[CHUNK_BYTES:]

        return BlobStream(size=len(big), chunks=chunks())

    holder.provide("state", state)

    async def scenario() -> None:
        stream = holder.rpc_blob(request("state/1"), context("leaver"))
        assert msgpack.unpackb((await stream.__anext__()).metadata)["size"] == len(big)
        assert holder.bytes_left("leaver") == CHUNK_BYTES  # the whole state reserved
        assert len((await stream.__anext__()).metadata) == CHUNK_BYTES
        await stream.aclose()  # the peer leaves after one chunk
        assert holder.bytes_left("leaver") == 3 * CHUNK_BYTES
        cut[0] = True
        header, sent = await fetch(holder, "state/1", "leaver")
        assert "size" in header and sent == CHUNK_BYTES
        assert holder.bytes_left("leaver") == 3 * CHUNK_BYTES  # the holder's cut costs the peer nothing

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_over_p2p_a_drainer_is_told_to_wait_and_a_joiner_is_served() -> None:
    """Loopback: the refusal reaches the drainer's client as a busy ``TransferError`` naming its wait."""
    big = bytes(range(256)) * 256  # 64 KiB: several messages

    async def scenario() -> None:
        holder = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = await holder.get_visible_maddrs()
        drainer, joiner = [
            await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs) for _ in range(2)
        ]
        try:
            limits = ServingLimits(budgets=(), upload_bytes_per_s=100.0, peer_share=1.0, burst_bytes=1000.0)
            service = BlobServicer(linger_s=0.0, serving=limits)

            async def state(name: str) -> bytes:
                return big

            service.provide("state", state)
            await service.add_p2p_handlers(holder, namespace="t")
            fetch = lambda p2p: BlobClient(p2p, namespace="t").fetch(
                holder.peer_id, "state/1", timeout=10, max_bytes=1 << 20
            )
            assert await fetch(drainer) == big  # its first state, whole, at once
            with pytest.raises(TransferError, match=r"busy.*took its share of this holder's upload.*another state in"):
                await fetch(drainer)
            assert await fetch(joiner) == big
            assert service.counters["refused_bytes"] == 1 and service.guard.banned_for(drainer.peer_id) == 0.0
        finally:
            await asyncio.gather(*(p.shutdown() for p in (holder, drainer, joiner)))

    asyncio.run(scenario())


# ---- charged only when its receiver can take it: a state served ahead of its holder's record ----


def test_a_state_served_ahead_of_the_holders_record_costs_the_downloader_no_budget() -> None:
    """A replica that did a round since it last announced serves a state its record does not claim yet: the downloader
    refuses it (``RecordBehind``) and keeps it aside, through no fault of its own. Charging it ate a joiner's budget
    of 4 states in four announce periods of a stage doing rounds every few seconds, and then refused it for a minute
    a state (the budget here is 1, so the second such download was refused)."""
    group = ReplicaGroup(outer_config(timeouts=FAST_TIMEOUTS), ["a"])
    sync = group.syncs["a"]
    clock = FakeClock(1000.0)
    holder = BlobServicer(linger_s=0.0, serving=ServingLimits(budgets=(("state", 1.0, 60.0),)), clock=clock)
    holder.provide("state", group.serving("a").export_state)
    record = StateClaim(round=sync.round, weights_hash=sync.global_hash, holders=("a",))

    async def served(peer: str) -> bytes | str:
        replies = [r.metadata async for r in holder.rpc_blob(request("state/1"), context(peer))]
        header = msgpack.unpackb(replies[0])
        return header["error"] if "error" in header else b"".join(replies[1:-1])

    async def scenario() -> None:
        sync.status_fields()  # announced: round 0
        assert sync.outer is not None
        sync.outer.round += 1  # a round done since
        for _ in range(3):
            blob = await served("joiner")
            assert isinstance(blob, bytes)
            state = unpack_state(blob, stage=1, template=sync.params)
            with pytest.raises(RecordBehind):
                record.check(state)  # what the downloader does with it
        sync.status_fields()  # the record catches up: the state is claimed, and charged
        assert isinstance(await served("joiner"), bytes)
        assert await served("joiner") == RequestError.BUSY

    try:
        asyncio.run(scenario())
    finally:
        sync.close()
    assert holder.counters["uncharged"] == 3 and holder.counters["refused_budget"] == 1


# ---- the weights copied once per version for concurrent downloads ----


class CountingHolder(RandomStepHolder):
    """A holder whose compute thread is an event the test sets, counting the calls made on it."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(4, 4), seed=0, step_size=0.01)
        self.calls, self.free = 0, asyncio.Event()

    async def exclusive(self, fn: Any, *, change: str = "none") -> Any:
        self.calls += 1
        await self.free.wait()
        return fn()


def test_concurrent_downloads_share_one_copy_of_the_weights_per_version() -> None:
    async def scenario() -> None:
        holder = CountingHolder()
        snapshot = SharedSnapshot(lambda: snapshot_weights(holder), lambda: holder.inner_steps)
        waiting = [asyncio.create_task(snapshot.get()) for _ in range(8)]  # 8 downloads ask while it is taken
        await asyncio.sleep(0)
        holder.free.set()
        copies = await asyncio.gather(*waiting)
        assert holder.calls == 1 and all(c["weight"] is copies[0]["weight"] for c in copies)
        assert (await snapshot.get())["weight"] is copies[0]["weight"]  # held by a download: still shared
        holder.train()  # an inner step: a new version
        assert (await snapshot.get())["weight"] is not copies[0]["weight"] and holder.calls == 2
        snapshot.invalidate()  # a round installed
        assert holder.calls == 2 and (await snapshot.get()) and holder.calls == 3
        del copies, waiting
        assert snapshot.copies == 3

    asyncio.run(scenario())


def test_a_copy_no_download_holds_is_freed_and_taken_again() -> None:
    async def scenario() -> None:
        holder = CountingHolder()
        holder.free.set()
        snapshot = SharedSnapshot(lambda: snapshot_weights(holder), lambda: holder.inner_steps)
        first = await snapshot.get()
        weight = first["weight"]
        del first, weight  # the last download of it ended
        await asyncio.sleep(0)  # (the loop lets go of the future that carried it)
        gc.collect()
        await snapshot.get()
        assert holder.calls == 2  # no copy kept for an idle holder

    asyncio.run(scenario())


# ---- forwards: one identity holds at most its share of a stage server's requests ----


def forward_request(mb: str) -> runtime_pb2.ExpertRequest:
    x = get_codec("fp32").encode(torch.randn(2, 8, 16))
    return runtime_pb2.ExpertRequest(metadata=pack(Forward(mb=mb, stage=1, prev_stage=0, x=x)))


def test_one_identity_holds_at_most_its_share_of_a_stage_servers_requests() -> None:
    backend = EchoBackend(held=True)  # every call waits for the test
    server = StageServicer(
        backend,
        stage=1,
        max_request_bytes=1 << 20,
        max_pending=8,
        serving=ServingLimits(pending_per_peer=6),
        clock=FakeClock(1000.0),
    )

    async def scenario() -> None:
        held = [asyncio.create_task(server.rpc_forward(forward_request(f"g{i}"), context("greedy"))) for i in range(6)]
        await asyncio.sleep(0)
        assert server.pending == 6 and backend.calls == 6
        refused = msgpack.unpackb((await server.rpc_forward(forward_request("g7"), context("greedy"))).metadata)
        assert refused["error"] == RequestError.BUSY and "holds 6 of this server's 8 requests" in refused["message"]
        others = [
            asyncio.create_task(server.rpc_forward(forward_request(f"h{i}"), context("honest"))) for i in range(2)
        ]
        await asyncio.sleep(0)
        assert server.pending == 8 and backend.calls == 8  # the others' places were kept
        backend.gate.set()
        await asyncio.gather(*held, *others)
        assert server.pending == 0 and not server._held

    asyncio.run(scenario())
    assert server.refused_held == 1 and server.guard.banned_for("greedy") == 0.0
