"""Stage RPC without sockets: message checks, the servicer's refusals and limits, the stage server's
gradients, and the trainer driving servers through the same envelope (including failover)."""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import AsyncIterator

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

import swarm.pipeline.protocol as protocol
from compress.codecs import get_codec
from compress.config import CodecConfig
from compress.errors import BadMagic, LimitExceeded
from swarm.config import SwarmConfig, TrainerOptions
from swarm.model.stages import build_stage
from swarm.model.step import stage_gradients
from swarm.pipeline.cache import STASHED_STEPS, ActivationCache, CacheEntry
from swarm.pipeline.protocol import (
    Backward,
    Forward,
    RequestError,
    StageServicer,
    pack,
    parse_reply,
    unpack,
)
from swarm.pipeline.server import StageServer
from swarm.pipeline.trainer import Trainer
from swarm.rpc.servicer import RemoteError, receive_reply, reply_parts
from swarm.sim.centralized import evaluate, train_centralized
from swarmtest.configs import RPC_BATCH, RPC_SEQ, RPC_WIDTH, rpc_config
from swarmtest.fakes import CONTEXT, EchoBackend, InProcessNetwork, request

B, T, D = RPC_BATCH, RPC_SEQ, RPC_WIDTH


def batches(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (B, T + 1), generator=g)
        yield x[:, :-1], (x[:, 1:] + x[:, :-1]) % 256  # learnable: target = f(current, next)


def reply_of(response: runtime_pb2.ExpertResponse) -> dict:
    return msgpack.unpackb(response.metadata)


# messages


@settings(deadline=None, max_examples=50)
@given(
    mb=st.from_regex(protocol.MICROBATCH_ID, fullmatch=True),
    stage=st.integers(0, 2**31),
    x=st.binary(max_size=64),
    resend=st.booleans(),
)
def test_requests_round_trip(mb: str, stage: int, x: bytes, resend: bool) -> None:
    fwd = Forward(mb=mb, stage=stage, prev_stage=0, x=x, train=resend)
    bwd = Backward(mb=mb, stage=stage, grad=x, x=x if resend else None)
    assert unpack(pack(fwd), Forward, max_bytes=1024) == fwd
    assert unpack(pack(bwd), Backward, max_bytes=1024) == bwd


@pytest.mark.parametrize(
    "fields",
    [
        {"mb": "a", "stage": 1, "prev_stage": 0, "x": b"", "extra": 1},  # unknown field
        {"mb": "a", "stage": 1, "x": b""},  # missing field
        {"mb": "a", "stage": True, "prev_stage": 0, "x": b""},  # bool is not an int here
        {"mb": "a", "stage": 1.0, "prev_stage": 0, "x": b""},
        {"mb": "a", "stage": 1, "prev_stage": 0, "x": "text"},
        {"mb": "a b", "stage": 1, "prev_stage": 0, "x": b""},  # microbatch id outside [\w.:/-]
        {"mb": "a" * 129, "stage": 1, "prev_stage": 0, "x": b""},
        [1, 2, 3],
    ],
)
def test_malformed_requests_are_invalid(fields: object) -> None:
    with pytest.raises(RequestError) as e:
        unpack(msgpack.packb(fields), Forward, max_bytes=1024)
    assert e.value.code == RequestError.INVALID


@settings(deadline=None, max_examples=100)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_but_request_error(data: bytes) -> None:
    try:
        unpack(data, Backward, max_bytes=100)
    except RequestError as e:
        assert e.code == RequestError.INVALID


# servicer


