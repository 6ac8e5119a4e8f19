"""Public-swarm defences: per-peer rate limits and bans on stage servers (pure, in-process and over
real P2P) and on the blob service, bounded streams, and the outer step dropping or clipping outsized
pseudo-gradients."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator, Iterator

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from compress.codecs import get_codec
from compress.config import CodecConfig
from compress.sparseloco import SparseLoCoCodec
from optim.config import InnerOptimConfig
from optim.outer import MAX_NORM_RATIO, PAIR_BOUND_RATIO, DiLoCo, OuterOptimizer, SparseLoCo
from swarm.config import SwarmConfig
from swarm.pipeline.protocol import Forward, RemoteError, RequestError, StageClient, StageServicer, pack, parse_reply
from swarm.pipeline.server import StageServer
from swarm.rpc.blobs import BlobRequest, BlobServicer
from swarm.rpc.defences import PeerGuard, PeerLimits
from swarm.rpc.servicer import pack_envelope, receive_reply
from swarmtest.clock import FakeClock
from swarmtest.configs import tiny_config

B, T, D = 2, 8, 16
FP32 = get_codec("fp32")


# ---- PeerGuard (pure) ----


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock(1000.0)
    guard = PeerGuard(PeerLimits(rate=2.0, burst=3.0), clock)
    assert [guard.take("a") for _ in range(4)] == [True, True, True, False]
    assert guard.take("b"), "every peer has its own budget"
    clock.now += 0.5  # one request's worth at 2/s
    assert guard.take("a") and not guard.take("a")
    clock.now += 100.0  # a long silence refills to the burst, not beyond
    assert sum(guard.take("a") for _ in range(10)) == 3


def test_strikes_within_the_window_ban_then_the_ban_expires() -> None:
    clock = FakeClock(1000.0)
    guard = PeerGuard(PeerLimits(strikes=3, strike_window_s=10.0, ban_s=60.0), clock)
    assert not guard.strike("a") and not guard.strike("a")
    clock.now += 11.0  # the first two strikes are now outside the window
    assert not guard.strike("a") and not guard.strike("a")
    assert guard.banned_for("a") == 0.0
    assert guard.strike("a")  # three within 10 s
    assert guard.banned_for("a") == 60.0 and guard.banned_for("b") == 0.0
    clock.now += 59.0
    assert guard.banned_for("a") == pytest.approx(1.0)
    clock.now += 1.0
    assert guard.banned_for("a") == 0.0
    assert not guard.strike("a"), "strikes start over after a ban"


def test_a_pardon_takes_back_the_latest_strike_but_not_a_ban() -> None:
    guard = PeerGuard(PeerLimits(strikes=2), FakeClock(1000.0))
    assert not guard.pardon("a")  # nothing to take back
    assert not guard.strike("a") and guard.pardon("a")
    assert not guard.strike("a"), "the pardoned strike no longer counts towards a ban"
    assert guard.strike("a") and not guard.pardon("a") and guard.banned_for("a") > 0


def test_the_table_is_bounded_and_a_knocking_banned_peer_stays_banned() -> None:
    clock = FakeClock(1000.0)
    guard = PeerGuard(PeerLimits(strikes=1, max_peers=3), clock)
    assert guard.strike("evil")
    for i in range(20):
        guard.take(f"sybil{i}")
        assert guard.banned_for("evil") > 0  # it keeps knocking: it stays in the table
    assert len(guard) == 3


@pytest.mark.parametrize("bad", [dict(rate=0.0), dict(burst=0.5), dict(strikes=0), dict(ban_s=-1.0), dict(max_peers=0)])
def test_limits_are_validated(bad: dict) -> None:
    with pytest.raises(ValueError):
        PeerLimits(**bad)


# ---- the servicer, in-process ----


def tiny() -> SwarmConfig:
    return tiny_config(
        model={"d_model": D, "n_heads": 2, "max_seq_len": T},
        train={"seq_len": T, "microbatch_size": B, "inner_batch": B},
        inner=InnerOptimConfig(),
        codecs=CodecConfig(activations="fp32", gradients="fp32"),
    )


@pytest.fixture
def server() -> Iterator[StageServer]:
    server = StageServer(tiny(), 1)
    yield server
    server.shutdown()


def context(peer: str) -> P2PContext:
    return P2PContext(handle_name="test", local_id="server", remote_id=peer)


def forward(x: torch.Tensor | bytes, mb: str = "m") -> runtime_pb2.ExpertRequest:
    frame = x if isinstance(x, bytes) else FP32.encode(x)
    return runtime_pb2.ExpertRequest(metadata=pack(Forward(mb=mb, stage=1, prev_stage=0, x=frame)))


def error_of(response: runtime_pb2.ExpertResponse) -> str | None:
    return msgpack.unpackb(response.metadata).get("error")


GARBAGE = [
    forward(torch.full((B, T, D), math.nan)),  # non-finite activations
    forward(torch.randn(B, T, D + 1)),  # wrong width
    forward(b"SWLC" + bytes(60)),  # not a frame
    runtime_pb2.ExpertRequest(metadata=b"\xc1junk"),  # not msgpack
]


def test_a_peer_sending_garbage_is_banned_and_others_are_still_served(server: StageServer) -> None:
    clock = FakeClock(1000.0)
    servicer = StageServicer(
        server,
        stage=1,
        max_request_bytes=server.max_request_bytes,
        clock=clock,
        limits=PeerLimits(strikes=len(GARBAGE), strike_window_s=60.0, ban_s=30.0),
    )
    good = forward(torch.randn(B, T, D))

    async def scenario() -> None:
        for bad in GARBAGE:
            assert error_of(await servicer.rpc_forward(bad, context("evil"))) == RequestError.INVALID
        banned = parse_error(await servicer.rpc_forward(good, context("evil")))
        assert banned.code == RequestError.BANNED and "30 s" in banned.message
        assert error_of(await servicer.rpc_forward(good, context("honest"))) is None
        clock.now += 30.0
        assert error_of(await servicer.rpc_forward(good, context("evil"))) is None  # the ban is over

    asyncio.run(scenario())
    assert servicer.bans == 1 and server.counters["forward"] == 2


def parse_error(response: runtime_pb2.ExpertResponse) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        parse_reply(response.metadata)
    return info.value


def test_a_peer_over_its_rate_is_told_busy_without_a_strike(server: StageServer) -> None:
    clock = FakeClock(1000.0)
    servicer = StageServicer(
        server,
        stage=1,
        max_request_bytes=server.max_request_bytes,
        clock=clock,
        limits=PeerLimits(rate=1.0, burst=2.0, strikes=1),
    )
    good = forward(torch.randn(B, T, D))

    async def scenario() -> list[str | None]:
        codes = [error_of(await servicer.rpc_forward(good, context("eager"))) for _ in range(3)]
        clock.now += 1.0
        return codes + [error_of(await servicer.rpc_forward(good, context("eager")))]

    assert asyncio.run(scenario()) == [None, None, RequestError.BUSY, None]
    assert servicer.guard.banned_for("eager") == 0.0  # busy is not misbehaviour


def test_requests_for_a_stage_the_server_left_are_refused_without_a_strike(server: StageServer) -> None:
    """A server that moved from stage 2 to 1 (the rebalancer) keeps getting stage-2 requests from trainers whose view of
    the DHT lags; they are told to ask another peer, and never banned for it (a ban locked a trainer out of the rebuilt
    stage for 300 s)."""
    servicer = StageServicer(server, stage=1, max_request_bytes=server.max_request_bytes, limits=PeerLimits(strikes=2))
    stale = runtime_pb2.ExpertRequest(
        metadata=pack(Forward(mb="m", stage=2, prev_stage=1, x=FP32.encode(torch.randn(B, T, D))))
    )

    async def scenario() -> list[RemoteError]:
        return [parse_error(await servicer.rpc_forward(stale, context("trainer"))) for _ in range(5)]

    refusals = asyncio.run(scenario())
    assert {e.code for e in refusals} == {RequestError.NOT_FOUND} and "holds stage 1, not 2" in refusals[0].message
    assert servicer.guard.banned_for("trainer") == 0.0 and servicer.bans == 0
    assert error_of(asyncio.run(servicer.rpc_forward(forward(torch.randn(B, T, D)), context("trainer")))) is None


def test_streams_of_empty_chunks_or_stalled_streams_are_cut_off(server: StageServer) -> None:
    servicer = StageServicer(server, stage=1, max_request_bytes=server.max_request_bytes, stream_timeout_s=0.2)

    async def empty_chunks() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        while True:  # never ends, never grows: the size limit alone would not stop it
            yield runtime_pb2.ExpertRequest(metadata=b"")

    async def stalled() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield runtime_pb2.ExpertRequest(metadata=b"\x81")
        await asyncio.sleep(3600)

    async def reply(requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> RemoteError:
        replies = servicer.rpc_forward_stream(requests, context("slowloris"))
        try:
            data = await receive_reply(replies, max_bytes=1 << 20, idle_s=5)
        finally:
            await replies.aclose()
        with pytest.raises(RemoteError) as info:
            parse_reply(data)
        return info.value

    assert "empty chunk" in asyncio.run(reply(empty_chunks())).message
    assert "took over" in asyncio.run(reply(stalled())).message
    assert servicer.pending == 0


# ---- the servicer over real P2P: the ban follows the libp2p-authenticated peer id ----


@pytest.mark.timeout(60)
def test_garbage_activations_over_p2p_get_the_sender_banned(server: StageServer) -> None:
    async def scenario() -> None:
        host = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await host.get_visible_maddrs()]
        evil, honest = [await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
        servicer = StageServicer(
            server, stage=1, max_request_bytes=server.max_request_bytes, limits=PeerLimits(strikes=3)
        )
        await servicer.add_p2p_handlers(host, namespace="public")
        try:
            x = torch.randn(B, T, D)
            client = StageClient(evil, namespace="public")
            for i in range(3):
                with pytest.raises(RemoteError) as refused:
                    await client.forward(
                        host.peer_id,
                        Forward(mb=f"g{i}", stage=1, prev_stage=0, x=FP32.encode(torch.full_like(x, math.inf))),
                        timeout=10,
                    )
                assert refused.value.code == RequestError.INVALID
            with pytest.raises(RemoteError) as refused:
                await client.forward(
                    host.peer_id, Forward(mb="ok", stage=1, prev_stage=0, x=FP32.encode(x)), timeout=10
                )
            assert refused.value.code == RequestError.BANNED and str(evil.peer_id) in refused.value.message
            y = await StageClient(honest, namespace="public").forward(
                host.peer_id, Forward(mb="ok", stage=1, prev_stage=0, x=FP32.encode(x)), timeout=10
            )
            assert FP32.decode(y).shape == x.shape
        finally:
            for p2p in (evil, honest, host):
                await p2p.shutdown()

    asyncio.run(scenario())


# ---- the blob service: the same defences (one servicer base, swarm/rpc/servicer.py) ----


async def provide_blob(name: str) -> bytes:
    if name == "state/bug":
        raise RuntimeError("a bug of ours")
    if name != "state/1":
        raise LookupError(name)
    return b"blob"


def blob_servicer(clock: FakeClock, limits: PeerLimits) -> BlobServicer:
    servicer = BlobServicer(linger_s=0.0, limits=limits, clock=clock)
    servicer.provide("state", provide_blob)
    return servicer


async def ask_blob(servicer: BlobServicer, metadata: bytes, peer: str) -> dict:
    """The header of the blob service's reply (the size and hash, or the error reply)."""
    replies = [r.metadata async for r in servicer.rpc_blob(runtime_pb2.ExpertRequest(metadata=metadata), context(peer))]
    return msgpack.unpackb(replies[0])


