"""Link-adaptive boundary codecs (compress/adaptive.py): the choice per link, receivers decoding by the frame's codec id,
and a trainer that moves to a heavier codec on a slow link.

The trainer tests call real ``StageServer``s directly (no network, as tests/test_trainer_window.py does); a link's
transfer is an ``asyncio.sleep`` of its frames' bytes over its bandwidth."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import astuple

import msgpack
import pytest
import torch

from compress.adaptive import Ladder, LinkEstimate, LinkEstimator, choose_codec, frame_bytes
from compress.codec_base import BOUNDARY_MAX_ABS
from compress.codecs import get_codec
from compress.errors import ShapeMismatch, UnknownCodec, WireError
from swarm.config import SwarmConfig, TrainerOptions
from swarm.dht.metrics import Meter
from swarm.pipeline.boundary import boundary_codecs, boundary_ladders
from swarm.pipeline.frames import Outgoing
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import Backward, Forward, Reply, _reply, parse_reply
from swarm.pipeline.server import StageServer
from swarm.pipeline.trainer import Trainer
from swarmtest.configs import BATCH, SEQ, tiny_config
from swarmtest.fakes import DirectStages

SHAPE = (BATCH, SEQ, 64)  # the tiny config's boundary tensor
Batch = tuple[torch.Tensor, torch.Tensor]


def adaptive(**sections: object) -> SwarmConfig:
    return tiny_config(codecs={"activations": "adaptive", "gradients": "adaptive"}, **sections)


# the choice


def test_the_choice_is_light_on_a_fast_link_and_heavier_on_slower_ones() -> None:
    ladder, _ = boundary_ladders(adaptive())
    assert ladder.names == ("bf16", "int8", "int4")
    sizes = {codec.name: frame_bytes(codec, SHAPE) for codec in ladder.codecs}
    compute_s = 0.01

    def link_where_fits(name: str) -> LinkEstimate:  # exactly the bandwidth at which a frame each way takes compute_s
        return LinkEstimate(seconds_per_byte=compute_s / (2 * sizes[name]), compute_s=compute_s)

    assert choose_codec(ladder, SHAPE, LinkEstimate(seconds_per_byte=1e-10, compute_s=compute_s)).name == "bf16"
    assert choose_codec(ladder, SHAPE, link_where_fits("bf16")).name == "bf16"
    assert choose_codec(ladder, SHAPE, link_where_fits("int8")).name == "int8"
    assert choose_codec(ladder, SHAPE, link_where_fits("int4")).name == "int4"
    assert choose_codec(ladder, SHAPE, LinkEstimate(seconds_per_byte=1.0, compute_s=compute_s)).name == "int4"
    assert choose_codec(ladder, SHAPE, None).name == "int8"  # unmeasured: the default codec of a fixed swarm


def test_a_fixed_codec_is_a_ladder_of_one_and_the_default_stays_int8() -> None:
    forward, backward = boundary_ladders(tiny_config())
    assert forward.names == backward.names == ("int8",)
    assert choose_codec(forward, SHAPE, LinkEstimate(seconds_per_byte=1.0, compute_s=1e-3)).name == "int8"
    assert [codec.name for codec in boundary_codecs(adaptive())] == ["int8", "int8"]  # the simulator's


def test_a_subspace_model_adapts_within_the_subspace_codec() -> None:
    forward, backward = boundary_ladders(adaptive(model={"subspace_rank": 16}))
    assert forward.names == backward.names == ("subspace+bf16", "subspace+int8", "subspace+int4")
    assert forward.start.name == "subspace+int8"


def test_the_link_estimate_takes_the_servers_time_out_of_the_round_trip() -> None:
    links = LinkEstimator(alpha=0.5)
    links.observe("a", nbytes=1000, elapsed_s=0.3, server_s=0.2, compute_s=0.1)
    assert astuple(links.get("a")) == pytest.approx((1e-4, 0.1))  # (seconds per byte, compute per call)
    links.observe("a", nbytes=1000, elapsed_s=0.6, server_s=0.3, compute_s=0.3)  # EMA of both
    assert astuple(links.get("a")) == pytest.approx((2e-4, 0.2))
    links.observe("b", nbytes=1000, elapsed_s=0.1, server_s=5.0, compute_s=9.0)  # claims beyond the round trip
    assert links.get("b").compute_s == pytest.approx(0.1) and links.get("b").seconds_per_byte > 0
    links.observe("c", nbytes=1000, elapsed_s=0.1, server_s=None, compute_s=None)  # an older server: unmeasured
    assert links.get("c") is None


# receivers


def test_a_receiver_decodes_every_ladder_codec_and_refuses_others() -> None:
    ladder, _ = boundary_ladders(adaptive())
    x = torch.randn(SHAPE)
    for codec in ladder.codecs:
        used, y, tokens = ladder.decode(codec.encode(x), expected_shape=SHAPE)
        assert used is codec and tokens is None and torch.allclose(y, codec.decode(codec.encode(x)))
    with pytest.raises(UnknownCodec, match="accepts only bf16, int8, int4"):
        ladder.decode(get_codec("fp32").encode(x), expected_shape=SHAPE)
    with pytest.raises(ShapeMismatch):  # the same header checks as a single codec's decode
        ladder.decode(get_codec("int8").encode(x[:1]), expected_shape=SHAPE)
    fixed = Ladder([get_codec("int8")])
    with pytest.raises(UnknownCodec):
        fixed.decode(get_codec("bf16").encode(x))


def test_a_ladder_refuses_a_reply_over_the_receivers_bound_on_values() -> None:
    """A trainer decodes stage replies with ``max_abs = BOUNDARY_MAX_ABS``: a finite bf16 reply of 1e30 (no shape,
    finiteness or scale check refuses it) is refused; the same frame decodes where no bound is asked for."""
    ladder, _ = boundary_ladders(adaptive())
    x = torch.randn(SHAPE)
    x[0, 0, 0] = 1e30
    frame = get_codec("bf16").encode(x)
    assert ladder.decode(frame, expected_shape=SHAPE)[1].abs().max() > BOUNDARY_MAX_ABS
    with pytest.raises(WireError, match="over the receiver's limit"):
        ladder.decode(frame, expected_shape=SHAPE, max_abs=BOUNDARY_MAX_ABS)


def test_a_subspace_ladder_decodes_each_inner_codec_with_its_tokens() -> None:
    ladder, _ = boundary_ladders(adaptive(model={"subspace_rank": 16}))
    basis, table = ladder.codecs[0].basis, ladder.codecs[0].table  # (d, k), (vocab, d): the model's
    tokens = torch.randint(0, len(table), SHAPE[:2])
    h = torch.randn(*SHAPE[:2], basis.shape[1]) @ basis.T + table[tokens]  # a subspace model's activations
    for codec in ladder.codecs:
        used, _, decoded_tokens = ladder.decode(codec.encode(h, tokens=tokens), expected_shape=SHAPE)
        assert used is codec and torch.equal(decoded_tokens, tokens)
    with pytest.raises(UnknownCodec):
        ladder.decode(get_codec("int8").encode(h), expected_shape=SHAPE)


def test_a_server_replies_in_the_requests_codec_with_its_times_and_counts_the_frames() -> None:
    cfg = adaptive()
    server, meter = StageServer(cfg, 1), Meter(role="stage", stage=1, state="serving")
    backend = MeteredBackend(server, meter.traffic)
    x = torch.randn(SHAPE)

    async def scenario() -> None:
        for name in ("bf16", "int4"):
            codec = get_codec(name)
            reply = await backend.forward("t", Forward(mb=f"m{name}", stage=1, prev_stage=0, x=codec.encode(x)))
            assert isinstance(reply, Reply) and reply.codec == name
            assert reply.server_s >= reply.compute_s > 0
            grad = await backend.backward("t", Backward(mb=f"m{name}", stage=1, grad=codec.encode(x)))
            assert grad.codec == name
        with pytest.raises(UnknownCodec):
            await server.forward("t", Forward(mb="bad", stage=1, prev_stage=0, x=get_codec("fp32").encode(x)))

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
    assert meter.sample(server.status(queue=0), tokens=0).frames_sent == {"bf16": 2, "int4": 2}  # what it publishes


def test_the_reply_message_carries_the_times_and_ignores_junk_ones() -> None:
    reply = parse_reply(_reply(Reply(b"frame", codec="int8", server_s=0.25, compute_s=0.125)))
    assert reply == b"frame" and (reply.server_s, reply.compute_s) == (0.25, 0.125)
    assert parse_reply(_reply(b"frame")).server_s is None  # an older server says nothing
    junk = parse_reply(msgpack.packb({"y": b"frame", "server_s": "soon", "compute_s": -1.0}, use_bin_type=True))
    assert (junk.server_s, junk.compute_s) == (None, None)


# a trainer over links of a given bandwidth


def batches(seed: int = 0) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def train_over(bytes_per_s: float | None, steps: int = 8) -> tuple[Trainer, dict]:
    cfg = adaptive(steps=steps)
    link = DirectStages.of(cfg, {"s1": 1}, bytes_per_s=bytes_per_s)  # each direction takes its bytes at that rate
    trainer = Trainer(cfg, link, link.router, options=TrainerOptions(in_flight=1, log_every=steps))
    try:
        record = asyncio.run(trainer.train(batches(), steps=steps))
    finally:
        trainer.shutdown()
        link.shutdown()
    assert trainer.counters["completed"] == steps and trainer.counters["failed"] == 0
    assert record["train_loss"] is not None and record["train_loss"] < 6.0
    return trainer, record


def test_a_trainer_on_a_fast_link_sends_bf16_and_records_the_link() -> None:
    trainer, record = train_over(None)
    link = record["links"]["s1"]
    assert link["codec_activations"] == link["codec_gradients"] == "bf16"
    assert link["bytes_per_s"] > 0 and link["compute_s"] > 0
    # the first microbatch goes unmeasured (int8), every later frame in bf16
    assert record["frames_sent"]["bf16"] >= 2 * (8 - 1) and record["frames_sent"].get("int4", 0) == 0


def test_a_trainer_on_a_slow_link_moves_to_a_heavier_codec() -> None:
    # 1 MB/s: an int4 frame each way takes ~35 ms, many times the tiny stage's compute
    trainer, record = train_over(1e6)
    link = record["links"]["s1"]
    assert link["codec_activations"] == link["codec_gradients"] == "int4"
    assert link["bytes_per_s"] == pytest.approx(1e6, rel=0.5)  # the wire's time, the server's taken out
    frames = record["frames_sent"]
    assert frames["int4"] >= 2 * (8 - 1) and frames.get("bf16", 0) == 0
    assert sum(frames.values()) == 2 * 8  # one activation and one gradient frame per microbatch, nothing resent


def test_a_relayed_frame_is_reencoded_only_for_a_link_in_another_codec() -> None:
    _, int8, int4 = boundary_ladders(adaptive())[0].codecs
    frame = int8.encode(torch.randn(SHAPE))
    outgoing = Outgoing(int8.decode(frame), None, frame, int8)
    assert outgoing.frame(int8) is frame  # relayed as it arrived: no second rounding
    assert outgoing.frame(int4) == int4.encode(int8.decode(frame))
    assert outgoing.frame(int4) is outgoing.frame(int4)  # encoded once per codec