def test_servicer_replies_with_errors_and_keeps_serving() -> None:
    async def scenario() -> None:
        backend = EchoBackend(info={"calls": 1})
        servicer = StageServicer(backend, stage=1, max_request_bytes=4096)
        good = pack(Forward(mb="m", stage=1, prev_stage=0, x=b"frame"))
        for error, code in [
            (RequestError(RequestError.CACHE_MISS, "gone"), RequestError.CACHE_MISS),
            (BadMagic("junk"), RequestError.INVALID),
            (ZeroDivisionError("bug"), RequestError.INTERNAL),
        ]:
            backend.raise_next = error
            assert reply_of(await servicer.rpc_forward(request(good), CONTEXT))["error"] == code
        assert (
            reply_of(await servicer.rpc_forward(request(pack(Forward(mb="m", stage=2, prev_stage=0, x=b""))), CONTEXT))[
                "error"
            ]
            == RequestError.NOT_FOUND  # another stage's request: ask another peer (no strike: the server may have moved)
        )
        assert (
            reply_of(await servicer.rpc_forward(request(b"\x00" * 5000), CONTEXT))["error"] == RequestError.INVALID
        )  # over the size limit
        assert parse_reply((await servicer.rpc_forward(request(good), CONTEXT)).metadata) == b"frame"
        info = msgpack.unpackb((await servicer.rpc_info(runtime_pb2.ExpertUID(uid=""), CONTEXT)).serialized_info)
        assert info == {"calls": 1, "stage": 1, "pending": 0, "refused": 5}

    asyncio.run(scenario())


def test_a_servicer_of_several_stages_sends_each_request_to_its_stages_backend() -> None:
    """A full peer with --serve: one set of handlers, each request computed by its own stage's backend."""

    class Tagged(EchoBackend):
        def __init__(self, tag: bytes) -> None:
            super().__init__()
            self.tag = tag

        async def forward(self, peer: object, req: Forward) -> bytes:
            return self.tag + await super().forward(peer, req)

    async def scenario() -> None:
        servicer = StageServicer(Tagged(b"1:"), stage=1, max_request_bytes=4096, other_stages={2: Tagged(b"2:")})
        for stage in (1, 2):
            frame = pack(Forward(mb="m", stage=stage, prev_stage=stage - 1, x=b"x"))
            assert parse_reply((await servicer.rpc_forward(request(frame), CONTEXT)).metadata) == f"{stage}:x".encode()
        unheld = pack(Forward(mb="m", stage=3, prev_stage=2, x=b"x"))
        refusal = reply_of(await servicer.rpc_forward(request(unheld), CONTEXT))
        assert refusal["error"] == RequestError.NOT_FOUND and "1, 2" in refusal["message"]
        info = msgpack.unpackb((await servicer.rpc_info(runtime_pb2.ExpertUID(uid=""), CONTEXT)).serialized_info)
        assert set(info["stages"]) == {"1", "2"}

    asyncio.run(scenario())


def test_servicer_refuses_requests_beyond_max_pending() -> None:
    async def scenario() -> None:
        backend = EchoBackend()
        servicer = StageServicer(backend, stage=1, max_request_bytes=4096, max_pending=2)
        good = request(pack(Forward(mb="m", stage=1, prev_stage=0, x=b"y")))
        backend.gate.clear()
        held = [asyncio.create_task(servicer.rpc_forward(good, CONTEXT)) for _ in range(2)]
        while servicer.pending < 2 and not any(task.done() for task in held):  # until both reach the gated backend
            await asyncio.sleep(0)
        assert servicer.pending == 2
        assert reply_of(await servicer.rpc_forward(good, CONTEXT))["error"] == RequestError.BUSY
        backend.gate.set()
        assert [parse_reply(r.metadata) for r in await asyncio.gather(*held)] == [b"y", b"y"]
        assert servicer.pending == 0

    asyncio.run(scenario())


def test_stream_handlers_are_registered_as_streams() -> None:
    StageServicer._collect_rpc_handlers()  # hivemind reads streaming from typing.AsyncIterator hints only
    handlers = {h.method_name: (h.stream_input, h.stream_output) for h in StageServicer._rpc_handlers}
    assert handlers == {
        "rpc_forward": (False, False),
        "rpc_backward": (False, False),
        "rpc_info": (False, False),
        "rpc_forward_stream": (True, True),
        "rpc_backward_stream": (True, True),
    }


