"""The throughput model (``swarm/plan``, ``swarmloco plan``): frames priced as the real codecs write them at real
shapes, the bottleneck found where the arithmetic puts it, and the command's table and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from compress.codecs import get_codec
from compress.wire import encode_frame
from peer.cli import app
from swarm.config import SwarmConfig, derive_config
from swarm.plan.measure import measure, random_batches
from swarm.plan.model import (
    WIRE_OVERHEAD,
    Compute,
    Frames,
    Link,
    Network,
    Swarm,
    fix,
    parse_rate,
    predict,
)
from swarm.plan.shapes import REFERENCE_RATES, codec_frames, frame_bytes, reference_compute, stage_flops_per_token

# real shapes: 125m's width, microbatches of 8 × 1024, a few blocks
REAL = {
    "model.d_model": 768,
    "model.n_heads": 12,
    "model.n_layers": 4,
    "model.max_seq_len": 1024,
    "train.seq_len": 1024,
    "train.microbatch_size": 8,
    "train.inner_batch": 16,
    "stages.num_stages": 2,
}
MBIT = 1e6 / 8  # bytes per second in a Mbit/s


def real_config(codec: str = "int8") -> SwarmConfig:
    return derive_config(SwarmConfig(), REAL | {"codecs.activations": codec})


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
def test_frame_bytes_are_what_the_codec_writes_at_real_shapes(codec: str) -> None:
    cfg = real_config(codec)
    shape = (8, 1024, 768)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    c = get_codec(codec)
    meta, body = c.pack(x)
    encoded = len(encode_frame(c.codec_id, body, dtype=x.dtype, shape=shape, meta=meta, compress=False))
    assert frame_bytes(codec, shape, cfg.model, kind="activation") == encoded
    # zstd only ever shrinks a frame: the model's frames err slow; uniform values' int8 and fp32 codes do not shrink
    zstd = len(c.encode(x))
    assert zstd <= encoded and (zstd == encoded or codec not in ("int8", "fp32"))
    frames = codec_frames(cfg)
    assert frames.into == frames.out == frames.grad_into == frames.grad_out == (encoded, encoded)
    # the trainer sends each of the 2 stages its input and its output's gradient, and gets both back
    assert frames.trainer_sent == frames.trainer_received == 4 * encoded
    assert frames.server_sent(1) == frames.server_received(2) == 2 * encoded


def test_int8_costs_a_quarter_of_fp32_plus_a_byte_a_token() -> None:
    """At 125m's width a token's int8 row is 768 codes and its scale step: 3,076 bytes each way across the trainer's
    link over 2 stages (the issue's 4,388 sent + received was after zstd)."""
    frames = codec_frames(real_config("int8"))
    assert frames.trainer_sent / (8 * 1024) == pytest.approx(4 * 769, abs=0.1)
    fp32 = codec_frames(real_config("fp32"))
    assert fp32.trainer_sent / (8 * 1024) == pytest.approx(4 * 768 * 4, abs=0.1)


def test_subspace_frames_carry_k_numbers_and_the_token_ids() -> None:
    cfg = derive_config(SwarmConfig(), REAL | {"codecs.activations": "subspace+int8"})
    k = cfg.model.subspace_rank
    assert k == 768 // 8
    assert frame_bytes("subspace+int8", (8, 1024, 768), cfg.model, kind="activation") < 8 * 1024 * (k + 1 + 8) + 64


def test_parse_rate_reads_bits_and_bytes() -> None:
    assert parse_rate("100mbit") == 100 * MBIT
    assert parse_rate("1gbit") == parse_rate("1000 Mbit/s") == 1000 * MBIT
    assert parse_rate("12.5MB") == 12.5e6
    assert parse_rate("500kbit") == 500e3 / 8
    for bad in ("fast", "100", "-5mbit", "0mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def swarm(
    *, up_mbit: float, down_mbit: float | None = None, stage_s: float = 0.5, window: int = 8, staleness: int = 1
) -> Swarm:
    """2 stages of 1 MB frames, ``stage_s`` of compute each, servers at the trainer's downlink rate."""
    trainer = Link(up=up_mbit * MBIT, down=(down_mbit or up_mbit) * MBIT)
    return Swarm(
        tokens=1000,
        frames=Frames.uniform(stages=2, activation=1_000_000, gradient=1_000_000),
        compute=Compute(stages=(stage_s, stage_s), trainer=0.01),
        network=Network(trainer=trainer, server=Link.symmetric((down_mbit or up_mbit) * MBIT), rtt_s=0.05),
        window=window,
        microbatches_per_step=4,
        max_staleness=staleness,
    )


def test_the_bottleneck_moves_from_the_link_to_the_compute_as_the_link_grows() -> None:
    rates = [1.0, 10.0, 100.0, 1000.0, 10_000.0]
    predictions = [predict(swarm(up_mbit=r)) for r in rates]
    assert predictions[0].bottleneck == "the trainer's uplink"
    assert predictions[-1].bottleneck == "stage 1's compute"
    tokens = [p.tokens_per_s for p in predictions]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1] / 50
    # link-bound with the window spanning steps: exactly the uplink's rate, 4 MB a microbatch on the wire
    slow = predictions[0]
    assert slow.tokens_per_s == pytest.approx(1000 / (4e6 * WIRE_OVERHEAD / MBIT))
    # compute-bound: a microbatch per stage compute time
    assert predictions[-1].tokens_per_s == pytest.approx(1000 / 0.5)