def blob_request(name: str) -> bytes:
    return pack_envelope(BlobRequest(name=name))


def test_a_peer_sending_invalid_blob_requests_is_banned_and_others_are_still_served() -> None:
    clock = FakeClock(1000.0)
    invalid = [
        b"\xc1junk",
        msgpack.packb({"name": "../etc"}),
        msgpack.packb({"name": "state/1", "evil": 1}),
        msgpack.packb({"name": 7}),
        bytes(20_000),
    ]
    servicer = blob_servicer(clock, PeerLimits(strikes=len(invalid), strike_window_s=60.0, ban_s=30.0))

    async def scenario() -> None:
        # neither a missing blob nor our own failure is the sender's fault: no strikes
        assert (await ask_blob(servicer, blob_request("state/9"), "evil"))["error"] == RequestError.NOT_FOUND
        assert (await ask_blob(servicer, blob_request("state/bug"), "evil"))["error"] == RequestError.INTERNAL
        for bad in invalid:
            assert (await ask_blob(servicer, bad, "evil"))["error"] == RequestError.INVALID
        banned = await ask_blob(servicer, blob_request("state/1"), "evil")
        assert banned["error"] == RequestError.BANNED and "30 s" in banned["message"]
        assert (await ask_blob(servicer, blob_request("state/1"), "honest"))["size"] == len(b"blob")
        clock.now += 30.0
        assert (await ask_blob(servicer, blob_request("state/1"), "evil"))["size"] == len(b"blob")  # the ban is over

    asyncio.run(scenario())
    assert servicer.bans == 1 and servicer.served_bytes == 2 * len(b"blob")


