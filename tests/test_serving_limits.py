"""Bounded serving (swarm/rpc/blobs.py, ServingLimits): one identity cannot take a holder's blob service, in streams
or in whole-state downloads; others are still served, and a stream the holder cuts itself costs the peer nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.rpc.blobs import BlobRequest, BlobServicer, BlobStream, ServingLimits
from swarm.rpc.servicer import RequestError, pack_envelope
from swarmtest.clock import FakeClock

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
    out = BlobServicer(serving=ServingLimits(**limits), clock=clock)  # type: ignore[arg-type]

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
    holder = BlobServicer(serving=ServingLimits(streams_per_peer=2), clock=clock)

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
    holder = BlobServicer(serving=ServingLimits(budgets=(("state", 1.0, 60.0),)), clock=clock)
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