def test_an_asymmetric_link_is_limited_by_its_uplink_and_the_fix_says_so() -> None:
    home = swarm(up_mbit=20, down_mbit=100, stage_s=0.01)
    p = predict(home)
    assert p.bottleneck == "the trainer's uplink"
    assert p.resource("the trainer's uplink").seconds == pytest.approx(5 * p.resource("the trainer's downlink").seconds)
    what, better = fix(home, p)
    assert what == "up at 200 Mbit/s"  # the faster of its downlink's rate and 10× its own
    assert better.tokens_per_s > 4 * p.tokens_per_s


def test_a_window_within_the_inner_step_pays_a_round_trip_per_step() -> None:
    """max_staleness 0: n microbatches take a round trip and n − 1 intervals; with one microbatch a step and one in
    flight the pipeline is synchronous, a step is one microbatch's round trip."""
    one = replace(swarm(up_mbit=10_000), microbatches_per_step=1, window=4, max_staleness=0)
    p = predict(one)
    assert p.window == 1 and p.step_s == pytest.approx(p.round_trip_s)
    assert p.round_trip_s > 4 * 0.05 + 2 * 0.5  # 4 hops' round trips and both stages' compute
    assert p.bottleneck.startswith("the window")
    drained = predict(replace(swarm(up_mbit=10_000), max_staleness=0))
    spanning = predict(swarm(up_mbit=10_000))
    assert drained.tokens_per_s < spanning.tokens_per_s
    assert drained.step_s == pytest.approx(drained.round_trip_s + 3 * 0.5)


def test_frames_relayed_server_to_server_leave_the_trainer_the_path_ends_and_cross_s_plus_1_links() -> None:
    """Issue 43 §3 (--relay): at S stages the trainer's link carries 2 frames a way instead of 2·S, the servers' links
    what they carry today, and a microbatch's frames cross S + 1 links each way instead of 4·S transfers."""
    for stages in (1, 2, 4):
        base = replace(
            swarm(up_mbit=10, stage_s=0.01),
            frames=Frames.uniform(stages=stages, activation=1_000_000, gradient=1_000_000),
            compute=Compute(stages=(0.01,) * stages, trainer=0.01),
        )
        relayed = replace(base, route="relay")
        called, relay = predict(base), predict(relayed)
        assert relayed.frames.trainer_link("relay") == (2_000_000, 2_000_000)
        assert relay.resource("the trainer's uplink").bytes * stages == called.resource("the trainer's uplink").bytes
        for s in range(1, stages + 1):
            for side in ("uplink", "downlink"):
                name = f"stage {s}'s {side}"
                assert relay.resource(name).seconds == pytest.approx(called.resource(name).seconds)
        transfer_s = WIRE_OVERHEAD * 1_000_000 / (10 * MBIT)  # one frame over one 10 Mbit/s link
        calls = 2 * (2 * stages - 1)  # per direction S calls of the trainer's and S − 1 pushes between servers
        assert relay.round_trip_s == pytest.approx(0.01 + 0.01 * stages + calls * 0.05 + 2 * (stages + 1) * transfer_s)
        assert called.round_trip_s == pytest.approx(0.01 + 0.01 * stages + 2 * stages * (0.05 + 2 * transfer_s))
        # link-bound, the window spanning steps: S times the tokens, the servers' links as busy as the trainer's
        assert relay.tokens_per_s == pytest.approx(stages * called.tokens_per_s)
    with pytest.raises(ValueError, match="route"):
        replace(swarm(up_mbit=10), route="mesh")  # type: ignore[arg-type]