def test_a_peer_over_its_blob_rate_is_told_busy_without_a_strike() -> None:
    clock = FakeClock(1000.0)
    servicer = blob_servicer(clock, PeerLimits(rate=1.0, burst=2.0, strikes=1))

    async def scenario() -> list[str | None]:
        codes = [(await ask_blob(servicer, blob_request("state/1"), "eager")).get("error") for _ in range(3)]
        clock.now += 1.0
        return codes + [(await ask_blob(servicer, blob_request("state/1"), "eager")).get("error")]

    assert asyncio.run(scenario()) == [None, None, RequestError.BUSY, None]
    assert servicer.guard.banned_for("eager") == 0.0


# ---- the outer step's screen of pseudo-gradients ----


def start_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(100, generator=g)}


def make(method: str, start: dict[str, torch.Tensor]) -> OuterOptimizer:
    if method == "diloco":
        return DiLoCo(start, codec=get_codec("fp32"))
    return SparseLoCo(start, codec=SparseLoCoCodec(topk=16))


def deltas(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{name: 0.01 * torch.randn(t.shape, generator=g) for name, t in start_params().items()} for _ in range(n)]


def outer_step(
    method: str, group: list[dict[str, torch.Tensor]], *, orders: int = 1
) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    """Each member's Δ into a payload; ``orders`` replicas apply them, each in its own delivery order."""
    start = start_params()
    payloads = [make(method, start).make_payload({k: start[k] - d[k] for k in start}) for d in group]
    used, results = [], []
    for seed in range(orders):
        received = list(payloads)
        random.Random(seed).shuffle(received)
        local = {k: t.clone() for k, t in start.items()}
        used.append(make(method, start).apply(received, local).used)
        results.append(local)
    return used, results


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
@pytest.mark.parametrize("members", [3, 5])
def test_a_scaled_pseudo_gradient_is_dropped_and_replicas_stay_identical(method: str, members: int) -> None:
    honest = deltas(members - 1)
    attacker = {name: 1000.0 * t for name, t in deltas(1, seed=9)[0].items()}
    used, results = outer_step(method, [*honest[:1], attacker, *honest[1:]], orders=3)
    assert used == [members - 1] * 3
    _, (without_attacker,) = outer_step(method, honest)
    for result in results:
        for name in result:
            assert torch.equal(result[name], without_attacker[name])