def test_streamed_requests_are_reassembled_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_UNARY_PAYLOAD_SIZE", 7)  # chunks of 7 bytes, both ways

    async def stream(payload: bytes) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for chunk in protocol._chunks(payload):
            yield request(chunk)

    async def scenario() -> None:
        servicer = StageServicer(EchoBackend(), stage=1, max_request_bytes=200)
        frame = bytes(range(50))

        async def read(replies: AsyncIterator[runtime_pb2.ExpertResponse]) -> tuple[bytes, int]:
            messages = 0

            async def counted() -> AsyncIterator[runtime_pb2.ExpertResponse]:
                nonlocal messages
                async for message in replies:
                    messages += 1
                    yield message

            try:  # read by its length: the server holds the stream open until the caller closes it
                return await receive_reply(counted(), max_bytes=1000, idle_s=5), messages
            finally:
                await replies.aclose()

        reply, messages = await read(
            servicer.rpc_forward_stream(stream(pack(Forward(mb="m", stage=1, prev_stage=0, x=frame))), CONTEXT)
        )
        assert messages > 1 and parse_reply(reply) == frame
        reply, _ = await read(servicer.rpc_backward_stream(stream(b"\x00" * 1000), CONTEXT))
        assert msgpack.unpackb(reply)["error"] == RequestError.INVALID

    asyncio.run(scenario())


# stage server


def test_activation_cache_is_bounded_by_count_and_bytes() -> None:
    entry = lambda n: CacheEntry(x=torch.zeros(n), tokens=None, forward_s=0.0, weights=0)  # n float32 = 4n bytes
    cache = ActivationCache(max_items=3, max_bytes=400, share=1)
    for key in "abcd":
        cache.put("p", key, entry(10))
    assert len(cache) == 3 and cache.pop("p", "a") is None and cache.evicted == 1
    cache.put("p", "big", entry(90))  # 360 bytes: the oldest go until 400 bytes fit
    assert [key for key in "bcd" if cache.pop("p", key) is not None] == ["d"] and cache.nbytes == 360
    assert cache.pop("p", "big") is not None and cache.nbytes == 0 and len(cache) == 0


def test_a_backward_across_an_outer_install_keeps_the_gradients_of_the_weights_its_forward_ran_on() -> None:
    """An outer install moves the weights between a forward and its backward: the backward differentiates the
    weights the forward ran on (stashed at the install) and its gradients accumulate into the moved weights."""

    async def scenario() -> None:
        server, codec = StageServer(rpc_config(), 1), get_codec("fp32")
        before_install = copy.deepcopy(server.module)
        x, g = torch.randn(B, T, D), torch.randn(B, T, D)
        await server.forward("p", Forward(mb="before", stage=1, prev_stage=0, x=codec.encode(x)))

        @torch.no_grad()
        def install() -> None:  # an outer round's move: θ ← θ + (θ_global − θ_snapshot)
            for p in server.module.parameters():
                p.add_(0.1 * torch.randn_like(p))

        await server.exclusive(install, change="moved")
        returned = codec.decode(await server.backward("p", Backward(mb="before", stage=1, grad=codec.encode(g))))
        expected_x, expected = stage_gradients(before_install, x, g)
        assert torch.allclose(returned, expected_x, atol=1e-6)
        held = [p.grad for p in server.module.parameters() if p.requires_grad]
        assert all(torch.allclose(h, e, atol=1e-6) for h, e in zip(held, expected, strict=True) if e is not None)
        assert server.inner.samples == B and server.counters["stashed_backward"] == 1
        assert server.counters["stale_backward"] == 0
        server.shutdown()

    asyncio.run(scenario())


def test_a_backward_across_a_download_goes_back_without_touching_the_new_weights_gradients() -> None:
    async def scenario() -> None:
        server, codec = StageServer(rpc_config(), 1), get_codec("fp32")
        x, g = torch.randn(B, T, D), torch.randn(B, T, D)
        for mb in ("before", "after"):
            await server.forward("p", Forward(mb=mb, stage=1, prev_stage=0, x=codec.encode(x)))
            if mb == "before":  # the download replaces the weights between this forward and its backward
                await server.exclusive(lambda: None, change="replaced")
        stale = await server.backward("p", Backward(mb="before", stage=1, grad=codec.encode(g)))
        assert codec.decode(stale).shape == x.shape  # the microbatch goes on upstream
        assert server.counters["stale_backward"] == 1 and server.inner.samples == 0
        assert all(p.grad is None for p in server.module.parameters())  # nothing of it accumulated
        await server.backward("p", Backward(mb="after", stage=1, grad=codec.encode(g)))
        assert server.inner.samples == B and server.counters["stale_backward"] == 1
        server.shutdown()

    asyncio.run(scenario())


