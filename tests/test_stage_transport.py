"""The stage RPC on loopback at the sizes users train: 125m-shaped boundary tensors (8 × 1024 × 768) through a real
stage server, forward and backward, in fp32, bf16 and int8; a reply larger than its request foretold; a streamed call
kept alive through a compute longer than its timeout, and one that is only ever kept alive.

Toy shapes hid for three releases that a unary reply over hivemind's 4 MiB message bound never arrives (the server
"sent" it, the trainer timed out and blamed the server). Keep these shapes: they are the point of this file.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from hivemind.p2p import P2P

import swarm.pipeline.protocol as protocol
from compress.codecs import get_codec
from compress.config import CodecConfig
from swarm.config import SwarmConfig
from swarm.pipeline.protocol import (
    MAX_UNARY_REPLY_BYTES,
    Backward,
    Forward,
    Reply,
    StageClient,
    StageServicer,
    needs_stream,
    pack,
)
from swarm.pipeline.server import StageServer
from swarmtest.configs import LOOPBACK_MADDRS, tiny_config
from swarmtest.fakes import EchoBackend

REAL_BATCH, REAL_SEQ, REAL_D = 8, 1024, 768  # the 125m preset's width at microbatch 8 × 1024 tokens


def real_shape_config(codec: str) -> SwarmConfig:
    """One block of the 125m preset's width per stage, at microbatch 8 × 1024 (few blocks keep it fast on a CPU)."""
    return tiny_config(
        stages=1,
        model={"d_model": REAL_D, "n_layers": 1, "n_heads": 12, "max_seq_len": REAL_SEQ},
        train={"seq_len": REAL_SEQ, "microbatch_size": REAL_BATCH, "inner_batch": REAL_BATCH},
        codecs=CodecConfig(activations=codec, gradients=codec),
    )


def embedding_like() -> torch.Tensor:
    """(REAL_BATCH, REAL_SEQ, REAL_D) rows of a 256-token embedding table: a first hop's input, byte-tokenizer style."""
    return torch.randn(256, REAL_D)[torch.randint(0, 256, (REAL_BATCH, REAL_SEQ))]


async def _loopback_pair() -> tuple[P2P, P2P]:
    host = await P2P.create(host_maddrs=LOOPBACK_MADDRS)
    maddrs = [str(m) for m in await host.get_visible_maddrs()]
    return host, await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK_MADDRS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_125m_shaped_boundary_tensors_cross_a_real_stage_server_both_ways(codec: str) -> None:
    cfg = real_shape_config(codec)
    server = StageServer(cfg, 1)
    coder = get_codec(codec)
    torch.manual_seed(0)
    x = embedding_like()  # what a trainer sends the first stage: zstd makes its request small, the reply is not
    grad = torch.randn(REAL_BATCH, REAL_SEQ, REAL_D) * 1e-3
    x_sent = coder.decode(coder.encode(x))  # what the server computes on
    expected_y = server.module(x_sent).detach()

    async def scenario() -> tuple[Reply, Reply]:
        host, caller = await _loopback_pair()
        try:
            servicer = StageServicer(server, stage=1, max_request_bytes=server.max_request_bytes)
            await servicer.add_p2p_handlers(host, namespace=cfg.swarm_id)
            client = StageClient(caller, namespace=cfg.swarm_id)
            forward = Forward(mb="real", stage=1, prev_stage=0, x=coder.encode(x))
            y = await client.forward(host.peer_id, forward, timeout=120)
            backward = Backward(mb="real", stage=1, grad=coder.encode(grad))
            return y, await client.backward(host.peer_id, backward, timeout=120)
        finally:
            for p2p in (caller, host):
                await p2p.shutdown()

    try:
        y_frame, grad_frame = asyncio.run(scenario())
    finally:
        server.shutdown()
    # the request went unary or by stream as its size says; both replies are over hivemind's 4 MiB unary bound
    assert len(y_frame) > 4 << 20 and len(grad_frame) > 4 << 20
    y, grad_x = coder.decode(y_frame), coder.decode(grad_frame)
    assert y.shape == grad_x.shape == (REAL_BATCH, REAL_SEQ, REAL_D)
    tolerance = {"fp32": 1e-5, "bf16": 1e-2, "int8": 2e-2}[codec]  # relative to the output's scale
    assert (y - expected_y).abs().max() <= tolerance * expected_y.abs().max()
    assert torch.isfinite(grad_x).all() and grad_x.abs().sum() > 0
    assert server.counters["forward"] == 1 and server.counters["backward"] == 1