def test_reference_compute_splits_a_microbatch_by_flops() -> None:
    cfg = derive_config(SwarmConfig(), {"model.preset": "125m", "train.seq_len": 1024, "train.microbatch_size": 8})
    cfg = derive_config(cfg, {"stages.num_stages": 2, "train.inner_batch": 16})
    rate = REFERENCE_RATES["h200"]["125m"]
    compute = reference_compute(cfg, tokens_per_s=rate)
    assert compute.trainer + sum(compute.stages) == pytest.approx(8 * 1024 / rate)
    assert compute.stages[0] == pytest.approx(compute.stages[1])  # 6 blocks each
    flops = stage_flops_per_token(cfg.model, 2, 1024)
    assert math.isclose(compute.trainer / compute.stages[0], flops[0] / flops[1])
    recomputing = reference_compute(cfg, tokens_per_s=rate, keep_graphs=False)
    assert recomputing.stages[0] == pytest.approx(4 / 3 * compute.stages[0])


def test_measure_records_the_frames_the_pipeline_sent_and_its_compute() -> None:
    cfg = derive_config(
        SwarmConfig(),
        {
            "model.n_layers": 2,
            "stages.num_stages": 2,
            "train.seq_len": 32,
            "train.microbatch_size": 2,
            "train.inner_batch": 4,
        },
    )
    m = measure(cfg, random_batches(cfg), steps=1, warmup_steps=0)
    assert len(m.step_s) == 1 and all(s > 0 for s in m.compute.stages) and m.compute.trainer > 0
    raw = codec_frames(cfg)
    # gradients hardly compress; any frame is at most the codec's own size (zstd is used only where it pays)
    assert m.frames.grad_out == raw.grad_out
    for measured, codec in ((m.frames.into, raw.into), (m.frames.out, raw.out), (m.frames.grad_into, raw.grad_into)):
        assert all(0 < a <= b for a, b in zip(measured, codec))
    assert m.frames.into[1] == m.frames.out[0]  # the trainer relays stage 1's output frame to stage 2 as it came


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_plan_prints_the_links_the_prediction_and_what_to_fix() -> None:
    out = invoke("--preset", "125m", "--link", "100mbit", "--up", "20mbit", "--rtt-ms", "50")
    for line in ("the trainer's uplink", "stage 2's compute", "bytes/token", "3,076", "predicted:", "of one process"):
        assert line in out, line
    assert "bottleneck: the trainer's uplink: 20 Mbit/s carries 25.20 MB per microbatch" in out
    assert "fix: up at 200 Mbit/s" in out


def test_plan_json_agrees_with_the_model() -> None:
    record = json.loads(
        invoke("--preset", "1b", "--link", "1gbit", "--json", "--max-staleness", "1", "--in-flight", "16")
    )
    assert record["preset"] == "1b" and record["shape"]["d_model"] == 2048
    assert record["network"]["trainer_up_mbit"] == pytest.approx(1000)
    uplink = next(r for r in record["resources"] if r["resource"] == "the trainer's uplink")
    assert uplink["bytes_per_token"] == pytest.approx(4 * 2049, abs=0.1)
    assert record["fraction_of_one_process"] == pytest.approx(record["tokens_per_s"] / REFERENCE_RATES["h200"]["1b"])


def test_plan_help_explains_every_option_and_bad_input_is_one_line() -> None:
    out = invoke("--help")
    for option in (
        "--preset",
        "--link",
        "--up",
        "--down",
        "--server-link",
        "--rtt-ms",
        "--device",
        "--codec",
        "--json",
    ):
        assert option in out, option
    result = CliRunner().invoke(app, ["plan", "--link", "fast"])
    assert result.exit_code == 2 and "a link rate is a number and a unit" in result.output
    result = CliRunner().invoke(app, ["plan", "--preset", "20m"])  # no H200 measurement of 20m
    assert result.exit_code == 2 and "--tokens-per-s" in result.output


def test_a_short_run_pays_for_the_window_starting_at_one() -> None:
    """The trainer's window starts at 1: a run's first microbatch goes alone, so its first step takes a round trip
    more than the pipeline's, and a run's rate approaches the long-run rate as it lengthens."""
    two = replace(swarm(up_mbit=10), microbatches_per_step=2, max_staleness=0)
    steady = predict(two)
    one_step = predict(two, steps=1)
    assert 2 * two.tokens / one_step.tokens_per_s == pytest.approx(2 * steady.round_trip_s)
    rates = [predict(two, steps=k).tokens_per_s for k in (1, 4, 40, 4000)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(steady.tokens_per_s, rel=1e-3)