def test_a_backward_after_inner_steps_since_its_forward_differentiates_the_weights_its_forward_ran_on() -> None:
    """Two microbatches per inner step, six forwarded at step 0: "a" and "b" come back first (step 1), "c" and "d"
    one step on (step 2), "late" two steps on: each is differentiated at step 0's weights, exactly as a copy of those
    weights would be. Then "e" and "f" make step 3, and the stash (the last two steps' weights) lets step 0's go:
    "ancient" is recomputed on weights three steps on, and counted. None of it is refused or left out."""

    async def scenario() -> None:
        server, codec = StageServer(rpc_config(), 1), get_codec("fp32")
        assert server.cfg.train.inner_batch == 2 * B and STASHED_STEPS == 2
        at_step_0 = copy.deepcopy(server.module)
        xs = {mb: torch.randn(B, T, D) for mb in ("ancient", "late", "a", "b", "c", "d", "e", "f")}
        g = torch.randn(B, T, D)
        forward = lambda mb: server.forward("p", Forward(mb=mb, stage=1, prev_stage=0, x=codec.encode(xs[mb])))
        backward = lambda mb: server.backward("p", Backward(mb=mb, stage=1, grad=codec.encode(g)))
        for mb in ("ancient", "late", "a", "b", "c", "d"):
            await forward(mb)
        for mb in ("a", "b", "c", "d"):
            await backward(mb)
        assert server.inner_steps == 2 and server.inner.samples == 0 and len(server.stash) == 2

        # "late": the input gradient and the parameter gradients of step 0's weights, not of today's
        returned = codec.decode(await backward("late"))
        expected_x, expected = stage_gradients(at_step_0, xs["late"], g)
        assert torch.allclose(returned, expected_x, atol=1e-6)
        held = [p.grad for p in server.module.parameters() if p.requires_grad]
        assert all(torch.allclose(h, e, atol=1e-6) for h, e in zip(held, expected, strict=True) if e is not None)
        _, today = stage_gradients(server.module, xs["late"], g)
        assert not all(torch.allclose(h, t, atol=1e-6) for h, t in zip(held, today, strict=True) if t is not None)

        assert server.counters["stashed_backward"] == 3 and server.counters["stale_recompute"] == 0  # c, d, late

        for mb in ("e", "f"):  # each back on the weights it ran on ("e" and "late" make step 3)
            await forward(mb)
            await backward(mb)
        assert server.inner_steps == 3 and server.stash.get((0, 0)) is None
        await backward("ancient")
        assert server.counters["stale_recompute"] == 1 and server.counters["stale_recompute_steps"] == 3
        assert server.counters["stashed_backward"] == 3
        assert server.counters["backward"] == 8 and server.counters["stale_backward"] == 0
        server.shutdown()

    asyncio.run(scenario())


def test_stage_server_gradients_are_autograd_gradients_and_survive_a_lost_input() -> None:
    async def scenario() -> None:
        cfg = rpc_config()
        server, reference = StageServer(cfg, 1), build_stage(cfg.model, 2, 1)
        codec = get_codec("fp32")
        x, g = torch.randn(B, T, D), torch.randn(B, T, D)
        y = codec.decode(await server.forward("p", Forward(mb="m", stage=1, prev_stage=0, x=codec.encode(x))))
        x_ref = x.clone().requires_grad_()
        y_ref = reference(x_ref)
        y_ref.backward(g)
        torch.testing.assert_close(y, y_ref.detach())
        grad_x = codec.decode(await server.backward("p", Backward(mb="m", stage=1, grad=codec.encode(g))))
        torch.testing.assert_close(grad_x, x_ref.grad)

        with pytest.raises(RequestError) as miss:  # served once already: the input is gone
            await server.backward("p", Backward(mb="m", stage=1, grad=codec.encode(g)))
        assert miss.value.code == RequestError.CACHE_MISS
        resent = await server.backward("p", Backward(mb="m", stage=1, grad=codec.encode(g), x=codec.encode(x)))
        assert server.inner_steps == 1  # 2 microbatches of B = inner_batch samples
        assert server.counters["recompute_from_resent"] == 1 and codec.decode(resent).shape == x.shape
        with pytest.raises(LimitExceeded):  # a batch larger than the swarm's microbatch: refused before decoding
            await server.forward("p", Forward(mb="n", stage=1, prev_stage=0, x=codec.encode(torch.randn(2 * B, T, D))))
        with pytest.raises(RequestError):  # the input cannot come from the stage itself
            await server.forward("p", Forward(mb="n", stage=1, prev_stage=1, x=codec.encode(x)))
        server.shutdown()

    asyncio.run(scenario())