@pytest.mark.timeout(60)
def test_a_streamed_call_outlives_its_timeout_while_the_server_computes_and_not_while_it_only_keeps_it_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(protocol, "MAX_STREAM_CALL_TIMEOUTS", 4)
    big = Forward(mb="m", stage=1, prev_stage=0, x=get_codec("int8").encode(torch.randn(REAL_BATCH, REAL_SEQ, REAL_D)))
    small = Forward(mb="m", stage=1, prev_stage=0, x=get_codec("int8").encode(torch.randn(2, 8, 16)))
    assert needs_stream(pack(big), big) and not needs_stream(pack(small), small)

    async def call(compute_s: float | None, request: Forward) -> tuple[Reply | Exception, float]:
        host, caller = await _loopback_pair()
        try:
            servicer = StageServicer(EchoBackend(delay_s=compute_s), stage=1, max_request_bytes=16 << 20)
            await servicer.add_p2p_handlers(host, namespace="ns")
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                outcome: Reply | Exception = await StageClient(caller, namespace="ns").forward(
                    host.peer_id, request, timeout=1.0
                )
            except Exception as e:
                outcome = e
            return outcome, loop.time() - started
        finally:
            for p2p in (caller, host):
                await p2p.shutdown()

    reply, _ = asyncio.run(call(2.5, big))  # 2.5 s of compute against a 1 s timeout: kept alive, arrives
    assert reply == big.x
    timed_out, _ = asyncio.run(call(2.5, small))  # a unary call has its timeout in all
    assert isinstance(timed_out, TimeoutError)
    hung, took = asyncio.run(call(None, big))  # only keep-alives: given up after 4 timeouts in all
    assert isinstance(hung, TimeoutError) and 3.5 < took < 10


@pytest.mark.timeout(60)
def test_a_unary_reply_over_the_limit_is_refused_at_once_said_at_warning_and_asked_again_by_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = EchoBackend(reply_bytes=6 << 20, fill=b"\x01")  # a reply no size estimate foretold
    small = Forward(mb="m", stage=1, prev_stage=0, x=get_codec("int8").encode(torch.randn(2, 8, 16)))
    assert not needs_stream(pack(small), small)  # the client goes unary: its estimate says the reply is small

    async def scenario() -> tuple[Reply, list[float]]:
        host, caller = await _loopback_pair()
        try:
            await StageServicer(backend, stage=1, max_request_bytes=1 << 20).add_p2p_handlers(host, namespace="ns")
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await StageClient(caller, namespace="ns").forward(host.peer_id, small, timeout=60)
            return reply, [loop.time() - started]
        finally:
            for p2p in (caller, host):
                await p2p.shutdown()

    with caplog.at_level(logging.WARNING, logger="swarm.pipeline.protocol"):
        reply, (took,) = asyncio.run(scenario())
    assert len(reply) == 6 << 20 and backend.calls == 2  # refused as unary, served again by stream
    assert took < 30  # no timeout in between: the refusal is immediate
    (warning,) = [r.getMessage() for r in caplog.records if "over the unary limit" in r.getMessage()]
    assert "a forward reply of 629" in warning and f"limit of {MAX_UNARY_REPLY_BYTES} bytes" in warning


def test_a_call_goes_by_stream_when_its_reply_could_pass_the_unary_bound_whatever_its_request() -> None:
    # an embedding's int8 codes are few distinct rows: zstd makes the request small, the reply is not
    request = Forward(mb="m", stage=1, prev_stage=0, x=get_codec("int8").encode(embedding_like()))
    assert len(pack(request)) < 2 << 20 and needs_stream(pack(request), request)
    small = Forward(mb="m", stage=1, prev_stage=0, x=get_codec("int8").encode(torch.randn(2, 64, REAL_D)))
    assert not needs_stream(pack(small), small)