def test_a_non_finite_pseudo_gradient_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    start = start_params()
    honest = [DiLoCo(start, codec=FP32).make_payload({k: start[k] - d[k] for k in start}) for d in deltas(3)]
    diverged = {k: t.clone() for k, t in start.items()}
    diverged["b"][7] = math.nan  # fp32 frames carry NaN; decoding refuses it
    local = {k: t.clone() for k, t in start.items()}
    assert DiLoCo(start, codec=FP32).apply([*honest, DiLoCo(start, codec=FP32).make_payload(diverged)], local).used == 3
    assert all(torch.isfinite(t).all() for t in local.values())
    assert "dropped a pseudo-gradient" in caplog.text


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_in_a_pair_the_larger_pseudo_gradient_is_clipped(method: str) -> None:
    honest, other = deltas(2)
    # not opposed to the honest Δ (an opposed one loses its part along it: tests/test_outer_robust.py)
    huge = {name: 1000.0 * (t + honest[name]) for name, t in other.items()}
    used, (result, other_order) = outer_step(method, [honest, huge], orders=2)
    assert used == [2, 2] and all(torch.equal(result[k], other_order[k]) for k in result)
    moved = {k: start_params()[k] - result[k] for k in result}
    norm = lambda ts: math.sqrt(sum(float(t.double().square().sum()) for t in ts.values()))
    _, (honest_only,) = outer_step(method, [honest, honest])
    honest_step = norm({k: start_params()[k] - honest_only[k] for k in result})
    # a Δ clipped to 10·‖Δ_honest‖ (a strike), then per parameter to PAIR_BOUND_RATIO × the honest one's, averaged
    # with Δ_honest moves at most (1 + ratio)/2 times as far as Δ_honest alone (SparseLoCo averages per index over the
    # senders, so an index only the clipped Δ sent counts fully: 1 + ratio)
    assert PAIR_BOUND_RATIO < MAX_NORM_RATIO
    bound = (1 + PAIR_BOUND_RATIO) / (2 if method == "diloco" else 1)
    assert norm(moved) <= bound * honest_step * (1 + 1e-4)
    assert norm(moved) > 1.2 * honest_step  # clipped, not dropped: nobody can tell which of two is wrong