# trainer over an in-process network


def train(cfg: SwarmConfig, net: InProcessNetwork, steps: int, **kw) -> tuple[Trainer, dict]:
    trainer = Trainer(cfg, net, net.router, options=TrainerOptions(**kw))
    record = asyncio.run(trainer.train(batches(), steps=steps, val_batches=[next(batches(seed=99)) for _ in range(2)]))
    return trainer, record


def test_swarm_with_fp32_wire_and_no_clipping_equals_centralized_training() -> None:
    cfg = rpc_config(steps=6, clip=0.0)  # per-stage clipping is the one intended difference; off here
    # max_staleness 0: the synchronous pipeline (both microbatches of a step in flight, none of the next)
    _, record = train(cfg, InProcessNetwork(cfg, {"a": 1, "b": 2}), steps=6, in_flight=2, max_staleness=0)
    val = [next(batches(seed=99)) for _ in range(2)]
    model = train_centralized(cfg, batches(), val, steps=6)
    assert record["val_loss"] == pytest.approx(evaluate(model, val), abs=1e-5)
    assert record["completed"] == record["started"] == 12 and record["wire_bytes"]["activations"] > 0


def test_what_a_trainer_counts_sent_is_what_its_servers_count_received_by_kind() -> None:
    cfg = rpc_config(codecs=CodecConfig())  # int8 on the wire
    net = InProcessNetwork(cfg, {"a": 1, "b": 2})
    trainer, record = train(cfg, net, steps=3)
    servers = [net.traffic["a"], net.traffic["b"]]
    assert trainer.traffic.sent == sum((t.received for t in servers), Counter())
    assert trainer.traffic.received == sum((t.sent for t in servers), Counter())
    assert set(trainer.traffic.sent) == {"activations", "gradients", "eval"}
    both = trainer.traffic.sent + trainer.traffic.received
    assert {kind: record["wire_bytes"][kind] for kind in ("activations", "gradients")} == {
        kind: both[kind] for kind in ("activations", "gradients")
    }  # the progress record reads the same counters (its eval bytes stop before the last validation)
    assert trainer.fp32_bytes["activations"] > 3 * record["wire_bytes"]["activations"]  # int8: ~4x below fp32


def test_failed_replicas_are_retried_elsewhere_and_nothing_is_lost() -> None:
    cfg = rpc_config(codecs=CodecConfig())  # int8 on the wire
    net = InProcessNetwork(cfg, {"1a": 1, "1b": 1, "2a": 2})
    net.dead.add("1a")
    trainer, record = train(cfg, net, steps=3)
    assert record["failed"] == 0 and record["completed"] == record["started"] == 6
    assert record["hop_failures"] >= 1 and net.served("1b") == 6  # banned after its first failure

    real_backward = net.backward

    async def stage2_dies_after_forward(peer: str, req: Backward, *, timeout: float) -> bytes:
        # 2a dies between a forward it served and that microbatch's backward (whichever replica routing chose first)
        net.dead.add("2a") if peer == "2a" and req.x is None else None
        return await real_backward(peer, req, timeout=timeout)

    net.servers["2b"] = StageServer(cfg, 2)
    net.servicers["2b"] = StageServicer(
        net.servers["2b"], stage=2, max_request_bytes=net.servers["2b"].max_request_bytes
    )
    net.router.update(2, ["2a", "2b"])
    net.dead.clear()
    net.router.update(1, ["1b"])
    net.backward = stage2_dies_after_forward  # type: ignore[method-assign]  # 2a dies between forward and backward
    asyncio.run(trainer.train(batches(), steps=4))
    counters = trainer.counters
    assert (
        counters["failed"] == 0
        and counters["resent_inputs"] >= 1
        and net.servers["2b"].counters["recompute_from_resent"] >= 1
    )


def test_a_stage_without_live_replicas_is_skipped_and_counted() -> None:
    cfg = rpc_config(stages=2, codecs=CodecConfig())
    net = InProcessNetwork(cfg, {"1a": 1})  # nobody serves stage 2
    _, record = train(cfg, net, steps=2)
    assert record["skipped_hops"] == record["started"] == record["completed"] == 4
    assert net.served("1a") == 4


def test_persistent_failures_stop_the_trainer_instead_of_spinning() -> None:
    cfg = rpc_config()
    net = InProcessNetwork(cfg, {"1a": 1, "2a": 2})
    trainer = Trainer(cfg, net, net.router, options=TrainerOptions(max_failures_in_a_row=5))
    bad_tokens = iter(
        lambda: (torch.full((B, T), 999), torch.zeros(B, T, dtype=torch.long)), None
    )  # outside the vocabulary
    with pytest.raises(RuntimeError, match="microbatches failed in a row"):
        asyncio.run(trainer.train(bad_tokens, steps=2))
    counters = trainer.counters
    assert (
        counters["failed"] >= 5
        and counters["started"] == counters["failed"] + counters["cancelled"]
        and counters["completed"] == 0
    )


def test_a_flooding_owner_evicts_its_own_inputs_and_a_full_cache_evicts_the_largest_holder() -> None:
    entry = lambda: CacheEntry(x=torch.zeros(10), tokens=None, forward_s=0.0, weights=0)  # 40 bytes
    cache = ActivationCache(max_items=8, max_bytes=10_000, share=4)  # 2 entries per owner
    cache.put("honest", "h0", entry())
    for i in range(100):  # forwards never followed by a backward
        cache.put("flooder", f"f{i}", entry())
    assert len(cache) == 3 and cache.evicted == 98
    assert cache.pop("honest", "h0") is not None and cache.pop("flooder", "f0") is None
    cache.put("honest", "h1", entry())
    for owner in "abcdef":  # owners within their share overfill the cache: a largest holder loses its oldest
        cache.put(owner, "1", entry())
    assert len(cache) == 8 and cache.evicted == 99
    assert cache.pop("flooder", "f98") is None and cache.pop("flooder", "f99") is not None
    assert cache.pop("honest", "h1") is not None


def _replies(*messages: bytes) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    async def gen() -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for m in messages:
            yield runtime_pb2.ExpertResponse(metadata=m)

    return gen()


def test_a_streamed_reply_is_read_by_its_length_and_one_cut_short_is_a_transport_failure() -> None:
    reply = bytes(range(256)) * 1000  # 256 kB
    parts = reply_parts(reply, 64 << 10)
    assert all(len(p) <= 64 << 10 for p in parts) and len(parts) == 4  # 8 + 256,000 bytes
    # keep-alives (empty messages) before and between parts are skipped; reading stops at the length, not the end
    stream = _replies(b"", *parts[:2], b"", *parts[2:], b"never read")
    assert asyncio.run(receive_reply(stream, max_bytes=len(reply), idle_s=5)) == reply
    with pytest.raises(RemoteError, match="cut short") as cut:  # the stream ended with a part missing
        asyncio.run(receive_reply(_replies(*parts[:-1]), max_bytes=len(reply), idle_s=5))
    assert cut.value.code == RequestError.UNREACHABLE  # the link's failure: retried, no fault of the server's
    with pytest.raises(RemoteError, match="cut short"):  # before even its length arrived
        asyncio.run(receive_reply(_replies(b"", parts[0][:3]), max_bytes=len(reply), idle_s=5))
    with pytest.raises(RemoteError, match="over"):  # a length over what the request allows: not read at all
        asyncio.run(receive_reply(_replies(*parts), max_bytes=len(reply) - 1, idle_s=5))
    assert asyncio.run(receive_reply(_replies(*reply_parts(b"", 16)), max_bytes=0, idle_s=5)) == b""