@settings(deadline=None, max_examples=25)
@given(
    scales=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 30.0, 1e4]), min_size=3, max_size=6), seed=st.integers(0, 1000)
)
def test_screened_groups_agree_and_keep_nothing_far_above_the_median(scales: list[float], seed: int) -> None:
    group = [{name: scale * t for name, t in delta.items()} for scale, delta in zip(scales, deltas(len(scales), seed))]
    used, results = outer_step("diloco", group, orders=2)
    norms = sorted(math.sqrt(sum(float(t.double().square().sum()) for t in d.values())) for d in group)
    median = (norms[(len(norms) - 1) // 2] + norms[len(norms) // 2]) / 2
    expected = len(norms) if median == 0 else sum(n <= MAX_NORM_RATIO * median for n in norms)
    assert used == [expected, expected]
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


@pytest.mark.parametrize("method", ["diloco", "sparseloco"])
def test_in_a_pair_a_delta_far_above_this_replicas_own_is_dropped_and_its_sender_named(method: str) -> None:
    start = start_params()
    own, other = deltas(2)
    me, clean = make(method, start), make(method, start)
    mine = me.make_payload({k: start[k] - own[k] for k in start})  # this replica's ‖Δ‖ is now on record
    huge = make(method, start).make_payload({k: start[k] - 1000.0 * other[k] for k in start})
    local = {k: t.clone() for k, t in start.items()}
    screening = me.apply([huge, mine], local)
    assert screening.used == 1 and list(screening.dropped) == [0] and not screening.clipped  # the sender, by index
    assert "this replica's own" in screening.dropped[0]
    clean_local = {k: t.clone() for k, t in start.items()}
    clean.apply([clean.make_payload({k: start[k] - own[k] for k in start})], clean_local)
    assert all(torch.equal(local[k], clean_local[k]) for k in start)  # exactly the round without the attacker

    if method == "sparseloco":  # (its error feedback would send the earlier rounds' residual: no small Δ below)
        return
    # within ×10 of this replica's recent ‖Δ‖ but over ×10 the other member's (this round's own is small): clipped,
    # and named too
    me, small = make(method, start), {k: 0.01 * t for k, t in own.items()}
    for _ in range(2):
        me.make_payload({k: start[k] - own[k] for k in start})
    mine = me.make_payload({k: start[k] - small[k] for k in start})
    larger = make(method, start).make_payload({k: start[k] - 5.0 * other[k] for k in start})
    screening = me.apply([mine, larger], {k: t.clone() for k, t in start.items()})
    assert screening.used == 2 and list(screening.clipped) == [1] and not screening.dropped
